"""Logit bias and the repetition, presence and frequency penalties (minakv/worker/penalties.py), against the
formulas written out in float64, alone and through the engine (the walk oracle's logits, forced along the
engine's tokens, with the penalties applied by hand, must give the engine's greedy choices)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import tiny_model
from helpers.programs import oracle_run

from minakv import Engine, SamplingParams
from minakv.worker.penalties import PenaltyTables
from minakv.worker.sampler import SamplingTensors, adjust, sample


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """One row by the book: bias, then presence and frequency over the output, then repetition over the
    prompt and output."""
    x = logits.double().clone()
    for token, value in (p.logit_bias or {}).items():
        x[token] += value
    for token in set(output):
        x[token] -= p.presence_penalty + p.frequency_penalty * output.count(token)
    for token in set(prompt) | set(output):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    return x


CASES = [
    SamplingParams(presence_penalty=0.7),
    SamplingParams(frequency_penalty=0.4),
    SamplingParams(frequency_penalty=-0.5, presence_penalty=1.5),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=0.2),
    SamplingParams(logit_bias={3: 5.0, 7: -100.0}),
    SamplingParams(),  # an unpenalised row among penalised ones
]


def test_adjusted_logits_follow_the_formulas() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 40
    logits = torch.randn(len(CASES), vocab, generator=gen) * 3
    prompts = [torch.randint(0, vocab, (12,), generator=gen).tolist() for _ in CASES]
    outputs = [torch.randint(0, vocab, (9,), generator=gen).tolist() for _ in CASES]
    tables = PenaltyTables(8, vocab, torch.device("cpu"))
    rows = []
    for i, p in enumerate(CASES):
        row = 7 - i if p.penalized else -1  # table rows need not follow sample rows
        if row >= 0:
            tables.reset(row, prompts[i], outputs[i][:-1])
            tables.record(
                torch.tensor([row]), torch.tensor([outputs[i][-1]])
            )  # the last one as a step adds it
        rows.append(row)
    t = SamplingTensors.build(CASES, list(range(len(CASES))), [0] * len(CASES), "cpu", rows)
    got = adjust(logits, t, tables)
    for i, p in enumerate(CASES):
        torch.testing.assert_close(
            got[i].double(), reference(logits[i], prompts[i], outputs[i], p), rtol=1e-6, atol=1e-5
        )
    assert torch.equal(logits, logits.clone())  # the raw logits (for logprobs) are left alone


def test_a_strong_bias_decides_the_token() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    ps = [SamplingParams(temperature=t, logit_bias={11: 100.0}) for t in (0.0, 1.0, 0.5)]
    t = SamplingTensors.build(ps, [1, 2, 3], [0, 0, 0], "cpu")
    assert sample(logits, t).tolist() == [11, 11, 11]


@pytest.fixture(scope="module")
def model():
    return tiny_model("gpt_oss")


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5
        ),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.8),
    ],
)
def test_engine_penalties_match_the_formulas_on_oracle_logits(model, p: SamplingParams) -> None:
    segments = [[5, 9, 9, 17, 3, 5, 40, 41], [7, 7, 7, 8]]
    engine = Engine(model, page_size=4, kv_cache_tokens=512, max_num_batched_tokens=64)
    others = [{"message_tokens": [[i, i + 1, i + 2]]} for i in range(3)]  # batch neighbours without penalties
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = engine.generate([{"message_tokens": segments}, *others], [p, plain, plain, plain])
    tokens = outs[0].token_ids
    run = oracle_run(model, segments, {}, tokens)
    rows = run.logits[len(run.logits) - len(tokens) - 1 : -1]
    prompt = [t for s in segments for t in s]
    for j, token in enumerate(tokens):
        expected = reference(rows[j], prompt, tokens[:j], p)
        top2 = torch.topk(expected, 2).values
        assert int(expected.argmax()) == token or float(top2[0] - top2[1]) < 1e-6, f"step {j}"
    # the penalties changed something: the same request without them decodes differently
    assert engine.generate([{"message_tokens": segments}], plain)[0].token_ids != tokens
    engine.check()


def test_seeded_penalised_request_is_batch_independent(model) -> None:
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True, frequency_penalty=1.0,
                       repetition_penalty=1.2, logit_bias={4: 2.0})  # fmt: skip
    prompt = {"message_tokens": [[3, 1, 4, 1, 5, 9, 2, 6]]}
    alone = Engine(model, page_size=4, kv_cache_tokens=512).generate([prompt], p)[0].token_ids
    crowd = [{"message_tokens": [[i, 2 * i + 1]]} for i in range(5)]
    other = SamplingParams(max_tokens=7, temperature=1.0, seed=9, ignore_eos=True, presence_penalty=2.0)
    engine = Engine(model, page_size=4, kv_cache_tokens=512, max_num_batched_tokens=16)
    outs = engine.generate([*crowd[:2], prompt, *crowd[2:]], [other, other, p, other, other, other])
    assert outs[2].token_ids == alone


def test_bad_values_are_refused() -> None:
    for bad in ({"presence_penalty": 3}, {"frequency_penalty": float("nan")}, {"repetition_penalty": 0},
                {"min_p": 1.5}, {"logit_bias": {-1: 1.0}}, {"logit_bias": {3: 500}}):  # fmt: skip
        with pytest.raises(ValueError):
            SamplingParams(**bad).check()

"""The Engine on the built-in tiny presets: parity with transformers' generate, sampling, stop conditions,
streaming and abort, and exact pool accounting after every scenario."""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import pytest
import torch

from minakv import Engine, SamplingParams
from minakv.presets import resolve_model

transformers = pytest.importorskip("transformers")

PRESETS = ["tiny-gpt-oss", "tiny-minimax-m2"]


@pytest.fixture(scope="module", params=PRESETS)
def engine(request):
    engine = Engine(request.param, device="cpu", dtype="float32", page_size=16, max_num_batched_tokens=48)
    yield engine
    assert_idle(engine)


def assert_idle(engine: Engine) -> None:
    """No request holds a page any more, and the accounting is exact."""
    engine.check()
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["pages_used"] == stats["pages_cached"], stats


def hf_greedy(name: str, prompt: list[int], new: int) -> list[int]:
    model = hf_model(name)
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


_hf: dict[str, torch.nn.Module] = {}


def hf_model(name: str):
    if name not in _hf:
        path = resolve_model(name)
        _hf[name] = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    return _hf[name]


def prompts_for(engine: Engine) -> list[list[int]]:
    window = min((w for w in engine.model.config.layer_windows if w), default=8)
    g = torch.Generator().manual_seed(0)
    vocab = min(engine.model.config.vocab_size, 5000)
    lengths = [3, window + 5, 2 * window + 9, 1]  # shorter and longer than the sliding window
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_greedy_batch_equals_transformers(engine):
    prompts = prompts_for(engine)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(engine.model_name, prompt, 32), f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length" and out.usage.completion_tokens == 32
    assert_idle(engine)


def test_fixed_seed_reproduces_output(engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    prompt = prompts_for(engine)[1]
    alone = engine.generate([prompt], params)[0]
    batched = engine.generate([prompts_for(engine)[0], prompt, prompts_for(engine)[2]], params)[1]
    assert alone.token_ids == batched.token_ids
    other = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=99))[0]
    assert other.token_ids != alone.token_ids
    assert_idle(engine)


def first_step_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=20))[0]
    return out.logprobs[0]


@pytest.mark.parametrize("mode", ["top_k", "top_p"])
def test_top_k_top_p_support_and_frequencies(engine, mode):
    """Sample the first token many times; every sample lies in the allowed set, and frequencies follow the
    renormalised probabilities (a chi-square bound loose enough to fail only for a wrong distribution)."""
    prompt = prompts_for(engine)[0]
    top = first_step_logits(engine, prompt).top  # the 20 best (token, logprob), exact
    ids = [t for t, _ in top]
    p = torch.tensor([lp for _, lp in top], dtype=torch.float64).exp()
    if mode == "top_k":
        top_k, top_p = 3, 1.0
    else:  # a nucleus that must hold exactly the 3 best tokens
        top_k, top_p = -1, float(p[0] + p[1] + p[2] / 2)
    expected = p[:3] / p[:3].sum()
    n = 200
    params = [
        SamplingParams(max_tokens=1, temperature=1.0, top_k=top_k, top_p=top_p, seed=s) for s in range(n)
    ]
    counts = Counter(o.token_ids[0] for o in engine.generate([prompt] * n, params))
    assert set(counts) <= set(ids[:3]), f"sampled outside the support: {set(counts) - set(ids[:3])}"
    observed = torch.tensor([counts.get(t, 0) for t in ids[:3]], dtype=torch.float64)
    chi2 = float(((observed - n * expected) ** 2 / (n * expected)).sum())
    assert chi2 < 20, (chi2, observed.tolist(), (n * expected).tolist())  # 2 degrees of freedom
    assert_idle(engine)


def test_stop_strings_and_stop_token_ids(engine):
    if engine.tokenizer is None:
        pytest.skip("no tokenizer")
    prompt = prompts_for(engine)[2]
    free = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    # a stop token id: generation ends at its first occurrence, which is included in token_ids
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    # a stop string: taken from the middle of the free text; the text is cut before it
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if not stop.strip():
        pytest.skip("degenerate text")
    out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert_idle(engine)


def test_ids_only_output_skips_the_text(engine):
    """detokenize=False: the same tokens (seeded), no text; stop strings then are a clear error."""
    if engine.tokenizer is None:
        pytest.skip("no tokenizer")
    prompt = prompts_for(engine)[1]
    params = {"max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    full = engine.generate([prompt], SamplingParams(**params))[0]
    ids = engine.generate([prompt], SamplingParams(**params, detokenize=False))[0]
    assert ids.token_ids == full.token_ids and ids.text == "" and full.text
    with pytest.raises(ValueError, match="stop strings need the text"):
        engine.generate([prompt], SamplingParams(**params, detokenize=False, stop=["x"]))
    assert_idle(engine)


def test_stream_increments_and_abort_frees_pages(engine):
    prompt = prompts_for(engine)[2]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    full = engine.generate([prompt], params)[0]

    async def consume(limit: int | None) -> tuple[list[int], str | None]:
        tokens, reason = [], None
        async for out in engine.stream(prompt, params, request_id=f"s-{limit}"):
            tokens += out.token_ids
            reason = out.finish_reason
            if limit is not None and len(tokens) >= limit:
                break  # the consumer goes away mid-stream: the request is aborted
        return tokens, reason

    async def scenario():
        streamed = await consume(None)
        aborted = await consume(3)
        for _ in range(200):  # the engine thread processes the abort on its next loop
            if engine.stats()["running"] == 0:
                break
            await asyncio.sleep(0.01)
        return streamed, aborted

    (tokens, reason), (partial, _) = asyncio.run(scenario())
    assert tokens == full.token_ids and reason == "length"
    assert partial == full.token_ids[: len(partial)] and len(partial) >= 3
    assert_idle(engine)


def test_abort_waiting_and_unknown_requests(engine):
    engine.abort("no-such-request")
    assert_idle(engine)


def test_bad_input_is_a_clear_error(engine):
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate([[1, 2]], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[engine.model.config.vocab_size]])
    with pytest.raises(ValueError, match="drop"):
        engine.generate([{"message_tokens": [[1], [2]], "cache": {"drop": {"0": [1]}}}])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * (engine.max_model_len + 1)])
    pool_tokens = engine.stats()["pages_total"] * engine.config.page_size
    with pytest.raises(ValueError, match="KV pool holds"):
        Engine(engine.model, page_size=4, kv_cache_tokens=16).generate([[1] * 20])
    assert pool_tokens > 20
    assert_idle(engine)


def test_stats_report_kv_bytes_per_decode_token(engine):
    engine.generate([prompts_for(engine)[1]], SamplingParams(max_tokens=4, temperature=0))
    stats = engine.stats()
    assert stats["decode_tokens"] > 0 and stats["kv_bytes_read_per_decode_token"] > 0
    assert math.isfinite(stats["kv_bytes_read_per_decode_token"])


def test_the_limit_is_on_positions_not_on_the_raw_history() -> None:
    """An agent whose drops and repositions keep its positions compact may send a history longer than
    max_model_len (docs/design.md 2.2); its positions, not its tokens, must stay under the limit."""
    engine = Engine("tiny-gpt-oss", kv_cache_tokens=4096, max_model_len=256)
    parts = [[(7 * i + j) % 300 + 1 for j in range(100)] for i in range(4)]  # 400 tokens
    # after message 1 and after message 2, drop the message before and renumber: positions stay < 200
    compact = {"message_tokens": parts, "cache": {"drop": {"1": [0], "2": [1]}, "reposition": [1, 2]}}
    out = engine.generate([compact], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 20 and out.usage.prompt_tokens == 400
    with pytest.raises(
        ValueError, match="max_model_len"
    ):  # the same history without operations: 400 positions
        engine.generate([{"message_tokens": parts}])
    engine.check()


def test_identical_requests_finish_apart(engine):
    """Eight streams of one prompt and one setting (the server's n = 8): the one submitted second ends first
    (aborted). Requests compared field by field once (numpy arrays among the fields), so removing it from the
    running list raised, the quarantine raised again, the engine thread died and every stream hung."""
    params = SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True)

    async def run() -> list[str | None]:
        streams = [engine.stream([5, 6, 7], params, request_id=f"same-{i}") for i in range(8)]
        firsts = [await s.__anext__() for s in streams]
        engine.abort("same-1")

        async def rest(s, out):
            while out.finish_reason is None:
                out = await s.__anext__()
            return out.finish_reason

        return await asyncio.wait_for(asyncio.gather(*(rest(s, f) for s, f in zip(streams, firsts))), 60)

    reasons = asyncio.run(run())
    assert reasons[1] == "abort" and reasons.count("length") == 7, reasons
    engine.check()

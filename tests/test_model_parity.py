"""Parity of minakv's GPT-OSS and MiniMax-M2 with transformers' own implementations.

Tiny models are built and initialised by transformers, the parameters transformers starts at 0 or 1
(expert and attention biases, correction bias, norm weights) and the tiny sinks are re-randomised so every
term matters, and the weights go through `save_pretrained`. minakv loads the same files; logits must
agree to 1e-4 relative error (||ours - ref|| / ||ref||) in float32 on CPU: prompts shorter and longer than
the sliding window, then 16 decode steps against transformers' KV cache. The same again for MXFP4
(GPT-OSS) and FP8 (MiniMax-M2) checkpoints written with minakv's quantisers and loaded by both sides.

The checkpoints are written by tests/helpers/checkpoints.py (the `checkpoints` fixture of conftest.py).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from helpers.checkpoints import WINDOW, load_hf, rel_err

from minakv.model import load_model
from minakv.reference.dense import DenseContext, generate_greedy

TOL = 1e-4


@torch.no_grad()
def compare(path: Path, prompt_len: int, decode_steps: int = 16, seed: int = 1) -> list[float]:
    """Relative logit errors: the prefill, then each teacher-forced decode step."""
    ref_model, ours = load_hf(path), load_model(path, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 256, (prompt_len + decode_steps,), generator=gen)
    prompt, rest = tokens[:prompt_len], tokens[prompt_len:]

    # transformers renamed `past_key_values` to `cache` during 5.x; use whichever this version has.
    key = "cache" if "cache" in inspect.signature(ref_model.forward).parameters else "past_key_values"
    ref = ref_model(prompt[None], use_cache=True)
    cache = ref[key]
    ctx = DenseContext()
    ctx.advance(prompt_len)
    errors = [rel_err(ours.compute_logits(ours(prompt, ctx)), ref.logits[0])]
    for token in rest:
        ref = ref_model(token.view(1, 1), use_cache=True, **{key: cache})
        cache = ref[key]
        ctx.advance(1)
        errors.append(rel_err(ours.compute_logits(ours(token.view(1), ctx)), ref.logits[0]))
    return errors


CASES = [
    ("gpt_oss", WINDOW - 2),  # prompt inside the window
    ("gpt_oss", 3 * WINDOW + 1),  # prompt longer than the window
    ("gpt_oss_mxfp4", 3 * WINDOW + 1),
    ("minimax_m2", 4),
    ("minimax_m2", 19),
    ("minimax_m2_fp8", 19),
]


@pytest.mark.parametrize(("which", "prompt_len"), CASES)
def test_logits_match_transformers(checkpoints: dict[str, Path], which: str, prompt_len: int) -> None:
    errors = compare(checkpoints[which], prompt_len)
    assert len(errors) == 17
    assert max(errors) < TOL, f"{which}: relative logit errors {errors}"


def test_quantised_checkpoints_differ_from_the_originals(checkpoints: dict[str, Path]) -> None:
    """The quantised fixtures really are quantised (their logits move), so their parity test means something."""
    for plain, quant in (("gpt_oss", "gpt_oss_mxfp4"), ("minimax_m2", "minimax_m2_fp8")):
        a = load_model(checkpoints[plain], device="cpu", dtype=torch.float32)
        b = load_model(checkpoints[quant], device="cpu", dtype=torch.float32)
        ids = torch.arange(3, 15)
        logits = []
        for m in (a, b):
            ctx = DenseContext()
            ctx.advance(len(ids))
            logits.append(m.compute_logits(m(ids, ctx)))
        assert rel_err(logits[1], logits[0]) > 1e-3


def test_layer_windows_follow_layer_types(checkpoints: dict[str, Path]) -> None:
    model = load_model(checkpoints["gpt_oss"], device="cpu")
    assert [spec.window for spec in model.attention_layers] == [WINDOW, None, None, WINDOW]
    assert all(spec.sinks is not None for spec in model.attention_layers)
    m2 = load_model(checkpoints["minimax_m2"], device="cpu")
    assert m2.rope.rotary_dim == 16 and all(s.window is None and s.sinks is None for s in m2.attention_layers)


@torch.no_grad()
def test_generate_greedy_matches_transformers_generate(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["gpt_oss"]
    ref_model = load_hf(path)
    prompt = [5, 17, 99, 42, 7, 200, 13, 64, 3]
    ref = ref_model.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    ours = generate_greedy(load_model(path, device="cpu"), prompt, 12, stop_ids=[])
    assert ours == ref[0, len(prompt) :].tolist()

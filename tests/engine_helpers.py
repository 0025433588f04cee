"""Shared pieces of the engine tests: tiny models with small vocabularies, random cache programs, and the
comparison of an engine run against the walk oracle."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from minakv.cache.program import compile_program
from minakv.model import build_model
from minakv.model.config import ModelConfig
from minakv.outputs import RequestOutput
from minakv.reference.oracle import WalkOracle

GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 384, "hidden_size": 64,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "max_position_embeddings": 131072,
    "rope_theta": 150000.0, "rms_norm_eps": 1e-5,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
}  # fmt: skip
MINIMAX = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "vocab_size": 384,
    "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "rotary_dim": 8, "intermediate_size": 32, "num_local_experts": 6, "num_experts_per_tok": 2,
    "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
}  # fmt: skip


def tiny_model(family: str, dtype: torch.dtype = torch.float64, seed: int = 0):
    """A random tiny model with weights large enough that attention and routing are not flat."""
    config = ModelConfig.from_hf(GPT_OSS if family == "gpt_oss" else MINIMAX)
    model = build_model(config, device="cpu", dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.1)
        elif p.ndim >= 2 and "embed" not in name:
            p.data.mul_(8.0)  # std 0.16: sharper attention and logits than the 0.02 init
        else:
            p.data.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.3)  # biases, sinks, correction
    return model


@st.composite
def programs(draw, max_messages: int = 6, max_len: int = 9, vocab: int = 384):
    """Segments (one token list per message) plus valid drop/reposition operations."""
    n = draw(st.integers(1, max_messages))
    segments = [draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=max_len)) for _ in range(n)]
    drop: dict[str, list[int]] = {}
    for trigger in range(n):
        if draw(st.integers(0, 2)) == 0:
            ids = draw(st.lists(st.integers(0, trigger), max_size=3, unique=True))
            if ids:
                drop[str(trigger)] = sorted(ids)
    reposition = sorted(draw(st.lists(st.integers(0, n - 1), max_size=2, unique=True)))
    return segments, {"drop": drop, "reposition": reposition}


def compiles(segments: list[list[int]], cache: dict) -> bool:
    owners = [i for i, s in enumerate(segments) for _ in s]
    try:
        compile_program(owners, len(segments), cache.get("drop"), cache.get("reposition"))
    except ValueError:
        return False
    return True


def oracle_run(model, segments: list[list[int]], cache: dict, forced: list[int]):
    owners = [i for i, s in enumerate(segments) for _ in s]
    program = compile_program(owners, len(segments), cache.get("drop"), cache.get("reposition"))
    prompt = [t for s in segments for t in s]
    return WalkOracle(model, program).run(prompt, forced=forced)


def assert_matches_oracle(model, segments, cache, out: RequestOutput, tol: float = 1e-6) -> None:
    """The engine's greedy tokens are the oracle's argmax at every step (unless a near-tie), and its
    logprobs equal the oracle's, with the oracle forced along the engine's tokens."""
    run = oracle_run(model, segments, cache, out.token_ids)
    rows = run.logits[len(run.logits) - len(out.token_ids) - 1 : -1].double()
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for j, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        top2 = torch.topk(rows[j], 2).values
        if int(rows[j].argmax()) != token:
            assert float(top2[0] - top2[1]) < 1e-6, (
                f"step {j}: engine chose {token}, oracle {int(rows[j].argmax())}"
            )
            return  # a genuine tie: the continuations may diverge from here
        assert math.isclose(lp.logprob, run.logprobs[j], rel_tol=tol, abs_tol=tol), (
            j,
            lp.logprob,
            run.logprobs[j],
        )

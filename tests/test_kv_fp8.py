"""The fp8 KV cache (`kv_cache_dtype="fp8"`): float8_e4m3fn K/V, widened in registers by the attention kernels.

- The kernels read an fp8 cache exactly as a wide cache holding the same (rounded) values: the only error
  is the rounding of K/V to fp8 itself.
- In the engine that rounding is the whole difference from the model-dtype cache: the first generated token's
  distribution stays within a documented KL of it (tiny random models are far less smooth than real ones,
  so this bounds the worst case loosely), and everything the cache does stays exact within the fp8 mode: a
  warm engine (cache hits, holes restored, keys re-rotated in fp8) gives the cold engine's tokens and
  logprobs.
"""

from __future__ import annotations

import pytest
import test_ops_decode_attention as dec
import test_ops_segment_attention as seg
import torch
from helpers.models import tiny_model
from helpers.triton import interpreted

from minakv import Engine, SamplingParams
from minakv.ops.decode_attention import decode_attention_ref, decode_attention_triton
from minakv.ops.segment_attention import segment_attention_ref, segment_attention_triton

FP8 = torch.float8_e4m3fn


def as_fp8(case: dict) -> tuple[dict, dict]:
    """(the case with an fp8 cache, the same case with the fp8 values in a float32 cache)."""
    narrow = {**case, "k_cache": case["k_cache"].to(FP8), "v_cache": case["v_cache"].to(FP8)}
    wide = {**case, "k_cache": narrow["k_cache"].float(), "v_cache": narrow["v_cache"].float()}
    return narrow, wide


@interpreted
def test_decode_attention_reads_fp8_as_its_values() -> None:
    narrow, wide = as_fp8(dec.random_case(4, 4, [1, 9, 20], torch.float32, seed=3))
    for run in (decode_attention_ref, decode_attention_triton):
        torch.testing.assert_close(run(**narrow, window=8), run(**wide, window=8), rtol=1e-5, atol=1e-5)


@interpreted
def test_segment_attention_reads_fp8_as_its_values() -> None:
    narrow, wide = as_fp8(seg.random_case(2, 4, [5, 17], [3, 11], torch.float32, seed=5))
    for run, kw in ((segment_attention_ref, {}), (segment_attention_triton, {"block_m": 16, "block_n": 16})):
        torch.testing.assert_close(
            run(**narrow, window=8, **kw), run(**wide, window=8, **kw), rtol=1e-5, atol=1e-5
        )


@pytest.fixture(scope="module")
def model():
    return tiny_model("gpt_oss", dtype=torch.float32)


def agent_rounds(rounds: int = 4) -> list[dict]:
    """Cumulative rounds: each adds a tool result that drops the one before last, and repositions."""
    gen = torch.Generator().manual_seed(2)
    history = [torch.randint(0, 384, (14,), generator=gen).tolist()]
    out, drop, repos = [], {}, []
    for r in range(rounds):
        history.append(torch.randint(0, 384, (9,), generator=gen).tolist())
        if r >= 1:
            drop[str(len(history) - 1)] = [len(history) - 3]
            repos.append(len(history) - 1)
        out.append(
            {
                "message_tokens": [list(m) for m in history],
                "cache": {"drop": dict(drop), "reposition": list(repos)},
            }
        )
        history.append([7, 8, 9])  # the assistant turn
    return out


def test_fp8_cache_is_exact_within_itself_through_drop_reposition_and_restore(model) -> None:
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0)
    warm = Engine(model, page_size=4, kv_cache_tokens=96, kv_cache_dtype="fp8")  # small: evictions, holes
    for prompt in agent_rounds():
        got = warm.generate([prompt], params)[0]
        cold = Engine(model, page_size=4, kv_cache_tokens=512, kv_cache_dtype="fp8").generate(
            [prompt], params
        )[0]
        assert got.token_ids == cold.token_ids
        assert [x.logprob for x in got.logprobs] == pytest.approx(
            [x.logprob for x in cold.logprobs], abs=1e-5
        )
    assert warm.stats()["cache_hit_tokens"] > 0
    assert warm.worker.k_cache.dtype == FP8
    warm.check()


def test_fp8_cache_stays_close_to_the_model_dtype(model) -> None:
    """KL(first token | fp32 KV || first token | fp8 KV), summed over the fp32 run's 20 most likely tokens,
    <= 0.05 nats on each round's prompt."""
    wide = Engine(model, page_size=4, kv_cache_tokens=512)
    narrow = Engine(model, page_size=4, kv_cache_tokens=512, kv_cache_dtype="fp8")
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=20)
    for prompt in agent_rounds():
        a, b = (e.generate([prompt], params)[0].logprobs[0] for e in (wide, narrow))
        pa = dict(a.top)
        pb = dict(b.top)
        shared = [t for t in pa if t in pb]
        kl = sum(torch.tensor(pa[t]).exp() * (pa[t] - pb[t]) for t in shared)
        assert float(kl) <= 0.05, float(kl)

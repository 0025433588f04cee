"""The engine on CUDA (Triton kernels, grouped-GEMM MoE, CUDA-graph decode) against CPU references.

1. The tiny presets in float32: greedy output on the GPU equals the CPU engine's (same prompts of mixed
   lengths, one batch), with CUDA graphs on and off.
2. bf16 on the GPU: random drop/reposition programs (as in test_engine_walk.py, at page sizes 1, 16 and 7,
   chunked prefill, a pool small enough to evict and restore) against the float64 walk oracle on CPU.
   bf16 cannot match float64 exactly, so the tolerance is *measured* in the test: the same bf16 weights,
   run by the plain dense reference (DenseContext, no paging, no kernels) on the GPU, deviate from the
   float64 model by some amount in the logprob of the best token on plain prompts; the engine may deviate
   by at most 4x that (at least 0.02). The models are engine_helpers' sharp tiny models with their
   matrices scaled down (x0.5 GPT-OSS, x0.35 MiniMax-M2): at full sharpness bf16 rounding alone flips
   MoE routing and argmaxes (measured on CPU: top-1 logprob deviations 0.38 and 1.15, ~10% argmax flips),
   which would leave nothing to test; scaled, the measured noise is ~0.013 and ~0.034 (tolerances ~0.05
   and ~0.14), while removing three early tokens of a prompt moves logprobs by 0.06-0.55.

Skipped without CUDA (CI runs them as skips; run them on a GPU with `pytest -m gpu`).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from engine_helpers import compiles, oracle_run, programs, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minakv import Engine, SamplingParams
from minakv.model.context import DenseContext

PRESETS = ["tiny-gpt-oss", "tiny-minimax-m2"]
ENGINE_SHAPES = {  # page size, chunk budget, pool tokens (as in test_engine_walk.py)
    "page1": {"page_size": 1, "max_num_batched_tokens": 512, "kv_cache_tokens": 4096},
    "page16-chunked": {"page_size": 16, "max_num_batched_tokens": 7, "kv_cache_tokens": 4096},
    "page7-small-pool": {"page_size": 7, "max_num_batched_tokens": 13, "kv_cache_tokens": 140},
}
NEAR_TIE = 1e-4  # float32 CPU vs GPU: logits agree to ~1e-5 here, so only closer calls may flip


def preset_prompts(engine: Engine) -> list[list[int]]:
    window = min((w for w in engine.model.config.layer_windows if w), default=8)
    g = torch.Generator().manual_seed(0)
    vocab = min(engine.model.config.vocab_size, 5000)
    lengths = [3, window + 5, 2 * window + 9, 1, 40]  # shorter and longer than the sliding window
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_float32_greedy_equals_cpu(name, monkeypatch):
    shape = {"dtype": "float32", "page_size": 16, "max_num_batched_tokens": 48}
    cpu = Engine(name, device="cpu", **shape)
    prompts = preset_prompts(cpu)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)
    expected = cpu.generate(prompts, params)
    runs = {}
    for graphs in ("1", "0"):
        monkeypatch.setenv("MINAKV_CUDA_GRAPHS", graphs)
        gpu = Engine(name, device="cuda", **shape)
        runs[graphs] = gpu.generate(prompts, params)
        gpu.check()
        if graphs == "1":
            assert gpu.worker.graphs is not None and gpu.worker.graphs.failure is None
            assert gpu.worker.graphs.graphs, "decode steps should have replayed CUDA graphs"
    for graphs, outs in runs.items():
        for prompt, want, got in zip(prompts, expected, outs):
            assert len(got.token_ids) == 32
            assert_same_greedy(want, got, NEAR_TIE, 1e-3, (name, graphs, len(prompt)))


def assert_same_greedy(want, got, near_tie: float, lp_tol: float, label) -> None:
    """Same tokens and logprobs, except that the runs may part at a near-tie of `want`'s two best
    candidates (then the continuations legitimately differ and the comparison stops there)."""
    for j, (a, b) in enumerate(zip(want.token_ids, got.token_ids)):
        if a != b:
            (_, lp1), (_, lp2) = want.logprobs[j].top[:2]
            assert lp1 - lp2 < near_tie, (label, j, a, b, lp1 - lp2)
            return
        assert abs(want.logprobs[j].logprob - got.logprobs[j].logprob) < lp_tol, (label, j)


def bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The float64 CPU model as bf16 on the GPU, keeping the parameters transformers keeps in fp32."""
    keep = {id(p) for p in model.fp32_parameters()}
    gpu = copy.deepcopy(model)
    for p_cpu, p in zip(model.parameters(), gpu.parameters()):
        p.data = p_cpu.data.to("cuda", torch.float32 if id(p_cpu) in keep else torch.bfloat16)
    gpu.tie_weights()
    return gpu


def dense_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """log_softmax of every position's next-token logits, one dense forward (float64 out)."""
    device = model.embed_tokens.weight.device
    ctx = DenseContext()
    ctx.advance(len(prompt))
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt, device=device), ctx)
        return torch.log_softmax(model.compute_logits(hidden).double().cpu(), dim=-1)


def measured_bf16_noise(cpu_model, gpu_model) -> float:
    """Largest |logprob| deviation of the bf16 GPU model (dense reference path) from float64, of the best
    token of each position of a few plain prompts (the test compares the logprobs of chosen tokens)."""
    rng = random.Random(0)
    worst = 0.0
    for n in (8, 30, 60):
        prompt = [rng.randrange(384) for _ in range(n)]
        ref, got = dense_logprobs(cpu_model, prompt), dense_logprobs(gpu_model, prompt)
        top = ref.argmax(dim=-1, keepdim=True)
        worst = max(worst, float((ref.gather(1, top) - got.gather(1, top)).abs().max()))
    return worst


SOFTEN = {"gpt_oss": 0.5, "minimax_m2": 0.35}  # matrix scale that keeps the tiny models non-chaotic in bf16


@pytest.fixture(scope="module", params=["gpt_oss", "minimax_m2"])
def models(request):
    cpu = tiny_model(request.param)  # float64
    for name, p in cpu.named_parameters():
        if p.ndim >= 2 and "embed" not in name:
            p.data.mul_(SOFTEN[request.param])
    gpu = bf16_copy(cpu)
    noise = measured_bf16_noise(cpu, gpu)
    tol = max(4 * noise, 0.02)
    print(f"{request.param}: bf16 dense-reference noise {noise:.4f} -> logprob tolerance {tol:.4f}")
    assert tol < 0.25, "bf16 noise this large would make the comparison meaningless"
    return cpu, gpu, tol


@pytest.fixture(scope="module", params=list(ENGINE_SHAPES))
def engine(request, models):
    engine = Engine(models[1], **ENGINE_SHAPES[request.param])
    yield engine
    engine.check()
    assert engine.stats()["running"] == 0


def assert_close_to_oracle(cpu_model, segments, cache, out, tol: float) -> None:
    """Forced along the engine's tokens, the float64 oracle gives each chosen token (nearly) the best
    logprob, and the engine's logprob of it is within `tol` of the oracle's."""
    run = oracle_run(cpu_model, segments, cache, out.token_ids)
    rows = torch.log_softmax(run.logits[len(run.logits) - len(out.token_ids) - 1 : -1].double(), dim=-1)
    for j, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        best = float(rows[j].max())
        assert float(rows[j, token]) > best - 2 * tol, (
            f"step {j}: token {token} is far from the oracle's best"
        )
        assert abs(lp.logprob - float(rows[j, token])) < tol, (j, lp.logprob, float(rows[j, token]), tol)


GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=programs(), seed=st.integers(0, 2**16))
def test_bf16_random_programs_match_the_walk(engine, models, data, seed):
    cpu_model, _, tol = models
    segments, cache = data
    if not compiles(segments, cache):
        return
    rng = random.Random(seed)
    others = [[rng.randrange(384) for _ in range(rng.randint(1, 20))] for _ in range(2)]
    outs = engine.generate([others[0], {"segments": segments, "cache": cache}, others[1]], GREEDY)
    assert_close_to_oracle(cpu_model, segments, cache, outs[1], tol)
    again = engine.generate([{"segments": segments, "cache": cache}], GREEDY)[0]
    assert_close_to_oracle(cpu_model, segments, cache, again, tol)
    engine.check()


def test_bf16_decode_graphs_match_eager(models, monkeypatch):
    """The same batch decoded with and without CUDA graphs gives the same tokens and logprobs (up to bf16
    GEMMs picking other tilings for the padded batch of the graph: within the measured tolerance)."""
    _, gpu_model, tol = models
    rng = random.Random(1)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(3, 40))] for _ in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    outs = {}
    for graphs in ("1", "0"):
        monkeypatch.setenv("MINAKV_CUDA_GRAPHS", graphs)
        engine = Engine(gpu_model, page_size=16, kv_cache_tokens=2048)
        outs[graphs] = engine.generate(prompts, params)
        if graphs == "1":
            assert engine.worker.graphs.failure is None and engine.worker.graphs.graphs
    for i, (a, b) in enumerate(zip(outs["0"], outs["1"])):
        assert_same_greedy(a, b, 2 * tol, tol, ("graphs vs eager", i))

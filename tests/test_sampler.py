"""The batched sampler (minakv/worker/sampler.py) on the CPU: exact filtered distributions, batch-independent
seeded streams, greedy rows, logprobs, and degenerate parameters.

The sampler is deterministic given (seed, counter), so these tests are too: a bound either always holds or
never does. "One device-to-host transfer per step" cannot be observed on the CPU; `sample` is checked to
return a tensor (no Python ints, hence no read-back), and `sample_to_host` reads one packed tensor.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.triton import interpreted

from minakv.ops import triton_util
from minakv.params import SamplingParams
from minakv.worker.sampler import SamplingTensors, sample, sample_to_host, thresholds

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.3, 0.0, -0.4, -1.0, -1.6, -2.5, float("-inf")])


def params(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, logprobs=None) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, logprobs=logprobs)


def exact(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The filtered distribution in float64, written independently of the sampler: temperature, then the k
    largest, then the shortest sorted prefix reaching top_p, then p >= min_p * p_max."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(p, descending=True).tolist()
    keep = order[:top_k] if top_k > 0 else order
    mass, prefix = float(p[keep].sum()), []
    for i in keep:
        prefix.append(i)
        if sum(float(p[j]) for j in prefix) / mass >= top_p:
            break
    keep = [i for i in prefix if p[i] >= min_p * p[order[0]] and p[i] > 0]
    q = torch.zeros_like(p)
    q[keep] = p[keep]
    return q / q.sum()


def draw(logits: torch.Tensor, p: SamplingParams, n: int, seed: int = 7) -> torch.Tensor:
    """n draws of one row: n rows of a batch, the same seed, counters 0..n-1."""
    t = SamplingTensors.build([p] * n, [seed] * n, list(range(n)), "cpu")
    return sample(logits.expand(n, -1).contiguous(), t)


def chi_square(tokens: torch.Tensor, q: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=q.numel()).double()
    assert (observed[q == 0] == 0).all(), f"sampled outside the support: {observed.tolist()} vs {q.tolist()}"
    expected = q * tokens.numel()
    support = q > 0
    return float(((observed[support] - expected[support]) ** 2 / expected[support]).sum())


SETTINGS = [  # (temperature, top_k, top_p, min_p)
    (1.0, -1, 1.0, 0.0),
    (0.7, -1, 1.0, 0.0),
    (1.0, 3, 1.0, 0.0),
    (1.0, -1, 0.8, 0.0),
    (1.0, -1, 1.0, 0.2),
    (0.7, 5, 0.8, 0.0),
    (1.3, 6, 0.9, 0.1),
    (0.5, -1, 0.95, 0.05),
    (2.0, 20, 0.6, 0.0),
]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", SETTINGS)
def test_frequencies_follow_the_filtered_distribution(temperature, top_k, top_p, min_p):
    n = 20000
    tokens = draw(LOGITS, params(temperature, top_k, top_p, min_p), n)
    q = exact(LOGITS, temperature, top_k, top_p, min_p)
    # df <= 10: chi2 above 40 has probability < 2e-5 under the right distribution. A top_p prefix one token
    # too long or too short, or min_p against the wrong reference, gives chi2 in the hundreds at this n.
    assert chi_square(tokens, q) < 40
    assert torch.bincount(tokens, minlength=LOGITS.numel())[q > 0].min() > 0  # every kept token appears


def test_seeded_row_is_batch_independent():
    g = torch.Generator().manual_seed(0)
    mine = torch.randn(1000, generator=g)
    target = params(temperature=0.9, top_k=40, top_p=0.9)
    alone = [int(sample(mine[None], SamplingTensors.build([target], [1234], [c], "cpu"))) for c in range(30)]
    assert len(set(alone)) > 5  # a real stream, not one token
    others = [params(0), params(1.0), params(0.6, top_p=0.5), params(1.0, top_k=3, min_p=0.3), params(1.5)]
    for size, where in ((2, 0), (7, 3), (12, 11), (40, 17)):
        got = []
        for c in range(30):
            logits = torch.randn(size, 1000, generator=g) * 3
            logits[where] = mine
            ps = [others[int(i) % len(others)] for i in torch.randint(0, 99, (size,), generator=g)]
            seeds = torch.randint(0, 2**62, (size,), generator=g).tolist()
            counters = torch.randint(0, 500, (size,), generator=g).tolist()
            ps[where], seeds[where], counters[where] = target, 1234, c
            got.append(int(sample(logits, SamplingTensors.build(ps, seeds, counters, "cpu"))[where]))
        assert got == alone, (size, where)
    other_seed = [
        int(sample(mine[None], SamplingTensors.build([target], [1235], [c], "cpu"))) for c in range(30)
    ]
    shifted = [
        int(sample(mine[None], SamplingTensors.build([target], [1234], [c + 1], "cpu"))) for c in range(30)
    ]
    assert other_seed != alone and shifted != alone
    big_seed = [
        int(sample(mine[None], SamplingTensors.build([target], [2**62 + 1234], [c], "cpu")))
        for c in range(30)
    ]
    assert big_seed != alone  # the seed's high 32 bits count too


def test_greedy_rows_are_the_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 500, generator=g)
    ps = [params(0, top_k=3, top_p=0.1) if i % 2 == 0 else params(1.0, top_p=0.7) for i in range(9)]
    tokens = sample(logits, SamplingTensors.build(ps, list(range(9)), [5] * 9, "cpu"))
    assert isinstance(tokens, torch.Tensor) and tokens.dtype == torch.int64 and tokens.shape == (9,)
    assert tokens[0::2].tolist() == logits.argmax(dim=-1)[0::2].tolist()
    all_greedy = SamplingTensors.build([params(0)] * 9, [0] * 9, [0] * 9, "cpu")
    assert all_greedy.all_greedy and sample(logits, all_greedy).tolist() == logits.argmax(dim=-1).tolist()


def test_logprobs_are_the_models_log_softmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 300, generator=g) * 2
    ps = [
        params(0.8, top_p=0.5, logprobs=3),
        params(0),
        params(0, logprobs=0),
        params(1.0, logprobs=7),
        params(2.0),
    ]
    t = SamplingTensors.build(ps, [11, 12, 13, 14, 15], [3] * 5, "cpu")
    assert t.needs_logprobs and t.max_logprobs == 7
    tokens, records = sample_to_host(logits, t, ps)
    assert tokens == sample(logits, t).tolist()
    lp = torch.log_softmax(logits.double(), dim=-1)
    for row, (p, rec) in enumerate(zip(ps, records)):
        if p.logprobs is None:
            assert rec is None
            continue
        assert rec.token_id == tokens[row]
        assert math.isclose(rec.logprob, float(lp[row, tokens[row]]), abs_tol=1e-5)
        values, ids = torch.topk(lp[row], p.logprobs)
        assert [i for i, _ in rec.top] == ids.tolist()
        assert all(math.isclose(v, float(w), abs_tol=1e-5) for (_, v), w in zip(rec.top, values))
    plain = SamplingTensors.build([params(1.0)] * 5, [1] * 5, [0] * 5, "cpu")
    assert not plain.needs_logprobs and sample_to_host(logits, plain, [params(1.0)] * 5)[1] == [None] * 5


def test_degenerate_parameters_give_valid_tokens():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 64, generator=g)
    logits[:, ::3] = float("-inf")
    logits[5] = 0.25  # all equal
    logits[6] = float("-inf")
    logits[6, 17] = 4.0  # one finite entry
    ps = [
        params(1e-300),
        params(1e-8),
        params(1.0, top_p=1e-9),
        params(1e-4, top_k=1, top_p=1e-9, min_p=1.0),
        params(100.0, top_k=10**9),
        params(1.0, top_p=1e-9, min_p=0.999),
        params(3e-5, top_p=0.5),
        params(1.0, top_k=2, min_p=1.0),
    ]
    argmax = logits.argmax(dim=-1)
    for c in range(20):
        t = SamplingTensors.build(ps, [c * 31 + i for i in range(8)], [c] * 8, "cpu")
        tokens, _ = sample_to_host(logits, t, ps)
        assert all(0 <= tok < 64 and torch.isfinite(logits[row, tok]) for row, tok in enumerate(tokens))
        assert tokens[:4] == argmax[:4].tolist() and tokens[6] == 17
        assert tokens[2] == int(argmax[2]) and tokens[7] == int(argmax[7])
    # a row of -inf everywhere has no valid token: it must still not raise or produce an out-of-range id
    t = SamplingTensors.build([params(1.0, top_p=0.5)], [0], [0], "cpu")
    assert 0 <= int(sample(torch.full((1, 64), float("-inf")), t)) < 64


@interpreted
@pytest.mark.parametrize("seed", range(3))
def test_kernels_match_the_torch_path(seed, monkeypatch):
    """The Triton top-p threshold (bisection) equals the sorted reference, in the CPU interpreter (the fused
    Gumbel kernel uses libdevice's log1p, which the interpreter lacks: test_kernels_on_the_gpu covers it)."""
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 6, 300
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[0, :10] = float("-inf")
    logits[1, 5:8] = logits[1, 4]  # ties at the boundary region
    ps = [
        params(1.0, top_p=p, top_k=k)
        for p, k in [(0.9, -1), (0.5, 20), (1.0, 7), (1e-9, -1), (0.99, -1), (0.3, 3)]
    ]
    t = SamplingTensors.build(ps, list(range(rows)), [seed] * rows, "cpu")
    reference = thresholds(logits, t)
    monkeypatch.setattr(triton_util, "TRITON_ON_CPU", True)
    assert torch.equal(thresholds(logits, t), reference)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_on_the_gpu():
    """At a real vocabulary: the kernels' thresholds and tokens equal the torch path's on the same rows."""
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 64, 201088
    logits = (torch.randn(rows, vocab, generator=gen) * 2).cuda()
    ps = [params(1.0, top_p=[0.9, 0.5, 1.0, 0.99][i % 4], top_k=[-1, 50][i % 2]) for i in range(rows)]
    t = SamplingTensors.build(ps, list(range(rows)), [3] * rows, "cuda")
    z = logits - logits.amax(dim=-1, keepdim=True)
    cpu_t = SamplingTensors.build(ps, list(range(rows)), [3] * rows, "cpu")
    same = thresholds(z, t).cpu() == thresholds(z.cpu(), cpu_t)
    assert same.float().mean() >= 0.95  # sums in another order may move a rare boundary by one token
    cpu = sample(logits.cpu(), cpu_t)
    assert (sample(logits, t).cpu() == cpu).float().mean() >= 0.98  # float rounding may flip a rare tie
    # no filter: the kernel scales the raw logits itself (z never materialised), greedy rows mixed in
    ps = [params([0.7, 1.0, 1.3, 0.0][i % 4]) for i in range(rows)]
    t, cpu_t = (SamplingTensors.build(ps, list(range(rows)), [5] * rows, d) for d in ("cuda", "cpu"))
    assert not t.filters
    fused, ref = sample(logits, t).cpu(), sample(logits.cpu(), cpu_t)
    assert (fused == ref).float().mean() >= 0.98
    assert torch.equal(fused[3::4], logits[3::4].argmax(-1).cpu())  # temperature 0: the argmax


def test_top_k_past_int64_keeps_every_token():
    """A top_k beyond int64 (found by the server fuzz test: it failed the engine step) means no limit: the
    same tokens as top_k = -1, for the same seeds."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 64, generator=gen) * 2
    huge = [SamplingParams(temperature=1.0, top_k=4968939453530955130601472) for _ in range(3)]
    none = [SamplingParams(temperature=1.0) for _ in range(3)]
    t_huge, t_none = (SamplingTensors.build(ps, [7, 8, 9], [0, 1, 2], "cpu") for ps in (huge, none))
    assert torch.equal(sample(logits, t_huge), sample(logits, t_none))

"""The all-to-all expert dispatch (minakv/parallel/dispatch.py) against a float64 loop over every
(token, expert) pair of the whole MoE, and against the all-reduce form, on tiny random experts.

Two and four ranks are spawned (gloo on CPU). Each builds the same problems from a seed, cuts the expert
weights with `shard` for every layout of its world (ep > 1 dispatches, tp = world with ep < world gives
each expert's I to several ranks, ep = 1 stays an all-reduce), and runs `run_experts` in both forms.
The problems cover T smaller than the world, T not divisible by it, experts that get no pair, and ranks
that receive no row at all (every pair routed to the first block of experts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minakv.ops.moe import activate, moe, route_softmax_topk
from minakv.parallel import Parallel, ParallelError
from minakv.parallel.dispatch import dispatch_experts, shares
from minakv.parallel.experts import run_experts
from minakv.parallel.shard import shard

E, H, I, K = 8, 16, 8, 2  # experts, hidden, intermediate, experts per token
LAYOUTS = {2: [(1, 2), (2, 2), (2, 1)], 4: [(1, 4), (4, 4), (4, 2), (4, 1)]}  # world -> (tp, ep)
# (name, tokens, every pair on experts 0..1, activation with GPT-OSS biases or MiniMax-M2's plain SiLU, dtype)
PROBLEMS = [
    ("one-token", 1, False, "swiglu_oai", torch.float32),
    ("three", 3, False, "silu", torch.float32),
    ("uneven", 7, False, "swiglu_oai", torch.float32),
    ("even", 16, False, "silu", torch.float32),
    ("skewed", 5, True, "swiglu_oai", torch.float32),
    ("bf16", 13, False, "silu", torch.bfloat16),
]


def problem(index: int) -> dict:
    """The whole experts, tokens and routing of PROBLEMS[index], the same on every rank (seeded)."""
    _, tokens, skewed, activation, dtype = PROBLEMS[index]
    g = torch.Generator().manual_seed(index)
    p = {
        "x": torch.randn(tokens, H, generator=g),
        "gate_up": torch.randn(E, 2 * I, H, generator=g) * 0.3,
        "down": torch.randn(E, H, I, generator=g) * 0.3,
        "activation": activation,
        "dtype": dtype,
    }
    if activation == "swiglu_oai":
        p["gate_up_bias"], p["down_bias"] = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    logits = torch.randn(tokens, E, generator=g)
    if skewed:  # only experts 0 and 1: with ep >= 2 every other block, and the ranks holding it, get nothing
        logits[:, 2:] = -1e9
    p["weights"], p["ids"] = route_softmax_topk(logits, K)
    return p


def reference(p: dict) -> torch.Tensor:
    """sum over a token's k experts of weight * expert(x), pair by pair, in float64."""
    d = torch.float64
    x = p["x"].to(p["dtype"]).to(d)
    out = torch.zeros(x.shape, dtype=d)
    for t in range(x.shape[0]):
        for s in range(K):
            e = int(p["ids"][t, s])
            h = p["gate_up"][e].to(p["dtype"]).to(d) @ x[t]
            if "gate_up_bias" in p:
                h = h + p["gate_up_bias"][e].to(d)
            y = p["down"][e].to(p["dtype"]).to(d) @ activate(h, p["activation"])
            if "down_bias" in p:
                y = y + p["down_bias"][e].to(d)
            out[t] += float(p["weights"][t, s]) * y
    return out


def rank_experts(p: dict, par: Parallel):
    """This rank's cut of the experts, as the (x, weights, ids) -> out callable the MoE blocks pass."""
    names = [n for n in ("gate_up", "down", "gate_up_bias", "down_bias") if n in p]
    w = {n: shard(f"layers.0.mlp.experts.{n}", p[n], par).to(p["dtype"]) for n in names}

    def experts(x, weights, ids):
        args = (w.get("gate_up_bias"), w.get("down_bias"), p["activation"])
        return moe(x, w["gate_up"], w["down"], weights, ids, *args)

    return experts


def rank_main(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results = {}
    for tp, ep in LAYOUTS[world]:
        for index, (name, *_) in enumerate(PROBLEMS):
            p = problem(index)
            x, weights, ids = p["x"].to(p["dtype"]), p["weights"], p["ids"]
            for form in ("all_to_all", "all_reduce"):
                par = Parallel(rank, tp, ep, expert_dispatch=form)
                experts = rank_experts(p, par)
                results[(tp, ep, name), form] = run_experts(experts, x, weights, ids, E, par)
                if form == "all_to_all" and ep > 1:  # the default really dispatches
                    direct = dispatch_experts(experts, x, weights, ids, E, par)
                    assert torch.equal(direct, results[(tp, ep, name), form])
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_equals_the_whole_moe_and_the_all_reduce_form(world, tmp_path) -> None:
    mp.spawn(rank_main, args=(world, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for tp, ep in LAYOUTS[world]:
        for index, (name, *_, dtype) in enumerate(PROBLEMS):
            want = reference(problem(index))
            tol = (1e-2 if dtype == torch.bfloat16 else 2e-6) * float(want.abs().max())
            case = (tp, ep, name)
            a2a, ar = ranks[0][case, "all_to_all"], ranks[0][case, "all_reduce"]
            assert a2a.dtype == dtype and a2a.shape == want.shape, case
            assert float((a2a.double() - want).abs().max()) <= tol, case
            assert float((ar.double() - want).abs().max()) <= tol, case
            assert float((a2a.double() - ar.double()).abs().max()) <= tol, case
            for r in range(1, world):  # every rank ends with the same output, bit for bit
                assert torch.equal(ranks[r][case, "all_to_all"], a2a), (case, r)
                assert torch.equal(ranks[r][case, "all_reduce"], ar), (case, r)


def test_shares_split_the_tokens_unevenly_first_ranks_first() -> None:
    assert shares(7, 2) == [4, 3]
    assert shares(3, 4) == [1, 1, 1, 0]
    assert shares(8, 4) == [2, 2, 2, 2]
    assert shares(0, 2) == [0, 0]


def test_an_unknown_dispatch_is_refused() -> None:
    with pytest.raises(ParallelError, match="expert_dispatch"):
        Parallel(0, 1, 1, expert_dispatch="ring")

"""Tensor-parallel attention and expert-parallel MoE (minakv/parallel/) against the single-process model.

Two ranks are spawned once (torch.multiprocessing + gloo on CPU, the code NCCL runs on GPUs). For every
case each rank loads its share of a tiny preset (HF-format checkpoints built on the fly) and computes
(1) the logits of a prefill and three greedy decode steps through a dense context, and (2) a batch of
drop/reposition programs through its own `Engine` over the sharded model (the real `Worker`: key table,
paged KV, chunked prefill). Every rank's scheduler makes the same batches, so the ranks meet at the
same collectives. This process is the reference: the unsharded model, its Engine, and the walk oracle.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.programs import HISTORY, assert_matches_oracle, compiles
from safetensors.torch import save_file

from minakv import Engine, SamplingParams
from minakv.model import ModelConfig, build_model, load_model
from minakv.model.loader import checkpoint_name
from minakv.parallel import SINGLE, Parallel, ParallelError
from minakv.parallel.experts import local_experts
from minakv.parallel.shard import shard
from minakv.presets import resolve_model
from minakv.reference.dense import DenseContext

WORLD = 2
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
ENGINE = {"page_size": 4, "max_num_batched_tokens": 16, "kv_cache_tokens": 512}
PROMPT = [5, 17, 250, 3, 99, 42, 7, 300, 11, 64, 128, 2]
# MiniMax-M2 in FP8 with dims whose splits fall on 128x128 scale blocks (the tiny preset's do not):
# dummy weights, drawn whole and cut
FP8 = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "vocab_size": 512,
    "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 128, "rotary_dim": 64, "intermediate_size": 256, "num_local_experts": 4,
    "num_experts_per_tok": 2, "max_position_embeddings": 4096, "rope_theta": 10000.0,
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}  # fmt: skip
CASES = {  # name -> (preset, "fp8-dummy" or "fp8-checkpoint", tp, ep, run the engine)
    "gpt-oss-tp2": ("tiny-gpt-oss", 2, 1, True),
    "gpt-oss-ep2": ("tiny-gpt-oss", 1, 2, True),
    "gpt-oss-ep2-all-reduce": ("tiny-gpt-oss", 1, 2, False),
    "gpt-oss-tp2-ep2": ("tiny-gpt-oss", 2, 2, True),
    "minimax-tp2": ("tiny-minimax-m2", 2, 1, True),
    "minimax-ep2": ("tiny-minimax-m2", 1, 2, True),
    "minimax-tp2-ep2": ("tiny-minimax-m2", 2, 2, True),
    "gpt-oss-mxfp4-tp2": ("tiny-gpt-oss-mxfp4", 2, 1, False),
    "gpt-oss-mxfp4-ep2": ("tiny-gpt-oss-mxfp4", 1, 2, False),
    "minimax-fp8-ep2": ("tiny-minimax-m2-fp8", 1, 2, False),
    "minimax-fp8-dummy-tp2": ("fp8-dummy", 2, 1, False),
    "minimax-fp8-checkpoint-tp2": ("fp8-checkpoint", 2, 1, True),
}
DISPATCH = {"gpt-oss-ep2-all-reduce": "all_reduce"}  # the others: the default, all-to-all under EP


def fp8_checkpoint() -> Path:
    """The FP8 dummy model written as a MiniMax-M2 checkpoint (per-expert w1/w3/w2 with their scale grids)."""
    return Path(os.environ["MINAKV_CACHE"]) / "fp8-aligned"


def write_fp8_checkpoint() -> None:
    model, config, path = make("fp8-dummy"), ModelConfig.from_hf(FP8), fp8_checkpoint()
    tensors = {}
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        prefix = checkpoint_name(config, name).rsplit(".", 1)[0]
        leaf = name.rsplit(".", 1)[-1]
        if ".experts." not in name:
            tensors[checkpoint_name(config, name)] = t
        elif leaf in ("gate_up", "gate_up_scale_inv"):
            gates, ups = t.chunk(2, dim=1)  # [E, 2I, H] and its scale grid: the gate half, then the up half
            suffix = ".weight" + leaf.removeprefix("gate_up")
            for j in range(t.shape[0]):
                tensors[f"{prefix}.{j}.w1{suffix}"], tensors[f"{prefix}.{j}.w3{suffix}"] = gates[j], ups[j]
        else:
            for j in range(t.shape[0]):
                tensors[f"{prefix}.{j}.w2.weight" + leaf.removeprefix("down")] = t[j]
    path.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(FP8))


def make(model: str, parallel: Parallel = SINGLE):
    if model == "fp8-dummy":
        return build_model(ModelConfig.from_hf(FP8), "cpu", torch.float32, parallel=parallel)
    path = fp8_checkpoint() if model == "fp8-checkpoint" else resolve_model(model)
    return load_model(path, device="cpu", dtype=torch.float32, parallel=parallel)


def random_programs(count: int, seed: int = 0) -> list[tuple[list[list[int]], dict]]:
    """Messages with random drops and repositions (seeded, so every rank draws the same ones)."""
    rng, found = random.Random(seed), []
    while len(found) < count:
        n = rng.randint(2, 6)
        segments = [[rng.randrange(384) for _ in range(rng.randint(1, 9))] for _ in range(n)]
        drop = {str(t): sorted(rng.sample(range(t + 1), rng.randint(1, min(2, t + 1))))
                for t in range(n) if rng.random() < 0.4}  # fmt: skip
        cache = {"drop": drop, "reposition": sorted(rng.sample(range(n), rng.randint(0, 2)))}
        if compiles(segments, cache):
            found.append((segments, cache))
    return found


PROGRAMS = HISTORY + random_programs(4)


def requests() -> list:
    """The programs batched between two unrelated prompts."""
    others = [[9, 8, 7, 6, 5, 4, 3], list(range(40, 61))]
    return [others[0], *({"message_tokens": s, "cache": c} for s, c in PROGRAMS), others[1]]


@torch.inference_mode()
def forward_logits(model) -> torch.Tensor:
    """A prefill of PROMPT, then three greedy decode steps: the logits of every step's last token."""
    ctx, ids, rows = DenseContext(), torch.tensor(PROMPT), []
    for _ in range(4):
        ctx.advance(ids.numel())
        logits = model.compute_logits(model(ids, ctx))
        rows.append(logits)
        ids = logits[-1:].argmax(-1)
    return torch.cat(rows)


def rank_main(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    results = {}
    for name, (model, tp, ep, engine) in CASES.items():
        sharded = make(model, Parallel(rank, tp, ep, expert_dispatch=DISPATCH.get(name, "all_to_all")))
        result = {"logits": forward_logits(sharded), "kv_heads": sharded.kv_heads}
        if engine:
            e = Engine(sharded, **ENGINE)
            result["outputs"] = e.generate(requests(), GREEDY)
            result["again"] = e.generate(requests()[1:2], GREEDY)[0]  # from the cache this time
            result["kv_shape"] = tuple(e.worker.k_cache.shape)
            e.check()
        results[name] = result
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every case's results on each rank (spawned once for the module)."""
    for preset in {m for m, *_ in CASES.values() if m.startswith("tiny")}:
        resolve_model(preset)  # build the checkpoints here, once, before the ranks read them
    write_fp8_checkpoint()
    tmp = tmp_path_factory.mktemp("parallel")
    mp.spawn(rank_main, args=(f"file://{tmp / 'store'}", str(tmp)), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


_full: dict[str, torch.nn.Module] = {}


def full(model: str):
    if model not in _full:
        _full[model] = make(model)
    return _full[model]


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_forward_equals_the_single_process_model(ranks, case):
    model, tp, *_ = CASES[case]
    ref = forward_logits(full(model))
    for r in range(WORLD):
        got = ranks[r][case]["logits"]
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), (r, float((got - ref).abs().max()))
        assert ranks[r][case]["kv_heads"] == full(model).config.num_kv_heads // tp


@pytest.mark.parametrize("case", [c for c, (*_, engine) in CASES.items() if engine])
def test_sharded_engine_matches_the_single_process_engine_and_the_walk(ranks, case):
    model, tp, *_ = CASES[case]
    reference = full(model)
    ref = Engine(reference, **ENGINE)
    expected = ref.generate(requests(), GREEDY)
    c = reference.config
    assert ranks[0][case]["kv_shape"][2:] == (c.num_kv_heads // tp, c.head_dim)  # only its kv heads
    for r in range(WORLD):  # every rank samples the same tokens (the logits are replicated)
        outs = ranks[r][case]["outputs"]
        for got, want in zip(outs, expected):
            assert got.token_ids == want.token_ids
            assert [x.logprob for x in got.logprobs] == pytest.approx(
                [x.logprob for x in want.logprobs], abs=1e-4
            )
    for (segments, cache), out in zip(PROGRAMS, ranks[0][case]["outputs"][1:], strict=False):
        assert_matches_oracle(reference, segments, cache, out, tol=1e-4)
    assert ranks[0][case]["again"].token_ids == expected[1].token_ids
    assert ranks[0][case]["again"].usage.cached_tokens > 0


# ----- single-process checks of the pieces -----


def test_the_expert_shares_sum_to_the_whole_moe() -> None:
    """Each rank's `local_experts` (compact and masked) on its cut of the weights, summed over ranks."""
    from minakv.ops.moe import moe, route_softmax_topk

    g = torch.Generator().manual_seed(0)
    e, h, i, t = 6, 16, 8, 11
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    gate_up_bias, down_bias = torch.randn(e, 2 * i, generator=g), torch.randn(e, h, generator=g)
    x = torch.randn(t, h, generator=g)
    weights, ids = route_softmax_topk(torch.randn(t, e, generator=g), 2)
    args = {"activation": "swiglu_oai"}
    whole = moe(x, gate_up, down, weights, ids, gate_up_bias, down_bias, **args)
    for tp, ep in ((1, 2), (2, 1), (2, 2), (1, 3), (4, 2), (4, 1)):
        for compact in (True, False):
            total = torch.zeros_like(x)
            for rank in range(max(tp, ep)):
                par = Parallel(rank, tp, ep)
                w = {n: shard(f"layers.0.mlp.experts.{n}", v, par)
                     for n, v in (("gate_up", gate_up), ("down", down), ("gate_up_bias", gate_up_bias),
                                  ("down_bias", down_bias))}  # fmt: skip
                first, count = par.expert_range(e)

                def experts(x, wt, ids, w=w):
                    return moe(x, w["gate_up"], w["down"], wt, ids, w["gate_up_bias"], w["down_bias"], **args)

                total += local_experts(experts, x, weights, ids, first, count, e, compact=compact)
            assert torch.allclose(total, whole, atol=1e-4), (tp, ep, compact)


def test_sharded_dummy_weights_are_cuts_of_the_unsharded_ones() -> None:
    whole = make("fp8-dummy")
    ref = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
    for rank in range(WORLD):
        par = Parallel(rank, 2, 2)
        part = build_model(ModelConfig.from_hf(FP8), "cpu", torch.float32, parallel=par)
        for name, t in (*part.named_parameters(), *part.named_buffers()):
            want = shard(name, ref[name], par)
            assert t.shape == want.shape and torch.equal(t.float(), want.float()), name
        assert part.layers[0].mlp.experts.gate_up.shape == (2, 512, 256)  # its 2 experts, whole
        assert part.layers[0].self_attn.k_proj.weight.shape == (128, 256)  # its kv head
        assert bool((part.layers[0].self_attn.o_proj.weight_scale_inv == 0.02).all())


def test_layouts_that_do_not_cut_are_refused() -> None:
    with pytest.raises(ParallelError, match="attention is split over all"):
        Parallel(0, tp=2, ep=4)
    with pytest.raises(ParallelError, match="outside"):
        Parallel(2, tp=2)
    with pytest.raises(ParallelError, match="kv heads"):  # the tiny models have 2 kv heads
        load_model(resolve_model("tiny-gpt-oss"), "cpu", torch.float32, parallel=Parallel(0, tp=4, ep=4))
    with pytest.raises(ParallelError, match="FP8 k/v projection rows .* blocks of 128"):
        load_model(resolve_model("tiny-minimax-m2-fp8"), "cpu", torch.float32, parallel=Parallel(0, tp=2))
    config = ModelConfig.from_hf({**FP8, "intermediate_size": 192})
    with pytest.raises(ParallelError, match="FP8 expert intermediate size"):
        build_model(config, "cpu", torch.float32, parallel=Parallel(0, tp=2))
    build_model(config, "cpu", torch.float32, parallel=Parallel(0, tp=2, ep=2))  # whole experts: fine


def test_the_fp8_checkpoint_loads_back_as_the_dummy_model(ranks) -> None:
    """The checkpoint the FP8 cases load is the dummy model (so their reference is not the loader's own)."""
    assert torch.equal(forward_logits(full("fp8-checkpoint")), forward_logits(full("fp8-dummy")))


@pytest.mark.slow
def test_four_ranks_and_groups_inside_a_larger_world(tmp_path) -> None:
    """Four ranks: EP=4 over all of them (2 experts each), then two groups of two in the same world, as
    prefill and decode workers would be: TP=2 of MiniMax-M2 on ranks 0-1, EP=2 of GPT-OSS on ranks 2-3."""
    mp.spawn(_four_main, args=(f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=4, join=True)
    for r in range(4):
        ep4, grouped = torch.load(tmp_path / f"{r}.pt")
        assert torch.allclose(ep4, forward_logits(full("tiny-gpt-oss")), rtol=1e-4, atol=1e-4)
        ref = forward_logits(full("tiny-minimax-m2" if r < 2 else "tiny-gpt-oss"))
        assert torch.allclose(grouped, ref, rtol=1e-4, atol=1e-4)


def _four_main(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    ep4 = forward_logits(make("tiny-gpt-oss", Parallel(rank, 1, 4)))
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    if rank < 2:
        grouped = forward_logits(make("tiny-minimax-m2", Parallel(rank, 2, 1, groups[0])))
    else:
        grouped = forward_logits(make("tiny-gpt-oss", Parallel(rank - 2, 1, 2, groups[1])))
    torch.save((ep4, grouped), Path(out) / f"{rank}.pt")
    dist.destroy_process_group()

"""The engine's own tensor / expert-parallel workers (`Engine(model, tensor_parallel_size=2)` or
`expert_parallel_size=2`: two worker processes over gloo on CPU, each with its share of the model;
docs/parallel.md, docs/workers.md) against independent references:

- batched random drop/reposition programs give the single-process engine's greedy tokens (fp32) and the
  walk oracle's logprobs; a second round reads them from the cache;
- a killed rank (either one) ends its streams within 5 s as `Unavailable`, the engine restarts every
  rank, the pool accounting stays exact, and it serves the same tokens again; no process is left after
  shutdown;
- prefill/decode with TP=2 on each side (four processes; killing one of them: slow);
- the parent's protocol without processes: a step only some ranks failed, or one that hangs, is a death.

Each engine spawns processes that import torch (seconds each), so one engine per case serves the module.
"""

from __future__ import annotations

from multiprocessing import Pipe
from types import SimpleNamespace

import pytest
from helpers.processes import SMALL_STEPS, alive, assert_recovered, kill_while_decoding
from helpers.programs import assert_matches_oracle, mixed_prompts, programs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minakv import Engine, SamplingParams
from minakv.config import EngineConfig
from minakv.parallel import ParallelError
from minakv.worker import ranks as ranks_module
from minakv.worker.build import load_model_by_name
from minakv.worker.child import Failed, broken_group
from minakv.worker.ranks import WorkerDied, result_of
from minakv.worker.worker import StepResult

SETTINGS = {**SMALL_STEPS, "kv_cache_tokens": 1024}
GREEDY = SamplingParams(max_tokens=5, temperature=0, logprobs=0, ignore_eos=True)
PD = {"prefill_devices": ["cpu"], "decode_devices": ["cpu"]}
CASES = {  # name -> (preset, engine keywords)
    "gpt-oss-tp2": ("tiny-gpt-oss", {"tensor_parallel_size": 2}),
    # the all-to-all expert dispatch through the whole engine (the default, all-reduce, in gpt-oss-ep2)
    "minimax-ep2": ("tiny-minimax-m2", {"expert_parallel_size": 2, "expert_dispatch": "all_to_all"}),
    "gpt-oss-ep2": ("tiny-gpt-oss", {"expert_parallel_size": 2}),
    "minimax-tp2": ("tiny-minimax-m2", {"tensor_parallel_size": 2}),
    "minimax-pd-tp2": ("tiny-minimax-m2", {"tensor_parallel_size": 2, **PD}),
}
FAST = ("gpt-oss-tp2", "minimax-ep2", "minimax-pd-tp2")


_references: dict[str, tuple] = {}


def reference(preset: str) -> tuple:
    """(the oracle's model, the single-process engine) of a preset, shared by its cases."""
    if preset not in _references:
        model = load_model_by_name(EngineConfig(model=preset, device="cpu"))  # what the ranks cut up
        _references[preset] = (model, Engine(preset, **SETTINGS))
    return _references[preset]


@pytest.fixture(
    scope="module",
    params=[c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
)
def case(request):
    """(the case's name, the oracle's model, the single-process engine, the parallel engine)."""
    preset, kwargs = CASES[request.param]
    model, local = reference(preset)
    engine = Engine(preset, **kwargs, **SETTINGS)
    yield request.param, model, local, engine
    pids = engine.worker.pids
    engine.shutdown()
    assert len(pids) == len(set(pids)) >= 2 and not any(alive(pid) for pid in pids)  # none left behind


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    batch=st.lists(programs(max_messages=5, max_len=9, vocab=384), min_size=3, max_size=5), seed=st.integers()
)
def test_random_programs_match_the_single_process_engine_and_the_walk(case, batch, seed) -> None:
    _, model, local, engine = case
    batch, prompts = mixed_prompts(batch, seed)
    expected = local.generate(prompts, GREEDY)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    for got, want in zip(outs, expected):
        assert [x.logprob for x in got.logprobs] == pytest.approx(
            [x.logprob for x in want.logprobs], abs=1e-4
        )
    for (segments, cache), out in zip(batch, [o for i, o in enumerate(outs) if i != 1]):
        assert_matches_oracle(model, segments, cache, out, tol=1e-4)
    # a second round of the longest prompt reads its full pages from every rank's cache (tokens dropped
    # before anything read them are never computed, so only the computed ones fill pages)
    longest = max(range(len(prompts)), key=lambda i: expected[i].usage.prompt_tokens)
    (again,) = engine.generate([prompts[longest]], GREEDY)
    assert again.token_ids == expected[longest].token_ids
    first = expected[longest].usage
    computed = first.prompt_tokens - first.drop_skipped_tokens
    assert again.usage.cached_tokens > 0 or computed <= 2 * SETTINGS["page_size"]
    engine.check()


@pytest.mark.parametrize("rank", [1, 0])
def test_a_killed_rank_fails_its_streams_fast_then_every_rank_restarts(case, rank) -> None:
    name = case[0]
    if (name != FAST[0] and rank == 0) or "pd" in name:
        pytest.skip("each kill restarts every rank (seconds): one case kills rank 0, the pair's is slow")
    kill_and_recover(case, rank)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["minimax-pd-tp2"], indirect=True)
def test_a_killed_prefill_rank_of_a_tp2_pair_stops_all_four(case) -> None:
    kill_and_recover(case, 1)  # prefill rank 1: prefill rank 0 and decode rank 1 are blocked on it


def kill_and_recover(case, rank: int) -> None:
    """Kill worker process `rank` (of `pids`: the prefill side's first) while requests decode."""
    _, _, local, engine = case
    old = engine.worker.pids
    victim = old[rank]
    streams = kill_while_decoding(engine, victim)
    for outs in streams:
        assert f"rank {rank} (pid {victim}" in outs[-1].error and "ranks" in outs[-1].error
    assert_recovered(engine, local, old, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))


# ----- settings -----
def test_layouts_and_devices_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ParallelError, match="attention is split over all"):
        Engine("tiny-gpt-oss", tensor_parallel_size=2, expert_parallel_size=4, **SETTINGS)
    with pytest.raises(ValueError, match="exactly one device per rank"):
        Engine("tiny-gpt-oss", tensor_parallel_size=2, prefill_devices=["cpu"] * 3, **SETTINGS)
    with pytest.raises(ValueError, match="one GPU"):
        Engine("tiny-gpt-oss", tensor_parallel_size=2, prefill_devices=["cuda:0"], **SETTINGS)
    with pytest.raises(ValueError, match="distinct GPUs"):
        Engine("tiny-gpt-oss", expert_parallel_size=2, prefill_devices=["cuda:0", "cuda:0"], **SETTINGS)
    with pytest.raises(ValueError, match="loads its model by name"):
        Engine(reference("tiny-minimax-m2")[0], tensor_parallel_size=2, **SETTINGS)
    config = EngineConfig(tensor_parallel_size=2, device="cpu")
    assert config.role_devices(None) == ["cpu", "cpu"] and config.role_devices(["cpu"]) == ["cpu", "cpu"]
    assert EngineConfig(expert_parallel_size=2, device="cuda").role_devices(None) == ["cuda:0", "cuda:1"]


def test_serve_flags() -> None:
    from minakv.server.serve import parser

    args = parser().parse_args(["tiny-gpt-oss", "--tensor-parallel-size", "2", "--expert-parallel-size", "2"])
    assert (args.tensor_parallel_size, args.expert_parallel_size) == (2, 2)


# ----- the parent's protocol, without processes -----
class FakeRank:
    """A rank as `result_of` sees it: a pipe to read and a process that lives."""

    def __init__(self, index: int) -> None:
        self.results, self.end = Pipe(duplex=False)
        self.name, self.pid, self.device = f"worker process rank {index}", 1000 + index, "cpu"
        self.process = SimpleNamespace(join=lambda timeout: None)

    def alive(self) -> bool:
        return True


def test_a_step_some_ranks_fail_or_hang_is_a_death(monkeypatch) -> None:
    monkeypatch.setattr(ranks_module, "OUT_OF_STEP_S", 0.2)
    boom = Failed("RuntimeError", "boom", "")
    ranks = [FakeRank(0), FakeRank(1)]
    ranks[0].end.send((1, StepResult([7], [None])))  # an older step's answer is skipped
    ranks[0].end.send((2, StepResult([3], [None])))
    ranks[1].end.send((2, None))
    assert result_of(ranks, 2, ranks).tokens == [3]
    for r in ranks:  # every rank failed: a failed step (the engine quarantines its requests)
        r.end.send((3, boom))
    with pytest.raises(RuntimeError, match="worker step failed: RuntimeError: boom") as info:
        result_of(ranks, 3, ranks)
    assert not isinstance(info.value, WorkerDied)
    ranks[0].end.send((4, StepResult([3], [None])))
    ranks[1].end.send((4, boom))
    with pytest.raises(WorkerDied, match="rank 1 alone failed step 4"):
        result_of(ranks, 4, ranks)
    ranks[0].end.send((5, boom))  # rank 1 never answers (blocked in a collective rank 0 never reached)
    with pytest.raises(WorkerDied, match="out of step"):
        result_of(ranks, 5, ranks)
    ranks[1].end.send((6, Failed("RuntimeError", "Connection closed by peer", "", fatal=True)))
    with pytest.raises(WorkerDied, match="rank 1 stopped: Connection closed"):
        result_of(ranks, 6, ranks)


def test_collective_errors_are_told_from_step_errors() -> None:
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:8094")
    try:
        raise ValueError("in the MoE") from gloo
    except ValueError as exc:
        assert broken_group(exc)
    assert not broken_group(RuntimeError("index out of range"))

"""Cache programs for tests: the literal walk of docs/design.md 2.3, random programs, and an engine run
compared with the walk oracle.

- `walk` runs the walk token by token with plain dicts (the reference the compiled program and the plan are
  checked against); `requests` draws raw (owners, drop, reposition) cases for it, invalid ones included.
- `plan_keys`: a request's plan and page keys, as the scheduler forms them.
- `programs` draws prompts as segments (one token list per message) with valid cache operations, the shape
  the engine takes; `assert_matches_oracle` checks an engine's output against the oracle.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

import torch
from hypothesis import strategies as st

from minakv.cache.keys import PageKey, page_keys
from minakv.cache.plan import Plan, plan_request
from minakv.cache.program import Program, compile_program
from minakv.outputs import RequestOutput
from minakv.params import Grammar, SamplingParams
from minakv.reference.oracle import WalkOracle


class WalkError(Exception):
    pass


def walk(owners, num_messages, drop, reposition, num_generated, max_positions=None):
    """docs/design.md 2.3 token by token. Returns, per query, {token: position} of everything it sees; the
    final {token: position} and next position; per token the positions it held (birth, then after each
    reposition that changed something); and per point the set of tokens dropped there."""
    n = len(owners)

    def after(m):  # the first token after message m
        return next((i for i, o in enumerate(owners) if o > m), n)

    drops_at = defaultdict(list)  # point -> messages dropped there
    for trigger, ids in drop.items():
        if int(trigger) < num_messages:
            drops_at[after(int(trigger))] += ids
    repositions_at = {after(m) for m in reposition if m < num_messages}

    active, next_pos, seen = {}, 0, []
    history = defaultdict(list)
    dropped_at = defaultdict(set)
    total = n + num_generated
    for i in range(total + 1):
        for m in drops_at.get(i, []):  # drops first
            for t in [t for t in active if t < n and owners[t] == m]:
                del active[t]
                dropped_at[i].add(t)
        if i in repositions_at:  # then the reposition
            if not active:
                raise WalkError("nothing active")
            ranks = {t: r for r, t in enumerate(sorted(active))}
            if ranks != active or next_pos != len(active):  # else it would change no position
                active = ranks
                next_pos = len(active)
                for t, p in active.items():
                    history[t].append(p)
        if i == total:
            break
        if max_positions is not None and next_pos >= max_positions:
            raise WalkError("position limit")
        active[i] = next_pos  # token i is born at next_pos
        history[i].append(next_pos)
        next_pos += 1
        seen.append(dict(active))
    return seen, dict(active), next_pos, history, dropped_at


@st.composite
def requests(draw):
    num_messages = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, 4), min_size=num_messages, max_size=num_messages))
    prompt = draw(st.integers(0, 2))  # generation prompt tokens (owner N)
    owners = [m for m, k in enumerate(lengths) for _ in range(k)] + [num_messages] * prompt
    drop = {}
    for trigger in draw(st.lists(st.integers(0, num_messages + 1), unique=True, max_size=4)):
        ids = draw(st.lists(st.integers(0, trigger), max_size=3))
        drop[str(trigger) if draw(st.booleans()) else trigger] = ids
    reposition = sorted(draw(st.sets(st.integers(0, num_messages + 1), max_size=3)))
    generated = draw(st.integers(0, 3))
    window = draw(st.one_of(st.none(), st.integers(1, 6)))
    return owners, num_messages, drop, reposition, generated, window


@st.composite
def programs(draw, max_messages: int = 6, max_len: int = 9, vocab: int = 384):
    """Parts (one token list per message) plus valid drop/reposition operations."""
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


def plan_keys(program: Program, token_ids: list[int], page_size: int) -> tuple[Plan, list[PageKey]]:
    """A request's plan and its page keys as the scheduler forms them when it publishes its pages: a page
    is dead (evicted first) when the first generated token reads none of its entries."""
    plan = plan_request(program, token_ids)
    live = set(plan.final_keys)
    full = len(plan.records) // page_size * page_size
    dead = [not live.intersection(range(p, p + page_size)) for p in range(0, full, page_size)]
    return plan, page_keys(plan.records, page_size, dead)


# Programs that once failed on the GPU in bf16 (routing noise: tests/test_engine_gpu.py); kept as examples.
HISTORY = [
    (
        [[125, 256, 175, 79, 247], [125, 259], [156], [95, 178, 60], [168, 67, 127, 1]],
        {"drop": {"3": [3]}, "reposition": [2, 4]},
    ),
    ([[0, 122, 88, 183, 152], [185, 179], [86]], {"drop": {"0": [0], "2": [0, 1, 2]}, "reposition": []}),
    (
        [[0, 262, 101, 171, 0, 79, 0, 128, 209], [3], [277, 231, 308, 113, 103, 382, 211, 81, 324]],
        {"drop": {"0": [0], "2": [1]}, "reposition": [1, 2]},
    ),
]


def mixed_prompts(batch: list, seed: int) -> tuple[list, list[dict | list[int]]]:
    """The programs of `batch` that compile, as message-token prompts, with an unrelated plain prompt at
    index 1 (so a batch mixes programs and ordinary requests) -> (kept programs, prompts)."""
    batch = [b for b in batch if compiles(*b)]
    rng = random.Random(seed)
    prompts = [{"message_tokens": s, "cache": c} for s, c in batch]
    prompts.insert(1, [rng.randrange(384) for _ in range(rng.randint(1, 30))])
    return batch, prompts


PENALISED = SamplingParams(max_tokens=8, temperature=0.8, seed=3, repetition_penalty=1.3,
                           frequency_penalty=0.5, ignore_eos=True)  # fmt: skip


def assert_penalties_and_grammars_match(local, engine) -> None:
    """Penalised and (with a tokenizer) grammar-constrained requests give `local`'s tokens on `engine`: the
    penalty counts and mask rows follow their requests into whichever worker samples them."""
    prompts = [[7, 7, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    params = [PENALISED, PENALISED]
    if engine.tokenizer is not None:  # (gpt-oss: a tokenizer to compile a grammar for)
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        prompts += ["Hello there", "json please"]
        params += [SamplingParams(max_tokens=12, seed=i, grammar=Grammar(json_schema=schema)) for i in (1, 2)]
    expected = [o.token_ids for o in local.generate(prompts, params)]
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    engine.check()

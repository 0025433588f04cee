"""The engine's step loop: per-step host work does not grow with history, overlap changes nothing, and a seeded
request samples the same tokens alone or in any batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minakv import Engine, SamplingParams
from minakv.model import ModelConfig, build_model
from minakv.worker.batch import ForwardBatch
from minakv.worker.worker import StepResult

CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 512, "hidden_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 131072,
}  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig.from_hf(CONFIG), device="cpu", dtype=torch.float32, seed=0)


def sent(batch: ForwardBatch) -> int:
    """Elements the batch asks the host to send to the device."""
    columns = [batch.input_ids, batch.positions, batch.slots, batch.decode_rows, batch.decode_lens,
               batch.seg_q_indptr, batch.seg_kv_indptr, *batch.table_writes, batch.seg_kv_slots,
               batch.seg_kv_pos, *batch.rerotate]  # fmt: skip
    return sum(len(c) if not isinstance(c, list) or not c or isinstance(c[0], int) else sum(map(len, c))
               for c in columns)  # fmt: skip


def decode_traffic(model, history: int, steps: int = 6) -> list[int]:
    """Elements sent per decode step (after the first, which fills the key table) for a request with
    `history` prompt tokens (half of them dropped), scheduled without a worker."""
    engine = Engine(model, kv_cache_tokens=history + 256, max_num_batched_tokens=1 << 20)
    half = history // 2
    segments = [(np.arange(half) % 500).tolist(), (np.arange(history - half) % 500).tolist()]
    prompt = {"message_tokens": segments, "cache": {"drop": {"1": [0]}}}
    engine.scheduler.add(
        engine._make(prompt, SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True))
    )
    counts = []
    for _ in range(steps + 1):
        batch = engine.scheduler.schedule()
        counts.append(sent(batch))
        n = len(batch.sample_rows)
        engine.scheduler.update(batch, StepResult([7] * n, [None] * n))
    return counts[2:]  # [0]: the prompt, [1]: the first decode step writes the row


def test_decode_traffic_does_not_grow_with_history(model):
    short, long = decode_traffic(model, 1_000), decode_traffic(model, 64_000)
    assert short == long and max(long) < 20, (short, long)


def outputs(model, prompts, params, **kwargs) -> list[list[int]]:
    engine = Engine(model, kv_cache_tokens=4096, **kwargs)
    outs = engine.generate(prompts, params, use_tqdm=False)
    engine.check()
    return [o.token_ids for o in outs]


def prompts_of(n: int, length: int = 20, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, length + i).tolist() for i in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_overlap_gives_identical_outputs(model, temperature):
    prompts = prompts_of(5)
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=temperature, seed=i, stop_token_ids=[3, 11])
              for i in range(5)]  # fmt: skip
    assert outputs(model, prompts, params, overlap=True) == outputs(model, prompts, params, overlap=False)


def test_seeded_request_is_identical_alone_and_in_any_batch(model):
    target = prompts_of(1, seed=9)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = outputs(model, [target], [params])[0]
    others = prompts_of(6, seed=3)
    other_params = [
        SamplingParams(max_tokens=5 + i, temperature=0.7, seed=i, ignore_eos=True) for i in range(6)
    ]
    for at in (0, 3, 6):
        batch = others[:at] + [target] + others[at:]
        batch_params = other_params[:at] + [params] + other_params[at:]
        assert outputs(model, batch, batch_params)[at] == alone
    different = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1235, ignore_eos=True)
    assert outputs(model, [target], [different])[0] != alone


def run_agents(engine, rounds: int, keep: int = 2, tool: int = 48, turn: int = 4):
    """Two agents that drop old tool results and reposition every round (the kv_drop policy); yields after
    each round with the engine's counters before and after it."""
    rng = np.random.default_rng(1)
    agents = [[rng.integers(0, 500, 40).tolist(), rng.integers(0, 500, 8).tolist()] for _ in range(2)]
    params = SamplingParams(max_tokens=turn, temperature=0, ignore_eos=True)
    for r in range(rounds):
        for a in agents:
            a.append(rng.integers(0, 500, tool).tolist())  # tool result j sits at message 2 + 2j
        n = r + 1
        cache = {"drop": {str(2 + 2 * j): [2 + 2 * (j - keep)] for j in range(keep, n)},
                 "reposition": [2 + 2 * j for j in range(keep, n)]}  # fmt: skip
        before = engine.stats()
        outs = engine.generate([{"message_tokens": a, "cache": cache} for a in agents], params)
        engine.check()
        yield r, before, engine.stats()
        for a, o in zip(agents, outs):
            a.append(o.token_ids)


def test_repositioning_agents_compute_only_their_new_tokens_under_eviction(model):
    """Each round computes only the new tool result and the last turn, even when the pool is too small to
    keep every old stage: superseded stages are not recomputed, and they go first when pages run out."""
    engine = Engine(model, kv_cache_tokens=700, page_size=4, max_num_batched_tokens=4096)
    for r, before, after in run_agents(engine, 9):
        new = 48 + (48 if r == 0 else 4)  # the tool result; the system and user messages, or the last turn
        assert after["prefill_tokens"] - before["prefill_tokens"] == 2 * new, r
        assert after["preemptions"] == 0
    assert engine.stats()["evictions"] > 0  # the pool was too small to keep everything


def test_repositioning_agents_hold_only_what_they_read(model, monkeypatch):
    """With room to keep every old stage cached, a round still holds only the pages its queries read: the
    pages a request takes from the cache grow with its live state, not with its history of stages."""
    engine = Engine(model, kv_cache_tokens=20000, page_size=4, max_num_batched_tokens=4096)
    held: list[int] = []
    acquire = engine.scheduler.kv.acquire
    monkeypatch.setattr(
        engine.scheduler.kv, "acquire", lambda pages: held.append(len(pages)) or acquire(pages)
    )
    per_round = []
    for _ in run_agents(engine, 10):
        per_round.append(max(held[-2:]))
    # live state grows by the kept turns (about a page a round); every old stage would add ~40 pages
    assert engine.stats()["evictions"] == 0 and per_round[-1] - per_round[4] <= 2 * 5, per_round


def test_a_prompt_is_shared_once_its_prefill_is_done(model):
    """A request arriving while another with the same prompt decodes reads the prompt's full pages from the
    cache (they are published at the first token, not at the end), and decodes the same greedy tokens."""
    engine = Engine(model, page_size=4, kv_cache_tokens=1024, max_num_batched_tokens=256)
    prompt = prompts_of(1, length=61)[0]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = engine._make(prompt, params)
    engine.scheduler.add(first)
    while not first.output_ids:
        engine.step()
    second = engine._make(prompt, params)
    engine.scheduler.add(second)
    while engine.scheduler.has_work():
        engine.step()
    engine._flush()
    assert first.finish_reason == second.finish_reason == "length"
    assert second.usage.cached_tokens == 60  # 15 full pages; the last token's page is always computed
    assert second.output_ids == first.output_ids
    engine.check()

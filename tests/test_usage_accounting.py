"""Usage accounting when a dropped message has left the cache: its tokens are neither cached nor computed
again, so they count as drop-skipped, and `prompt = cached + computed + drop_skipped` holds with the
engine's own count of computed tokens (docs/design.md 3.2: dropped pages are evicted first)."""

from __future__ import annotations

import numpy as np

from minakv import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def test_an_evicted_dropped_message_counts_as_skipped() -> None:
    engine = Engine("tiny-gpt-oss", device="cpu", dtype="float32", page_size=4, kv_cache_tokens=320)
    rng = np.random.default_rng(0)

    def ids(n: int) -> list[int]:
        return rng.integers(0, 1000, n).tolist()

    messages = [ids(20), ids(64), ids(12), ids(8)]  # message 1 (64 tokens) is dropped at message 2's end
    cache = {"drop": {"2": [1]}}
    first = engine.generate([{"message_tokens": messages, "cache": cache}], GREEDY, use_tqdm=False)[0]
    assert first.usage.cached_tokens == 0 and first.usage.drop_skipped_tokens == 0  # message 1 was read
    # fill the pool with an unrelated prompt: the cache evicts dead pages (message 1's) before live ones
    engine.generate([ids(240)], GREEDY, use_tqdm=False)
    before = engine.stats()["prefill_tokens"]
    again = [*messages, ids(6)]
    second = engine.generate([{"message_tokens": again, "cache": cache}], GREEDY, use_tqdm=False)[0]
    u = second.usage
    computed = engine.stats()["prefill_tokens"] - before
    assert u.drop_skipped_tokens > 0  # message 1's evicted pages: not recomputed, nobody reads them
    assert u.prompt_tokens == u.cached_tokens + computed + u.drop_skipped_tokens
    engine.check()

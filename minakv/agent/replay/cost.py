"""The API cost model: what a replay would cost at an API's prices.

API providers bill three kinds of tokens at three prices: input the server had to compute (uncached),
input it found in its prefix cache (cached, usually about a tenth of the price), and output. From the
usage a request reports (docs/server.md) and the prompt tokens still in attention after its drops
(`active`; session.py counts it):

    computed = prompt_tokens - cached_tokens - drop_skipped_tokens     (the prompt tokens prefilled)
    uncached = computed
    cached   = active - computed          (billing "active", the default)
             = prompt_tokens - computed   (billing "sent")
    cost     = (uncached * input + cached * cached_input + completion_tokens * output) / 1e6

Two billings, because the question is what a dropped token should cost:

- `active`: the context the model reads is what is billed. A dropped token costs nothing from the request
  after its drop on (the provider holds it, but no query reads it), just as a token text_drop deleted
  costs nothing. This is the comparison cache engineering is about: kv_drop pays for the short context
  text_drop pays for, without text_drop's recomputation. For plain and text_drop, active = prompt_tokens
  and the two billings agree.
- `sent`: every prompt token sent is billed, cached or not, as today's APIs bill a request. kv_drop then
  costs what plain costs (the same tokens are sent and found in the cache); it saves time and memory, not
  money.

A drop-skipped token (never computed: dropped before any query read it) is never billed as uncached. Prices
are in currency units per million tokens. The defaults are illustrative, not AKV's (its benchmark's prices
are not published with its code): a 10x cache discount and output at 8x input, the shape of common API
price sheets. Pass your provider's with `--prices in,cached,out`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prices:
    input: float = 1.25  # per million uncached input tokens
    cached_input: float = 0.125  # per million cached input tokens
    output: float = 10.0  # per million output tokens

    @classmethod
    def parse(cls, text: str) -> Prices:
        """ "in,cached,out" -> Prices."""
        parts = text.split(",")
        if len(parts) != 3:
            raise ValueError(f"prices must be 'in,cached,out' (per million tokens), got {text!r}")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"prices must be numbers, got {text!r}") from None
        if any(v < 0 for v in values):
            raise ValueError(f"prices must be non-negative, got {text!r}")
        return cls(*values)


BILLINGS = ("active", "sent")


def token_split(usage: dict, active: int | None = None) -> dict[str, int]:
    """The billed token kinds of one request's flat usage (prompt_tokens, completion_tokens,
    cached_tokens, drop_skipped_tokens; missing fields count as 0). `active`: the prompt tokens still in
    attention (billing "active"); None bills every prompt token (billing "sent")."""
    prompt = usage.get("prompt_tokens", 0)
    computed = prompt - usage.get("cached_tokens", 0) - usage.get("drop_skipped_tokens", 0)
    cached = (prompt if active is None else active) - computed
    return {
        "uncached_input": computed,
        "cached_input": max(0, cached),
        "output": usage.get("completion_tokens", 0),
    }


def cost(usage: dict, prices: Prices, active: int | None = None) -> dict[str, float]:
    """The cost of one request: per token kind and the total (see token_split for `active`)."""
    split = token_split(usage, active)
    out = {
        "uncached_input": split["uncached_input"] * prices.input / 1e6,
        "cached_input": split["cached_input"] * prices.cached_input / 1e6,
        "output": split["output"] * prices.output / 1e6,
    }
    out["total"] = sum(out.values())
    return out


def total_cost(requests: list[tuple[dict, int | None]], prices: Prices) -> dict[str, float]:
    """Summed cost of (usage, active) pairs, per token kind and in total."""
    keys = ("uncached_input", "cached_input", "output", "total")
    sums = dict.fromkeys(keys, 0.0)
    for usage, active in requests:
        for k, v in cost(usage, prices, active).items():
            sums[k] += v
    return sums

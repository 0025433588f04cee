"""A policy's replay in numbers: the summary, the per-round series, the table and the JSON.

Per policy (all tokens summed over every request of every task):

- prefill: logical (prompt tokens sent) vs actual (computed = prompt - cached - drop-skipped), the
  cached, drop-skipped and re-rotated parts, and the server's own prefill counter when it has one;
- decode: completion tokens, and the server's decode steps;
- TTFT and TPOT in ms and E2E in s: mean, p50, p90, p99 over requests, as the client sees them, and the
  server's own means (from its histograms) under `server`;
- KV bytes read per decode token (the server's counter over the policy's interval);
- the active context: prompt tokens still in attention after the operations;
- the cost model (cost.py), in total and per token kind, billed on the active context (`cost`) and on
  every token sent (`cost_sent`); throughput over the policy's wall time.

Per round r (the r-th request of every task): mean latency, mean TTFT, mean active context and prompt
length, computed tokens, and the cumulative cost of rounds 0..r: the series the plots draw.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from minakv.agent.replay.cost import Prices, cost, total_cost
from minakv.agent.replay.metrics import KV_PER_TOKEN, summarize, usage_sums
from minakv.agent.replay.runner import PolicyRun
from minakv.agent.replay.session import Record


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def per_round(records: Sequence[Record], prices: Prices) -> dict[str, list]:
    rounds = sorted({r.round for r in records})
    keys = ("round", "tasks", "latency_s", "ttft_ms", "active_tokens", "prompt_tokens", "computed_tokens",
            "cost", "cumulative_cost")  # fmt: skip
    series: dict[str, list] = {k: [] for k in keys}
    total = 0.0
    for n in rounds:
        mine = [r for r in records if r.round == n]
        spent = sum(cost(r.usage, prices, r.active_tokens)["total"] for r in mine)
        total += spent
        series["round"].append(n)
        series["tasks"].append(len(mine))
        series["latency_s"].append(_mean([r.e2e for r in mine]))
        series["ttft_ms"].append(_mean([r.ttft * 1e3 for r in mine if r.ttft is not None]))
        series["active_tokens"].append(_mean([r.active_tokens for r in mine]))
        series["prompt_tokens"].append(_mean([r.usage["prompt_tokens"] for r in mine]))
        series["computed_tokens"].append(usage_sums(r.usage for r in mine)["computed_tokens"])
        series["cost"].append(spent)
        series["cumulative_cost"].append(total)
    return series


def summarize_run(run: PolicyRun, prices: Prices) -> dict:
    recs = run.records
    sums = usage_sums(r.usage for r in recs)
    completion = sum(r.usage["completion_tokens"] for r in recs)
    server = run.server
    return {
        "policy": run.label,
        "tasks": len({r.task for r in recs}),
        "requests": len(recs),
        "wall_s": run.wall_s,
        "prefill": {
            "logical": sums["prompt_tokens"], "actual": sums["computed_tokens"],
            "cached": sums["cached_tokens"], "drop_skipped": sums["drop_skipped_tokens"],
            "re_rotated": sums["repos_tokens"], "server_actual": server.get("prefill_tokens"),
        },
        "decode": {"logical": completion, "server_actual": server.get("decode_tokens")},
        "ttft_ms": summarize((r.ttft for r in recs), 1e3),
        "tpot_ms": summarize((r.tpot for r in recs), 1e3),
        "e2e_s": summarize(r.e2e for r in recs),
        "kv_bytes_per_decode_token": server.get(KV_PER_TOKEN),
        "active_tokens": summarize(r.active_tokens for r in recs),
        "active_exact": all(r.active_exact for r in recs),
        "throughput": {"input_tok_s": sums["prompt_tokens"] / run.wall_s,
                       "output_tok_s": completion / run.wall_s,
                       "actual_prefill_tok_s": sums["computed_tokens"] / run.wall_s},
        "cost": total_cost([(r.usage, r.active_tokens) for r in recs], prices),
        "cost_sent": total_cost([(r.usage, None) for r in recs], prices),
        "server": server,
        "per_round": per_round(recs, prices),
    }  # fmt: skip


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(summaries: Sequence[dict]) -> str:
    """A Markdown table, one row per policy; cost relative to the first policy."""
    head = ("| policy | wall s | prompt (logical) | computed (actual) | cached | drop-skipped | re-rotated | "
            "decode | TTFT ms p50/p90/p99 | TPOT ms p50/p90/p99 | server TPOT ms mean | KV B/decode tok | "
            "active ctx mean | cost | vs first | cost, all sent billed |\n" + "|---" * 16 + "|")  # fmt: skip
    rows = [head]
    base = summaries[0]["cost"]["total"] if summaries else 0
    for s in summaries:
        p, t, o = s["prefill"], s["ttft_ms"], s["tpot_ms"]
        rel = f"{s['cost']['total'] / base:.3f}" if base else "-"
        rows.append(
            f"| {s['policy']} | {s['wall_s']:.2f} | {p['logical']} | {p['actual']} | {p['cached']} | "
            f"{p['drop_skipped']} | {p['re_rotated']} | {s['decode']['logical']} | "
            f"{_f(t['p50'])}/{_f(t['p90'])}/{_f(t['p99'])} | "
            f"{_f(o['p50'], 2)}/{_f(o['p90'], 2)}/{_f(o['p99'], 2)} | "
            f"{_f(s['server'].get('server_tpot_ms'), 2)} | {_f(s['kv_bytes_per_decode_token'], 0)} | "
            f"{_f(s['active_tokens']['mean'], 0)} | "
            f"{s['cost']['total']:.6f} | {rel} | {s['cost_sent']['total']:.6f} |"
        )
    return "\n".join(rows)


def write_json(summaries: Sequence[dict], meta: dict, out_dir: str | Path, name: str = "replay.json") -> Path:
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "policies": list(summaries)}, indent=1) + "\n")
    return path

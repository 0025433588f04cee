"""The replay's arithmetic: the cost model against hand-computed bills, percentiles, usage sums, the
server counters read from /metrics, policy specs, and the per-round series of a made-up run."""

from __future__ import annotations

import numpy as np
import pytest

from minakv.agent import CachePolicy
from minakv.agent.replay.cost import Prices, cost, token_split, total_cost
from minakv.agent.replay.metrics import counter_deltas, parse_prometheus, summarize, usage_sums
from minakv.agent.replay.policies import parse_policies, parse_policy
from minakv.agent.replay.report import summarize_run, table
from minakv.agent.replay.runner import PolicyRun, urls
from minakv.agent.replay.session import Record, flat_usage

USAGE = {"prompt_tokens": 1000, "cached_tokens": 700, "drop_skipped_tokens": 100, "completion_tokens": 50}
PRICES = Prices(input=2.0, cached_input=0.5, output=8.0)


def test_cost_billing_sent() -> None:
    # computed = 1000 - 700 - 100 = 200 uncached; cached 700 + skipped 100 = 800
    assert token_split(USAGE) == {"uncached_input": 200, "cached_input": 800, "output": 50}
    bill = cost(USAGE, PRICES)
    # 200 * 2 / 1e6 + 800 * 0.5 / 1e6 + 50 * 8 / 1e6 = 0.0004 + 0.0004 + 0.0004
    assert bill == pytest.approx(
        {"uncached_input": 4e-4, "cached_input": 4e-4, "output": 4e-4, "total": 1.2e-3}
    )


def test_cost_billing_active() -> None:
    # 600 tokens still in attention: 200 computed, so 400 cached ones are billed and the dropped 400 are not
    assert token_split(USAGE, active=600) == {"uncached_input": 200, "cached_input": 400, "output": 50}
    assert cost(USAGE, PRICES, active=600)["total"] == pytest.approx(4e-4 + 2e-4 + 4e-4)
    # plain and text_drop: active = prompt, the same bill as "sent"
    assert cost(USAGE, PRICES, active=1000) == cost(USAGE, PRICES)
    # more computed than active (dropped tokens recomputed for earlier queries): no negative cached part
    assert token_split(USAGE, active=150)["cached_input"] == 0
    both = total_cost([(USAGE, 600), (USAGE, None)], PRICES)
    assert both["total"] == pytest.approx(1.0e-3 + 1.2e-3) and both["output"] == pytest.approx(8e-4)


def test_prices() -> None:
    assert Prices.parse("1,0.1,4") == Prices(1.0, 0.1, 4.0)
    assert Prices() == Prices(1.25, 0.125, 10.0)
    for bad in ("1,2", "a,b,c", "1,-1,2"):
        with pytest.raises(ValueError):
            Prices.parse(bad)


def test_summarize_matches_numpy() -> None:
    values = [5.0, 1.0, 9.0, 2.5, 7.0, 3.0, 100.0]
    s = summarize(values + [None], scale=1e3)
    assert s["mean"] == pytest.approx(np.mean(values) * 1e3)
    for q in (50, 90, 99):
        assert s[f"p{q}"] == pytest.approx(np.percentile(values, q) * 1e3)
    assert summarize([None]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_usage_sums_and_flat_usage() -> None:
    details = {"cached_tokens": 4, "repos_tokens": 2, "drop_skipped_tokens": 1}
    nested = {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": details,
    }
    flat = flat_usage(nested)
    assert flat == {"prompt_tokens": 10, "completion_tokens": 3, "cached_tokens": 4, "drop_skipped_tokens": 1,
                    "repos_tokens": 2}  # fmt: skip
    assert flat_usage({"prompt_tokens": 5, "prompt_tokens_details": None})["cached_tokens"] == 0
    assert usage_sums([flat, flat]) == {"prompt_tokens": 20, "cached_tokens": 8, "drop_skipped_tokens": 2,
                                        "repos_tokens": 4, "computed_tokens": 10}  # fmt: skip


def test_server_counters() -> None:
    page = """# HELP minakv_decode_tokens decode steps
minakv_decode_tokens 30.0
minakv_kv_bytes_read_per_decode_token 150.0
minakv_prefill_tokens 500.0
minakv:time_to_first_token_seconds_sum{model_name="m"} 3.0
minakv:time_to_first_token_seconds_count{model_name="m"} 4.0
minakv:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1.0
minakv_http_responses_total{route="/v1/chat/completions",status="200"} 4.0
"""
    after = parse_prometheus(page)
    assert after["decode_tokens"] == 30 and after["minakv:time_to_first_token_seconds_count"] == 4
    assert "http_responses_total" not in after
    ttft = "minakv:time_to_first_token_seconds"
    before = {"decode_tokens": 10.0, "kv_bytes_read_per_decode_token": 100.0, "prefill_tokens": 200.0,
              ttft + "_sum": 1.0, ttft + "_count": 2.0}  # fmt: skip
    d = counter_deltas(before, after)
    assert d["decode_tokens"] == 20 and d["prefill_tokens"] == 300
    assert d["kv_bytes_read_per_decode_token"] == pytest.approx((150 * 30 - 100 * 10) / 20)  # this interval's
    assert d["server_ttft_ms"] == pytest.approx(1e3 * (3.0 - 1.0) / (4 - 2))
    assert urls("http://h:1/v1/") == urls("http://h:1") == ("http://h:1/v1", "http://h:1/metrics")


def test_policy_specs() -> None:
    plain, kv, text = parse_policies("plain, kv_drop:K=4:every=1:first=5:target=both ,text_drop:K=4")
    assert (plain.label, plain.policy) == ("plain", None)
    assert kv.label == "kv_drop:K=4:every=1:first=5:target=both"
    assert kv.policy == CachePolicy(keep_tool_results=4, reposition_every_calls=1, reposition_first_call=5,
                                    target="both")  # fmt: skip
    assert text.policy == CachePolicy(keep_tool_results=4, mode="text_drop")
    assert parse_policy("kv_drop").policy.keep_tool_results == 12  # AKV's K
    assert parse_policy("kv_drop:thinking=1").policy == CachePolicy(thinking_drop=True)
    assert parse_policy("kv_drop:K=2:after=300").needs_counts and not kv.needs_counts
    for bad in ("plain:K=1", "drop", "kv_drop:K=x", "kv_drop:Q=1", "kv_drop:K", "text_drop:every=2",
                "plain,plain", ""):  # fmt: skip
        with pytest.raises(ValueError):
            parse_policies(bad)


def test_policy_messages_ops_and_dropped() -> None:
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    for j in range(3):
        history += [{"role": "assistant", "content": "", "tool_calls": [{"id": f"c{j}"}]},
                    {"role": "tool", "tool_call_id": f"c{j}", "content": f"r{j}"}]  # fmt: skip
    plain, kv, text = parse_policies("plain,kv_drop:K=2,text_drop:K=2")
    assert (
        plain.messages(history) == history and plain.extra_body(history) == {} and not plain.dropped(history)
    )
    assert kv.messages(history) == history
    assert kv.extra_body(history) == {"cache": {"drop": {"7": [3]}, "reposition": []}}
    assert kv.dropped(history) == {3}
    assert len(text.messages(history)) == len(history) - 1 and not text.dropped(history)


def record(policy: str, task: str, r: int, prompt: int, cached: int, active: int) -> Record:
    usage = {"prompt_tokens": prompt, "completion_tokens": 10, "cached_tokens": cached,
             "drop_skipped_tokens": 0, "repos_tokens": 0}  # fmt: skip
    return Record(policy, task, r, start=r, e2e=1.0 + r, ttft=0.1 * (r + 1), tpot=None, usage=usage,
                  active_tokens=active, active_exact=True)  # fmt: skip


def test_summary_and_per_round_series() -> None:
    prices = Prices(1.0, 0.1, 2.0)
    recs = [record("p", t, r, prompt=100 * (r + 1), cached=100 * r, active=100 * (r + 1) - 50 * r)
            for t in ("a", "b") for r in range(3)]  # fmt: skip
    run = PolicyRun(
        "p", recs, wall_s=2.0, server={"prefill_tokens": 600, "kv_bytes_read_per_decode_token": 9.0}
    )
    s = summarize_run(run, prices)
    assert (s["tasks"], s["requests"]) == (2, 6)
    assert s["prefill"] == {"logical": 1200, "actual": 600, "cached": 600, "drop_skipped": 0, "re_rotated": 0,
                            "server_actual": 600}  # fmt: skip
    assert s["decode"]["logical"] == 60 and s["kv_bytes_per_decode_token"] == 9.0
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0) and s["tpot_ms"]["mean"] is None
    assert s["throughput"]["input_tok_s"] == 600.0
    pr = s["per_round"]
    assert pr["round"] == [0, 1, 2] and pr["tasks"] == [2, 2, 2] and pr["latency_s"] == [1.0, 2.0, 3.0]
    assert pr["active_tokens"] == [100, 150, 200] and pr["computed_tokens"] == [200, 200, 200]
    # round r, per task: 100 computed at 1.0, (active - 100) cached at 0.1, 10 out at 2.0 (per million)
    per_task = [(100 + 0.1 * (a - 100) + 20) / 1e6 for a in (100, 150, 200)]
    assert pr["cost"] == pytest.approx([2 * c for c in per_task])
    assert pr["cumulative_cost"] == pytest.approx(np.cumsum([2 * c for c in per_task]).tolist())
    assert s["cost"]["total"] == pytest.approx(pr["cumulative_cost"][-1])
    assert s["cost_sent"]["total"] > s["cost"]["total"]  # the sent billing pays for the dropped 150
    lines = table([s, s]).splitlines()
    assert len(lines) == 4 and lines[2].startswith("| p | 2.00 | 1200 | 600 |") and "| 1.000 |" in lines[3]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policies", "kv_drop:Z=1"], "bad option 'Z=1'"),
        (["--prices", "1,2"], "prices must be"),
        (["--model", "m", "--trajectories", "/no/such.jsonl"], "No such file"),
        (["--model", "m", "--tasks", "1", "--rounds", "1", "--no-progress"], "APIConnectionError"),
    ],
)
def test_cli_errors_are_one_line(args: list[str], message: str, capsys, tmp_path) -> None:
    from minakv.cli import main

    assert main(["bench", "replay", "--url", "http://127.0.0.1:9", "--out", str(tmp_path), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("minakv bench replay: error: ") and message in err and "Traceback" not in err

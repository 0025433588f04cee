"""Replaying agent trajectories through an OpenAI-compatible server, to see what cache policies buy.

    from minakv.agent.replay import Prices, Settings, parse_policies, replay, summarize_run
    from minakv.agent.replay import synthetic_trajectories
    runs = replay("http://127.0.0.1:8000", synthetic_trajectories(4), parse_policies("plain,kv_drop:K=4"),
                  Settings(model="tiny-gpt-oss"), concurrency=4)
    print([summarize_run(r, Prices())["cost"]["total"] for r in runs])

The command line is `minakv bench replay --url URL ...` (cli.py). It replays the same trajectories once per
policy: C tasks at once, each task's turns in order, every request streamed, the model's real answer
folded back into the next turn and the tool results taken from the trajectory. Then it reports, per
policy, logical vs actual prefill and decode tokens, TTFT/TPOT percentiles, KV bytes per decode token and
an API bill, and plots them per round. AKV's benchmark (arXiv 2610.28577) is the model for all of it.

- `trajectory.py`: trajectories and their JSONL form (texts given literally or as token lengths).
- `synthetic.py`: generated trajectories with heavy-tailed tool-result lengths, seeded.
- `policies.py`: `plain`, `kv_drop:K=4:...`, `text_drop:K=4` specs -> policies (CachePolicy underneath).
- `session.py`: one task: streamed requests, the answer folded back, one Record per request.
- `runner.py`: C tasks at once per policy, a progress bar, the server's counters around each policy.
- `metrics.py`: percentiles, usage sums, counter differences (shared with bench/agent_replay.py).
- `cost.py`: the cost model.
- `report.py`: per-policy summaries, per-round series, the table and the JSON.
- `plots.py`: the PNGs (matplotlib, optional).
- `cli.py`: `minakv bench replay`.

How to run it and what the numbers mean: docs/agent.md.
"""

from minakv.agent.replay.cost import Prices, cost
from minakv.agent.replay.policies import NamedPolicy, parse_policies, parse_policy
from minakv.agent.replay.report import summarize_run, table
from minakv.agent.replay.runner import PolicyRun, replay, replay_async
from minakv.agent.replay.session import Record, Settings
from minakv.agent.replay.synthetic import SyntheticSpec, synthetic_trajectories
from minakv.agent.replay.trajectory import (
    ToolResult,
    Trajectory,
    Turn,
    parse_trajectory,
    read_jsonl,
    write_jsonl,
)

__all__ = [
    "NamedPolicy",
    "PolicyRun",
    "Prices",
    "Record",
    "Settings",
    "SyntheticSpec",
    "ToolResult",
    "Trajectory",
    "Turn",
    "cost",
    "parse_policies",
    "parse_policy",
    "parse_trajectory",
    "read_jsonl",
    "replay",
    "replay_async",
    "summarize_run",
    "synthetic_trajectories",
    "table",
    "write_jsonl",
]

"""Synthetic agent trajectories with heavy-tailed tool results.

Real agent tool results are mostly short (a grep hit, a test summary) with now and then a huge one (a
whole file, a stack of logs). That tail is what makes cache engineering pay: one long result stays in
every later request's prompt, and in every decode step's attention, until something drops it. So the
generator draws tool-result lengths from a heavy-tailed distribution:

- `lognormal` (default): median M, shape sigma: the p99 is M * e^(2.33 sigma) (about 10 M at sigma 1);
- `pareto`: shape alpha, scaled so the median is M: P(length > x) = (x_m / x)^alpha, heavier the smaller
  alpha is (below 2 the variance is infinite).

Lengths are clipped to [min_tool_tokens, max_tool_tokens] so a single draw cannot overflow the context.
Each turn makes one tool call, or two in parallel with probability `parallel`; the last turn is the final
answer (no tools). Everything comes from one seeded generator, so a seed fixes the trajectories; the
texts themselves are filled in from their place in the trajectory (trajectory.py).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from minakv.agent.replay.trajectory import ToolResult, Trajectory, Turn

DISTRIBUTIONS = ("lognormal", "pareto")


@dataclass(frozen=True)
class SyntheticSpec:
    rounds: int = 8  # turns per trajectory (requests per task)
    system_tokens: int = 512
    user_tokens: int = 128
    tool_tokens: int = 1000  # median tool-result length
    distribution: str = "lognormal"
    sigma: float = 1.0  # lognormal shape
    alpha: float = 1.5  # pareto shape
    min_tool_tokens: int = 8
    max_tool_tokens: int = 16384
    output_tokens: int = 64  # every answer's length (the replay asks for exactly this many)
    parallel: float = 0.2  # probability that a turn makes two tool calls

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {self.distribution!r}")
        if self.rounds < 1 or self.output_tokens < 1 or self.tool_tokens < 1:
            raise ValueError("rounds, output_tokens and tool_tokens must be positive")
        if not 1 <= self.min_tool_tokens <= self.tool_tokens <= self.max_tool_tokens:
            raise ValueError("need 1 <= min_tool_tokens <= tool_tokens <= max_tool_tokens")
        if self.sigma < 0 or self.alpha <= 0 or not 0 <= self.parallel <= 1:
            raise ValueError("need sigma >= 0, alpha > 0 and 0 <= parallel <= 1")


def tool_length(rng: random.Random, spec: SyntheticSpec) -> int:
    """One tool-result length in tokens."""
    if spec.distribution == "lognormal":
        x = spec.tool_tokens * rng.lognormvariate(0.0, spec.sigma)  # median of e^N(0, s) is 1
    else:
        x = spec.tool_tokens / 2 ** (1 / spec.alpha) * rng.paretovariate(spec.alpha)  # median x_m 2^(1/a)
    return max(spec.min_tool_tokens, min(spec.max_tool_tokens, round(x)))


def synthetic_trajectories(n: int, spec: SyntheticSpec = SyntheticSpec(), seed: int = 0) -> list[Trajectory]:
    """n trajectories of spec.rounds turns each, a function of (n, spec, seed) only."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = []
        for t in range(spec.rounds):
            last = t == spec.rounds - 1
            calls = 0 if last else (2 if rng.random() < spec.parallel else 1)
            results = tuple(
                ToolResult(tool_length(rng, spec), "run", json.dumps({"command": f"step {t}.{k}"}))
                for k in range(calls)
            )
            turns.append(Turn(results, spec.output_tokens))
        out.append(Trajectory(f"syn{seed}-{i}", spec.system_tokens, spec.user_tokens, tuple(turns)))
    return out

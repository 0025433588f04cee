"""Named policies for a replay: `plain`, `kv_drop:...` and `text_drop:...`, compared on one set of tasks.

    parse_policies("plain,kv_drop:K=4:every=1,text_drop:K=4")

`plain` sends the history as it is with no cache operations (what any OpenAI server gets). `kv_drop` and
`text_drop` are `CachePolicy`s (docs/agent.md) in those modes, with options after colons:

    K=4           keep_tool_results (default 12, AKV's setting, unless thinking=1)
    target=both   target: tool | assistant | both
    every=4       reposition_every_calls     first=4   reposition_first_call
    after=98304   reposition_after_tokens (needs token counts: the replay then counts with a TokenCounter)
    thinking=1    thinking_drop

The label of a policy is its spec as written, so tables and plots name what was run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from minakv.agent.drops import dropped_ids, rolling_drops
from minakv.agent.history import Message
from minakv.agent.policy import CachePolicy

AKV_KEEP = 12
OPTIONS = {"K": "keep_tool_results", "target": "target", "every": "reposition_every_calls",
           "first": "reposition_first_call", "after": "reposition_after_tokens",
           "thinking": "thinking_drop"}  # fmt: skip


@dataclass(frozen=True)
class NamedPolicy:
    label: str
    policy: CachePolicy | None  # None: plain

    @property
    def needs_counts(self) -> bool:
        return self.policy is not None and self.policy.reposition_after_tokens is not None

    def messages(self, history: Sequence[Message]) -> list[Message]:
        return list(history) if self.policy is None else self.policy.messages(history)

    def extra_body(self, history: Sequence[Message], counts: Sequence[int] | None = None) -> dict:
        return {} if self.policy is None else self.policy.extra_body(history, counts)

    def dropped(self, history: Sequence[Message]) -> set[int]:
        """Ids of the messages the request's operations drop out of attention (kv_drop; the rolling drop
        does not depend on token counts). text_drop sends none of them, plain drops nothing."""
        p = self.policy
        if p is None or p.mode != "kv_drop" or p.keep_tool_results is None:
            return set()
        return set(dropped_ids(rolling_drops(history, p.keep_tool_results, p.target)))


def parse_policy(spec: str) -> NamedPolicy:
    name, *options = spec.strip().split(":")
    if name == "plain":
        if options:
            raise ValueError(f"plain takes no options: {spec!r}")
        return NamedPolicy("plain", None)
    if name not in ("kv_drop", "text_drop"):
        raise ValueError(f"unknown policy {name!r} in {spec!r}: plain, kv_drop or text_drop")
    kwargs: dict = {"mode": name}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in OPTIONS:
            raise ValueError(
                f"bad option {option!r} in {spec!r}; options: {', '.join(f'{k}=' for k in OPTIONS)}"
            )
        field = OPTIONS[key]
        if field == "target":
            kwargs[field] = value
        elif field == "thinking_drop":
            kwargs[field] = value.lower() in ("1", "true", "yes")
        else:
            try:
                kwargs[field] = int(value)
            except ValueError:
                raise ValueError(f"{key} must be an integer in {spec!r}") from None
    if "keep_tool_results" not in kwargs and not kwargs.get("thinking_drop"):
        kwargs["keep_tool_results"] = AKV_KEEP
    return NamedPolicy(spec.strip(), CachePolicy(**kwargs))


def parse_policies(specs: str) -> list[NamedPolicy]:
    """A comma-separated list of specs; labels must be distinct."""
    policies = [parse_policy(s) for s in specs.split(",") if s.strip()]
    if not policies:
        raise ValueError("no policies given")
    labels = [p.label for p in policies]
    if len(set(labels)) != len(labels):
        raise ValueError(f"policies repeat: {labels}")
    return policies

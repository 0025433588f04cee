"""Client-side cache policies for agents: a message list in, the cache operations to send with it out.

    from minakv.agent import CachePolicy
    policy = CachePolicy(keep_tool_results=12, reposition_every_calls=4)
    ops = policy.ops(messages)    # {"drop": {"<trigger>": [ids]}, "reposition": [ids]}, cumulative

Pure Python: nothing here imports torch, so an agent process can use it next to the `openai` client
without the engine (the token counter loads the tokenizer and the chat template on first use).

- `policy.py`: `CachePolicy`, the entry point (kv_drop operations or text_drop messages).
- `history.py`: tool results and tool batches in an OpenAI-style message list.
- `drops.py`: the rolling drop (keep the last K tool results; targets tool, assistant, both).
- `reposition.py`: call-based and token-based reposition at tool-batch boundaries.
- `counter.py`: tokens per message, rendered the way the server renders them.
- `tools.py`: Cache-as-Tool, the `drop_messages` / `reposition` tools and their calls -> operations.

How the policies work, with pictures: docs/agent.md.
"""

from minakv.agent.counter import TokenCounter
from minakv.agent.drops import rolling_drops
from minakv.agent.history import ToolBatch, call_boundaries, tool_batches
from minakv.agent.policy import CachePolicy
from minakv.agent.reposition import REPOSITION_AFTER_TOKENS, reposition_points
from minakv.agent.tools import CACHE_TOOLS, CacheCall, calls_of, numbered, ops_from_tool_calls

__all__ = [
    "CACHE_TOOLS",
    "REPOSITION_AFTER_TOKENS",
    "CacheCall",
    "CachePolicy",
    "TokenCounter",
    "ToolBatch",
    "call_boundaries",
    "calls_of",
    "numbered",
    "ops_from_tool_calls",
    "reposition_points",
    "rolling_drops",
    "tool_batches",
]

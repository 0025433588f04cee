"""Agent histories for the minakv.agent tests: OpenAI-style message lists built from a list of tool batches,
and the cache operations they compile to (through the engine's own validation)."""

from __future__ import annotations

from typing import Any

from minakv.model.config import ModelConfig
from minakv.params import SamplingParams
from minakv.prompt import make_request
from minakv.scheduler.request import Request


def assistant(calls: int, tag: str = "") -> dict[str, Any]:
    """An assistant turn making `calls` tool calls (0: a plain answer)."""
    message: dict[str, Any] = {"role": "assistant", "content": f"turn {tag}"}
    if calls:
        message["tool_calls"] = [
            {"id": f"call_{tag}_{k}", "type": "function", "function": {"name": "read", "arguments": "{}"}}
            for k in range(calls)
        ]
    return message


def tool(tag: str = "") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": f"call_{tag}", "content": f"result {tag}"}


def history(batches: list[int]) -> list[dict[str, Any]]:
    """system, user, then per entry an assistant turn with that many calls and its tool results."""
    messages = [{"role": "system", "content": "you help"}, {"role": "user", "content": "the task"}]
    for b, calls in enumerate(batches):
        messages.append(assistant(calls, str(b)))
        messages += [tool(f"{b}_{k}") for k in range(calls)]
    return messages


def tool_ids(messages: list[dict]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "tool"]


def config(max_positions: int) -> ModelConfig:
    """The smallest ModelConfig make_request needs: only the vocabulary and the position limit matter."""
    return ModelConfig(
        arch="gpt_oss", vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
        intermediate_size=8, num_experts=1, experts_per_tok=1, rms_norm_eps=1e-6,
        max_position_embeddings=max_positions, rope_theta=10000.0, rotary_dim=8, rope_scaling=None,
        layer_windows=[None], sinks=False, attention_bias=False, qk_norm=False, swiglu_limit=7.0,
        swiglu_alpha=1.702, tie_word_embeddings=False,
    )  # fmt: skip


def compile_request(
    counts: list[int], ops: dict, max_positions: int = 1 << 30, max_tokens: int = 1
) -> Request:
    """The engine's request for messages of `counts` tokens (the message_tokens form) with `ops`: every
    operation is validated and the walk compiled, exactly as the engine does it (raises if invalid). The
    raw history may be longer than the position limit (max_model_len is not the constraint here)."""
    prompt = {"message_tokens": [[0] * n for n in counts], "cache": ops}
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return make_request(prompt, params, None, config(max_positions), max_model_len=1 << 40)

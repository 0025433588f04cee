"""How much one request may ask for, so that no request can slow down or starve the others.

Every limit is a setting (`minakv serve --max-...`, see serve.py), with defaults a vLLM user should never
hit by accident:

| limit | default | why |
|---|---|---|
| body size | 32 MiB | far above a full 131k-token context in JSON; a larger body is refused while it arrives (413) |
| messages | 8,192 | a message costs at least a few tokens of markup, so a full context holds fewer; rendering and cache-operation checks grow with it |
| tools | 256 | twice OpenAI's 128; every tool is rendered into the prompt |
| stop strings | 16, of at most 256 characters | every stop string is searched for after every token of the request (OpenAI allows 4) |
| stop token ids | 262,144 | one per vocabulary entry at most (o200k has 201,088): "every token stops" is a list of the whole vocabulary |
| cache-operation entries | 3 per message | a message can trigger a drop, be dropped and be repositioned after, once each; more repeats one |
| `max_tokens` | the positions left after the prompt | `max_model_len` bounds positions (prompt + output, as vLLM counts them; repositions renumber a history, so it may be longer); asking for more is a 400, as in vLLM |

A missing `max_tokens` means "until the context is full" for chat (vLLM's default) and 16 for legacy
completions (OpenAI's), capped by the positions left. Checks that only need the request's size run before
any expensive work: the counts right after decoding, and the prompt's length before tokenizing where the
rendered text is already too long (prepare.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from minakv.server.protocol import ChatCompletionRequest, RequestError, SamplingFields


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 32 << 20
    max_messages: int = 8192
    max_tools: int = 256
    max_stop: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 1 << 18


DEFAULT_LIMITS = Limits()


def check_sampling(req: SamplingFields, limits: Limits = DEFAULT_LIMITS) -> None:
    """The stop lists: their cost is paid on every generated token."""
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > limits.max_stop:
        raise RequestError(f"at most {limits.max_stop} stop strings are accepted, got {len(stops)}", "stop")
    for i, s in enumerate(stops):
        if len(s) > limits.max_stop_chars:
            param = "stop" if isinstance(req.stop, str) else f"stop[{i}]"
            raise RequestError(
                f"a stop string may have at most {limits.max_stop_chars} characters, got {len(s)}", param
            )
    if req.stop_token_ids is not None and len(req.stop_token_ids) > limits.max_stop_token_ids:
        raise RequestError(
            f"at most {limits.max_stop_token_ids} stop_token_ids are accepted, got {len(req.stop_token_ids)}",
            "stop_token_ids",
        )


def check_chat(req: ChatCompletionRequest, limits: Limits = DEFAULT_LIMITS) -> None:
    """Counts that tell, before rendering anything, that a chat request is too big."""
    if len(req.messages) > limits.max_messages:
        raise RequestError(
            f"at most {limits.max_messages} messages are accepted, got {len(req.messages)}", "messages"
        )
    if req.tools is not None and len(req.tools) > limits.max_tools:
        raise RequestError(f"at most {limits.max_tools} tools are accepted, got {len(req.tools)}", "tools")
    drops = [
        req.cache.drop if req.cache else None,
        req.drop_message,
        req.drop_rule and req.drop_rule.drop_messages,
    ]
    entries = sum(len(ids) + 1 for d in drops if d for ids in d.values())  # triggers and dropped ids
    entries += len(req.reposition or []) + len((req.cache and req.cache.reposition) or [])
    if entries > 3 * limits.max_messages:
        raise RequestError(
            f"the cache operations have {entries} entries; at most {3 * limits.max_messages} are accepted "
            "(3 per message: a message can trigger a drop, be dropped and be repositioned after, once each)",
            "cache" if req.cache is not None else ("drop_message" if req.drop_message else "reposition"),
        )


def max_tokens(
    requested: int | None,
    param: str,
    next_pos: int | None,
    max_model_len: int,
    default: int | None,
    prompt_param: str,
) -> int:
    """The number of tokens to generate: `requested` if the context has room for it (else a 400 naming
    `param`), else `default` (None: all the room there is) capped by the room. max_model_len bounds
    positions (prompt + output, as vLLM counts them); `next_pos` is where the first generated token sits:
    the prompt's length, less what repositions renumbered (None: unknown, the engine decides). A prompt
    that leaves no room at all is refused naming `prompt_param`."""
    if next_pos is None:
        return requested if requested is not None else (default or max_model_len)
    room = max_model_len - next_pos
    if room < 1:
        raise RequestError(
            f"the prompt takes {next_pos} positions; max_model_len is {max_model_len} (room is needed to generate)",
            prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested < 1:
        raise RequestError(f"{param} must be a positive integer, got {requested}", param)
    if requested > room:
        raise RequestError(
            f"{param} is {requested}, but the context has room for {room} more tokens: the prompt takes "
            f"{next_pos} positions and max_model_len is {max_model_len}; reduce {param} or the prompt",
            param,
            code="context_length_exceeded",
        )
    return requested

"""Decoded requests -> what the engine takes: a prompt (one of the engine's prompt forms) and SamplingParams.

Everything the engine would reject for a reason the client can name is checked here first, so the error
body names the request field (`messages[2].content`, `top_logprobs`, ...) rather than an engine internal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minakv.params import SamplingParams
from minakv.server.cache_ops import (
    CacheOps,
    ops_over_parts,
    parse_cache_ops,
    reasoning_flags,
    reasoning_spans,
    split_parts,
    with_sentinels,
)
from minakv.server.limits import DEFAULT_LIMITS, Limits, check_sampling
from minakv.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    RequestError,
    SamplingFields,
)

SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "logprobs",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
)


def unknown_model(name: str, served_names: set[str]) -> RequestError:
    return RequestError(
        f"The model {name!r} does not exist; this server serves {sorted(served_names)}",
        "model",
        status=404,  # as OpenAI answers
        code="model_not_found",
    )


MAX_CHOICES = 16  # n: choices per request (they share the prompt's KV: minakv/server/choices.py)


def check_common(req: SamplingFields, served_names: set[str]) -> None:
    if req.model not in served_names:
        raise unknown_model(req.model, served_names)
    if not isinstance(req.n, int) or not 1 <= req.n <= MAX_CHOICES:
        raise RequestError(f"n must be an integer in [1, {MAX_CHOICES}], got {req.n!r}", "n")


def sampling_params(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None, limits: Limits = DEFAULT_LIMITS
) -> SamplingParams:
    """SamplingParams from the request, checked with the engine's own rules and the stop-list `limits`
    (pass the app's: `settings["limits"]`); `max_tokens` None means the model's limit (the engine stops at
    the last position it may use)."""
    check_sampling(req, limits)
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:
        raise RequestError(f"seed must be a 64-bit integer, got {req.seed}", "seed")
    bias = {}
    for token, value in (req.logit_bias or {}).items():
        if not token.lstrip("-").isdigit():
            raise RequestError(f"logit_bias keys must be token ids, got {token!r}", "logit_bias")
        bias[int(token)] = value
    params = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else SamplingParams.max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None or req.top_k == 0 else req.top_k,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=bias or None,
    )
    try:
        params.check()
    except ValueError as e:
        message = str(e)
        raise RequestError(
            message, next((f for f in SAMPLING_FIELDS if message.startswith(f)), None)
        ) from None
    return params


# ---------------------------------------------------------------------------------------------------------
# Chat


def check_message(msg: ChatMessage, index: int) -> None:
    """What the renderer cannot take, named by field (it joins text parts and reads reasoning itself)."""
    if isinstance(msg.content, list):
        for j, part in enumerate(msg.content):
            if part.type != "text" or part.text is None:
                raise RequestError(
                    f"only text content parts are supported, got type {part.type!r}",
                    f"messages[{index}].content[{j}]",
                )
    if msg.role == "tool" and msg.content is None:
        raise RequestError("a tool message needs `content`", f"messages[{index}].content")


def tool_choice_mode(req: ChatCompletionRequest, structured: bool = False) -> str:
    """'auto' (tools rendered, calls parsed), 'required' (the same, and a grammar makes the turn call one:
    'required' or a named function; only for a caller that applies structured.py's grammar) or 'none' (no
    tools at all)."""
    choice = req.tool_choice
    if choice is None or choice == "auto":
        return "auto" if req.tools else "none"
    if choice == "none":
        return "none"
    if (choice == "required" or isinstance(choice, dict)) and not structured:
        raise RequestError(
            "tool_choice 'required' or a named function is supported on /v1/chat/completions only; use "
            "'auto' or 'none'",
            "tool_choice",
        )
    if choice == "required" or isinstance(choice, dict):
        if not req.tools:
            raise RequestError("tool_choice 'required' or a named function needs tools", "tool_choice")
        return "required"
    raise RequestError(
        f"tool_choice must be 'auto', 'none', 'required' or an object, got {choice!r}", "tool_choice"
    )


EFFORTS = ("low", "medium", "high")

# The template variables a client may set through `chat_template_kwargs`: what each accepts, in words and as
# a check. The rest of a template's context (messages, tools, add_generation_prompt, the special tokens)
# is the server's, and a `template` key would replace the model's template with the client's, so anything
# else is refused. The first three are what the GPT-OSS and MiniMax-M2 templates read; enable_thinking is
# what Qwen- and DeepSeek-style templates read, and vLLM clients send it.
TEMPLATE_VARIABLES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "reasoning_effort": ("'low', 'medium' or 'high'", lambda v: v in EFFORTS),
    "model_identity": ("a string", lambda v: isinstance(v, str)),
    "builtin_tools": (
        "a list of 'browser' and 'python'",
        lambda v: isinstance(v, list) and all(t in ("browser", "python") for t in v),
    ),
    "enable_thinking": ("true or false", lambda v: isinstance(v, bool)),
}


def template_kwargs(given: dict[str, Any]) -> dict[str, Any]:
    """`chat_template_kwargs` checked against the allow-list (TEMPLATE_VARIABLES)."""
    for key, value in given.items():
        if key not in TEMPLATE_VARIABLES:
            raise RequestError(
                f"chat_template_kwargs: {key!r} is not a template variable a request may set; the accepted "
                f"ones are {', '.join(TEMPLATE_VARIABLES)}",
                f"chat_template_kwargs.{key}",
            )
        words, accepts = TEMPLATE_VARIABLES[key]
        if not accepts(value):
            raise RequestError(
                f"chat_template_kwargs.{key} must be {words}, got {value!r:.100}",
                f"chat_template_kwargs.{key}",
            )
    return dict(given)


def chat_prompt(
    req: ChatCompletionRequest, raw: dict[str, Any], structured: bool = False
) -> tuple[dict[str, Any], CacheOps | None, bool]:
    """The engine's messages prompt, the parsed cache operations, and whether tool calls are parsed.
    `req` is the typed request (checked); `raw` the same body decoded untyped: messages and tools go to
    the template exactly as the client sent them (key order included, since templates print tools with
    `tojson`), so the same conversation always renders to the same tokens. With `structured`, the caller
    applies structured.py's grammar (response_format, forced tool calls); without, those are refused."""
    if not req.messages:
        raise RequestError("messages must not be empty", "messages")
    shaped = req.response_format is not None and req.response_format.get("type", "text") != "text"
    if shaped and not structured:
        raise RequestError("response_format other than 'text' is not supported here", "response_format")
    tools_on = tool_choice_mode(req, structured) != "none"
    for i, m in enumerate(req.messages):
        check_message(m, i)
    prompt: dict[str, Any] = {"messages": raw["messages"]}
    if tools_on:
        prompt["tools"] = raw["tools"]
    kwargs = template_kwargs(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        if req.reasoning_effort not in EFFORTS:
            raise RequestError(
                f"reasoning_effort must be 'low', 'medium' or 'high', got {req.reasoning_effort!r}",
                "reasoning_effort",
            )
        kwargs["reasoning_effort"] = req.reasoning_effort
    if kwargs:
        prompt["chat_template_kwargs"] = kwargs
    ops = parse_cache_ops(req)
    if ops is not None and not ops.thinking_drop:
        prompt["cache"] = ops.engine_form()
    return prompt, ops, tools_on


def thinking_drop_prompt(tokenizer: Any, prompt: dict[str, Any], ops: CacheOps) -> dict[str, Any]:
    """thinking_drop as a message_tokens prompt (see cache_ops.py): render once, locate each assistant message's
    reasoning by rendering again with sentinels in its place (text only, no tokenizing), cut the tokens at
    reasoning boundaries, renumber the operations into part ids."""
    from minakv.text.chat import normalize_message, render, render_spans

    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("thinking_drop needs a model with a tokenizer and a chat template", "drop_rule")
    kwargs = prompt.get("chat_template_kwargs") or {}
    tools = prompt.get("tools")
    rendered = render(prompt["messages"], tokenizer, tools=tools, **kwargs)
    marked_messages, where = with_sentinels(prompt["messages"])
    # the same call render() makes, without tokenizing
    specials = {k: getattr(tokenizer, k, None) for k in ("bos_token", "eos_token", "pad_token")}
    template_kwargs = {**{k: v for k, v in specials.items() if v is not None}, **kwargs}
    normalized = [normalize_message(m, i) for i, m in enumerate(marked_messages)]
    marked, _ = render_spans(normalized, tokenizer.chat_template, tools, True, **template_kwargs)
    flags = reasoning_flags(rendered.offsets, reasoning_spans(rendered.text, marked, where))
    segs = split_parts(rendered.token_ids, rendered.owners, flags, rendered.num_messages)
    return {"message_tokens": segs.token_ids, "cache": ops_over_parts(ops, segs, rendered.num_messages)}


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
    if not req.logprobs:
        return None
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise RequestError(f"top_logprobs must be in [0, 20], got {req.top_logprobs}", "top_logprobs")
    return req.top_logprobs or 0


# ---------------------------------------------------------------------------------------------------------
# Completions


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """Text or token ids. A list holding one prompt is unwrapped; batches are refused."""
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt must not be empty", "prompt")
        return prompt
    if not prompt:
        raise RequestError("prompt must not be empty", "prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):
            raise RequestError("prompt token ids must be non-negative", "prompt")
        return list(prompt)
    if all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("batched prompts are not supported; send one prompt per request", "prompt")
    raise RequestError("prompt must be a string or a list of token ids", "prompt")


def check_completion(req: CompletionRequest) -> None:
    if req.echo:
        raise RequestError("echo is not supported", "echo")
    if req.suffix:
        raise RequestError("suffix is not supported", "suffix")
    if req.best_of not in (None, 1):
        raise RequestError("best_of is not supported", "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise RequestError(f"logprobs must be in [0, 20], got {req.logprobs}", "logprobs")

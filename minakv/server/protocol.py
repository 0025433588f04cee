"""The wire format: OpenAI-compatible request and response types, decoded and encoded by msgspec.

Requests are decoded straight into typed structs, so a wrong type is rejected with the JSON path of the
offending field (`decode_request`), which becomes the `param` of the OpenAI-style error body. Unknown
fields are ignored, as OpenAI clients send fields minakv does not use. Cache operations ride along in the
chat request in two spellings (see `cache_ops.py`): the paper's `cache` object and AKV's `drop_message` /
`drop_rule` / `reposition` fields.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec
from msgspec import Struct

# ---------------------------------------------------------------------------------------------------------
# Errors


class RequestError(ValueError):
    """A request the server refuses: becomes an HTTP error with an OpenAI-style body."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(Struct):
    error: ErrorInfo


def error_body(err: RequestError) -> bytes:
    return msgspec.json.encode(ErrorBody(ErrorInfo(err.message, err.type, err.param, err.code)))


_PATH = re.compile(r"`\$\.?([^`]*)`")


def decode_request(body: bytes, type: type) -> Any:
    """Decode a JSON body into `type`, turning msgspec's errors into RequestError naming the field."""
    try:
        return msgspec.json.decode(body, type=type)
    except msgspec.ValidationError as e:
        # msgspec says e.g. "Expected `int`, got `str` - at `$.messages[0].role`"
        match = _PATH.search(str(e))
        param = match.group(1) if match and match.group(1) else None
        raise RequestError(f"Invalid request: {e}", param=param) from None
    except msgspec.DecodeError as e:
        raise RequestError(f"Invalid JSON body: {e}", code="invalid_json") from None


# ---------------------------------------------------------------------------------------------------------
# Requests


class ContentPart(Struct):
    type: str
    text: str | None = None


class FunctionCall(Struct):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Struct):
    function: FunctionCall
    id: str | None = None
    type: str = "function"


class ChatMessage(Struct, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the spelling some clients (and vLLM) use for reasoning_content


class FunctionDef(Struct, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct):
    function: FunctionDef
    type: Literal["function"] = "function"


class StreamOptions(Struct):
    include_usage: bool = False


class CacheForm(Struct, forbid_unknown_fields=True):
    """The paper's form: `"cache": {"drop": {"2": [0]}, "reposition": [2]}`."""

    drop: dict[int, list[int]] | None = None
    reposition: list[int] | None = None


class DropRule(Struct):
    """AKV's structured drop: `message_drop` (with `drop_messages`) or `thinking_drop`."""

    type: str
    drop_messages: dict[int, list[int]] | None = None


class SamplingFields(Struct, kw_only=True):
    """Fields shared by chat and completion requests."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension, as are min_p and top_k
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    user: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # cache operations (cache_ops.py)
    cache: CacheForm | None = None
    drop_message: dict[int, list[int]] | None = None
    drop_rule: DropRule | None = None
    reposition: list[int] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


# ---------------------------------------------------------------------------------------------------------
# Responses


class PromptTokensDetails(Struct):
    cached_tokens: int = 0
    repos_tokens: int = 0
    drop_skipped_tokens: int = 0


class UsageInfo(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobInfo(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    content: list[TokenLogprobInfo]


class FunctionCallOut(Struct):
    name: str
    arguments: str


class ToolCallOut(Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class ResponseMessage(Struct):
    content: str | None
    role: str = "assistant"
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = []


class ChatChoice(Struct):
    index: int
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"


class FunctionCallDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta | None = None


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: UsageInfo | None = None
    object: str = "chat.completion.chunk"


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    object: str = "text_completion"


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "minakv"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"

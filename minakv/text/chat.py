"""Chat rendering with token ownership (docs/design.md 2.1).

The conversation is rendered ONCE with the model's own Jinja chat template and tokenized ONCE; then every
token gets the index of the message it belongs to. Cache operations (drop, reposition) name messages, so the
engine must know which tokens each message owns, including the template's own text around it: role
headers and end markers belong to their message, text before the first message belongs to message 0, and
the generation prompt belongs to a synthetic owner N = len(messages).

How owners are found: we cannot render messages one by one (templates rewrite earlier messages depending
on later ones: GPT-OSS drops old reasoning, MiniMax groups consecutive tool results under one header), and
we do not want to parse each family's output format. Instead a small Jinja extension rewrites every
`{% for x in ... %}` loop of the template so that each iteration first reports "loop L is at item x" and
the loop's end reports "loop L is done". Both output nothing. Rendering is a generator that runs the
template lazily, so when a piece of output arrives we know which message iteration produced it. Of nested
loops over messages we keep the OUTERMOST one: an inner loop over messages is the template looking ahead
or back, not rendering them. Text outside any message iteration belongs to message 0 before the first
message output and to N (the generation prompt) after it. The hooks and the sandboxed Jinja environment
are in minakv/text/chat_template.py.

Characters get owners; a token gets the owner of its first character. A token that spans two messages
(a BPE merge across a boundary) cannot be split; `count_spanning` reports them and the tests show the real
templates produce none (their boundaries are special tokens).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from typing import Any

import jinja2
import numpy as np

from minakv.text.chat_template import TRACKER, ChatError, compile_template
from minakv.text.pieces import encode_runs


@dataclass
class Rendered:
    """A rendered conversation: the tokens, the owner message of each token, the text they came from."""

    token_ids: list[int]
    owners: list[int]  # owners[i] in 0..num_messages; num_messages is the generation prompt
    text: str
    num_messages: int
    spans: np.ndarray = field(
        default_factory=lambda: np.zeros((0, 2), np.int64)
    )  # [T, 2] chars of each token

    @property
    def offsets(self) -> list[tuple[int, int]]:
        """Per token, its (start, end) characters in `text` (as tuples: built on demand, few callers)."""
        return [tuple(o) for o in self.spans.tolist()]


# ---------------------------------------------------------------------------------------------------------
# Messages as templates expect them


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def normalize_message(message: Any, index: int) -> dict[str, Any]:
    """A fresh copy of one OpenAI-style message in the shape Hugging Face chat templates read: None fields
    dropped, null content as "", text parts joined, tool-call arguments as dicts (templates `tojson` them),
    reasoning under both `reasoning_content` (MiniMax) and `thinking` (GPT-OSS)."""
    if not isinstance(message, dict):
        raise ChatError(f"messages[{index}] must be an object, got {type(message).__name__}")
    if not isinstance(message.get("role"), str):
        raise ChatError(f"messages[{index}].role must be a string")
    out = {k: v for k, v in message.items() if v is not None}
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise ChatError(f"messages[{index}].content[{j}]: only text parts are supported")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise ChatError(f"messages[{index}].content must be a string, a list of text parts or null")
    out["content"] = content or ""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise ChatError(f"messages[{index}].reasoning_content must be a string")
        out.update(reasoning_content=reasoning, thinking=reasoning)
    if "tool_calls" in out:
        out["tool_calls"] = [_normalize_call(c, index, j) for j, c in enumerate(out["tool_calls"])]
    return out


def _normalize_call(call: Any, index: int, j: int) -> dict[str, Any]:
    where = f"messages[{index}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatError(f"{where}.function.name must be a string")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ChatError(f"{where}.function.arguments is not valid JSON: {e}") from None
    return {**call, "function": {**fn, "arguments": args}}


# ---------------------------------------------------------------------------------------------------------
# Rendering with owners


class _Tracker:
    """Which message iteration of the template is running now (see the module docstring)."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.index = {id(m): i for i, m in enumerate(messages)}
        self.frames: list[tuple[int, int]] = []  # (loop id, message index), outermost first
        self.entered = False  # did any loop visit a message?

    def enter(self, loop_id: int, *targets: Any) -> str:
        if self.frames and self.frames[-1][0] == loop_id:
            self.frames.pop()
        for t in targets:
            i = self.index.get(id(t))
            if i is not None:
                self.frames.append((loop_id, i))
                self.entered = True
                break
        return ""

    def done(self, loop_id: int) -> str:
        while self.frames and self.frames[-1][0] == loop_id:
            self.frames.pop()
        return ""

    def current(self) -> int | None:
        return self.frames[0][1] if self.frames else None


def render_spans(
    messages: list[dict[str, Any]], template: str, tools: list[dict] | None, add_generation_prompt: bool,
    **template_kwargs: Any,
) -> tuple[str, list[tuple[int, int]]]:  # fmt: skip
    """Render normalized messages; return the text and its owner runs as (start char, owner), starts
    increasing, owners non-decreasing."""
    n = len(messages)
    tracker = _Tracker(messages)
    context = {
        "bos_token": "", "eos_token": "",  # templates may print them; a tokenizer's own values override
        **template_kwargs,
        "messages": messages, "tools": tools or None, "add_generation_prompt": add_generation_prompt,
    }  # fmt: skip
    pieces: list[str] = []
    runs: list[tuple[int, int]] = []
    at, rendered_a_message = 0, False
    active = TRACKER.set(tracker)
    try:
        for chunk in compile_template(template).generate(**context):
            if not chunk:
                continue
            owner = tracker.current()
            if owner is not None:
                rendered_a_message = True
            elif not rendered_a_message:
                owner = 0  # before the first message: message 0 (a system prompt the template prints first)
            else:
                owner = n if add_generation_prompt else n - 1  # after the last: the generation prompt
            if runs and owner < runs[-1][1]:
                raise ChatError(
                    f"the chat template renders message {owner} after message {runs[-1][1]}; token ownership "
                    "needs messages rendered in order"
                )
            if not runs or owner != runs[-1][1]:
                runs.append((at, owner))
            pieces.append(chunk)
            at += len(chunk)
    except ChatError:
        raise
    except jinja2.TemplateError as e:
        raise ChatError(f"chat template error: {e.message or e}") from None
    except (TypeError, ValueError, LookupError, AttributeError) as e:  # e.g. a field of an unexpected type
        raise ChatError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
    finally:
        TRACKER.reset(active)
    text = "".join(pieces)
    if not rendered_a_message and tracker.entered and n > 1:
        # The loop ran but its output came out later as one piece: it sits in a macro or {% set %} block.
        raise ChatError(
            "cannot tell which message the chat template's output belongs to: its loop over messages renders "
            "into a macro or {% set %} block"
        )
    if not rendered_a_message and add_generation_prompt and n > 0:
        # No message was rendered inside a loop (e.g. only a system message): find the generation prompt
        # as what add_generation_prompt appends.
        plain, _ = render_spans(messages, template, tools, False, **template_kwargs)
        if text.startswith(plain) and len(plain) < len(text):
            runs = [(0, 0)] if plain else []
            runs.append((len(plain), n))
    return text, runs


def owners_of_tokens(offsets: list[tuple[int, int]], runs: list[tuple[int, int]]) -> list[int]:
    """Owner of each token = owner of its first character."""
    starts = [s for s, _ in runs]
    return [runs[max(bisect.bisect_right(starts, start) - 1, 0)][1] for start, _ in offsets]


def count_spanning(offsets: list[tuple[int, int]], runs: list[tuple[int, int]]) -> int:
    """How many tokens cover characters of two owners (they are given to the first)."""
    starts = [s for s, _ in runs]
    return sum(
        bisect.bisect_right(starts, start) != bisect.bisect_right(starts, end - 1)
        for start, end in offsets
        if end > start
    )


def render(
    messages: list[dict[str, Any]],
    tokenizer: Any,
    template: str | None = None,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> Rendered:
    """Render `messages` with the chat template (default: the tokenizer's), tokenize once, and give each
    token its owner. `template_kwargs` (reasoning_effort, model_identity, ...) go to the template."""
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatError("the model has no chat template (chat_template.jinja or tokenizer_config.json)")
    if not isinstance(messages, list):
        raise ChatError("messages must be a list")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ChatError("tools must be a list of objects")
    normalized = [normalize_message(m, i) for i, m in enumerate(messages)]
    specials = {k: getattr(tokenizer, k, None) for k in ("bos_token", "eos_token", "pad_token")}
    kwargs = {**{k: v for k, v in specials.items() if v is not None}, **template_kwargs}
    text, runs = render_spans(normalized, template, tools, add_generation_prompt, **kwargs)
    cache = getattr(tokenizer, "pieces", None)  # minakv's Tokenizer has one (pieces.py)
    if cache is not None:
        if check := getattr(tokenizer, "check", None):  # the server's length guard (server/prepare.py)
            check(text)
        encoded = encode_runs(cache, text, runs)
        if encoded is not None:  # message by message, earlier rounds' messages from the cache
            return Rendered(*encoded[:2], text, len(messages), encoded[2])
    ids, offsets = tokenizer.encode_with_offsets(text)
    spans = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    return Rendered(list(ids), owners_of_tokens(offsets, runs), text, len(messages), spans)


def message_text(rendered: Rendered, owner: int, tokenizer: Any) -> str:
    """The text of the tokens that `owner` owns (for tests and debugging)."""
    return tokenizer.decode([t for t, o in zip(rendered.token_ids, rendered.owners) if o == owner])

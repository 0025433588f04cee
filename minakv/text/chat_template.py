"""The Jinja environment for chat templates: what Hugging Face gives them, plus loop hooks for ownership.

Chat templates come from model repositories, so they run sandboxed, with the filters and globals
transformers provides (`tojson` without HTML escaping, `raise_exception`, `strftime_now`, loop controls).
On top, the `OwnerHooks` extension rewrites every `{% for %}` loop so that each iteration reports "loop L
is at item x" and the loop's end reports "loop L is done", to whatever tracker `render_spans`
(minakv/text/chat.py) has installed in `TRACKER`; the hooks output nothing, so the rendered text is
exactly the template's.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import datetime
from typing import Any, ClassVar, Protocol

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.lexer import Token, TokenStream
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatError(ValueError):
    """Messages or a template that cannot be rendered; the message says what is wrong."""


class LoopTracker(Protocol):
    def enter(self, loop_id: int, *targets: Any) -> str: ...
    def done(self, loop_id: int) -> str: ...


TRACKER: ContextVar[LoopTracker | None] = ContextVar("minakv_owner_tracker", default=None)

ENTER, DONE = "_minakv_enter", "_minakv_done"


class OwnerHooks(jinja2.ext.Extension):
    """Injects `{{ id|_minakv_enter(<loop target>) }}` at the start of every for-loop body and
    `{{ id|_minakv_done }}` after every `{% endfor %}` (filters: the sandbox calls them directly, which
    is several times cheaper than a sandboxed function call). Works on the token stream, after whitespace
    control is applied, so the template's output is unchanged. Also accepts HF's `{% generation %}` tag
    (a training-time marker) and renders its body as is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def filter_stream(self, stream: TokenStream) -> Iterator[Token]:
        open_loops: list[int] = []
        next_id = 0
        tokens = iter(stream)
        for tok in tokens:
            yield tok
            if tok.type != "block_begin":
                continue
            head = next(tokens)
            yield head
            if head.test("name:for"):
                target: list[Token] = []  # the loop variable(s): tokens up to the top-level `in`
                depth = 0
                for t in tokens:
                    yield t
                    if depth == 0 and t.test("name:in"):
                        break
                    depth += (t.type in ("lparen", "lbracket")) - (t.type in ("rparen", "rbracket"))
                    target.append(t)
                for t in tokens:
                    yield t
                    if t.type == "block_end":
                        break
                loop_id, next_id = next_id, next_id + 1
                open_loops.append(loop_id)
                yield from _hook(t.lineno, ENTER, loop_id, target)
            elif head.test("name:endfor") and open_loops:
                for t in tokens:
                    yield t
                    if t.type == "block_end":
                        break
                yield from _hook(t.lineno, DONE, open_loops.pop(), [])


def _hook(lineno: int, name: str, loop_id: int, args: list[Token]) -> list[Token]:
    """Tokens of `{{ loop_id|name(args) }}` (or `{{ loop_id|name }}`)."""
    call = [Token(lineno, "integer", loop_id), Token(lineno, "pipe", "|"), Token(lineno, "name", name)]
    if args:
        call += [Token(lineno, "lparen", "("), *args, Token(lineno, "rparen", ")")]
    return [Token(lineno, "variable_begin", "{{"), *call, Token(lineno, "variable_end", "}}")]


# pass_context keeps Jinja from evaluating the hooks once at compile time (constant folding).
@jinja2.pass_context
def _enter(_context: Any, loop_id: int, *targets: Any) -> str:
    tracker = TRACKER.get()
    return tracker.enter(loop_id, *targets) if tracker else ""


@jinja2.pass_context
def _done(_context: Any, loop_id: int) -> str:
    tracker = TRACKER.get()
    return tracker.done(loop_id) if tracker else ""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    # Jinja's own tojson escapes HTML characters (<, >, &, '); chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _environment() -> jinja2.Environment:
    # The settings Hugging Face uses for chat templates (sandboxed: templates from model repos are untrusted).
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, OwnerHooks]
    )
    env.filters["tojson"] = _tojson
    env.filters[ENTER], env.filters[DONE] = _enter, _done
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatError(f"chat template: syntax error at line {e.lineno}: {e.message}") from None

"""The text side of the tiny presets: their chat templates and tiny-minimax-m2's synthetic tokenizer.

The templates are our own short renderings of each family's chat format (not the official templates):
enough for tests of chat rendering, token ownership and tool calls to run on the tiny checkpoints.
"""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer

from minakv.text.bpe import build_bpe_tokenizer

# Our own short harmony rendering: system/developer/user as is; assistant reasoning on the analysis channel
# (when the conversation ends in a final answer, reasoning up to the first final one is dropped, as
# openai-harmony does), answers on final, tool calls on commentary
# addressed to functions.NAME; tool results come from functions.NAME (their `name`, else the last call's).
GPT_OSS_TEMPLATE = """\
{%- set ns = namespace(first_final=-1, last_is_final=false, assistant=-1, tool='tool') -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- set ns.assistant = ns.assistant + 1 -%}
{%- if m.get('content') and ns.first_final < 0 -%}{%- set ns.first_final = ns.assistant -%}{%- endif -%}
{%- set ns.last_is_final = (m.get('content') or '') != '' -%}
{%- endif -%}
{%- endfor -%}
{%- set ns.assistant = -1 -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- set ns.assistant = ns.assistant + 1 -%}
{%- if m.get('reasoning_content') and not (ns.last_is_final and ns.assistant <= ns.first_final) -%}
<|start|>assistant<|channel|>analysis<|message|>{{ m.reasoning_content }}<|end|>
{%- endif -%}
{%- for tc in m.get('tool_calls') or [] -%}
{%- set ns.tool = tc.function.name -%}
<|start|>assistant to=functions.{{ tc.function.name }}<|channel|>commentary <|constrain|>json<|message|>\
{{ tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson }}<|call|>
{%- endfor -%}
{%- if m.get('content') -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif -%}
{%- elif m.role == 'tool' -%}
<|start|>functions.{{ m.get('name') or ns.tool }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- else -%}
<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""

# Our own short MiniMax-M2 rendering: ]~!b[ once, then ]~b]role\n...[e~[\n per message (assistant = "ai"),
# tools listed in the system message, tool calls as <minimax:tool_call> XML, generation prompt opens <think>.
# Every tag trims whitespace and newlines are written as {{ '\n' }}, so the output does not depend on the
# trim_blocks/lstrip_blocks settings of the Jinja environment.
MINIMAX_TEMPLATE = r"""]~!b[
{%- if tools and messages[0].role != 'system' -%}
]~b]system{{ '\n' }}<tools>{% for t in tools %}<tool>{{ t | tojson }}</tool>{% endfor %}</tools>[e~[{{ '\n' }}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
]~b]system{{ '\n' }}{{ m.content }}
{%- if tools %}{{ '\n' }}<tools>{% for t in tools %}<tool>{{ t | tojson }}</tool>{% endfor %}</tools>{% endif -%}
[e~[{{ '\n' }}
{%- elif m.role == 'assistant' -%}
]~b]ai{{ '\n' }}
{%- if m.get('reasoning_content') %}<think>{{ m.reasoning_content }}</think>{{ '\n' }}{% endif -%}
{{ m.content or '' }}
{%- for tc in m.get('tool_calls') or [] -%}
{{ '\n' }}<minimax:tool_call>{{ '\n' }}<invoke name="{{ tc.function.name }}">
{%- if tc.function.arguments is mapping -%}
{%- for k, v in tc.function.arguments.items() -%}
{{ '\n' }}<parameter name="{{ k }}">{{ v if v is string else v | tojson }}</parameter>
{%- endfor -%}
{%- else -%}{{ tc.function.arguments }}{%- endif -%}
{{ '\n' }}</invoke>{{ '\n' }}</minimax:tool_call>
{%- endfor -%}
[e~[{{ '\n' }}
{%- else -%}
]~b]{{ m.role }}{{ '\n' }}{{ m.content }}[e~[{{ '\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
]~b]ai{{ '\n' }}<think>{{ '\n' }}
{%- endif -%}"""

MINIMAX_SPECIALS = ["]!p~[", "]~b]", "[e~[", "]~!b["]  # control tokens (skipped by decode(skip_special))
MINIMAX_ADDED = ["<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"]  # kept in text
# Words that become single tokens of the synthetic MiniMax vocabulary (each also adds its prefixes).
MINIMAX_WORDS = """system user ai tool assistant think invoke name parameter the and you what is are of to in
that it for on with as this be at by hello world weather city today please help answer question tokens cache
model message call function result json true false null error""".split()  # noqa: SIM905


def minimax_tokenizer() -> HFTokenizer:
    """A small byte-level BPE: 256 byte tokens, merges spelling MINIMAX_WORDS (with and without a leading
    space), then MiniMax's special and added tokens."""
    tokens = [bytes([b]) for b in range(256)]
    known = set(tokens)
    merges: list[tuple[bytes, bytes]] = []
    for word in MINIMAX_WORDS:
        for spelled in (word.encode(), b" " + word.encode()):
            for end in range(2, len(spelled) + 1):
                left, right = spelled[: end - 1], spelled[end - 1 : end]
                if spelled[:end] not in known:
                    known.add(spelled[:end])
                    tokens.append(spelled[:end])
                    merges.append((left, right))
    return build_bpe_tokenizer(tokens, merges, None, MINIMAX_SPECIALS, MINIMAX_ADDED)

"""Structured outputs in the engine: a grammar makes even random weights write valid JSON and tool calls.

The tiny presets have random weights, so without a grammar their output is noise; with one, every sample
must be valid (checked with `jsonschema`). The schemas bound what a random model would otherwise never
end (string lengths, integer ranges, array sizes): only the model can stop an unbounded string. Also: the
bitmask is applied only to the constrained rows, overlap on and off give the same tokens, and a
constrained request changes nothing for the others in its batch.
"""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
import torch

from minakv import Engine, SamplingParams
from minakv.grammar import chat_output, compile_grammar
from minakv.grammar.compiler import compiler_for
from minakv.params import Grammar
from minakv.text.parsers import parse_output
from minakv.worker.sampler import SamplingTensors, allowed, sample

SHORT = {"type": "string", "maxLength": 8}
SCHEMAS = [
    {  # flat, every scalar type
        "type": "object",
        "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "active": {"type": "boolean"}, "nothing": {"type": "null"}},
        "required": ["name", "age", "active", "nothing"],
        "additionalProperties": False,
    },
    {  # nested objects, enums, an array of enums
        "type": "object",
        "properties": {
            "user": {"type": "object",
                     "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                    "role": {"enum": ["admin", "user", "guest"]}},
                     "required": ["id", "role"], "additionalProperties": False},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["user", "tags"],
        "additionalProperties": False,
    },
    {  # an array of objects, optional properties, anyOf with null
        "type": "object",
        "properties": {
            "items": {"type": "array", "minItems": 1, "maxItems": 3,
                      "items": {"type": "object",
                                "properties": {"sku": SHORT, "gift": {"type": "boolean"},
                                               "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                                "required": ["sku", "qty"], "additionalProperties": False}},
            "note": {"anyOf": [SHORT, {"type": "null"}]},
            "point": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9},
                      "minItems": 2, "maxItems": 2},
        },
        "required": ["items", "note", "point"],
        "additionalProperties": False,
    },
]  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": SHORT, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                       "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]  # fmt: skip
ARCHS = {"tiny-gpt-oss": "gpt_oss", "tiny-minimax-m2": "minimax_m2"}


@pytest.fixture(scope="module", params=list(ARCHS))
def engine(request) -> Engine:
    # overlap off: on a CPU it gains nothing, and constrained requests would decode every other step
    return Engine(request.param, max_model_len=1024, overlap=False)


def constrained(schema: dict, seed: int, max_tokens: int = 256) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, grammar=Grammar(json_schema=schema))


def run_json_samples(engine: Engine, count: int) -> None:
    params = [constrained(SCHEMAS[i % len(SCHEMAS)], seed=i) for i in range(count)]
    outs = engine.generate(["Write JSON."] * count, params)
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop", (i, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMAS[i % len(SCHEMAS)])
    engine.check()


def test_json_schema_samples_are_valid(engine: Engine) -> None:
    """100 samples on tiny-minimax-m2 (a 585-token vocabulary: cheap steps), 30 on tiny-gpt-oss."""
    run_json_samples(engine, 100 if engine.model_name == "tiny-minimax-m2" else 30)


@pytest.mark.slow
def test_json_schema_hundred_samples_are_valid_gpt_oss(engine: Engine) -> None:
    if engine.model_name != "tiny-gpt-oss":
        pytest.skip("the fast test takes 100 samples of this model already")
    run_json_samples(engine, 100)


def test_json_object_is_an_object(engine: Engine) -> None:
    """Any object: nothing bounds it, and a random model would write one string or number forever. So the
    tokens that close strings, objects and arrays get a large logit bias, `"` > `}` > `]`: wherever the
    grammar allows one of them, it is taken (the grammar still decides which are allowed)."""
    closers = map(engine.tokenizer.token_to_id, ('"', "}", "]"))
    bias = dict(zip(closers, (100.0, 90.0, 80.0)))
    grammar = Grammar(json_schema={"type": "object"})
    params = [SamplingParams(max_tokens=32, seed=i, logit_bias=bias, grammar=grammar) for i in range(6)]
    for out in engine.generate(["Write JSON."] * 6, params):
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("mode", ["answer", "required", "named", "either"])
def test_chat_turn_in_the_family_format(engine: Engine, mode: str) -> None:
    """The answer (response_format), a call of any tool (tool_choice "required"), of one (named), or
    either (tools on "auto" with a response_format): parsed by the family's own output parser."""
    arch = ARCHS[engine.model_name]
    tools = {"answer": None, "required": TOOLS, "named": TOOLS[1:], "either": TOOLS}[mode]
    answer = SCHEMAS[1] if mode in ("answer", "either") else None
    grammar = chat_output(arch, engine.tokenizer, answer=answer, tools=tools)
    prompt = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS}
    params = [SamplingParams(max_tokens=128, seed=i, grammar=grammar) for i in range(6)]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools or []}
    kinds = set()
    for out in engine.generate([prompt] * 6, params):
        assert out.finish_reason == "stop", out.text
        parsed = parse_output(engine.tokenizer.decode(out.token_ids), arch, TOOLS)
        assert parsed.reasoning_content is None and bool(parsed.content) != bool(parsed.tool_calls), out.text
        if parsed.content:
            jsonschema.validate(json.loads(parsed.content), answer)
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        kinds.add("answer" if parsed.content else "call")
    # (with "either" the random model may well always take the same branch: both are valid)
    assert kinds <= {"answer", "call"} if mode == "either" else kinds == ({"answer"} if answer else {"call"})


def test_overlap_on_and_off_give_the_same_tokens() -> None:
    """A constrained request waits for its pending token under overlap (every other step), unconstrained
    ones do not: the tokens are the same either way."""
    params = [constrained(SCHEMAS[i % 3], seed=i) for i in range(4)]
    params += [SamplingParams(max_tokens=12, seed=7), SamplingParams(max_tokens=9, temperature=0)]
    outs = {}
    for overlap in (True, False):
        engine = Engine("tiny-minimax-m2", max_model_len=512, overlap=overlap)
        outs[overlap] = [o.token_ids for o in engine.generate(["Write JSON."] * len(params), params)]
        engine.check()
    assert outs[True] == outs[False]


def test_constrained_rows_leave_the_others_alone() -> None:
    engine = Engine("tiny-minimax-m2", max_model_len=512)
    free = [
        SamplingParams(max_tokens=16, seed=3),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
    ]
    alone = [o.token_ids for o in engine.generate(["Hello", "Hi"], free)]
    mixed = engine.generate(["Write JSON.", "Hello", "Hi", "Write JSON."],
                            [constrained(SCHEMAS[0], 1), *free, constrained(SCHEMAS[2], 2)])  # fmt: skip
    assert [o.token_ids for o in mixed[1:3]] == alone
    # and the constrained ones are what they are alone
    assert mixed[0].token_ids == engine.generate(["Write JSON."], constrained(SCHEMAS[0], 1))[0].token_ids


def test_mask_applies_to_its_rows_only() -> None:
    vocab, rows = 70, 4
    logits = torch.randn(rows, vocab)
    mask = torch.zeros(2, (vocab + 31) // 32, dtype=torch.int32)
    mask[0, 0] = 1 << 5  # row 1: only token 5
    mask[1, 2] = 1 << 1  # row 3: only token 65
    mask[1, 1] = -(2**31)  # and token 63 (the sign bit)
    ok = allowed(mask, vocab)
    assert ok.shape == (2, vocab) and ok[0].nonzero().flatten().tolist() == [5]
    assert ok[1].nonzero().flatten().tolist() == [63, 65]
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0),
        SamplingParams(),
        SamplingParams(),
    ]
    t = SamplingTensors.build(params, [1, 2, 3, 4], [0] * 4, "cpu", mask_rows=[1, 3], token_mask=mask.numpy())
    tokens = sample(logits, t).tolist()
    assert tokens[0] == logits[0].argmax() and tokens[1] == 5 and tokens[3] in (63, 65)
    t_free = SamplingTensors.build(params, [1, 2, 3, 4], [0] * 4, "cpu")
    assert sample(logits, t_free).tolist()[2] == tokens[2]  # an unconstrained sampled row: unchanged


def test_grammars_are_checked_and_cached() -> None:
    engine = Engine("tiny-minimax-m2", max_model_len=512)
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(grammar=Grammar(json_schema={}, regex="a+")).check()
    with pytest.raises(ValueError, match="grammar"):
        engine.generate(["x"], SamplingParams(grammar=Grammar(json_schema={"type": "objectx"})))
    with pytest.raises(ValueError, match="grammar"):
        engine.generate(["x"], SamplingParams(grammar=Grammar(lark="start: <|no such token|>")))
    out = engine.generate(["x"], SamplingParams(max_tokens=8, grammar=Grammar(regex="ab|cd")))[0]
    assert out.text in ("ab", "cd") and out.finish_reason == "stop"
    tok, vocab, eos = engine.tokenizer, engine.model.config.vocab_size, engine.tokenizer.eos_token_ids
    compiler = compiler_for(tok, vocab, eos)
    assert compiler is compiler_for(tok, vocab, eos)  # one per tokenizer
    first = compile_grammar(Grammar(json_schema=SCHEMAS[0]), tok, vocab, eos)
    cached = len(compiler.cache)
    again = compile_grammar(Grammar(json_schema=copy.deepcopy(SCHEMAS[0])), tok, vocab, eos)
    assert len(compiler.cache) == cached and again.matcher is not first.matcher  # one start state, copied

"""xgrammar vs llguidance on the host, at the gpt-oss vocabulary (o200k_harmony, 201,088 tokens).

Structured outputs need two things from a grammar library, and this measures both for each library:

- compiling a grammar (a JSON schema, any JSON object, a harmony tool call with special tokens) for one
  tokenizer: this runs once per request (or once per distinct schema, with a cache), in the caller's thread;
- the per-token mask: after each sampled token the matcher advances and fills one row of an int32 bitmask
  [rows, ceil(V / 32)]; this runs on the engine thread every step, so it is the figure that matters most.

Each grammar is driven along a valid output (the example instance tokenized with the model's tokenizer,
inside the harmony markup where the grammar asks for it) and along 64 random allowed tokens (roughly
what a random-weight model does: long odd strings, deep nesting). Compilation is timed cold (a fresh
compiler, no cache). The tokenizer setup (once per tokenizer) is reported separately.

    python bench/bench_grammar.py [--repeat 3] [--json out.json]
    python bench/bench_grammar.py --device    (on the GPU: the masked sampling step, see `device_cost`)

xgrammar is not a dependency of minakv: `pip install xgrammar torch==<the installed version>` first.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from importlib.metadata import version

import numpy as np
import torch

from minakv.params import SamplingParams
from minakv.worker.sampler import SamplingTensors, sample

try:  # the library comparison (CPU); --device needs neither
    import llguidance as llg
    import llguidance.numpy as llg_np
    import xgrammar as xgr

    from minakv.presets import resolve_model
    from minakv.text.tokenizer import Tokenizer
except ImportError:
    pass

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "status": {"enum": ["active", "inactive", "banned"]},
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "age", "address", "tags", "status"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                    "options": {"type": "object", "properties": {"gift": {"type": "boolean"}}},
                },
                "required": ["sku", "qty"],
            },
        },
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["id", "items", "note"],
}
CASES = {  # name -> (schema or None for any JSON object, example instance, harmony tool call?)
    "json_object": (None, {"a": [1, 2, {"b": None}], "c": "text"}, False),
    "weather": (WEATHER, {"city": "Paris", "unit": "celsius"}, False),
    "person (nested, enum, arrays)": (PERSON, {
        "name": "Ann", "age": 41, "address": {"street": "1 Main St", "zip": "12345"}, "tags": ["a", "b"],
        "status": "active", "scores": [1.5, 2]}, False),
    "order (array of objects)": (
        ORDER, {"id": 7, "items": [{"sku": "x1", "qty": 2, "options": {"gift": True}}], "note": None}, False),
    "harmony tool call (weather)": (WEATHER, {"city": "Paris", "unit": "celsius"}, True),
}  # fmt: skip
HARMONY_HEAD = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"


def gpt_oss_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model("tiny-gpt-oss"))


# ----- llguidance


def llg_grammar(schema: dict | None, harmony: bool) -> str:
    schema = schema or {"type": "object"}
    if not harmony:
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    lark = (f'start: <|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
            f"args <|call|>\nargs: %json {json.dumps(schema)}")  # fmt: skip
    return llg.LLMatcher.grammar_from_lark(lark)


class Llg:
    name = "llguidance " + llg.__version__

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = llg.LLTokenizer(tok.tok.to_str(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_ids)
        self.vocab = tok.vocab_size

    def compile(self, schema: dict | None, harmony: bool):
        m = llg.LLMatcher(self.tok, llg_grammar(schema, harmony), log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, mask: np.ndarray) -> None:
        llg_np.fill_next_token_bitmask(m, mask, 0)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()


# ----- xgrammar


class Xgr:
    name = "xgrammar " + version("xgrammar")

    def __init__(self, tok: Tokenizer) -> None:
        vocab = tok.tok.get_vocab(with_added_tokens=True)
        encoded = [""] * tok.vocab_size
        for text, i in vocab.items():
            encoded[i] = text
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.tok.to_str())
        self.info = xgr.TokenizerInfo(
            encoded,
            meta["vocab_type"],
            vocab_size=tok.vocab_size,
            stop_token_ids=tok.eos_token_ids,
            add_prefix_space=meta["add_prefix_space"],
        )
        self.vocab = tok.vocab_size

    def compile(self, schema: dict | None, harmony: bool):
        compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)  # cold: no cache between runs
        if not harmony:
            # strict_mode=False: like llguidance, extra properties only where the schema allows them
            return compiler.compile_json_schema(schema or {"type": "object"}, any_whitespace=False,
                                                separators=(",", ":"), strict_mode=False)  # fmt: skip
        st = xgr.StructuralTag.model_validate({"format": {"type": "sequence", "elements": [
            {"type": "token", "token": "<|channel|>"},
            {"type": "const_string", "value": "commentary to=functions.get_weather "},
            {"type": "token", "token": "<|constrain|>"},
            {"type": "const_string", "value": "json"},
            {"type": "token", "token": "<|message|>"},
            {"type": "json_schema", "json_schema": schema},
            {"type": "token", "token": "<|call|>"},
        ]}})  # fmt: skip
        return compiler.compile_structural_tag(st)

    def matcher(self, compiled):
        return xgr.GrammarMatcher(compiled)

    def fill(self, m, mask: np.ndarray) -> None:
        m.fill_next_token_bitmask(torch.from_numpy(mask), 0)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()


# ----- driving a matcher


def allowed(mask: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab]
    return np.nonzero(bits)[0]


def walk(lib, compiled, tokens: list[int] | None, seed: int, limit: int = 64) -> list[float]:
    """Per-token mask times (ms) along `tokens`, or along random allowed tokens when None."""
    m = lib.matcher(compiled)
    mask = np.full((1, (lib.vocab + 31) // 32), -1, dtype=np.int32)
    rng, times = random.Random(seed), []
    for i in range(len(tokens) if tokens is not None else limit):
        t0 = time.perf_counter()
        lib.fill(m, mask)
        times.append((time.perf_counter() - t0) * 1e3)
        if tokens is not None:
            token = tokens[i]
        else:
            ok = allowed(mask, lib.vocab)
            if not len(ok):
                break
            token = int(ok[rng.randrange(len(ok))])
        assert lib.accept(m, token), (lib.name, i, token)
        if lib.done(m):
            break
    return times


def example_tokens(tok: Tokenizer, instance, harmony: bool) -> list[int]:
    text = json.dumps(instance, separators=(",", ":"))
    if harmony:
        return tok.encode(HARMONY_HEAD) + tok.encode(text, allow_special=False) + tok.encode("<|call|>")
    return tok.encode(text, allow_special=False)


def summary(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"n": len(ms), "mean": statistics.fmean(ms), "p50": ms[len(ms) // 2],
            "p99": ms[min(len(ms) - 1, int(len(ms) * 0.99))], "max": ms[-1]}  # fmt: skip


def device_cost(rows: int = 64, vocab: int = 201_088) -> None:
    """The device side of structured outputs: `sample()` for `rows` sampled rows of which G carry a random
    bitmask (half the tokens allowed), against G = 0. Checks that every constrained row's token is allowed
    (the Triton Gumbel-max path with -inf logits) and prints the median time of the step's sampling."""
    import triton.testing

    logits = torch.randn(rows, vocab, device="cuda")
    params = [SamplingParams(temperature=1.0, top_p=0.9) for _ in range(rows)]
    base = None
    for g in (0, 1, 8, rows):
        mask = np.random.default_rng(g).integers(
            -(2**31), 2**31, size=(g, (vocab + 31) // 32), dtype=np.int64
        )
        mask = mask.astype(np.int32)
        t = SamplingTensors.build(params, list(range(rows)), [0] * rows, "cuda", mask_rows=list(range(g)),
                                  token_mask=mask)  # fmt: skip
        tokens = sample(logits, t).tolist()
        bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")
        assert all(bits[i, tokens[i]] for i in range(g)), "a constrained row sampled a disallowed token"
        ms = triton.testing.do_bench(lambda t=t: sample(logits, t), warmup=25, rep=100, return_mode="median")
        base = base if base is not None else ms
        print(f"batch {rows} x {vocab}, {g:3} rows with a mask: sample() {ms:.3f} ms (+{ms - base:.3f} ms)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="compilations per grammar (the median is shown)")
    ap.add_argument("--json", help="write the raw figures here")
    ap.add_argument("--device", action="store_true", help="time the masked sampling step on the GPU")
    args = ap.parse_args()
    if args.device:
        device_cost()
        return
    tok = gpt_oss_tokenizer()
    results: dict = {"vocab": tok.vocab_size, "libraries": {}}
    for make in (Llg, Xgr):
        t0 = time.perf_counter()
        lib = make(tok)
        setup = time.perf_counter() - t0
        row: dict = {"tokenizer_setup_s": setup, "grammars": {}}
        print(f"\n{lib.name}: tokenizer setup {setup:.2f} s (once per tokenizer)")
        columns = f"{'valid: mean/p50/max ms':>24} {'random: mean/p50/max (n)':>28}"
        print(f"  {'grammar':30} {'compile ms':>10} {columns}")
        for name, (schema, instance, harmony) in CASES.items():
            compile_ms, compiled = [], None
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                compiled = lib.compile(schema, harmony)
                compile_ms.append((time.perf_counter() - t0) * 1e3)
            valid = summary(walk(lib, compiled, example_tokens(tok, instance, harmony), 0))
            rand = summary([t for seed in range(4) for t in walk(lib, compiled, None, seed)])
            median = statistics.median(compile_ms)
            row["grammars"][name] = {"compile_ms": median, "valid": valid, "random": rand}
            figures = [f"{s['mean']:.3f} /{s['p50']:6.3f} /{s['max']:6.3f}" for s in (valid, rand)]
            print(f"  {name:30} {median:10.1f} {figures[0]:>24} {figures[1]:>22} ({rand['n']})")
        results["libraries"][lib.name] = row
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

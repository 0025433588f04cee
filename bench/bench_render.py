"""Rendering an agent's history for the server: the first time (every message tokenized) against the next
round (earlier messages from the piece cache, minakv/text/pieces.py), at growing history lengths. CPU only.

    PYTHONPATH=. python bench/bench_render.py [--rounds 8,24,48] [--tool-tokens 2000]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from minakv.presets.tiny import GPT_OSS_TEMPLATE
from minakv.text.chat import render
from minakv.text.tokenizer import Tokenizer, gpt_oss_tokenizer_json

REAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "chat_templates" / "gpt-oss.jinja"
WORDS = ["the", "quick", "brown", "fox", "over", "lazy", "dog", "result", "value", "error", "42", "{}", ":"]


def history(rounds: int, tool_words: int, rng: random.Random) -> list[dict]:
    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    msgs = [{"role": "system", "content": text(300)}, {"role": "user", "content": text(80)}]
    for j in range(rounds):
        call = {"id": f"c{j}", "type": "function", "function": {"name": "run", "arguments": '{"x": 1}'}}
        msgs += [{"role": "assistant", "content": text(30), "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": f"c{j}", "content": text(tool_words)}]  # fmt: skip
    return msgs


def timed(messages: list[dict], tokenizer: Tokenizer, template: str) -> tuple[float, object]:
    start = time.perf_counter()
    out = render(messages, tokenizer, template)
    return time.perf_counter() - start, out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", default="8,24,48")
    p.add_argument("--tool-tokens", type=int, default=2000)
    args = p.parse_args()
    template = REAL.read_text() if REAL.is_file() else GPT_OSS_TEMPLATE
    print(f"template: {'gpt-oss (real)' if REAL.is_file() else 'tiny-gpt-oss'}")
    for rounds in map(int, args.rounds.split(",")):
        rng = random.Random(rounds)
        msgs = history(rounds, int(args.tool_tokens * 0.75), rng)
        cold = Tokenizer(HFTokenizer.from_file(str(gpt_oss_tokenizer_json())))
        whole = Tokenizer(cold.tok)
        whole.pieces = None  # no piece cache: the whole text at once, as before
        t_whole, ref = timed(msgs[:-2], whole, template)
        t_cold, _ = timed(msgs[:-2], cold, template)
        t_next, out = timed(msgs, cold, template)  # the next round: two new messages
        assert out.token_ids[: len(ref.token_ids) - 8] == ref.token_ids[: len(ref.token_ids) - 8]
        row = {"rounds": rounds, "tokens": len(out.token_ids), "whole_ms": 1e3 * t_whole,
               "pieces_first_ms": 1e3 * t_cold, "pieces_next_round_ms": 1e3 * t_next}  # fmt: skip
        print(json.dumps(row))


if __name__ == "__main__":
    main()

"""OutputText (minakv/text/output_text.py) against a plain str: random appends with random `keep`, and
every read the engine makes (length, character, slice, find, cut, the whole text) at random offsets,
including offsets inside the settled chunks."""

from __future__ import annotations

import random

import pytest

from minakv.text import output_text
from minakv.text.output_text import OutputText


@pytest.mark.parametrize("seed", range(20))
def test_output_text_equals_a_plain_string(seed: int, monkeypatch) -> None:
    monkeypatch.setattr(output_text, "TAIL", 8)  # settle often: many chunks
    rng = random.Random(seed)
    text, model, most = OutputText(), "", 0
    for _ in range(300):
        piece = "".join(rng.choice("ab😀\ufffd ") for _ in range(rng.randint(0, 6)))
        keep = rng.randint(0, 5)
        text.append(piece, keep)
        model += piece
        assert len(text) == len(model) and len(text.tail) <= output_text.TAIL + keep + len(piece) + 1
        i, j = sorted(rng.randint(0, len(model)) for _ in range(2))
        assert text.slice(i, j) == model[i:j]
        if model:
            k = rng.randrange(len(model))
            assert text.char(k) == model[k]
        needle = rng.choice(["ab", "😀a", "b b", "\ufffd"])
        assert text.find(needle, i) == model.find(needle, i)
        if rng.random() < 0.03:
            end = (
                rng.randint(max(0, len(model) - 10), len(model))
                if rng.random() < 0.7
                else rng.randint(0, len(model))
            )
            text.cut(end)
            model = model[:end]
        assert str(text) == model
        most = max(most, len(text.chunks))
    assert most > 10

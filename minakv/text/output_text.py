"""A request's output text, grown a token's worth at a time, at a cost that does not grow with its length.

`text += piece` on a str attribute copies the whole text at every append: O(length) a token, quadratic over
a long output (hundreds of streams of 10k-token answers copy megabytes a step). Here the text is settled
chunks plus a short tail:

    chunks  "The answer is" " forty" ...  |  tail  "-two, bec"   <- append
            settled: never copied again   |  the last `keep` characters and what came since

Appending copies only the tail, and the tail is kept short (`settle` moves all but its last `keep`
characters to the chunks first). Everything a token's step reads lies in the tail: a stop string that the
new text could complete starts at most `keep` characters before it (keep = the longest stop string - 1),
and a stream's held-back end is at most `keep` characters (minakv/scheduler/request.py). Slices that reach
into the chunks (a stream that fell behind, the final text) join just the chunks they need.
"""

from __future__ import annotations

from bisect import bisect_right

TAIL = 256  # characters the tail may hold beyond `keep` before it settles


class OutputText:
    def __init__(self) -> None:
        self.chunks: list[str] = []
        self.starts: list[int] = []  # each chunk's first character, as an offset in the whole text
        self.base = 0  # characters in the chunks: where the tail starts
        self.tail = ""

    def __len__(self) -> int:
        return self.base + len(self.tail)

    def __str__(self) -> str:
        return "".join(self.chunks) + self.tail

    def append(self, piece: str, keep: int = 0) -> None:
        """Add `piece`, first settling the tail down to its last `keep` characters if it grew past TAIL."""
        if len(self.tail) > TAIL + keep:
            cut = len(self.tail) - keep
            self.chunks.append(self.tail[:cut])
            self.starts.append(self.base)
            self.base += cut
            self.tail = self.tail[cut:]
        self.tail += piece

    def find(self, s: str, start: int) -> int:
        """The first occurrence of s at or after offset `start`, or -1 (fast where start lies in the tail)."""
        if start < self.base:
            at = self.slice(start, len(self)).find(s)
            return at + start if at >= 0 else -1
        at = self.tail.find(s, start - self.base)
        return at + self.base if at >= 0 else -1

    def cut(self, end: int) -> None:
        """Drop the text from offset `end` on."""
        if end < self.base:  # (into the chunks: settle everything, then cut)
            self.chunks, self.starts, self.tail, self.base = [], [], str(self), 0
        self.tail = self.tail[: end - self.base]

    def slice(self, start: int, end: int) -> str:
        """text[start:end] for 0 <= start <= end <= len(self)."""
        if start >= self.base:
            return self.tail[start - self.base : end - self.base]
        first = bisect_right(self.starts, start) - 1
        head = "".join(self.chunks[first:])[start - self.starts[first] :]
        return (head + self.tail)[: end - start]

    def char(self, i: int) -> str:
        """The character at offset i."""
        return self.tail[i - self.base] if i >= self.base else self.slice(i, i + 1)

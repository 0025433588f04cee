"""References the engine is tested against: slow, obvious implementations, never used by the engine.

- `oracle`: the walk of docs/design.md 2.3, one token at a time with an explicit active set.
- `segments`: many attention segments in one forward, with dense masked attention (and the segments of a
  chunk, cut straight from the program).
- `dense`: one sequence in a contiguous cache (what transformers computes), and a greedy loop.
"""

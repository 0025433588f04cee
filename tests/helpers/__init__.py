"""What several test files share (tests/ is on sys.path: pytest puts the rootdir of files without an
`__init__.py` there, so tests import these as `from helpers.models import tiny_model`).

- `models`: the tiny random models (one `tiny_model`, two sizes) and the float64 MoE reference.
- `programs`: the literal walk of docs/design.md 2.3, random cache programs, and an engine run compared
  with the walk oracle.
- `checkpoints`: tiny transformers checkpoints saved to disk (plain and quantised); the `checkpoints`
  fixture in conftest.py builds them once per session.
- `server`: the in-process server harness and what the server tests compare with.
- `triton`: the marker for tests that need Triton's CPU interpreter.
"""

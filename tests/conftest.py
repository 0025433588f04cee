"""Shared fixtures: one private cache dir per test session, and the tiny presets built into it once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def minakv_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Generated files (o200k tokenizer, tiny checkpoints) go to $MINAKV_CACHE. Unless the caller set it,
    use a fresh folder so tests never read a stale user cache (subprocesses inherit it)."""
    if not os.environ.get("MINAKV_CACHE"):
        os.environ["MINAKV_CACHE"] = str(tmp_path_factory.mktemp("minakv-cache"))
    return Path(os.environ["MINAKV_CACHE"])


@pytest.fixture(scope="session")
def tiny_dir(minakv_cache: Path):
    """tiny_dir("tiny-gpt-oss") -> the preset's checkpoint directory, built once per session (presets:
    tiny-gpt-oss, tiny-gpt-oss-mxfp4, tiny-minimax-m2, tiny-minimax-m2-fp8)."""
    from minakv.model.presets import resolve_model

    return resolve_model

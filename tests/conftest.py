"""Shared fixtures: one private cache dir per test session, and the tiny presets built into it once."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports Triton: kernels run in its CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The same hypothesis examples every run, so CI never fails a landing on an example no earlier run met.
# MINAKV_HYPOTHESIS_RANDOM=1 draws new ones (do that while working on the engine).
if not os.environ.get("MINAKV_HYPOTHESIS_RANDOM"):
    from hypothesis import settings

    settings.register_profile("fixed", derandomize=True, database=None)
    settings.load_profile("fixed")

_OWN_CACHE: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Generated files (o200k tokenizer, tiny checkpoints) go to $MINAKV_CACHE. Unless the caller set it,
    use a fresh folder for this session, set before collection, so tests never read a stale user cache
    (subprocesses inherit it)."""
    global _OWN_CACHE
    # The tests run tiny models: with several intra-op threads, small ops spend more time synchronising
    # threads than computing (seen here: 30x slower engine steps with 2 threads on 2 loaded cores).
    torch.set_num_threads(1)
    if not os.environ.get("MINAKV_CACHE"):
        _OWN_CACHE = tempfile.mkdtemp(prefix="minakv-cache-")
        os.environ["MINAKV_CACHE"] = _OWN_CACHE


def pytest_unconfigure(config: pytest.Config) -> None:
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def minakv_cache() -> Path:
    return Path(os.environ["MINAKV_CACHE"])


@pytest.fixture(scope="session")
def tiny_dir(minakv_cache: Path):
    """tiny_dir("tiny-gpt-oss") -> the preset's checkpoint directory, built once per session (presets:
    tiny-gpt-oss, tiny-gpt-oss-mxfp4, tiny-minimax-m2, tiny-minimax-m2-fp8)."""
    from minakv.presets import resolve_model

    return resolve_model


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny transformers checkpoints of both families, plain and quantised (tests/helpers/checkpoints.py),
    written once per session."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from helpers.checkpoints import quantise_checkpoint, save_hf

    root = tmp_path_factory.mktemp("tiny-models")
    dirs = {arch: save_hf(arch, root / arch) for arch in ("gpt_oss", "minimax_m2")}
    dirs["gpt_oss_mxfp4"] = quantise_checkpoint(dirs["gpt_oss"], root / "gpt_oss_mxfp4")
    dirs["minimax_m2_fp8"] = quantise_checkpoint(dirs["minimax_m2"], root / "minimax_m2_fp8")
    return dirs

"""The command line as a user runs it: subprocesses of `python -m minakv` and the `minakv` console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    script = shutil.which("minakv", path=str(Path(sys.executable).parent))
    cmd = [script] if script else [sys.executable, "-m", "minakv"]
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=timeout, env=os.environ, check=False
    )


def test_build_tiny(tmp_path: Path):
    out = tmp_path / "m"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "minakv",
            "build-tiny",
            "tiny-minimax-m2",
            str(out),
            "--quant",
            "fp8",
            "--seed",
            "1",
        ],
        capture_output=True,
        check=False,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "minimax_m2" and config["quantization_config"]["quant_method"] == "fp8"
    assert (out / "model.safetensors").stat().st_size > 0


def test_generate_default_model(tiny_dir):
    tiny_dir("tiny-gpt-oss")  # build in this process's cache (shared through MINAKV_CACHE) to time it apart
    result = run("generate", "--prompt", "Hello there", "--max-tokens", "6", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "no generated text printed"
    assert "tokens/s" in result.stderr and "6 generated" in result.stderr


def test_generate_minimax_raw(tiny_dir):
    tiny_dir("tiny-minimax-m2")
    result = run("generate", "tiny-minimax-m2", "--prompt", "hello world", "--max-tokens", "4", "--raw")
    assert result.returncode == 0, result.stderr
    assert "tokens/s" in result.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", "/no/such/model"], "not a local directory"),
        (["generate", "--max-tokens", "0"], "--max-tokens"),
        (["build-tiny", "tiny-gpt-oss", "/tmp/x", "--quant", "fp8"], "mxfp4"),
    ],
)
def test_bad_input_is_one_clear_line(args: list[str], message: str):
    result = run(*args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr

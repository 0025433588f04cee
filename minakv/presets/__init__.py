"""Turning a model argument into a local checkpoint directory.

`resolve_model` accepts a built-in preset name (a tiny checkpoint, built on first use into the cache dir), a
local directory, or a Hugging Face hub repo id (downloaded: configs, tokenizer and safetensors only).
Presets are built into a temporary folder and renamed into place, so concurrent processes never see a
half-written checkpoint; the folder name includes the builder version, so a new builder rebuilds.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from minakv.text.tokenizer import cache_dir

# name -> (tiny preset, quantisation)
PRESETS: dict[str, tuple[str, str | None]] = {
    "tiny-gpt-oss": ("tiny-gpt-oss", None),
    "tiny-gpt-oss-mxfp4": ("tiny-gpt-oss", "mxfp4"),
    "tiny-minimax-m2": ("tiny-minimax-m2", None),
    "tiny-minimax-m2-fp8": ("tiny-minimax-m2", "fp8"),
}
DEFAULT_MODEL = "tiny-gpt-oss"
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model", "*.tiktoken"]


def preset_dir(name: str) -> Path:
    """The built checkpoint of preset `name`, building it if needed."""
    from minakv.presets.tiny import BUILDER_VERSION, build_tiny

    preset, quant = PRESETS[name]
    final = cache_dir() / "presets" / f"{name}-v{BUILDER_VERSION}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    try:
        build_tiny(preset, tmp, seed=0, quant=quant)
        try:
            os.rename(tmp, final)  # atomic; fails if another process got there first
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model(model: str | Path) -> Path:
    """A preset name -> its built directory; an existing directory -> itself; otherwise a hub repo id,
    downloaded with huggingface_hub (a clear error if that fails, e.g. offline)."""
    if str(model) in PRESETS:
        return preset_dir(str(model))
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    name = str(model)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise FileNotFoundError(
            f"model {name!r} is not a local directory, a preset ({', '.join(PRESETS)}) "
            "or a Hugging Face repo id (owner/name)"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=name, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated repo, ...
        raise FileNotFoundError(
            f"could not download {name!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
            "pass a local checkpoint directory or a preset instead"
        ) from e

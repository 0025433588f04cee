"""The models on a CUDA device: fp32 logits equal transformers' (on CPU), bf16 runs close to them, and
the packed MXFP4 experts stay on the device. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_model_parity import checkpoints, load_hf, rel_err  # noqa: F401  (checkpoints is a fixture)

from minakv.model import generate_greedy, load_model
from minakv.model.context import DenseContext

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@torch.no_grad()
@pytest.mark.parametrize("which", ["gpt_oss", "gpt_oss_mxfp4", "minimax_m2", "minimax_m2_fp8"])
def test_cuda_logits_match_transformers(checkpoints: dict[str, Path], which: str) -> None:  # noqa: F811
    path = checkpoints[which]
    ids = torch.randint(3, 256, (23,), generator=torch.Generator().manual_seed(0))
    ref = load_hf(path)(ids[None]).logits[0]
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(path, device="cuda", dtype=dtype)
        ctx = DenseContext()
        ctx.advance(len(ids))
        errors[dtype] = rel_err(model.compute_logits(model(ids.cuda(), ctx)).cpu(), ref)
    assert errors[torch.float32] < 1e-4, errors
    assert errors[torch.bfloat16] < 0.5, errors  # tiny random models are chaotic in bf16 (see test_loader)
    if which == "gpt_oss_mxfp4":
        packed = model.layers[0].mlp.experts.mxfp4
        assert packed is not None and packed["gate_up_blocks"].is_cuda
    assert len(generate_greedy(model, ids.tolist(), 4, stop_ids=[])) == 4

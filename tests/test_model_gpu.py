"""The models on a CUDA device: fp32 logits equal minakv's on CPU (which tests/test_model_parity.py
holds to transformers), bf16 runs close to them, and the packed MXFP4 experts live on the device.
Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.checkpoints import rel_err

from minakv.model import load_model
from minakv.reference.dense import DenseContext, generate_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    ctx = DenseContext()
    ctx.advance(len(ids))
    return model.compute_logits(model(ids.to(model.embed_tokens.weight.device), ctx)).cpu()


@torch.no_grad()
@pytest.mark.parametrize("which", ["gpt_oss", "gpt_oss_mxfp4", "minimax_m2", "minimax_m2_fp8"])
def test_cuda_matches_cpu(checkpoints: dict[str, Path], which: str) -> None:
    path = checkpoints[which]
    ids = torch.randint(3, 256, (23,), generator=torch.Generator().manual_seed(0))
    ref = logits(load_model(path, device="cpu", dtype=torch.float32), ids)
    torch.backends.cuda.matmul.allow_tf32 = False
    fp32 = load_model(path, device="cuda", dtype=torch.float32)
    assert rel_err(logits(fp32, ids), ref) < 1e-4
    bf16 = load_model(path, device="cuda")  # cuda default: bfloat16
    resident = torch.float8_e4m3fn if which == "minimax_m2_fp8" else torch.bfloat16  # FP8 stays FP8
    assert bf16.layers[0].self_attn.q_proj.weight.dtype == resident
    assert rel_err(logits(bf16, ids), ref) < 0.5  # tiny random models are chaotic in bf16 (see test_loader)
    if which == "gpt_oss_mxfp4":
        packed = bf16.layers[0].mlp.experts.mxfp4
        assert packed is not None and packed["gate_up_blocks"].is_cuda
    assert len(generate_greedy(bf16, ids.tolist(), 4, stop_ids=[])) == 4

"""RMSNorm in plain torch.

Both families normalise in fp32, but they differ in *where* the weight is applied: GPT-OSS multiplies by
the (fp32) weight before casting back to the input dtype; MiniMax-M2 (Llama style) casts back first and
then multiplies. In fp32 the two are identical; in bf16 they round differently, so the flag matters for
matching transformers bit for bit.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = True) -> torch.Tensor:
    """Normalise x [..., D] over its last dim and scale by weight [D]; returns x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        return (weight.float() * xf).to(x.dtype)
    return weight.to(x.dtype) * xf.to(x.dtype)

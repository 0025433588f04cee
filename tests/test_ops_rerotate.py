"""Re-rotation copy: the Triton kernel (run by Triton's CPU interpreter) against a float64 re-rotation
and against the torch reference: plain RoPE, partial rotary and YaRN; bit copies at equal positions,
values copied unchanged, untouched slots unchanged, key norms preserved under YaRN."""

from __future__ import annotations

import pytest
import torch
from helpers.triton import interpreted

from minakv.ops.rerotate import rerotate_copy, rerotate_copy_ref, rerotate_copy_triton
from minakv.ops.rope import Rope

YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0}
ROPES = {
    "plain": Rope(32, 10000.0),
    "partial": Rope(16, 10000.0),  # head_dim 32, only the first 16 dims rotate
    "yarn": Rope(32, 150000.0, YARN),
}


def random_move(dtype: torch.dtype, seed: int, layers: int = 3, slots: int = 96, n: int = 21):
    """Caches and a move of n tokens from random source slots to distinct fresh destination slots; every
    third token keeps its position (those must be copied bit for bit)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, slots, 2, 32, generator=gen).to(dtype)
    v = torch.randn(layers, slots, 2, 32, generator=gen).to(dtype)
    perm = torch.randperm(slots, generator=gen)
    src, dst = perm[:n], perm[n : 2 * n]
    old = torch.randint(0, 100_000, (n,), generator=gen)
    new = (old - torch.randint(1, 5000, (n,), generator=gen)).clamp(min=0)
    new[::3] = old[::3]
    return k, v, src, dst, old, new


def rerotate_float64(k: torch.Tensor, rope: Rope, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Independent reference: undo the scaled rotation by its inverse, apply the new one, in float64."""
    (oc, os_), (nc, ns) = [[t.double()[:, None, :] for t in rope.cos_sin(p)] for p in (old, new)]
    half = oc.shape[-1]
    y1, y2, rest = k[..., :half].double(), k[..., half : 2 * half].double(), k[..., 2 * half :].double()
    norm = oc * oc + os_ * os_
    x1, x2 = (y1 * oc + y2 * os_) / norm, (y2 * oc - y1 * os_) / norm
    return torch.cat([x1 * nc - x2 * ns, x2 * nc + x1 * ns, rest], dim=-1)


@interpreted
@pytest.mark.parametrize("rope_name", list(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rerotate_matches_float64(rope_name: str, dtype: torch.dtype) -> None:
    rope = ROPES[rope_name]
    k, v, src, dst, old, new = random_move(dtype, seed=len(rope_name))
    k_out, v_out = k.clone(), v.clone()
    rerotate_copy_triton(k_out, v_out, src, dst, old, new, rope, block_t=4)
    moved = new != old
    for layer in range(k.shape[0]):
        ref = rerotate_float64(k[layer, src], rope, old, new)
        err = (k_out[layer, dst].double() - ref)[moved].norm() / ref[moved].norm()
        assert err < (1e-6 if dtype == torch.float32 else 1e-2)
    # Equal positions: exact copy. Values: exact copy. Slots outside dst: untouched.
    assert torch.equal(k_out[:, dst[~moved]], k[:, src[~moved]])
    assert torch.equal(v_out[:, dst], v[:, src])
    untouched = torch.ones(k.shape[1], dtype=torch.bool)
    untouched[dst] = False
    assert torch.equal(k_out[:, untouched], k[:, untouched]) and torch.equal(
        v_out[:, untouched], v[:, untouched]
    )


@interpreted
def test_rerotate_preserves_norms_under_yarn() -> None:
    k, v, src, dst, old, new = random_move(torch.float32, seed=9)
    rerotate_copy_triton(k, v, src, dst, old, new, ROPES["yarn"])
    before, after = k[:, src].norm(dim=-1), k[:, dst].norm(dim=-1)
    assert ROPES["yarn"].attention_factor > 1.0  # the amplitude that a naive inverse would compound
    assert ((after - before).abs() / before).max() < 1e-5


@interpreted
def test_rerotate_in_place_and_matches_torch_reference() -> None:
    """dst == src re-rotates in place; fp32 results agree with the torch reference to rounding."""
    k, v, src, _, old, new = random_move(torch.float32, seed=4)
    k_ref, v_ref = k.clone(), v.clone()
    rerotate_copy_triton(k, v, src, src, old, new, ROPES["partial"])
    rerotate_copy_ref(k_ref, v_ref, src, src, old, new, ROPES["partial"])
    torch.testing.assert_close(k, k_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(v, v_ref)


def test_rerotate_dispatches_to_reference_on_cpu() -> None:
    k, v, src, dst, old, new = random_move(torch.float32, seed=2)
    k2, v2 = k.clone(), v.clone()
    rerotate_copy(k, v, src, dst, old, new, ROPES["yarn"])
    rerotate_copy_ref(k2, v2, src, dst, old, new, ROPES["yarn"])
    assert torch.equal(k, k2) and torch.equal(v, v2)


def test_rerotate_rejects_bad_shapes() -> None:
    k, v, src, dst, old, new = random_move(torch.float32, seed=2)
    with pytest.raises(ValueError, match="slots/positions"):
        rerotate_copy_triton(k, v, src, dst[:-1], old, new, ROPES["plain"])
    with pytest.raises(ValueError, match="rotary_dim"):
        rerotate_copy_triton(k, v, src, dst, old, new, Rope(64, 10000.0))

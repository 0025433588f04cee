"""The top-p threshold kernels (minakv/ops/top_p.py) in Triton's CPU interpreter: one program a row and the
row cut into slices give the same threshold bit for bit (the masses are summed as integers, so a seeded row
gets the same threshold alone as in a batch, whichever form its batch size takes), and both equal the sorted
reference of minakv/worker/sampler.py."""

from __future__ import annotations

import pytest
import torch
from helpers.triton import interpreted

from minakv.ops.top_p import splits_for, top_p_threshold_triton
from minakv.params import SamplingParams
from minakv.worker.sampler import SamplingTensors, top_p_threshold_sorted


@interpreted
@pytest.mark.parametrize("seed", [0])
def test_split_and_row_forms_agree_with_the_sorted_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 5, 700
    z = torch.randn(rows, vocab, generator=gen) * 3
    z[0, :20] = float("-inf")
    z[1, 5:9] = z[1].max()  # ties at the top
    z[2] = z[2].round()  # many ties everywhere
    z = z - z.amax(-1, keepdim=True)
    ps = [(0.9, -1), (0.5, 30), (0.99, -1), (1e-9, -1), (0.3, 5)]
    params = [SamplingParams(temperature=1.0, top_p=p, top_k=k) for p, k in ps]
    t = SamplingTensors.build(params, list(range(rows)), [0] * rows, "cpu")
    reference = top_p_threshold_sorted(z, t)
    k = t.top_k.clamp(min=1, max=vocab)[:, None]
    top_k = torch.where(
        (t.top_k > 0)[:, None], z.sort(-1, descending=True).values.gather(1, k - 1), -torch.inf
    )
    forms = {
        (s, w): top_p_threshold_triton(z, top_k, t.top_p, splits=s, ways=w)
        for s, w in ((1, 4), (8, 4), (16, 16))
    }
    for form, thr in forms.items():
        assert torch.equal(thr, forms[1, 4]), form
    assert torch.equal(torch.maximum(forms[1, 4], top_k), reference)


def test_splits_for() -> None:
    cpu = torch.device("cpu")  # (num_sms: 4 on the CPU)
    assert [splits_for(rows, 201088, cpu) for rows in (1, 3, 17)] == [32, 8, 1]
    assert splits_for(1, 300, cpu) == 1  # slices of at least 2,048 tokens

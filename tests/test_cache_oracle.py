"""The walk oracle on tiny models of both families, and the history dependence of docs/design.md 2.5."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.models import ARCHS, tiny_model
from helpers.programs import plan_keys

from minakv.cache.program import compile_program
from minakv.reference.dense import DenseContext
from minakv.reference.oracle import WalkOracle


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("arch", ARCHS)
def test_no_operations_equals_dense_forward(arch, dtype):
    model = tiny_model(arch, dtype, small=True)
    ids = [(5 * i + 3) % 64 for i in range(12)]
    ctx = DenseContext()
    ctx.advance(len(ids))
    with torch.inference_mode():
        ref = model.compute_logits(model(torch.tensor(ids), ctx))
    run = WalkOracle(model, compile_program([0] * 6 + [1] * 6, 2)).run(ids, max_new_tokens=3)
    torch.testing.assert_close(run.logits[:12], ref, rtol=0, atol=1e-5)  # logits are float32
    # greedy continuation: each generated token is the argmax of the previous row; logprobs match
    for j, token in enumerate(run.generated):
        row = run.logits[11 + j]
        assert token == int(row.argmax())
        assert run.logprobs[j] == pytest.approx(float(torch.log_softmax(row.double(), -1)[token]))


@pytest.mark.parametrize("arch", ARCHS)
def test_reposition_no_op_and_drop_semantics(arch):
    model = tiny_model(arch, small=True)
    owners = [0] * 4 + [1] * 4 + [2] * 4
    ids = [(7 * i + 1) % 64 for i in range(12)]
    plain = WalkOracle(model, compile_program(owners, 3)).run(ids)
    noop = WalkOracle(model, compile_program(owners, 3, None, [0, 1])).run(ids)  # nothing dropped: no-op
    assert torch.equal(plain.logits, noop.logits)
    dropped = WalkOracle(model, compile_program(owners, 3, {"1": [0]})).run(ids)
    assert torch.equal(dropped.logits[:8], plain.logits[:8])  # message 1 itself still sees message 0
    assert not torch.allclose(dropped.logits[8:], plain.logits[8:])


def test_oracle_positions_and_active_set():
    model = tiny_model("gpt_oss", small=True)
    owners = [0] * 3 + [1] * 3 + [2] * 2
    program = compile_program(owners, 3, {"1": [0]}, [1])
    oracle = WalkOracle(model, program)
    oracle.run(list(range(8)), max_new_tokens=1)
    assert oracle.active == [3, 4, 5, 6, 7, 8]
    assert [oracle.position[t] for t in oracle.active] == [0, 1, 2, 3, 4, 5]
    assert [oracle.position[t] for t in range(3)] == [0, 1, 2]  # dropped tokens keep their last position
    assert [oracle.position[t] for t in oracle.active] == program.active_before(8)[1].tolist() + [5]
    k, v = oracle.kv(0, [3])
    raw_k, raw_v = oracle.raw_kv(0, [3])
    assert torch.equal(v, raw_v) and not torch.equal(k, raw_k)


# -- docs/design.md 2.5 (acceptance 2) ------------------------------------------------------------------------

A, B, C = [11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]
HISTORIES = {
    1: ([0] * 4 + [1] * 4 + [2] * 4, 3, {"2": [0]}, A + B + C),  # append A, B, C, drop A
    2: ([0] * 4 + [1] * 4 + [2] * 4, 3, {"1": [0]}, A + B + C),  # append A, B, drop A, append C
    3: ([0] * 4 + [1] * 4, 2, None, B + C),  # append B, C
}


def test_three_histories_have_three_keys_for_c():
    keys = {}
    for h, (owners, n, drop, ids) in HISTORIES.items():
        keys[h] = plan_keys(compile_program(owners, n, drop), ids, page_size=4)[1]
    assert len({keys[h][-1].key for h in keys}) == 3  # C's page
    assert keys[1][:2] == keys[2][:2]  # (1) and (2) share A and B (A is dropped after B either way)
    assert keys[1][0].dropped and not keys[1][1].dropped
    assert keys[3][0].key != keys[1][1].key  # B after A is not B alone


@pytest.mark.parametrize("arch", ARCHS)
def test_three_histories_give_different_kv(arch):
    model = tiny_model(arch, small=True)
    kv = {}
    for h, (owners, n, drop, ids) in HISTORIES.items():
        oracle = WalkOracle(model, compile_program(owners, n, drop))
        oracle.run(ids)
        c = list(range(len(ids) - 4, len(ids)))
        b = list(range(len(ids) - 8, len(ids) - 4))
        kv[h] = {
            name: [oracle.kv(layer, toks) for layer in range(len(model.layers))]
            for name, toks in (("B", b), ("C", c))
        }

    def differ(x, y):  # at the last layer, where every earlier attention has had its effect
        return not torch.allclose(x[-1][0], y[-1][0], atol=1e-6) and not torch.allclose(x[-1][1], y[-1][1])

    assert (
        differ(kv[1]["C"], kv[2]["C"]) and differ(kv[1]["C"], kv[3]["C"]) and differ(kv[2]["C"], kv[3]["C"])
    )
    assert differ(kv[1]["B"], kv[3]["B"]) and differ(kv[2]["B"], kv[3]["B"])
    for layer in range(len(model.layers)):  # B is computed identically in (1) and (2)
        assert torch.equal(kv[1]["B"][layer][0], kv[2]["B"][layer][0])


def test_oracle_rejects_prompt_of_other_length():
    with pytest.raises(ValueError, match="prompt has 3 tokens"):
        WalkOracle(tiny_model("minimax_m2", small=True), compile_program([0, 0], 1)).run([1, 2, 3])


def test_positions_of_generated_tokens_follow_next_pos():
    program = compile_program([0, 0, 1, 1], 2, {1: [0]}, [1])
    oracle = WalkOracle(tiny_model("minimax_m2", small=True), program)
    oracle.run([1, 2, 3, 4], max_new_tokens=2)
    assert (
        [oracle.position[t] for t in (4, 5)] == program.birth_positions(np.array([4, 5])).tolist() == [2, 3]
    )

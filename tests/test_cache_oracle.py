"""The walk oracle on tiny models of both families, and the history dependence of docs/design.md 2.5.

Also home of the tiny-model helpers the other cache tests import.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minakv.cache.keys import page_keys
from minakv.cache.program import compile_program
from minakv.model import ModelConfig, build_model
from minakv.reference.dense import DenseContext
from minakv.reference.oracle import WalkOracle

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0}  # fmt: skip


def tiny_config(arch: str, windows: list[int | None] | None = None) -> ModelConfig:
    """GPT-OSS: YaRN, sinks, 3 layers with a sliding window of 3 positions on the even ones (so the last
    layer's K/V depend on a full-attention layer). MiniMax-M2: partial rotary (half of each head), qk-norm,
    3 full-attention layers (with 2, a dropped prefix could only show in K/V through positions)."""
    gpt = arch == "gpt_oss"
    windows = windows or ([3, None, 3] if gpt else [None, None, None])
    return ModelConfig(
        arch=arch, vocab_size=64, hidden_size=32, num_layers=len(windows), num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=16, num_experts=4, experts_per_tok=2, rms_norm_eps=1e-6, max_position_embeddings=512,
        rope_theta=10000.0, rotary_dim=8 if gpt else 4, rope_scaling=YARN if gpt else None,
        layer_windows=windows, sinks=gpt, attention_bias=gpt,
        qk_norm=not gpt, swiglu_limit=7.0, swiglu_alpha=1.702, tie_word_embeddings=False,
    )  # fmt: skip


def tiny_model(arch: str, dtype: torch.dtype = torch.float64, windows: list[int | None] | None = None):
    model = build_model(tiny_config(arch, windows), device="cpu", dtype=dtype, seed=1)
    with torch.no_grad():  # sharper attention than the 0.02 init, so history differences show
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
            if layer.self_attn.sinks is not None:
                layer.self_attn.sinks.normal_(0, 1)
    return model


ARCHS = ["gpt_oss", "minimax_m2"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: intra-op threads only cost (index_add_ in the MoE is ~10x slower with 2 threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("arch", ARCHS)
def test_no_operations_equals_dense_forward(arch, dtype):
    model = tiny_model(arch, dtype)
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
    model = tiny_model(arch)
    owners = [0] * 4 + [1] * 4 + [2] * 4
    ids = [(7 * i + 1) % 64 for i in range(12)]
    plain = WalkOracle(model, compile_program(owners, 3)).run(ids)
    noop = WalkOracle(model, compile_program(owners, 3, None, [0, 1])).run(ids)  # nothing dropped: no-op
    assert torch.equal(plain.logits, noop.logits)
    dropped = WalkOracle(model, compile_program(owners, 3, {"1": [0]})).run(ids)
    assert torch.equal(dropped.logits[:8], plain.logits[:8])  # message 1 itself still sees message 0
    assert not torch.allclose(dropped.logits[8:], plain.logits[8:])


def test_oracle_positions_and_active_set():
    model = tiny_model("gpt_oss")
    owners = [0] * 3 + [1] * 3 + [2] * 2
    program = compile_program(owners, 3, {"1": [0]}, [1])
    oracle = WalkOracle(model, program)
    oracle.run(list(range(8)), max_new_tokens=1)
    assert oracle.active == [3, 4, 5, 6, 7, 8]
    assert [oracle.position[t] for t in oracle.active] == [0, 1, 2, 3, 4, 5]
    assert [oracle.position[t] for t in range(3)] == [0, 1, 2]  # dropped tokens keep their last position
    assert [oracle.position[t] for t in oracle.active] == program.final_positions.tolist() + [5]
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
        program = compile_program(owners, n, drop)
        keys[h] = page_keys(program, ids, page_size=4)
    c = {h: keys[h][-1] for h in keys}
    assert len({c[h].exact for h in c}) == 3 and len({c[h].agnostic for h in c}) == 3
    assert keys[1][0] == keys[2][0] and keys[1][1] == keys[2][1]  # (1) and (2) share A and B
    assert keys[1][0].dropped and not keys[1][1].dropped
    assert keys[3][0].exact != keys[1][1].exact  # B after A is not B alone


@pytest.mark.parametrize("arch", ARCHS)
def test_three_histories_give_different_kv(arch):
    model = tiny_model(arch)
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
        WalkOracle(tiny_model("minimax_m2"), compile_program([0, 0], 1)).run([1, 2, 3])


def test_positions_of_generated_tokens_follow_next_pos():
    program = compile_program([0, 0, 1, 1], 2, {1: [0]}, [1])
    oracle = WalkOracle(tiny_model("minimax_m2"), program)
    oracle.run([1, 2, 3, 4], max_new_tokens=2)
    assert (
        [oracle.position[t] for t in (4, 5)] == program.birth_positions(np.array([4, 5])).tolist() == [2, 3]
    )

"""The checkpoint loader: config spellings, sharding, dtypes, where a model comes from, and the errors
for checkpoints that do not fit (each must name the tensor)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from helpers.checkpoints import quantise_checkpoint, rel_err, save_hf

from minakv.model import load_model
from minakv.model.loader import CheckpointError, resolve_path
from minakv.reference.dense import DenseContext, generate_greedy


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loader")
    dirs = {arch: save_hf(arch, root / arch, seed=3) for arch in ("gpt_oss", "minimax_m2")}
    dirs["minimax_m2_fp8"] = quantise_checkpoint(dirs["minimax_m2"], root / "minimax_m2_fp8")
    return dirs


def logits(path: Path, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    model = load_model(path, device="cpu", dtype=dtype)
    ids = torch.arange(3, 20)
    ctx = DenseContext()
    ctx.advance(len(ids))
    with torch.no_grad():
        return model.compute_logits(model(ids, ctx))


def edit_copy(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    """A copy of a single-file checkpoint with its tensors and/or config.json edited in place."""
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def shard(src: Path, dst: Path, parts: int = 3) -> Path:
    """Split a single-file checkpoint round-robin over `parts` files plus model.safetensors.index.json."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for p in range(parts):
        file = f"model-{p + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[p::parts]}
        save_file(chunk, dst / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def test_both_rope_spellings_give_the_same_model(tiny: dict[str, Path], tmp_path: Path) -> None:
    def old_spelling(config: dict) -> None:  # transformers 4.x / real checkpoints: rope_theta + rope_scaling
        params = config.pop("rope_parameters")
        config["rope_theta"] = params.pop("rope_theta")
        config["rope_scaling"] = params

    old = edit_copy(tiny["gpt_oss"], tmp_path / "old", edit_config=old_spelling)
    assert "rope_scaling" in json.loads((old / "config.json").read_text())
    a, b = load_model(tiny["gpt_oss"], device="cpu"), load_model(old, device="cpu")
    assert a.rope.attention_factor == b.rope.attention_factor > 1.0  # YaRN kept in both
    assert torch.equal(a.rope.inv_freq, b.rope.inv_freq)
    assert torch.equal(logits(tiny["gpt_oss"]), logits(old))


@pytest.mark.parametrize("which", ["gpt_oss", "minimax_m2_fp8"])
def test_sharded_checkpoint_loads(tiny: dict[str, Path], tmp_path: Path, which: str) -> None:
    sharded = shard(tiny[which], tmp_path / "sharded")
    assert torch.equal(logits(sharded), logits(tiny[which]))


def test_dtypes(tiny: dict[str, Path]) -> None:
    model = load_model(tiny["gpt_oss"], device="cpu")
    assert model.embed_tokens.weight.dtype == torch.float32  # cpu default
    model = load_model(tiny["gpt_oss"], device="cpu", dtype=torch.bfloat16)
    layer = model.layers[0]
    assert layer.self_attn.q_proj.weight.dtype == torch.bfloat16
    assert layer.mlp.experts.gate_up.dtype == torch.bfloat16
    # as transformers keeps them: GPT-OSS norms in fp32; sinks and the MiniMax correction bias in fp32.
    assert layer.input_layernorm.weight.dtype == model.norm.weight.dtype == torch.float32
    assert layer.self_attn.sinks.dtype == torch.float32
    m2 = load_model(tiny["minimax_m2"], device="cpu", dtype=torch.bfloat16)
    assert m2.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    assert m2.layers[0].self_attn.q_norm.weight.dtype == torch.bfloat16
    assert m2.layers[0].mlp.e_score_correction_bias.dtype == torch.float32
    # bf16 is no further from the fp32 reference than transformers' own bf16 (tiny random models are
    # chaotic in bf16: router choices flip, so both are several percent off).
    ref = logits(tiny["gpt_oss"])
    low = logits(tiny["gpt_oss"], torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny["gpt_oss"], dtype=torch.bfloat16).eval()
    with torch.no_grad():
        hf_low = hf(torch.arange(3, 20)[None]).logits[0].float()
    assert low.dtype == torch.float32
    assert rel_err(low, ref) < 1.5 * rel_err(hf_low, ref) + 0.01


def test_missing_tensor_is_named(tiny: dict[str, Path], tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    bad = edit_copy(tiny["gpt_oss"], tmp_path / "bad", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"
    ):
        load_model(bad, device="cpu")


def test_missing_expert_is_named(tiny: dict[str, Path], tmp_path: Path) -> None:
    name = "model.layers.2.block_sparse_moe.experts.5.w3.weight"
    bad = edit_copy(tiny["minimax_m2"], tmp_path / "bad", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"experts\.5\.w3\.weight"):
        load_model(bad, device="cpu")


def test_unexpected_tensor_is_named(tiny: dict[str, Path], tmp_path: Path) -> None:
    def add(t: dict) -> None:
        t["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(2, 2)

    bad = edit_copy(tiny["gpt_oss"], tmp_path / "bad", edit_tensors=add)
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.0\.self_attn\.extra_proj"):
        load_model(bad, device="cpu")


def test_shape_mismatch_is_named(tiny: dict[str, Path], tmp_path: Path) -> None:
    name = "model.layers.0.mlp.experts.down_proj"

    def shrink(t: dict) -> None:
        t[name] = t[name][:, :, :-1].contiguous()

    bad = edit_copy(tiny["gpt_oss"], tmp_path / "bad", edit_tensors=shrink)
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.0\.mlp\.experts\.down_proj': expected shape \(8, 32, 64\), got \(8, 32, 63\)",
    ):
        load_model(bad, device="cpu")


def test_fp8_weight_without_scale_is_named(tiny: dict[str, Path], tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    bad = edit_copy(tiny["minimax_m2_fp8"], tmp_path / "bad", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'model\.layers\.0\.self_attn\.o_proj\.weight_scale_inv'"
    ):
        load_model(bad, device="cpu")


def test_unknown_architecture(tiny: dict[str, Path], tmp_path: Path) -> None:
    def llama(config: dict) -> None:
        config["architectures"], config["model_type"] = ["LlamaForCausalLM"], "llama"

    bad = edit_copy(tiny["gpt_oss"], tmp_path / "bad", edit_config=llama)
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        load_model(bad, device="cpu")


def test_shard_index_pointing_to_a_missing_file(tiny: dict[str, Path], tmp_path: Path) -> None:
    sharded = shard(tiny["gpt_oss"], tmp_path / "sharded")
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors"):
        load_model(sharded, device="cpu")


def test_where_models_come_from(tiny: dict[str, Path], tmp_path: Path) -> None:
    """Directories, built-in presets (minakv.presets) and clear errors for anything else."""
    assert resolve_path(tiny["gpt_oss"]) == tiny["gpt_oss"]
    model = load_model("tiny-minimax-m2", device="cpu")
    assert model.config.arch == "minimax_m2" and len(generate_greedy(model, [5, 6, 7], 3, stop_ids=[])) == 3
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")


def test_tied_embeddings(tmp_path: Path) -> None:
    """A tied checkpoint has no lm_head tensor; the model shares the embedding and matches transformers."""
    torch.manual_seed(0)
    config = transformers.MiniMaxM2Config(
        num_hidden_layers=1, hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=256, rotary_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    transformers.MiniMaxM2ForCausalLM(config).save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = load_model(tmp_path, device="cpu")
    assert model.lm_head.weight is model.embed_tokens.weight
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.arange(3, 20)[None]).logits[0]
    assert rel_err(logits(tmp_path), ref) < 1e-4

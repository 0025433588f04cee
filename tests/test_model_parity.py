"""Parity of minakv's GPT-OSS and MiniMax-M2 with transformers' own implementations.

Tiny models are built and initialised by transformers, the parameters transformers starts at 0 or 1
(expert and attention biases, correction bias, norm weights) and the tiny sinks are re-randomised so every
term matters, and the weights go through `save_pretrained`. minakv loads the same files; logits must
agree to 1e-4 relative error (||ours - ref|| / ||ref||) in float32 on CPU: prompts shorter and longer than
the sliding window, then 16 decode steps against transformers' KV cache. The same again for MXFP4
(GPT-OSS) and FP8 (MiniMax-M2) checkpoints written with minakv's quantisers and loaded by both sides.

The builders here are reused by tests/test_loader.py.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from minakv.model import load_model
from minakv.model.quant import quantize_fp8_block, quantize_mxfp4
from minakv.reference.dense import DenseContext, generate_greedy

WINDOW = 5
TOL = 1e-4


def gpt_oss_config() -> transformers.GptOssConfig:
    return transformers.GptOssConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=256,
        sliding_window=WINDOW, max_position_embeddings=131072, initializer_range=0.2,
        layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def minimax_config() -> transformers.MiniMaxM2Config:
    # hidden 256 / intermediate 128 give FP8 scale grids larger than 1x1. The partial rotary is given in
    # both spellings: older transformers 5.x read only rope_parameters' partial_rotary_factor.
    return transformers.MiniMaxM2Config(
        num_hidden_layers=3, hidden_size=256, intermediate_size=128, head_dim=32, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=256, rotary_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    """Give a random value to what transformers initialises to a constant."""
    gen = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("inv_freq"):
            continue
        noise = torch.randn(t.shape, generator=gen)
        if "norm" in name:
            t.copy_(1.0 + 0.3 * noise)
        elif name.endswith(("bias", "sinks")):
            t.copy_(0.5 * noise)
        elif name.endswith("experts.gate_up_proj") and t.dim() == 3:
            t.mul_(5.0)  # GPT-OSS: push gate/up past the swiglu limit (7) so both clamps act


def save_hf(arch: str, path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    if arch == "gpt_oss":
        model = transformers.GptOssForCausalLM(gpt_oss_config())
    else:
        model = transformers.MiniMaxM2ForCausalLM(minimax_config())
    randomise(model, seed)
    model.save_pretrained(path)
    return path


def quantise_checkpoint(src: Path, dst: Path) -> Path:
    """Rewrite a saved tiny model in its family's real quantised format (models.md 3.3)."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    if config["model_type"] == "gpt_oss":
        for name, t in tensors.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(t.transpose(1, 2))
            else:
                out[name] = t
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
            ],
        }  # fmt: skip
    else:
        for name, t in tensors.items():
            if name.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")):
                out[name], out[name + "_scale_inv"] = quantize_fp8_block(t)
            else:
                out[name] = t
        config["quantization_config"] = {
            "quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128], "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
        }  # fmt: skip
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    dirs = {arch: save_hf(arch, root / arch) for arch in ("gpt_oss", "minimax_m2")}
    dirs["gpt_oss_mxfp4"] = quantise_checkpoint(dirs["gpt_oss"], root / "gpt_oss_mxfp4")
    dirs["minimax_m2_fp8"] = quantise_checkpoint(dirs["minimax_m2"], root / "minimax_m2_fp8")
    return dirs


def load_hf(path: Path) -> torch.nn.Module:
    """transformers' model in float32 on CPU. Quantised checkpoints are dequantised (on a CPU-only box
    transformers does that anyway; with a GPU present it would pick its own quantised kernels)."""
    quant = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    extra = {}
    if quant.get("quant_method") == "mxfp4":
        extra["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    elif quant.get("quant_method") == "fp8":
        extra["quantization_config"] = transformers.FineGrainedFP8Config(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", device_map="cpu", **extra
    )
    # Some 5.x versions keep dequantised MXFP4 experts in bf16 whatever `dtype` says; the values are
    # exact in bf16, so casting up is lossless and makes the reference compute in fp32.
    return model.float().eval()


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).norm() / ref.double().norm())


@torch.no_grad()
def compare(path: Path, prompt_len: int, decode_steps: int = 16, seed: int = 1) -> list[float]:
    """Relative logit errors: the prefill, then each teacher-forced decode step."""
    ref_model, ours = load_hf(path), load_model(path, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 256, (prompt_len + decode_steps,), generator=gen)
    prompt, rest = tokens[:prompt_len], tokens[prompt_len:]

    # transformers renamed `past_key_values` to `cache` during 5.x; use whichever this version has.
    key = "cache" if "cache" in inspect.signature(ref_model.forward).parameters else "past_key_values"
    ref = ref_model(prompt[None], use_cache=True)
    cache = ref[key]
    ctx = DenseContext()
    ctx.advance(prompt_len)
    errors = [rel_err(ours.compute_logits(ours(prompt, ctx)), ref.logits[0])]
    for token in rest:
        ref = ref_model(token.view(1, 1), use_cache=True, **{key: cache})
        cache = ref[key]
        ctx.advance(1)
        errors.append(rel_err(ours.compute_logits(ours(token.view(1), ctx)), ref.logits[0]))
    return errors


CASES = [
    ("gpt_oss", WINDOW - 2),  # prompt inside the window
    ("gpt_oss", 3 * WINDOW + 1),  # prompt longer than the window
    ("gpt_oss_mxfp4", 3 * WINDOW + 1),
    ("minimax_m2", 4),
    ("minimax_m2", 19),
    ("minimax_m2_fp8", 19),
]


@pytest.mark.parametrize(("which", "prompt_len"), CASES)
def test_logits_match_transformers(checkpoints: dict[str, Path], which: str, prompt_len: int) -> None:
    errors = compare(checkpoints[which], prompt_len)
    assert len(errors) == 17
    assert max(errors) < TOL, f"{which}: relative logit errors {errors}"


def test_quantised_checkpoints_differ_from_the_originals(checkpoints: dict[str, Path]) -> None:
    """The quantised fixtures really are quantised (their logits move), so their parity test means something."""
    for plain, quant in (("gpt_oss", "gpt_oss_mxfp4"), ("minimax_m2", "minimax_m2_fp8")):
        a = load_model(checkpoints[plain], device="cpu", dtype=torch.float32)
        b = load_model(checkpoints[quant], device="cpu", dtype=torch.float32)
        ids = torch.arange(3, 15)
        logits = []
        for m in (a, b):
            ctx = DenseContext()
            ctx.advance(len(ids))
            logits.append(m.compute_logits(m(ids, ctx)))
        assert rel_err(logits[1], logits[0]) > 1e-3


def test_layer_windows_follow_layer_types(checkpoints: dict[str, Path]) -> None:
    model = load_model(checkpoints["gpt_oss"], device="cpu")
    assert [spec.window for spec in model.attention_layers] == [WINDOW, None, None, WINDOW]
    assert all(spec.sinks is not None for spec in model.attention_layers)
    m2 = load_model(checkpoints["minimax_m2"], device="cpu")
    assert m2.rope.rotary_dim == 16 and all(s.window is None and s.sinks is None for s in m2.attention_layers)


@torch.no_grad()
def test_generate_greedy_matches_transformers_generate(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["gpt_oss"]
    ref_model = load_hf(path)
    prompt = [5, 17, 99, 42, 7, 200, 13, 64, 3]
    ref = ref_model.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    ours = generate_greedy(load_model(path, device="cpu"), prompt, 12, stop_ids=[])
    assert ours == ref[0, len(prompt) :].tolist()

"""The tiny-checkpoint builder: same seed -> same bytes; every variant loads in transformers (the reference)
and in minakv with equal logits; the chat templates render each family's format (GPT-OSS checked token by
token against openai-harmony); presets build once, also under concurrent processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from minakv.presets import PRESETS, resolve_model
from minakv.presets.tiny import build_tiny

transformers = pytest.importorskip("transformers")
from helpers.checkpoints import load_hf  # (after the skip: it imports transformers)

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the weather in Paris today?"},
]


def files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("preset,quant", [("tiny-minimax-m2", "fp8"), ("tiny-gpt-oss", None)])
def test_same_seed_same_bytes(tmp_path: Path, preset: str, quant: str | None):
    a = files(build_tiny(preset, tmp_path / "a", seed=3, quant=quant))
    b = files(build_tiny(preset, tmp_path / "b", seed=3, quant=quant))
    assert a == b
    if preset == "tiny-minimax-m2":  # the small one: a different seed gives different weights
        c = files(build_tiny(preset, tmp_path / "c", seed=4, quant=quant))
        assert a["model.safetensors"] != c["model.safetensors"] and a["tokenizer.json"] == c["tokenizer.json"]
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(a)


def test_bad_arguments(tmp_path: Path):
    with pytest.raises(ValueError, match="unknown tiny preset"):
        build_tiny("tiny-llama", tmp_path)
    with pytest.raises(ValueError, match="mxfp4"):
        build_tiny("tiny-gpt-oss", tmp_path, quant="fp8")
    with pytest.raises(ValueError, match="fp8"):
        build_tiny("tiny-minimax-m2", tmp_path, quant="mxfp4")


@pytest.mark.parametrize("name", list(PRESETS))
def test_loads_in_transformers_and_minakv(tiny_dir, name: str):
    from minakv.model import load_model
    from minakv.reference.dense import DenseContext

    path = tiny_dir(name)
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.model_type == {"tiny-gpt-oss": "gpt_oss", "tiny-minimax-m2": "minimax_m2"}[PRESETS[name][0]]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    ref_model = load_hf(path)  # (quantised checkpoints dequantised, as transformers does on a CPU-only box)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]

    model = load_model(path, device="cpu", dtype=torch.float32)
    ctx = DenseContext()
    ctx.advance(len(ids))
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor(ids), ctx))
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    # Peaked but not saturated logits: greedy decoding has something to choose.
    assert 1.0 < ref.std().item() < 20.0
    assert len(set(ref.argmax(-1).tolist())) > len(ids) // 3


@pytest.mark.parametrize("name", ["tiny-gpt-oss", "tiny-minimax-m2-fp8"])
def test_everything_is_exercised(tiny_dir, name: str):
    """Biases, sinks, norm weights and the routing correction bias are not at their trivial init values,
    and quantised tensors have the real dtypes."""
    path = tiny_dir(name)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    for key, t in tensors.items():
        if key.endswith(("_bias", ".bias", "sinks", "correction_bias")):
            assert t.float().abs().min() > 0 or t.float().abs().mean() > 0.01, key
        if "norm" in key:
            assert (t.float() - 1).abs().max() > 0.01, key
    if name == "tiny-minimax-m2-fp8":
        w = tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight"]
        assert w.dtype == torch.float8_e4m3fn
        assert tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (
            2,
            2,
        )  # a real 128-block grid
        assert tensors["model.layers.0.block_sparse_moe.e_score_correction_bias"].dtype == torch.float32
    else:
        assert tensors["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 128)
        assert tensors["model.layers.0.mlp.experts.down_proj"].shape == (8, 64, 64)


def test_gpt_oss_generation_config_and_stop_tokens(tiny_dir):
    from minakv.text.tokenizer import Tokenizer

    path = tiny_dir("tiny-gpt-oss")
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [200002, 199999, 200012]
    tok = Tokenizer.from_dir(path)
    assert tok.vocab_size == 201088
    assert set(tok.eos_token_ids) == {200002, 199999, 200012}


def test_gpt_oss_template_matches_harmony(tiny_dir, monkeypatch: pytest.MonkeyPatch):
    harmony = pytest.importorskip("openai_harmony")
    from minakv.text.tokenizer import o200k_tiktoken_file

    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(o200k_tiktoken_file().parent))
    enc = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    M, R = harmony.Message, harmony.Role
    reference = [
        M.from_role_and_content(R.USER, "Weather in Paris?"),
        M.from_role_and_content(R.ASSISTANT, "I should call the tool.").with_channel("analysis"),
        M.from_role_and_content(R.ASSISTANT, '{"city": "Paris"}')
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
        M.from_author_and_content(harmony.Author.new(R.TOOL, "functions.get_weather"), '{"temp": 20}')
        .with_channel("commentary")
        .with_recipient("assistant"),
        M.from_role_and_content(R.ASSISTANT, "It is 20 C.").with_channel("final"),
        M.from_role_and_content(R.USER, "Thanks! And tomorrow?"),
        M.from_role_and_content(R.ASSISTANT, "Call again.").with_channel("analysis"),
    ]
    expected = enc.render_conversation_for_completion(
        harmony.Conversation.from_messages(reference), R.ASSISTANT
    )
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "I should call the tool.", "tool_calls": [call]},
        {"role": "tool", "content": '{"temp": 20}'},  # named after the call
        {"role": "assistant", "content": "It is 20 C."},
        {"role": "user", "content": "Thanks! And tomorrow?"},
        {"role": "assistant", "reasoning_content": "Call again."},
    ]
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir("tiny-gpt-oss"))
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.decode(ids) == enc.decode_utf8(expected)
    assert ids == expected


def test_minimax_template_format(tiny_dir):
    path = tiny_dir("tiny-minimax-m2")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        *CHAT,
        {"role": "assistant", "reasoning_content": "use the tool", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "20 C"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text == (
        "]~!b[]~b]system\nBe brief.\n<tools><tool>"
        + json.dumps(tools[0], ensure_ascii=False)
        + "</tool></tools>[e~[\n"
        "]~b]user\nWhat is the weather in Paris today?[e~[\n"
        ']~b]ai\n<think>use the tool</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>[e~[\n'
        "]~b]tool\n20 C[e~[\n"
        "]~b]ai\n<think>\n"
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for special in ("]~!b[", "]~b]", "[e~[", "<think>", "</think>", "<minimax:tool_call>"):
        assert tok.convert_tokens_to_ids(special) in ids, special
    assert tok.decode(ids) == text
    config = json.loads((path / "config.json").read_text())
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("[e~[")
    assert config["vocab_size"] == len(tok) < 1000


def test_presets_build_once_even_concurrently(tmp_path: Path):
    env_code = "from minakv.presets import resolve_model; print(resolve_model('tiny-minimax-m2-fp8'))"
    env = {**__import__("os").environ, "MINAKV_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", env_code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1]
    built = Path(outs[0])
    assert (built / "config.json").is_file() and built.parent == tmp_path / "presets"
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no temp folders left behind
    assert resolve_model(str(built)) == built  # a local directory resolves to itself


def test_resolve_model_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        resolve_model(tmp_path / "missing")

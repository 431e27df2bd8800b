"""Checkpoints saved in FP8 (compressed-tensors' ``float-quantized`` format, transformers' ``fp8``
format) load as FP8 without the ``quantization`` option; every other quantization is refused with
the formats that load, and nothing is dequantized to the model's dtype.

The checkpoints are written here the way llm-compressor and transformers write them: the
projections' weights in float8_e4m3fn beside their scales (``weight_scale``: [out, 1] per channel
or one value per tensor; transformers' ``weight_scale_inv``), everything else as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import char_tokenizer, rel_err, tiny_llama
from safetensors.torch import save_file
from test_fp8 import INPUT, LOGITS_TOLERANCE, PROJECTIONS, fp8_layers
from torch import nn

from loramux import LoRARequest, SamplingParams
from loramux.engine.llm import LLM
from loramux.engine.worker.model_loader import load_model
from loramux.engine.quantization import Fp8Linear, quantize_model
from loramux.errors import QuantizationError

FP8_MAX = 448.0


def compressed_tensors(strategy: str = "channel", **group) -> dict:
    """llm-compressor's FP8_DYNAMIC scheme (``strategy="tensor"``: one weight scale per tensor)."""
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                  "dynamic": True},
            "output_activations": None, **group}},
        "ignore": ["lm_head"], "kv_cache_scheme": None,
    }


#: transformers' FineGrainedFP8Config with per-tensor scales
TRANSFORMERS_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None,
                    "modules_to_not_convert": ["lm_head"]}
FORMATS = {
    "compressed-tensors-channel": (compressed_tensors("channel"), "weight_scale", False),
    "compressed-tensors-tensor": (compressed_tensors("tensor"), "weight_scale", True),
    "transformers-fp8": (TRANSFORMERS_FP8, "weight_scale_inv", True),
}


def write_fp8_checkpoint(directory: Path, quantization_config: dict, scale_name: str = "weight_scale",
                         per_tensor: bool = False, extra: dict | None = None) -> dict[str, torch.Tensor]:
    """The tiny Llama saved in FP8 into ``directory``; returns the projections' FP8 weights as
    floats times their scales (what the loaded layers must stand for), by layer name."""
    model = tiny_llama()
    tensors, expected = {}, {}
    for key, tensor in model.state_dict().items():
        layer, _, kind = key.rpartition(".")
        if kind != "weight" or layer.rpartition(".")[2] not in PROJECTIONS:
            tensors[key] = tensor.contiguous()
            continue
        amax = tensor.abs().max() if per_tensor else tensor.abs().amax(dim=1, keepdim=True)  # [] or [out, 1]
        scale = (amax / FP8_MAX).float()
        tensors[key] = (tensor / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        # compressed-tensors keeps a per-tensor scale as [1], transformers as a scalar
        tensors[f"{layer}.{scale_name}"] = scale.reshape(1) if per_tensor and scale_name == "weight_scale" else scale
        expected[layer] = tensors[key].float() * scale
    tensors.update(extra or {})
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))
    char_tokenizer().save_pretrained(directory)
    return expected


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("fp8-checkpoints")
    return {name: (root / name, write_fp8_checkpoint(root / name, config, scale_name, per_tensor))
            for name, (config, scale_name, per_tensor) in FORMATS.items()}


@pytest.mark.parametrize("name", FORMATS)
def test_a_checkpoint_saved_in_fp8_loads_as_fp8_without_the_flag(checkpoints, name):
    directory, expected = checkpoints[name]
    model, tokenizer = load_model(directory)
    assert tokenizer is not None
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert sorted(layers) == sorted(expected)  # every projection, and only those
    for layer_name, layer in layers.items():
        assert torch.equal(layer.dequantize(), expected[layer_name]), layer_name
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32  # never FP8
    with torch.no_grad():
        assert rel_err(model(INPUT).logits, tiny_llama()(INPUT).logits) < LOGITS_TOLERANCE


def test_a_channel_checkpoint_round_trips_to_the_model_quantized_at_load(checkpoints):
    """Saving per-channel FP8 (as llm-compressor does) and loading it gives exactly the layers
    that quantizing the unquantized model at load gives."""
    loaded, _ = load_model(checkpoints["compressed-tensors-channel"][0])
    quantized = tiny_llama()
    quantize_model(quantized)
    for (name, a), (_, b) in zip(loaded.state_dict().items(), quantized.state_dict().items(), strict=True):
        assert torch.equal(a.float(), b.float()) and a.dtype == b.dtype, name
    with torch.no_grad():
        assert torch.equal(loaded(INPUT).logits, quantized(INPUT).logits)


def test_an_fp8_checkpoint_serves_adapters_as_the_model_quantized_at_load(checkpoints, engine_adapters, tmp_path):
    tiny_llama().save_pretrained(tmp_path / "bf16")
    char_tokenizer().save_pretrained(tmp_path / "bf16")
    request = LoRARequest("all", 1, str(engine_adapters["all"]))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
    outputs = []
    for model, quantization in ((checkpoints["compressed-tensors-channel"][0], None), (tmp_path / "bf16", "fp8")):
        llm = LLM(str(model), quantization=quantization, max_loras=1, max_lora_rank=8, max_model_len=64)
        assert len(fp8_layers(llm.llm_engine.model)) == 8  # fused q/k/v and gate/up, o, down
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=[None, request],
                                                                     use_tqdm=False)])
    assert outputs[0] == outputs[1]
    assert outputs[0][0] != outputs[0][1]


def test_random_weights_quantized_as_they_are_made_equal_the_model_quantized_after(tmp_path):
    """``load_format="dummy"`` with FP8 makes each projection and quantizes it in turn (the
    unquantized model never exists whole), from the same seeded values."""
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({**tiny_llama().config.to_dict(), "quantization_config": TRANSFORMERS_FP8}))
    made, _ = load_model(str(config), load_format="dummy")  # an FP8 model's config: FP8 without the flag
    expected, _ = load_model(_plain(tmp_path), load_format="dummy")
    quantize_model(expected)
    assert len(fp8_layers(made)) == 14
    for (name, a), (_, b) in zip(made.state_dict().items(), expected.state_dict().items(), strict=True):
        assert torch.equal(a.float(), b.float()), name
    flagged, _ = load_model(_plain(tmp_path), load_format="dummy", quantization="fp8")
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(flagged.state_dict().values(),
                                                                 made.state_dict().values()))


def _plain(tmp_path: Path) -> str:
    path = tmp_path / "plain.json"
    path.write_text(json.dumps(tiny_llama().config.to_dict()))
    return str(path)


# -- what is refused ---------------------------------------------------------------------------------

SUPPORTED = r"loads FP8 checkpoints saved as 'compressed-tensors' in the 'float-quantized' format .* and 'fp8'"
REFUSED_CONFIGS = {
    "block-wise transformers": ({**TRANSFORMERS_FP8, "weight_block_size": [128, 128]},
                                r"block-wise FP8 scales \(weight_block_size \[128, 128\]\)"),
    "static transformers": ({**TRANSFORMERS_FP8, "activation_scheme": "static"}, "activation_scheme 'static'"),
    "block-wise compressed-tensors": (compressed_tensors("block"), "block-wise weight scales"),
    "group-wise compressed-tensors": (compressed_tensors("group"), "'group' weight scales"),
    "static activations": (compressed_tensors(input_activations={"num_bits": 8, "type": "float", "strategy": "tensor",
                                                                 "dynamic": False}),
                           "strategy 'tensor', dynamic False; loramux quantizes activations dynamically, per token"),
    "weight-only": (compressed_tensors(input_activations=None), r"quantizes weights only \(no input_activations\)"),
    "int8": ({**compressed_tensors(), "format": "int-quantized"}, "has format 'int-quantized'"),
    "kv cache": ({**compressed_tensors(), "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "KV cache"),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quant_method 'gptq', which loramux cannot run"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
}


@pytest.mark.parametrize("case", REFUSED_CONFIGS)
def test_a_quantization_loramux_cannot_run_is_refused_naming_it_and_the_supported_formats(case, tmp_path):
    config, reason = REFUSED_CONFIGS[case]
    write_fp8_checkpoint(tmp_path / case, config)
    with pytest.raises(QuantizationError, match=f"{reason}.*{SUPPORTED}.*quantization='fp8'") as caught:
        LLM(str(tmp_path / case))
    assert str(tmp_path / case) in str(caught.value)
    with pytest.raises(QuantizationError, match=reason):  # asking for FP8 does not read it otherwise
        LLM(str(tmp_path / case), quantization="fp8")


REFUSED_TENSORS = {
    "a missing scale": (dict(scale_name="scale"), r"layer 'model\.layers\.\d\.[a-z_.]+' has an FP8 weight but no "
                                                  "weight_scale"),
    "block-wise scales": (dict(extra={"model.layers.0.mlp.down_proj.weight_scale": torch.ones(2, 4)}),
                          r"down_proj': weight_scale is \[2, 4\] for a weight of \[32, 64\]: block-wise or group-wise"),
    "a static activation scale": (dict(extra={"model.layers.1.mlp.up_proj.input_scale": torch.ones(1)}),
                                  r"up_proj' has a static activation scale \(input_scale\)"),
}


@pytest.mark.parametrize("case", REFUSED_TENSORS)
def test_a_tensor_outside_the_format_is_refused_and_the_next_load_works(case, tmp_path, checkpoints):
    options, reason = REFUSED_TENSORS[case]
    write_fp8_checkpoint(tmp_path / "bad", compressed_tensors(), **options)
    with pytest.raises(QuantizationError, match=reason):
        load_model(tmp_path / "bad")
    assert not nn.Linear(4, 4).weight.is_meta  # the meta-device loading is over
    model, _ = load_model(checkpoints["compressed-tensors-channel"][0])
    assert len(fp8_layers(model)) == 14


def test_a_config_that_says_fp8_over_unquantized_weights_is_refused(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": compressed_tensors()}))
    with pytest.raises(QuantizationError, match="quantization_config says 'compressed-tensors', but none of its "
                                                "weights is float8_e4m3fn. Remove quantization_config"):
        load_model(tmp_path)


def test_serve_stops_at_start_with_the_reason(tmp_path, capsys):
    from loramux.cli import main

    write_fp8_checkpoint(tmp_path, REFUSED_CONFIGS["block-wise transformers"][0])
    assert main(["serve", str(tmp_path), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert f"loramux: error: ({tmp_path}): its config.json's quantization_config has block-wise FP8 scales" in err

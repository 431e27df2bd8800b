"""Checkpoints saved in FP8: which formats load, and loading one straight into `Fp8Linear` layers.

A model dir whose ``config.json`` holds a ``quantization_config`` loads as that quantization, or
not at all: nothing is dequantized to the model's dtype behind the user's back. Supported, as
vLLM reads them (the scheme `Fp8Linear` runs: FP8 e4m3 weights, dynamic per-token activations):

- ``quant_method: "compressed-tensors"`` (llm-compressor's output), format ``float-quantized``:
  every ``config_groups`` entry with 8-bit float symmetric weights of ``strategy`` ``channel`` or
  ``tensor`` and ``input_activations`` 8-bit float, ``dynamic: true``, ``strategy: "token"``;
  tensors ``<layer>.weight`` (float8_e4m3fn) and ``<layer>.weight_scale`` ([out, 1] or one value);
- ``quant_method: "fp8"`` (transformers' ``FineGrainedFP8Config``) with ``weight_block_size: null``
  and ``activation_scheme: "dynamic"``: ``<layer>.weight`` and a per-tensor ``weight_scale_inv``
  (the multiplier, despite its name: ``W = weight * weight_scale_inv``).

A per-tensor scale becomes a per-channel one of equal entries (the same products). Refused, with
the reason: block-wise or group-wise weight scales (e.g. ``weight_block_size: [128, 128]``),
static or per-tensor activation scales, weight-only FP8, an FP8 KV cache, every other method.

Loading reads the safetensors files tensor by tensor into a model whose parameters start on the
meta device: an FP8 layer is built from its FP8 weight and scale as they are read, so the model
never exists in its unquantized dtype, on the device or off it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from loramux.engine.quantization.fp8 import Fp8Linear, check_fp8_device, has_fp8_layers
from loramux.errors import QuantizationError

__all__ = ["SUPPORTED_CHECKPOINTS", "Fp8Checkpoint", "checkpoint_format", "load_fp8_checkpoint",
           "parameters_on_meta"]

SUPPORTED_CHECKPOINTS = (
    "'compressed-tensors' in the 'float-quantized' format (FP8 weights with channel or tensor scales, "
    "dynamic per-token activations) and 'fp8' (transformers' FP8 format with per-tensor scales: "
    "weight_block_size null, activation_scheme 'dynamic')"
)
_FIX = ("Serve the unquantized (bf16/fp16) checkpoint, with quantization='fp8' (--quantization fp8) to "
        "quantize it as it loads.")
_FP8_SAFETENSORS_DTYPE = "F8_E4M3"


@dataclass(frozen=True)
class Fp8Checkpoint:
    """A supported FP8 checkpoint format: ``method`` (its ``quant_method``) and the name of the
    tensor holding each layer's weight scale."""

    method: str
    scale_name: str


def checkpoint_format(quantization_config, source) -> Fp8Checkpoint | None:
    """The format of a checkpoint whose config holds ``quantization_config`` (None: not quantized).

    :raises QuantizationError: a method or an option loramux cannot run, naming it and what is
        supported.
    """
    if quantization_config is None:
        return None
    config = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    method = config.get("quant_method")

    def refuse(problem: str) -> QuantizationError:
        return QuantizationError(f"its config.json's quantization_config {problem}; loramux loads FP8 checkpoints "
                                 f"saved as {SUPPORTED_CHECKPOINTS}.", path=source, fix=_FIX)

    if method == "compressed-tensors":
        _check_compressed_tensors(config, refuse)
        return Fp8Checkpoint(method, "weight_scale")
    if method == "fp8":
        if config.get("weight_block_size") is not None:
            raise refuse(f"has block-wise FP8 scales (weight_block_size {config['weight_block_size']}), "
                         "which loramux does not run")
        if str(config.get("activation_scheme", "dynamic")).lower() != "dynamic":
            raise refuse(f"has activation_scheme {config['activation_scheme']!r}; loramux quantizes activations "
                         "dynamically, per token")
        if config.get("scale_fmt", "float") != "float":
            raise refuse(f"has scale_fmt {config['scale_fmt']!r}, not float32 scales")
        return Fp8Checkpoint(method, "weight_scale_inv")
    raise refuse(f"has quant_method {method!r}, which loramux cannot run")


def _check_compressed_tensors(config: dict, refuse) -> None:
    groups = config.get("config_groups") or {}
    if not groups:
        raise refuse("(compressed-tensors) has no config_groups")
    if config.get("kv_cache_scheme"):
        raise refuse("quantizes the KV cache (kv_cache_scheme), which loramux keeps in the model's dtype")
    for name, group in groups.items():
        where = f"(compressed-tensors) group {name!r}"
        fmt = group.get("format") or config.get("format")
        if fmt != "float-quantized":
            raise refuse(f"{where} has format {fmt!r}")
        weights = group.get("weights") or {}
        if (weights.get("num_bits"), weights.get("type")) != (8, "float") or weights.get("symmetric") is False:
            raise refuse(f"{where} has {weights.get('num_bits')}-bit {weights.get('type')} weights "
                         f"(symmetric: {weights.get('symmetric')}), not symmetric FP8")
        strategy = weights.get("strategy")
        if strategy not in ("channel", "tensor"):
            kind = "block-wise" if strategy == "block" else f"{strategy!r}"
            raise refuse(f"{where} has {kind} weight scales (strategy {strategy!r}); loramux runs 'channel' "
                         "and 'tensor' scales")
        activations = group.get("input_activations")
        if activations is None:
            raise refuse(f"{where} quantizes weights only (no input_activations); loramux runs FP8 weights "
                         "with FP8 activations")
        if ((activations.get("num_bits"), activations.get("type")) != (8, "float")
                or activations.get("dynamic") is not True or activations.get("strategy") != "token"):
            raise refuse(f"{where} has input_activations {activations.get('num_bits')}-bit "
                         f"{activations.get('type')}, strategy {activations.get('strategy')!r}, dynamic "
                         f"{activations.get('dynamic')!r}; loramux quantizes activations dynamically, per token")
        if group.get("output_activations"):
            raise refuse(f"{where} quantizes output activations")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within it, every parameter a module registers is moved to the meta device (nothing is kept
    for it), while buffers are made as usual: a model built here has its computed buffers (rotary
    frequencies) and no weights, which are then loaded or made one tensor at a time."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@torch.no_grad()
def load_fp8_checkpoint(source, checkpoint: Fp8Checkpoint, dtype: torch.dtype,
                        device: torch.device) -> nn.Module:
    """The causal LM in ``source`` (a dir or a Hugging Face model id), its FP8 layers as
    `Fp8Linear`, everything else in ``dtype``, on ``device``, in eval mode.

    :raises QuantizationError: ``device`` has no FP8, or a tensor does not fit the format (a
        missing or block-wise scale, a static activation scale), or no weight is in FP8.
    :raises ValueError: the checkpoint's tensors do not match the model its config describes.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    check_fp8_device(device)
    config = AutoConfig.from_pretrained(source)
    del config.quantization_config  # the layers are built here, not by a transformers quantizer
    with torch.device(device), no_init_weights(), parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    files = _safetensors_files(source)
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt", device="cpu")) for f in files]
        where = {key: handle for handle in handles for key in handle.keys()}  # tensor name -> its file
        read: set[str] = set()
        for key, handle in where.items():
            if key.endswith(".weight") and handle.get_slice(key).get_dtype() == _FP8_SAFETENSORS_DTYPE:
                read |= _load_fp8_layer(model, key.removesuffix(".weight"), where, checkpoint, dtype, device, source)
        unexpected = [key for key in where if key not in read and not _load_tensor(model, key, where[key], dtype,
                                                                                   device, source)]
    model.tie_weights()
    missing = [name for name, param in model.named_parameters() if param.is_meta]
    if unexpected or missing:
        problems = [f"tensors its {type(model).__name__} does not have: {', '.join(unexpected[:6])}"] if unexpected else []
        problems += [f"weights missing from it: {', '.join(missing[:6])}"] if missing else []
        raise ValueError(f"{source}: the checkpoint does not match the model its config.json describes ("
                         f"{'; '.join(problems)}).")
    if not has_fp8_layers(model):
        raise QuantizationError(
            f"its config.json's quantization_config says {checkpoint.method!r}, but none of its weights is "
            "float8_e4m3fn.", path=source,
            fix="Remove quantization_config from config.json to load the weights as they are, or save FP8 weights.")
    return model.eval()


def _safetensors_files(source) -> list[Path]:
    path = Path(source)
    if not path.is_dir():  # a Hugging Face model id
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(source), allow_patterns=["*.safetensors", "*.safetensors.index.json"]))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise QuantizationError("holds no safetensors weights; FP8 checkpoints load from safetensors only.",
                                path=path, fix=_FIX)
    return files


def _load_fp8_layer(model: nn.Module, name: str, where: dict, checkpoint: Fp8Checkpoint, dtype: torch.dtype,
                    device: torch.device, source) -> set[str]:
    """Read layer ``name``'s FP8 weight, scale and bias into an `Fp8Linear` in its place; the
    tensor names read."""
    scale_key = f"{name}.{checkpoint.scale_name}"
    if scale_key not in where:
        raise QuantizationError(f"layer {name!r} has an FP8 weight but no {checkpoint.scale_name}.", path=source,
                                fix=_FIX)
    for static in ("input_scale", "activation_scale"):
        if f"{name}.{static}" in where:
            raise QuantizationError(f"layer {name!r} has a static activation scale ({static}); loramux quantizes "
                                    "activations dynamically, per token.", path=source, fix=_FIX)
    module = _submodule(model, name)
    if type(module) is not nn.Linear:
        found = "no such layer" if module is None else f"a {type(module).__name__}"
        raise ValueError(f"{source}: the checkpoint's FP8 tensor {name}.weight is for {found} of its "
                         f"{type(model).__name__}; FP8 weights load into linear projections only.")
    weight = where[f"{name}.weight"].get_tensor(f"{name}.weight")
    if tuple(weight.shape) != (module.out_features, module.in_features):
        raise ValueError(f"{source}: {name}.weight is {list(weight.shape)}, but the model's layer is "
                         f"[{module.out_features}, {module.in_features}].")
    scale = where[scale_key].get_tensor(scale_key)
    if scale.numel() not in (1, module.out_features):
        raise QuantizationError(
            f"layer {name!r}: {checkpoint.scale_name} is {list(scale.shape)} for a weight of "
            f"{list(weight.shape)}: block-wise or group-wise scales, which loramux does not run (it runs one "
            "scale per output channel or per tensor).", path=source, fix=_FIX)
    scale = scale.float().reshape(-1).expand(module.out_features).contiguous()
    bias_key = f"{name}.bias"
    bias = where[bias_key].get_tensor(bias_key).to(device) if bias_key in where else None
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, Fp8Linear(weight.to(device), scale.to(device), bias, dtype))
    return {f"{name}.weight", scale_key, bias_key}


def _load_tensor(model: nn.Module, key: str, handle, dtype: torch.dtype, device: torch.device, source) -> bool:
    """Read tensor ``key`` into the parameter or persistent buffer it names (floats in ``dtype``);
    False when the model has no such tensor. A non-persistent buffer (an old checkpoint's rotary
    frequencies) keeps the value the model computed."""
    module_name, _, attr = key.rpartition(".")
    module = _submodule(model, module_name)
    if module is None:
        return False
    if attr in module._non_persistent_buffers_set:
        return True
    if attr not in module._parameters and attr not in module._buffers:
        return False
    tensor = handle.get_tensor(key)
    current = module._parameters.get(attr, module._buffers.get(attr))
    if current is not None and tuple(current.shape) != tuple(tensor.shape):
        raise ValueError(f"{source}: {key} is {list(tensor.shape)}, but the model's is {list(current.shape)}.")
    tensor = tensor.to(device, dtype if tensor.is_floating_point() else None)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[attr] = tensor
    return True


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None

"""Loading a PEFT LoRA adapter directory into a validated `LoRAAdapter`.

Follows PEFT's semantics: ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``),
``rank_pattern`` / ``alpha_pattern`` matched per module exactly as PEFT matches them, embedding
LoRA through ``lora_embedding_A/B``. Anything PEFT can save that loramux cannot apply faithfully
is refused by name rather than silently ignored.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from functools import partial
from os import PathLike
from pathlib import Path

import torch

from loramux.errors import AdapterNotFoundError, IncompatibleAdapterError, InvalidAdapterError
from loramux.registry.adapter import LoRAAdapter, LoRAModuleWeights
from loramux.registry.config import LoRAConfig
from loramux.registry.handle import combine_digest, config_digest
from loramux.registry.weights_io import all_finite, parse_safetensors, read_and_hash, read_pickle

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "PICKLE_FILE",
    "SAFETENSORS_FILE",
    "load_adapter",
    "load_adapter_with_digest",
]

ADAPTER_CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

# PEFT config fields that change what a LoRA computes; when set, loramux refuses the adapter.
_UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA bias terms (lora_bias)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "layer_replication": "layer replication (layer_replication)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
    "use_qalora": "QALoRA (use_qalora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "megatron_config": "Megatron parallel layers (megatron_config)",
}

# base_model.model.<module>.lora_A[.<adapter>].weight, or <module>.lora_embedding_A[.<adapter>]
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+?)\."
    r"(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?:\.(?!weight$)[^.]+)?(?:\.weight)?$"
)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's ``get_pattern_key``: the first pattern that matches a dotted suffix of ``module``."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _read_config(directory: Path, name: str) -> dict:
    config_file = directory / ADAPTER_CONFIG_FILE
    if not config_file.is_file():
        raise InvalidAdapterError(
            f"{ADAPTER_CONFIG_FILE} is missing.",
            adapter=name,
            path=config_file,
            fix="Save the adapter with PEFT's save_pretrained(), which writes it.",
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidAdapterError(
            f"{ADAPTER_CONFIG_FILE} cannot be read as JSON ({error}).",
            adapter=name,
            path=config_file,
            fix="Re-save the adapter with PEFT's save_pretrained().",
        ) from error
    if not isinstance(config, dict):
        raise InvalidAdapterError(
            f"{ADAPTER_CONFIG_FILE} must hold a JSON object.", adapter=name, path=config_file
        )
    return config


def _check_supported(config: dict, name: str, config_file: Path) -> None:
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise InvalidAdapterError(
            f"peft_type is {config.get('peft_type')!r}; loramux serves LoRA adapters only.",
            adapter=name,
            path=config_file,
            fix="Use an adapter trained with peft.LoraConfig.",
        )
    if config.get("bias", "none") != "none":
        raise InvalidAdapterError(
            f"bias={config['bias']!r} is not supported (only 'none').",
            adapter=name,
            path=config_file,
            fix="Retrain with LoraConfig(bias='none').",
        )
    for field, feature in _UNSUPPORTED_FEATURES.items():
        if config.get(field):
            raise InvalidAdapterError(
                f"{feature} is not supported.",
                adapter=name,
                path=config_file,
                fix=f"Retrain or re-save the adapter without {field}, or merge it into the base model.",
            )
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise InvalidAdapterError(
                f"{field}={value!r} in the config; it must be a positive number.",
                adapter=name,
                path=config_file,
            )


def _check_base_model(config: dict, expected: str, name: str, config_file: Path) -> None:
    trained_for = config.get("base_model_name_or_path")
    if not trained_for:
        return
    # A local checkout and a Hub id of the same model share their last path component.
    same = trained_for == expected or Path(trained_for).name == Path(expected).name
    if not same:
        raise IncompatibleAdapterError(
            f"it was trained for base model {trained_for!r}, not {expected!r}.",
            adapter=name,
            path=config_file,
            fix="Serve it with the model it was trained for, or fix base_model_name.",
        )


def _read_tensors(
    directory: Path, name: str, *, pin_memory: bool
) -> tuple[dict[str, torch.Tensor], Path, Callable[[], bytes]]:
    """The weights file's tensors (views into one buffer read once), its path, and a function
    returning its digest (still being computed: call it last)."""
    safetensors_file = directory / SAFETENSORS_FILE
    pickle_file = directory / PICKLE_FILE
    allocate = partial(torch.empty, dtype=torch.uint8, pin_memory=pin_memory)
    if safetensors_file.is_file():
        try:
            buffer, digest = read_and_hash(safetensors_file, allocate)
            return parse_safetensors(buffer), safetensors_file, digest
        except (OSError, ValueError) as error:
            raise InvalidAdapterError(
                f"the weights file is corrupt or truncated ({error}).",
                adapter=name,
                path=safetensors_file,
                fix="Download or save the adapter again.",
            ) from error
    if pickle_file.is_file():
        try:
            buffer, digest = read_and_hash(pickle_file, allocate)
            # weights_only=True refuses any pickle that would run code: nothing in it executes.
            tensors = read_pickle(buffer)
        except Exception as error:
            raise InvalidAdapterError(
                f"refused to load {PICKLE_FILE}: it is not a plain tensor file ({error}).",
                adapter=name,
                path=pickle_file,
                fix="Convert it to adapter_model.safetensors (PEFT saves safetensors by default).",
            ) from error
        if not isinstance(tensors, dict) or not all(
            isinstance(t, torch.Tensor) for t in tensors.values()
        ):
            raise InvalidAdapterError(
                f"{PICKLE_FILE} must hold a dict of tensors.", adapter=name, path=pickle_file
            )
        if pin_memory:
            tensors = {key: tensor.pin_memory() for key, tensor in tensors.items()}
        return tensors, pickle_file, digest
    raise InvalidAdapterError(
        f"no weights: neither {SAFETENSORS_FILE} nor {PICKLE_FILE} is present.",
        adapter=name,
        path=directory,
        fix="Save the adapter with PEFT's save_pretrained().",
    )


def _group_by_module(
    tensors: dict[str, torch.Tensor], name: str, weights_file: Path
) -> dict[str, dict[str, torch.Tensor]]:
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if key.endswith(".base_layer.weight"):
            # PEFT saves the base embedding beside an embedding LoRA (save_embedding_layers);
            # it is the base model's own weight, which loramux never replaces.
            continue
        match = _KEY.match(key)
        if match is None:
            raise InvalidAdapterError(
                f"unexpected tensor {key!r}: not a LoRA A/B weight (DoRA magnitudes, biases and "
                "saved modules are not supported).",
                adapter=name,
                path=weights_file,
            )
        grouped.setdefault(match["module"], {})[match["kind"]] = tensor
    if not grouped:
        raise InvalidAdapterError(
            "the weights file holds no LoRA tensors.", adapter=name, path=weights_file
        )
    return grouped


def _module_weights(
    module: str, parts: dict[str, torch.Tensor], config: dict, name: str, weights_file: Path
) -> LoRAModuleWeights:
    is_embedding = "lora_embedding_A" in parts or "lora_embedding_B" in parts
    a_key, b_key = ("lora_embedding_A", "lora_embedding_B") if is_embedding else ("lora_A", "lora_B")
    if a_key not in parts or b_key not in parts:
        missing = a_key if a_key not in parts else b_key
        raise InvalidAdapterError(
            f"module {module!r} has no {missing} tensor.", adapter=name, path=weights_file
        )
    lora_a, lora_b = parts[a_key], parts[b_key]
    rank = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
    if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] != rank or lora_b.shape[1] != rank:
        raise InvalidAdapterError(
            f"module {module!r}: {a_key} is {tuple(lora_a.shape)} and {b_key} is "
            f"{tuple(lora_b.shape)}, but the config says rank {rank} "
            f"(expected [{rank}, in] and [out, {rank}]).",
            adapter=name,
            path=weights_file,
            fix="The weights and adapter_config.json disagree; re-save the adapter.",
        )
    if not (lora_a.is_floating_point() and lora_b.is_floating_point()):
        raise InvalidAdapterError(
            f"module {module!r}: LoRA weights must be floating point, got {lora_a.dtype}.",
            adapter=name,
            path=weights_file,
        )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoRAModuleWeights(lora_a.contiguous(), lora_b.contiguous(), float(scaling), is_embedding)


def load_adapter(
    path: str | PathLike[str],
    config: LoRAConfig | None = None,
    *,
    name: str | None = None,
    base_model_name: str | None = None,
    pin_memory: bool = False,
) -> LoRAAdapter:
    """Load and validate the PEFT LoRA adapter saved in directory ``path``.

    :param path: a directory holding ``adapter_config.json`` and ``adapter_model.safetensors``
        (or ``adapter_model.bin``, loaded with ``torch.load(weights_only=True)`` only).
    :param config: bounds to check against (``max_lora_rank``) and the dtype to cast to.
    :param name: the adapter's name in error messages and in the result; defaults to the
        directory's name.
    :param base_model_name: when given, the adapter must have been trained for this model.
    :param pin_memory: put the weights in page-locked memory (needs CUDA): read straight into
        it when no cast is asked for, else cast into it, so it costs no extra copy.
    :returns: the adapter, in host memory.
    :raises AdapterNotFoundError: ``path`` is not a directory.
    :raises InvalidAdapterError: the files are missing, corrupt, unsafe or unsupported.
    :raises IncompatibleAdapterError: the rank exceeds ``config.max_lora_rank`` or the base
        model differs.
    """
    return load_adapter_with_digest(
        path, config, name=name, base_model_name=base_model_name, pin_memory=pin_memory
    )[0]


def load_adapter_with_digest(
    path: str | PathLike[str],
    config: LoRAConfig | None = None,
    *,
    name: str | None = None,
    base_model_name: str | None = None,
    pin_memory: bool = False,
) -> tuple[LoRAAdapter, str]:
    """:func:`load_adapter`, and the adapter's content digest (see :mod:`loramux.registry.handle`)
    computed from the bytes as they were read: the files are read once."""
    directory = Path(path)
    name = name or directory.name
    if not directory.is_dir():
        raise AdapterNotFoundError(
            "no adapter directory at this path.",
            adapter=name,
            path=directory,
            fix="Check the path; it must be a directory saved by PEFT's save_pretrained().",
        )
    peft_config = _read_config(directory, name)
    config_file = directory / ADAPTER_CONFIG_FILE
    _check_supported(peft_config, name, config_file)
    if base_model_name:
        _check_base_model(peft_config, base_model_name, name, config_file)
    cast_to = config.torch_dtype if config is not None else None
    # Read straight into page-locked memory unless a cast makes a new copy anyway.
    tensors, weights_file, weights_digest = _read_tensors(
        directory, name, pin_memory=pin_memory and cast_to is None
    )
    modules = {
        module: _module_weights(module, parts, peft_config, name, weights_file)
        for module, parts in _group_by_module(tensors, name, weights_file).items()
    }
    _check_finite(modules, name, weights_file)
    adapter = LoRAAdapter(
        name=name,
        path=directory,
        modules=modules,
        lora_alpha=peft_config["lora_alpha"],
        target_modules=peft_config.get("target_modules") or [],
        base_model_name=peft_config.get("base_model_name_or_path"),
        peft_config=peft_config,
    )
    if config is not None and adapter.rank > config.max_lora_rank:
        raise IncompatibleAdapterError(
            f"its rank is {adapter.rank}, above max_lora_rank={config.max_lora_rank}.",
            adapter=name,
            path=config_file,
            fix=f"Raise max_lora_rank (--max-lora-rank) to at least {adapter.rank}.",
        )
    if cast_to is not None or _held_bytes(adapter) > _WASTE_FACTOR * adapter.nbytes + 4096:
        # a cast copies anyway; and a file that also holds tensors loramux skips (PEFT saves the
        # base embedding beside an embedding LoRA) must not keep its whole read buffer alive
        adapter = adapter.pack(cast_to, pin_memory=pin_memory)
    digest = combine_digest(config_digest(peft_config, cast_to), weights_digest())
    return adapter, digest


_WASTE_FACTOR = 1.25


def _held_bytes(adapter: LoRAAdapter) -> int:
    """Bytes of host memory the adapter's tensors keep alive (their distinct storages)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for w in adapter.modules.values()
        for t in (w.lora_a, w.lora_b)
    }
    return sum(storages.values())


def _check_finite(modules: dict[str, LoRAModuleWeights], name: str, weights_file: Path) -> None:
    tensors = [t for weights in modules.values() for t in (weights.lora_a, weights.lora_b)]
    if all_finite(tensors):
        return
    bad = next(m for m, w in modules.items() if not all_finite([w.lora_a, w.lora_b]))
    raise InvalidAdapterError(
        f"module {bad!r}: the weights contain NaN or infinity.", adapter=name, path=weights_file
    )

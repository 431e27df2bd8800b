"""Loading a PEFT LoRA adapter directory into a validated `LoRAAdapter`.

Follows PEFT's semantics: ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``),
``rank_pattern`` / ``alpha_pattern`` matched per module exactly as PEFT matches them, embedding
LoRA through ``lora_embedding_A/B``. Anything PEFT can save that loramux cannot apply faithfully
is refused by name rather than silently ignored.
"""

from __future__ import annotations

import json
import math
import time
import re
from collections.abc import Callable
from os import PathLike
from pathlib import Path
from typing import NamedTuple

import torch

from loramux.errors import AdapterNotFoundError, IncompatibleAdapterError, InvalidAdapterError
from loramux.registry.adapter import LoRAAdapter, LoRAModuleWeights
from loramux.registry.config import LoRAConfig
from loramux.registry.handle import combine_digest, config_digest
from loramux.registry.host_memory import PAGEABLE, PINNED_EACH_LOAD, HostMemory, release_frames
from loramux.registry.weights_io import (
    SafetensorsLayout,
    advise_read,
    all_finite,
    read_and_hash,
    read_pickle,
    read_safetensors,
    spans_finite,
)

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


class _Weights(NamedTuple):
    """A weights file, read: its tensors, where they came from, and its digest (still being
    computed: call it last)."""

    tensors: dict[str, torch.Tensor]
    file: Path
    digest: Callable[[], bytes]
    buffer: torch.Tensor | None  # the read buffer the tensors are views of (None: a pickle's own tensors)
    layout: SafetensorsLayout | None
    finite: Callable[[], bool] | None = None  # True: every float in the file is finite (safetensors)


def _read_tensors(directory: Path, name: str, allocate: Callable[[int], torch.Tensor]) -> _Weights:
    """The weights file read once into ``allocate(its size)``; safetensors' tensors are views into
    that buffer."""
    safetensors_file = directory / SAFETENSORS_FILE
    pickle_file = directory / PICKLE_FILE
    if safetensors_file.is_file():
        try:
            read = read_safetensors(safetensors_file, allocate)
            return _Weights(read.tensors, safetensors_file, read.digest, read.buffer, read.layout, read.finite)
        except (OSError, ValueError) as error:
            raise InvalidAdapterError(
                f"the weights file is corrupt or truncated ({error}).",
                adapter=name,
                path=safetensors_file,
                fix="Download or save the adapter again.",
            ) from error
    if pickle_file.is_file():
        digest = None
        try:
            buffer, digest = read_and_hash(pickle_file, PAGEABLE.allocate)  # torch.load copies out of it
            # weights_only=True refuses any pickle that would run code: nothing in it executes.
            tensors = read_pickle(buffer)
        except Exception as error:
            _settle(digest)
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
        return _Weights(tensors, pickle_file, digest, None, None)
    raise InvalidAdapterError(
        f"no weights: neither {SAFETENSORS_FILE} nor {PICKLE_FILE} is present.",
        adapter=name,
        path=directory,
        fix="Save the adapter with PEFT's save_pretrained().",
    )


def _settle(digest: Callable[[], bytes] | None) -> None:
    """Wait for a read's hash threads (they hold its buffer), so a failed load lets it go at once."""
    if digest is not None:
        digest()


class _ModulePlan(NamedTuple):
    """What a weights file means under a config: per module, the keys of its A and B, its
    scaling and kind; the byte runs of the tensors kept (for the finite check); their bytes.

    It depends only on the file's layout and the config's scaling fields, so for safetensors it is
    made once per (layout, config) and kept with the layout: a load of an adapter of a kind seen
    before does no per-tensor checks, only builds its views.
    """

    modules: tuple[tuple[str, str, str, float, bool], ...]  # (module, A key, B key, scaling, is_embedding)
    spans: tuple[tuple[torch.dtype, int, int], ...]  # (dtype, begin, end) in the read buffer
    nbytes: int


_PLANS_PER_LAYOUT = 16


def _module_plan(weights: _Weights, peft_config: dict, config_key: bytes, name: str) -> _ModulePlan:
    layout = weights.layout
    plans = layout.derived.setdefault("loader", {}) if layout is not None else {}
    plan = plans.get(config_key)
    if plan is not None:
        return plan
    modules = tuple(
        _module_entry(module, parts, weights.tensors, peft_config, name, weights.file)
        for module, parts in _group_by_module(weights.tensors, name, weights.file).items()
    )
    kept = {key for _, a_key, b_key, _, _ in modules for key in (a_key, b_key)}
    nbytes = sum(weights.tensors[key].nbytes for key in kept)
    plan = _ModulePlan(modules, layout.runs(kept) if layout is not None else (), nbytes)
    if layout is not None:
        if len(plans) >= _PLANS_PER_LAYOUT:
            plans.clear()
        plans[config_key] = plan
    return plan


def _group_by_module(
    tensors: dict[str, torch.Tensor], name: str, weights_file: Path
) -> dict[str, dict[str, str]]:
    """Module -> {kind (lora_A, ...): tensor key}."""
    grouped: dict[str, dict[str, str]] = {}
    for key in tensors:
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
        grouped.setdefault(match["module"], {})[match["kind"]] = key
    if not grouped:
        raise InvalidAdapterError(
            "the weights file holds no LoRA tensors.", adapter=name, path=weights_file
        )
    return grouped


def _module_entry(
    module: str, parts: dict[str, str], tensors: dict[str, torch.Tensor], config: dict, name: str,
    weights_file: Path,
) -> tuple[str, str, str, float, bool]:
    is_embedding = "lora_embedding_A" in parts or "lora_embedding_B" in parts
    a_kind, b_kind = ("lora_embedding_A", "lora_embedding_B") if is_embedding else ("lora_A", "lora_B")
    if a_kind not in parts or b_kind not in parts:
        missing = a_kind if a_kind not in parts else b_kind
        raise InvalidAdapterError(
            f"module {module!r} has no {missing} tensor.", adapter=name, path=weights_file
        )
    lora_a, lora_b = tensors[parts[a_kind]], tensors[parts[b_kind]]
    rank = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
    # a layer's LoRA is [r, in] and [out, r]; a convolution's carries its kernel after those
    # ([r, in, *kernel], [out, r, 1, ...]), which the layer's wrapper maps (`adapter_matrices`)
    if lora_a.dim() < 2 or lora_b.dim() < 2 or lora_a.shape[0] != rank or lora_b.shape[1] != rank:
        raise InvalidAdapterError(
            f"module {module!r}: {a_kind} is {tuple(lora_a.shape)} and {b_kind} is "
            f"{tuple(lora_b.shape)}, but the config says rank {rank} "
            f"(expected [{rank}, in, ...] and [out, {rank}, ...]).",
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
    return module, parts[a_kind], parts[b_kind], float(scaling), is_embedding


def load_adapter(
    path: str | PathLike[str],
    config: LoRAConfig | None = None,
    *,
    name: str | None = None,
    base_model_name: str | None = None,
    pin_memory: bool = False,
    host_memory: HostMemory | None = None,
) -> LoRAAdapter:
    """Load and validate the PEFT LoRA adapter saved in directory ``path``.

    :param path: a directory holding ``adapter_config.json`` and ``adapter_model.safetensors``
        (or ``adapter_model.bin``, loaded with ``torch.load(weights_only=True)`` only).
    :param config: bounds to check against (``max_lora_rank``) and the dtype to cast to.
    :param name: the adapter's name in error messages and in the result; defaults to the
        directory's name.
    :param base_model_name: when given, the adapter must have been trained for this model.
    :param pin_memory: put the weights in page-locked memory allocated for this load (needs
        CUDA): read straight into it when no cast is asked for, else cast into it, so it costs no
        extra copy.
    :param host_memory: where to put the weights instead (a
        :class:`~loramux.registry.page_locked_arena.PageLockedArena`, say); overrides ``pin_memory``.
    :returns: the adapter, in host memory: every tensor a view of one buffer from ``host_memory``.
    :raises AdapterNotFoundError: ``path`` is not a directory.
    :raises InvalidAdapterError: the files are missing, corrupt, unsafe or unsupported.
    :raises IncompatibleAdapterError: the rank exceeds ``config.max_lora_rank`` or the base
        model differs.
    """
    return load_adapter_with_digest(
        path, config, name=name, base_model_name=base_model_name, pin_memory=pin_memory, host_memory=host_memory
    )[0]


def load_adapter_with_digest(
    path: str | PathLike[str],
    config: LoRAConfig | None = None,
    *,
    name: str | None = None,
    base_model_name: str | None = None,
    pin_memory: bool = False,
    host_memory: HostMemory | None = None,
    stages: dict[str, float] | None = None,
) -> tuple[LoRAAdapter, str]:
    """:func:`load_adapter`, and the adapter's content digest (see :mod:`loramux.registry.handle`)
    computed from the bytes as they were read: the files are read once.

    :param stages: if given, receives the seconds of each stage of the load (for benchmarks):
        ``read`` (the config and the weights file, into host memory), ``checks`` (the tensors'
        names, shapes and ranks, and the wait for the finite scan run beside the read) and
        ``digest_wait`` (what is left of the content hash after them).
    """
    memory = host_memory or (PINNED_EACH_LOAD if pin_memory else PAGEABLE)
    try:
        return _load(Path(path), config, name or Path(path).name, base_model_name, memory, stages)
    except BaseException as error:
        release_frames(error)  # the failed load's buffer goes back now, not when the error is dropped
        raise


def _load(directory: Path, config: LoRAConfig | None, name: str, base_model_name: str | None,
          memory: HostMemory, stages: dict[str, float] | None = None) -> tuple[LoRAAdapter, str]:
    started = time.perf_counter()
    if not directory.is_dir():
        raise AdapterNotFoundError(
            "no adapter directory at this path.",
            adapter=name,
            path=directory,
            fix="Check the path; it must be a directory saved by PEFT's save_pretrained().",
        )
    # both files' disk reads start now, the small config's first: the weights stream in while it is parsed
    advise_read(directory / ADAPTER_CONFIG_FILE, directory / SAFETENSORS_FILE)
    peft_config = _read_config(directory, name)
    config_file = directory / ADAPTER_CONFIG_FILE
    _check_supported(peft_config, name, config_file)
    if base_model_name:
        _check_base_model(peft_config, base_model_name, name, config_file)
    cast_to = config.torch_dtype if config is not None else None
    # Read straight into the adapter's host memory unless a cast makes a new copy anyway.
    weights = _read_tensors(directory, name, (memory if cast_to is None else PAGEABLE).allocate)
    read = time.perf_counter()
    settings = config_digest(peft_config, cast_to)
    try:
        adapter = _checked_adapter(directory, config, name, peft_config, settings, memory, weights)
    except BaseException:
        _settle(weights.digest)
        raise
    checked = time.perf_counter()
    digest = combine_digest(settings, weights.digest())
    if stages is not None:
        stages.update(read=read - started, checks=checked - read, digest_wait=time.perf_counter() - checked)
    return adapter, digest


def _checked_adapter(directory: Path, config: LoRAConfig | None, name: str, peft_config: dict, settings: bytes,
                     memory: HostMemory, weights: _Weights) -> LoRAAdapter:
    """The adapter ``weights`` hold, checked, in one buffer of ``memory`` (``settings``: the
    config's `config_digest`)."""
    config_file = directory / ADAPTER_CONFIG_FILE
    cast_to = config.torch_dtype if config is not None else None
    plan = _module_plan(weights, peft_config, settings, name)
    tensors = weights.tensors
    modules = {module: LoRAModuleWeights(tensors[a_key], tensors[b_key], scaling, is_embedding)
               for module, a_key, b_key, scaling, is_embedding in plan.modules}
    _check_finite(modules, weights, plan, name)
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
    buffer = weights.buffer
    if cast_to is not None or buffer is None or buffer.numel() > _WASTE_FACTOR * plan.nbytes + 4096:
        # one buffer of `memory` holding just the weights: a cast copies anyway, a pickle's tensors
        # are torch.load's own, and a file that also holds tensors loramux skips (PEFT saves the base
        # embedding beside an embedding LoRA) must not keep its whole read buffer alive
        adapter = adapter.pack(cast_to, allocate=memory.allocate)
    return adapter


_WASTE_FACTOR = 1.25


def _check_finite(modules: dict[str, LoRAModuleWeights], weights: _Weights, plan: _ModulePlan, name: str) -> None:
    if weights.finite is not None and weights.finite():  # scanned while read: nothing to do
        return
    if weights.buffer is not None:
        finite = spans_finite(weights.buffer, plan.spans)
    else:
        finite = all_finite([t for w in modules.values() for t in (w.lora_a, w.lora_b)])
    if finite:
        return
    bad = next(m for m, w in modules.items() if not all_finite([w.lora_a, w.lora_b]))
    raise InvalidAdapterError(
        f"module {bad!r}: the weights contain NaN or infinity.", adapter=name, path=weights.file
    )

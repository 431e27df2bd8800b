"""Everything an engine is built from: the model, tokenizer, KV cache, LoRA manager and registry.

Sizing defaults (each argument overrides its own):

============================  ======================  ======================
argument                      CUDA                    CPU
============================  ======================  ======================
``max_num_seqs``              64                      16
``max_model_len``             min(model's, 4096)      min(model's, 2048)
``max_num_batched_tokens``    4096                    1024
============================  ======================  ======================

The KV cache is ``max_num_seqs x max_model_len`` tokens, allocated once; on CUDA an engine whose
cache does not fit in free memory fails at start with the sizes to lower.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from loramux.engine.kv_cache import KVCache, kv_cache_shape
from loramux.registry import LoRAConfig, LoRARequest

__all__ = ["EngineSetup", "build_engine_setup"]


@dataclass
class EngineSetup:
    model: torch.nn.Module
    tokenizer: object | None
    model_name: str
    device: torch.device
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    max_loras: int
    kv_cache: KVCache
    eos_token_ids: frozenset[int]
    lora_manager: object | None
    registry: object | None
    registry_validates: bool  # the registry runs lora_manager.validate itself (one we built)
    lora_modules: list[LoRARequest]
    seed: int | None
    max_loading_workers: int


def build_engine_setup(
    model: str | os.PathLike | torch.nn.Module | None = None,
    *,
    enable_lora: bool = True,
    max_loras: int = 1,
    max_lora_rank: int = 16,
    max_cpu_loras: int | None = None,
    max_cpu_lora_bytes: int | None = None,
    lora_dtype: str | torch.dtype = "auto",
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    load_format: str = "auto",
    lora_modules: Mapping[str, str] | Iterable[LoRARequest | str] | None = None,
    registry=None,
    resolver_settings=None,
    tokenizer=None,
    lora_target_modules: list[str] | str | None = None,
    seed: int | None = 0,
    max_loading_workers: int = 4,
) -> EngineSetup:
    if isinstance(model, torch.nn.Module):  # an already loaded Hugging Face model
        hf_model = model.eval()
        device = next(model.parameters()).device
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    else:
        from loramux.engine.model_loader import DEFAULT_MODEL_NAME, load_model

        device = torch.device(device) if device is not None else _default_device()
        hf_model, loaded_tokenizer = load_model(model, dtype=dtype, device=device, load_format=load_format)
        tokenizer = tokenizer or loaded_tokenizer
        name = DEFAULT_MODEL_NAME if model is None else str(model)
    cuda = device.type == "cuda"
    text_config = hf_model.config.get_text_config()
    model_max = getattr(text_config, "max_position_embeddings", None) or 4096
    max_num_seqs = _positive("max_num_seqs", max_num_seqs or (64 if cuda else 16))
    max_model_len = _positive("max_model_len", max_model_len or min(model_max, 4096 if cuda else 2048))
    max_num_batched_tokens = _positive("max_num_batched_tokens", max_num_batched_tokens or (4096 if cuda else 1024))
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_num_seqs={max_num_seqs} "
            "(every running sequence decodes one token per step)"
        )
    kv_dtype = next(hf_model.parameters()).dtype
    _check_kv_fits(text_config, max_num_seqs, max_model_len, kv_dtype, device)
    kv_cache = KVCache(text_config, rows=max_num_seqs, max_len=max_model_len, dtype=kv_dtype, device=device)

    lora_manager = registry_obj = None
    requests: list[LoRARequest] = []
    if enable_lora:
        from loramux.engine.lora_model import LoRAModelManager

        lora_config = LoRAConfig(
            max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
            max_cpu_lora_bytes=max_cpu_lora_bytes, lora_dtype=lora_dtype,
        )
        lora_manager = LoRAModelManager(hf_model, lora_config, target_modules=lora_target_modules)
        registry_obj = registry if registry is not None else _make_registry(
            lora_config, name, lora_manager.validate, resolver_settings
        )
        requests = _lora_requests(lora_modules)
    elif lora_modules:
        raise ValueError("lora_modules were given but enable_lora=False")
    return EngineSetup(
        model=hf_model,
        tokenizer=tokenizer,
        model_name=name,
        device=device,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_loras=max_loras if enable_lora else 0,
        kv_cache=kv_cache,
        eos_token_ids=_eos_ids(hf_model, tokenizer),
        lora_manager=lora_manager,
        registry=registry_obj,
        registry_validates=enable_lora and registry is None,
        lora_modules=requests,
        seed=seed,
        max_loading_workers=max_loading_workers,
    )


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: got {value!r}; allowed: an int >= 1")
    return value


def _check_kv_fits(config, rows: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
    layers, _, kv_heads, _, head_dim = kv_cache_shape(config, rows, max_len)
    nbytes = 2 * layers * rows * kv_heads * max_len * head_dim * dtype.itemsize
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes > 0.9 * free:
        raise ValueError(
            f"the KV cache for max_num_seqs={rows} x max_model_len={max_len} needs "
            f"{nbytes / 2**30:.1f} GiB but {free / 2**30:.1f} GiB are free on {device}; "
            "lower max_num_seqs or max_model_len."
        )


def _eos_ids(model: torch.nn.Module, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config.get_text_config()):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
            break
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _lora_requests(lora_modules) -> list[LoRARequest]:
    """``{"name": path}``, ``["name=path", ...]`` or LoRARequests, numbered from 1 in order."""
    if not lora_modules:
        return []
    items = list(lora_modules.items()) if isinstance(lora_modules, Mapping) else list(lora_modules)
    requests = []
    for number, item in enumerate(items, start=1):
        if isinstance(item, LoRARequest):
            requests.append(item)
            continue
        if isinstance(item, str):
            if "=" not in item:
                raise ValueError(f"lora_modules entry {item!r}: expected 'name=path'")
            item = tuple(item.split("=", 1))
        name, path = item
        requests.append(LoRARequest(name, number, str(path)))
    return requests


def _make_registry(lora_config: LoRAConfig, model_name: str, validate, resolver_settings):
    from loramux.registry import Registry

    # validation before caching: an adapter that does not fit never takes a CPU-tier entry
    return Registry(
        lora_config, base_model_name=model_name, validate=validate, resolver_settings=resolver_settings
    )


"""Everything an engine is built from besides its config: the model, tokenizer, LoRA manager and registry.
`close_engine_parts` closes what an engine built.

`build_engine_setup` loads (or takes) the model and resolves the config's device defaults in place
(`EngineConfig.resolve`). The KV cache is a pool of blocks of ``block_size`` tokens
(`PagedKVCache`), so ``max_model_len`` does not multiply memory: on CUDA the blocks take what
``gpu_memory_utilization`` of the device leaves after the weights, the LoRA slots and the largest
step's activations (measured by running it once); on CPU a fixed budget (`CPU_KV_CACHE_BYTES`),
capped at four times what ``max_num_seqs`` sequences of ``max_model_len`` can use at once.
``num_gpu_blocks_override`` sets the number on any device.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loramux.engine.config import EngineConfig
from loramux.engine.process_tuning import release_frozen_heap
from loramux.engine.worker.siblings import fuse_siblings
from loramux.registry import LoRAConfig, LoRARequest
from loramux.registry.host_memory import PAGEABLE, HostMemory
from loramux.registry.page_locked_arena import PIECE_ALIGNMENT, PageLockedArena

if TYPE_CHECKING:
    from loramux.engine.adapters.lifecycle import AdapterLifecycle
    from loramux.engine.core.structured_output import StructuredOutputs
    from loramux.engine.worker.model_runner import ModelRunner
    from loramux.registry import Registry

__all__ = ["EngineSetup", "build_engine_setup", "close_engine_parts"]


@dataclass
class EngineSetup:
    model: torch.nn.Module
    tokenizer: object | None
    model_name: str
    eos_token_ids: frozenset[int]
    lora_manager: object | None
    registry: object | None
    registry_validates: bool  # the registry runs lora_manager.validate_and_prepare itself (one we built)
    lora_modules: list[LoRARequest]


def build_engine_setup(config: EngineConfig, *, tp_rank: int = 0, workers=None,
                       worker_manager_class: type | None = None) -> EngineSetup:
    """Load (or take) the model, quantized as ``config.quantization`` or its checkpoint says, shard
    it for ``tp_rank`` when ``config.tensor_parallel_size > 1``, fuse its sibling projections, wrap
    it for LoRA and resolve the device's default sizes.

    A tensor-parallel worker (``tp_rank > 0``) builds the same model and LoRA layers but no
    registry: adapters reach it as weight shards from the driver (``workers``: the driver's
    `WorkerGroup`, which its slot writes go through), into the LoRA manager the worker names
    (``worker_manager_class``: its `WorkerLoRAManager`).

    On CUDA the registry the engine builds loads into a `PageLockedArena` page-locked beside the rest
    of the start (`PageLockedArena.wait`: the engine waits for it before it captures any graph).
    """
    tp_size = config.tensor_parallel_size
    tokenizer = config.tokenizer
    if isinstance(config.model, torch.nn.Module):  # an already loaded Hugging Face model
        hf_model = config.model.eval()
        device = next(hf_model.parameters()).device
        name = getattr(hf_model.config, "_name_or_path", "") or type(hf_model).__name__
        if config.quantization == "fp8":  # in place, layer by layer
            from loramux.engine.quantization import quantize_model

            quantize_model(hf_model)
    else:
        from loramux.engine.worker.model_loader import DEFAULT_MODEL_NAME, load_model

        device = torch.device(config.device) if config.device is not None else _default_device()
        prepare_config = None
        if tp_size > 1:
            from loramux.engine.tensor_parallel.group import rank_device
            from loramux.engine.tensor_parallel.sharding import shard_config

            device = rank_device(device, tp_rank, tp_size)
            if config.load_format == "dummy":  # random weights: build this rank's share only
                prepare_config = functools.partial(shard_config, size=tp_size)
        hf_model, loaded_tokenizer = load_model(
            config.model, dtype=config.dtype, device=device, load_format=config.load_format,
            prepare_config=prepare_config, quantization=config.quantization,
        )
        tokenizer = tokenizer or loaded_tokenizer
        name = DEFAULT_MODEL_NAME if config.model is None else str(config.model)
    cuda = device.type == "cuda"
    config.resolve(device, getattr(hf_model.config.get_text_config(), "max_position_embeddings", None))
    if tp_size > 1:
        from loramux.engine.tensor_parallel.sharding import shard_model

        # before fusing: each rank fuses its own heads
        shard_model(hf_model, tp_rank, tp_size, prebuilt=config.load_format == "dummy")
        _share_all_reduce_memory(config, hf_model, device)
    if config.fuse_projections:
        fuse_siblings(hf_model)  # before LoRA wraps the layers: one wrapper per fused group

    lora_manager = registry_obj = None
    requests: list[LoRARequest] = []
    if config.enable_lora:
        lora_config = config.lora_config
        if tp_rank > 0:  # a worker's slots are written from the driver's
            lora_manager = worker_manager_class(hf_model, lora_config, target_modules=config.lora_target_modules)
        else:
            from loramux.engine.adapters.lora_model import LoRAModelManager

            registry_obj = config.registry
            memory = registry_obj.host_memory if registry_obj is not None else _host_memory(lora_config, cuda)
            lora_manager = LoRAModelManager(
                hf_model, lora_config, target_modules=config.lora_target_modules, workers=workers,
                on_host_copies=memory.fence if isinstance(memory, PageLockedArena) else None)
            if registry_obj is None:
                from loramux.registry import Registry

                # validation before caching: an adapter that does not fit never takes a CPU-tier entry
                registry_obj = Registry(lora_config, base_model_name=name,
                                        validate=lora_manager.validate_and_prepare,
                                        resolver_settings=config.resolver_settings, host_memory=memory)
            requests = _lora_requests(config.lora_modules)
    return EngineSetup(
        model=hf_model,
        tokenizer=tokenizer,
        model_name=name,
        eos_token_ids=_eos_ids(hf_model, tokenizer),
        lora_manager=lora_manager,
        registry=registry_obj,
        registry_validates=config.enable_lora and config.registry is None,
        lora_modules=requests,
    )


def _share_all_reduce_memory(config: EngineConfig, model: torch.nn.Module, device: torch.device) -> None:
    """Map the all-reduce buffer every rank shares (a collective: each rank builds its setup in
    the same order), sized for a step's largest all-reduce: one row of the hidden width per
    token. Made before the KV cache is sized from what memory is left."""
    from loramux.engine.tensor_parallel.group import use_symmetric_memory

    dtype = model.get_input_embeddings().weight.dtype  # what the row-parallel layers write
    hidden = model.config.get_text_config().hidden_size
    use_symmetric_memory(config.max_num_batched_tokens * hidden * dtype.itemsize, dtype, device)


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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


def _host_memory(lora_config: LoRAConfig, cuda: bool) -> HostMemory:
    """Where the engine's registry puts adapter weights: on CUDA a `PageLockedArena` of
    ``max_pinned_lora_bytes``, page-locked on a thread of its own (loads while serving then carve
    page-locked buffers instead of allocating them: a ``cudaHostAlloc`` stalls every CUDA call of
    the engine's thread); elsewhere, or with none reserved, pageable memory."""
    nbytes = lora_config.max_pinned_lora_bytes
    if not cuda or nbytes < PIECE_ALIGNMENT:
        return PAGEABLE
    return PageLockedArena(nbytes, in_background=True)


#: the CPU engine's KV budget (a modest fixed amount; tests and the embedded model need far less)
CPU_KV_CACHE_BYTES = 512 * 2**20


def num_kv_blocks(config: EngineConfig, model: torch.nn.Module, profile_peak_bytes) -> int:
    """How many KV blocks to allocate (see the module docstring). ``profile_peak_bytes()`` runs
    the largest step once and returns its activation bytes (CUDA only)."""
    from loramux.engine.core.block_manager import blocks_needed
    from loramux.engine.worker.kv_cache import PagedKVCache

    block_bytes = PagedKVCache.block_bytes(model.config.get_text_config(), config.block_size,
                                           next(model.parameters()).dtype)
    per_seq = blocks_needed(config.max_model_len, config.block_size)
    cuda = config.device.type == "cuda"
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
    elif cuda:
        torch.cuda.empty_cache()  # blocks this process cached but no longer uses are free, not in use
        free, total = torch.cuda.mem_get_info(config.device)
        peak = profile_peak_bytes()
        budget = config.gpu_memory_utilization * total - (total - free) - peak
        num_blocks = int(budget // block_bytes)
    else:
        # capped at 4x what max_num_seqs sequences can hold at once: room for the prefix cache
        num_blocks = min(CPU_KV_CACHE_BYTES // block_bytes, 4 * config.max_num_seqs * per_seq + 1)
    if num_blocks < per_seq + 1:
        used = ""
        if cuda and config.num_gpu_blocks_override is None:
            used = (f" ({(total - free) / 2**30:.1f} GiB of the device's {total / 2**30:.1f} GiB were in use "
                    "before the cache: the weights, and anything else on it, such as another engine)")
        raise ValueError(
            f"the KV cache has room for {max(num_blocks, 0)} blocks of {config.block_size} tokens{used}, but one "
            f"sequence of max_model_len={config.max_model_len} needs {per_seq} (plus one scratch block); lower "
            "max_model_len, close other engines, or raise gpu_memory_utilization / num_gpu_blocks_override."
        )
    return num_blocks


def close_engine_parts(runner: ModelRunner, adapters: AdapterLifecycle | None, structured: StructuredOutputs,
                       workers, own_registry: Registry | None, owns_model: bool) -> None:
    """Close an engine's parts (its finalizer: it must not hold the engine itself), the registry
    it built (one it was given carries on) and, when it loaded the model, the model's weights."""
    if adapters is not None:
        adapters.close()
    if own_registry is not None:
        own_registry.close()
    structured.close()
    release = functools.partial(runner.close, release_weights=owns_model)
    if workers is None:
        release()
    else:  # between stopping the workers and leaving their group (see WorkerGroup.shutdown)
        workers.shutdown(release=release)
    release_frozen_heap()

"""`EngineConfig`: every option of an engine, in one validated dataclass (nano-vllm's ``config.py``).

    config = EngineConfig("llama-3.1-8b", load_format="dummy", max_loras=8, tensor_parallel_size=2)
    engine = LLMEngine(config=config)          # or LLMEngine("llama-3.1-8b", load_format="dummy", ...)

Each field is checked in ``__post_init__``, with an error naming the value and what is allowed.
Fields left at None take the device's default when the engine is set up (the table in
:mod:`loramux.engine.engine_setup`), so one config serves a CPU test and a GPU server alike.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from loramux.engine.structured_output import StructuredOutputLimits
from loramux.registry import LoRAConfig, LoRARequest

__all__ = ["EngineConfig"]

_LOAD_FORMATS = ("auto", "dummy")
_QUANTIZATIONS = ("fp8",)


@dataclass
class EngineConfig:
    """The options of :class:`~loramux.LLM` and :class:`~loramux.engine.llm_engine.LLMEngine`
    (see `LLM` for each one's meaning)."""

    model: str | os.PathLike | torch.nn.Module | None = None
    # LoRA
    enable_lora: bool = True
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    max_cpu_lora_bytes: int | None = None
    max_gpu_lora_bytes: int | None = None
    max_pinned_lora_bytes: int | None = None
    lora_dtype: str | torch.dtype = "auto"
    lora_modules: Mapping[str, str] | Iterable[LoRARequest | str] | None = None
    lora_target_modules: list[str] | str | None = None
    registry: Any = None  # a loramux.registry.Registry built elsewhere; None: the engine builds one
    resolver_settings: Any = None  # a loramux.resolvers.ResolverSettings
    max_loading_workers: int = 4
    # the model
    dtype: str | torch.dtype = "auto"
    device: str | torch.device | None = None  # None: CUDA when available
    load_format: str = "auto"
    quantization: str | None = None  # "fp8"; None: as the checkpoint is saved (unquantized, or FP8)
    tokenizer: Any = None
    fuse_projections: bool = True
    tensor_parallel_size: int = 1
    # sizes (None: the device's default, see engine_setup)
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_shared_prefill_tokens: int | None = None  # prompt tokens beside decodes in a step API requests share
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # the forward
    enforce_eager: bool = False
    compilation: bool = True
    max_graph_tokens: int = 4096
    cuda_graph_sizes: list[int] | None = None  # None: graph_token_sizes(max_num_seqs, max_graph_tokens)
    async_scheduling: bool = True  # launch a step before reading the last one's tokens back
    seed: int | None = 0
    # what one structured-output format may cost (None: StructuredOutputLimits()'s defaults)
    structured_output_limits: StructuredOutputLimits | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "max_shared_prefill_tokens",
                     "num_gpu_blocks_override"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        _check_positive("max_loading_workers", self.max_loading_workers)
        _check_positive("max_graph_tokens", self.max_graph_tokens)
        if self.cuda_graph_sizes is not None:
            given = self.cuda_graph_sizes
            sizes = list(given) if isinstance(given, Iterable) and not isinstance(given, (str, bytes)) else []
            if not sizes or any(not isinstance(T, int) or isinstance(T, bool) or T < 2 for T in sizes):
                raise ValueError(
                    f"cuda_graph_sizes: got {given!r}; allowed: None (the default sizes) or a non-empty "
                    "list of token counts, each an int >= 2 (a one-token step runs as two rows)"
                )
            self.cuda_graph_sizes = sorted(set(sizes))
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
        if (self.max_num_seqs is not None and self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_num_seqs="
                f"{self.max_num_seqs} (every running sequence decodes one token per step)"
            )
        size = self.block_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 8 or size & (size - 1):
            raise ValueError(f"block_size: got {size!r}; allowed: a power of two >= 8 (default 16)")
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: got {utilization!r}; allowed: a number in (0, 1]")
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(
                f"load_format: got {self.load_format!r}; allowed: 'auto' (real weights) or 'dummy' "
                "(random weights from a config)"
            )
        if self.quantization is not None and self.quantization not in _QUANTIZATIONS:
            raise ValueError(
                f"quantization: got {self.quantization!r}; allowed: None (the checkpoint as saved: unquantized, "
                "or FP8) or 'fp8' (the projections' weights quantized to FP8 as they load)"
            )
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed: got {self.seed!r}; allowed: an int or None")
        if self.structured_output_limits is not None and not isinstance(
                self.structured_output_limits, StructuredOutputLimits):
            raise ValueError(f"structured_output_limits: got {self.structured_output_limits!r}; allowed: None "
                             "or a loramux.engine.structured_output.StructuredOutputLimits")
        if not self.enable_lora and self.lora_modules:
            raise ValueError("lora_modules were given but enable_lora=False; enable LoRA or drop them")
        if self.enable_lora:
            self.lora_config  # noqa: B018 -- builds LoRAConfig once, which checks the LoRA sizes
        if self.tensor_parallel_size > 1 and isinstance(self.model, torch.nn.Module):
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs the model as a name, a dir or a "
                f"dummy config name (got a loaded {type(self.model).__name__}): every worker process "
                "loads the model itself and keeps its shard. Save it with save_pretrained and pass the dir."
            )

    @property
    def lora_config(self) -> LoRAConfig:
        """The LoRA tiers' sizes, as the registry and the model manager take them."""
        return LoRAConfig(
            max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, max_cpu_loras=self.max_cpu_loras,
            max_cpu_lora_bytes=self.max_cpu_lora_bytes, max_gpu_lora_bytes=self.max_gpu_lora_bytes,
            max_pinned_lora_bytes=self.max_pinned_lora_bytes, lora_dtype=self.lora_dtype,
        )

    @classmethod
    def from_kwargs(cls, model=None, **kwargs) -> EngineConfig:
        """``EngineConfig(model, **kwargs)``, with an unknown keyword a TypeError naming the
        closest option (``max_lora=4`` -> "did you mean 'max_loras'?")."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; the options are {', '.join(names)}"
                raise TypeError(f"unknown engine option {key!r}{hint}")
        return cls(model=model, **kwargs)

    def for_worker(self) -> EngineConfig:
        """What a tensor-parallel worker needs to build its shard of the model: this config less
        the driver's own objects (registry, tokenizer, adapters to register), so it pickles."""
        return dataclasses.replace(
            self, registry=None, resolver_settings=None, tokenizer=None, lora_modules=None,
        )


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: got {value!r}; allowed: an int >= 1")


"""`EngineConfig`: every option of an engine, in one dataclass (nano-vllm's ``config.py``).

    config = EngineConfig("llama-3.1-8b", load_format="dummy", max_loras=8, tensor_parallel_size=2)
    engine = LLMEngine(config=config)          # or LLMEngine("llama-3.1-8b", load_format="dummy", ...)

Each option is declared once, here: its default, its doc (the string under the field) and its
``loramux serve`` flag (:mod:`loramux.flags` generates the flags from these fields). Every rule
is checked once, by `EngineConfig.validate`, with an error naming the value and what is allowed.

A size left at None takes its device's default when the engine starts: `EngineConfig.resolve`
writes the resolved values back into this object, which the engine then hands whole to its parts
(``Scheduler(config, ...)``, ``ModelRunner(config, ...)``), as nano-vllm does.

============================  ==========================  ======================
field (None: the default)     CUDA                        CPU
============================  ==========================  ======================
``max_num_seqs``              64                          16
``max_model_len``             min(model's, 4096)          min(model's, 2048)
``max_num_batched_tokens``    4096                        1024
``max_shared_prefill_tokens`` no bound                    8
``async_scheduling``          on                          off
============================  ==========================  ======================
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from loramux.engine.core.structured_output import StructuredOutputLimits
from loramux.flags import flag, parse_byte_size, parse_byte_size_or_zero
from loramux.registry import LoRAConfig, LoRARequest

__all__ = ["DEVICE_DEFAULTS", "EngineConfig"]

_LOAD_FORMATS = ("auto", "dummy")
_QUANTIZATIONS = ("fp8",)
_DTYPES = ("auto", "float32", "float16", "bfloat16")

#: what a size left at None takes: field -> (on CUDA, on CPU); None: no bound
DEVICE_DEFAULTS: dict[str, tuple[int | None, int | None]] = {
    "max_num_seqs": (64, 16),
    "max_num_batched_tokens": (4096, 1024),
    # on a CPU a step's time grows with its tokens from the first, so a request decoding beside
    # another's prompts would wait for them too; a GPU takes thousands for the time of one
    "max_shared_prefill_tokens": (None, 8),
}
#: max_model_len's default: the model's, at most this (CUDA, CPU)
MAX_MODEL_LEN_CAP = (4096, 2048)


@dataclass
class EngineConfig:
    """The options of :class:`~loramux.LLM` and :class:`~loramux.engine.LLMEngine`."""

    model: str | os.PathLike | torch.nn.Module | None = None
    """A Hugging Face model id or dir, a shipped config name with ``load_format`` dummy, an already
    loaded ``PreTrainedModel``, or None: the embedded default model (SmolLM2-135M-Instruct)."""

    # -- LoRA ----------------------------------------------------------------------------------
    enable_lora: bool = flag(True, group="LoRA")
    """Wrap the model's layers so that requests can name adapters."""
    max_loras: int | None = flag(LoRAConfig.max_loras, metavar="N", group="LoRA")
    """A cap on the adapters resident on the GPU, and so usable in one step (default: none; the GPU
    pool's bytes, ``max_gpu_lora_bytes``, bound them)."""
    max_lora_rank: int = flag(LoRAConfig.max_lora_rank, metavar="R", group="LoRA")
    """The largest adapter rank."""
    max_cpu_loras: int | None = flag(LoRAConfig.max_cpu_loras, metavar="C", group="LoRA")
    """Adapters kept loaded in host memory (default: ``max_loras``; without it, no count:
    ``max_cpu_lora_bytes`` bounds them)."""
    max_cpu_lora_bytes: int | None = flag(LoRAConfig.max_cpu_lora_bytes, type=parse_byte_size, metavar="SIZE",
                                          group="LoRA")
    """Bytes of adapter weights kept in host memory, e.g. 8GiB (default: 10% of the host's memory);
    the CPU tier keeps at most ``max_cpu_loras`` adapters and at most this many bytes."""
    max_gpu_lora_bytes: int | None = flag(LoRAConfig.max_gpu_lora_bytes, type=parse_byte_size, metavar="SIZE",
                                          group="LoRA")
    """GPU memory for the weights of resident adapters, e.g. 8GiB, shared by rank (a rank-8 adapter
    takes an eighth of a rank-64 one), taken before the KV cache is sized; the adapters of a step
    are those whose rows fit it together (default: 10% of the GPU, 128MiB on CPU, at most what
    256 adapters of ``max_lora_rank`` take; with ``max_loras`` set: room for that many adapters
    of ``max_lora_rank``)."""
    max_pinned_lora_bytes: int | None = flag(LoRAConfig.max_pinned_lora_bytes, type=parse_byte_size_or_zero,
                                             metavar="SIZE", group="LoRA")
    """Page-locked host memory reserved at start (CUDA) for the adapters in host memory, e.g. 4GiB:
    loads carve from it, so nothing is page-locked while serving, and take pageable memory when it
    is full (default: ``max_cpu_lora_bytes``, at most 8GiB; 0: none)."""
    lora_dtype: str | torch.dtype = flag(LoRAConfig.lora_dtype, choices=_DTYPES, group="LoRA")
    """Adapter weight dtype (auto: the model's)."""
    lora_modules: Mapping[str, str] | Iterable[LoRARequest | str] | None = None
    """Adapters registered at start: ``{"name": path}``, ``["name=path"]`` or LoRARequests."""
    lora_target_modules: list[str] | str | None = flag(None, nargs="+", metavar="MODULE", group="LoRA")
    """Wrap only these modules (PEFT's rule: names matched as dotted suffixes, or one regex); default:
    every supported layer. Narrowing saves GPU memory."""
    registry: Any = None
    """A :class:`loramux.registry.Registry` built elsewhere; None: the engine builds one."""
    resolver_settings: Any = None
    """The resolvers' :class:`loramux.resolvers.ResolverSettings` (default: from the environment)."""
    max_loading_workers: int = flag(LoRAConfig.max_loading_workers, metavar="N", group="LoRA")
    """Adapter loads that run at once beside the step loop."""

    # -- the model -----------------------------------------------------------------------------
    dtype: str | torch.dtype = flag("auto", choices=_DTYPES, group="engine")
    """The model's dtype (auto: float32 on CPU, bfloat16 on GPU)."""
    device: str | torch.device | None = flag(None, group="engine")
    """cpu, cuda, cuda:1 ... (default: CUDA when present)."""
    load_format: str = flag("auto", choices=_LOAD_FORMATS, group="engine")
    """dummy: random weights from the model's config (benchmarks)."""
    quantization: str | None = flag(None, "-q", "--quantization", choices=_QUANTIZATIONS, group="engine")
    """fp8: the projections' weights quantized to FP8 as they load (per output channel; activations
    per token), half the weight bytes, FP8 GEMMs on GPUs of compute capability 8.9+; adapters run
    on top in the model's dtype. A checkpoint saved in FP8 loads as FP8 without it (default: the
    checkpoint as saved)."""
    tokenizer: Any = None
    """The tokenizer (default: the model's)."""
    fuse_projections: bool = flag(True, group="engine")
    """Run q/k/v and gate/up as one GEMM each."""
    tensor_parallel_size: int = flag(1, "-tp", "--tensor-parallel-size", metavar="N", group="engine")
    """Shard the model over N GPUs of this host, one process each (NCCL; gloo on CPU); the engine and
    its adapter tiers run once."""

    # -- sizes (None: the device's default, DEVICE_DEFAULTS) -----------------------------------
    max_num_seqs: int | None = flag(None, group="engine")
    """Sequences running at once (default: 64 on CUDA, 16 on CPU)."""
    max_model_len: int | None = flag(None, group="engine")
    """Prompt plus output tokens of one sequence (default: the model's, at most 4096 on CUDA, 2048
    on CPU)."""
    max_num_batched_tokens: int | None = flag(None, group="engine")
    """Tokens one step computes; longer prompts are prefilled in chunks (default: 4096 on CUDA, 1024
    on CPU)."""
    max_shared_prefill_tokens: int | None = flag(None, group="engine")
    """Prompt tokens a step carries beside its decodes while requests of more than one API request
    share it (default: no bound on CUDA, 8 on CPU)."""
    block_size: int = flag(16, group="engine")
    """Tokens per KV-cache block (a power of two >= 8)."""
    gpu_memory_utilization: float = flag(0.9, metavar="FRACTION", group="engine")
    """Share of the GPU for weights, LoRA slots, activations and the KV cache; the KV blocks take
    what is left."""
    num_gpu_blocks_override: int | None = flag(None, metavar="N", group="engine")
    """Allocate exactly N KV blocks, on any device."""
    enable_prefix_caching: bool = flag(True, group="engine")
    """Reuse the KV blocks of a shared prompt prefix, keyed by the adapter's content."""

    # -- the forward ---------------------------------------------------------------------------
    enforce_eager: bool = flag(False, group="engine")
    """No torch.compile and no CUDA graphs (on CUDA both are on by default)."""
    compilation: bool = flag(True, group="engine")
    """torch.compile the forward on CUDA; off keeps the CUDA graphs without compiling (a faster start)."""
    max_graph_tokens: int = flag(4096, metavar="N", group="engine")
    """Steps of up to N tokens (decodes, short prompts, mixed steps) replay CUDA graphs captured at
    start; larger ones run eagerly (at most ``max_num_batched_tokens``)."""
    cuda_graph_sizes: list[int] | None = flag(None, nargs="+", metavar="T", group="engine")
    """The padded token counts to capture step graphs for, in place of the default (2, 4, 8, steps
    of 16 up to ``max_num_seqs``, then four sizes per power of two, 160, 192, 224, 256, 320, ...,
    up to ``max_graph_tokens``); a step replays the smallest graph that holds it."""
    async_scheduling: bool | None = flag(None, action=argparse.BooleanOptionalAction, group="engine")
    """Launch each step before reading the last one's tokens back, so the host's work between steps
    overlaps the GPU's (default: on CUDA; off on CPU, whose forward returns only once computed:
    nothing overlaps, and a request would learn it finished one step late)."""
    seed: int | None = flag(0, group="engine")
    """Seed for sampling."""
    structured_output_limits: StructuredOutputLimits | None = flag(
        None, "--structured-outputs-limits", dest="structured_outputs_limits", type=StructuredOutputLimits.from_json,
        metavar="JSON", group="HTTP", describe=StructuredOutputLimits.describe)
    """What one structured-output format may cost, as a JSON object, e.g. '{"compile_timeout": 10,
    "cache_bytes": "512MiB"}'; a format over a limit is refused, naming it."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every option (after construction, and again once `resolve` filled the defaults).

        :raises ValueError: naming the option, the value and what is allowed.
        """
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "max_shared_prefill_tokens",
                     "num_gpu_blocks_override"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
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
                             "or a loramux.engine.core.structured_output.StructuredOutputLimits")
        if not self.enable_lora and self.lora_modules:
            raise ValueError("lora_modules were given but enable_lora=False; enable LoRA or drop them")
        if self.enable_lora:
            self.lora_config  # noqa: B018 -- builds LoRAConfig, which checks the LoRA sizes
        if self.tensor_parallel_size > 1 and isinstance(self.model, torch.nn.Module):
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs the model as a name, a dir or a "
                f"dummy config name (got a loaded {type(self.model).__name__}): every worker process "
                "loads the model itself and keeps its shard. Save it with save_pretrained and pass the dir."
            )

    def resolve(self, device: torch.device, model_max_len: int | None) -> None:
        """Write the device's defaults (`DEVICE_DEFAULTS`) into the sizes left at None, and
        ``device``, then check the result (`validate`). ``model_max_len`` is the model's own
        (``max_position_embeddings``)."""
        cuda = device.type == "cuda"
        self.device = device
        for name, defaults in DEVICE_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, defaults[0 if cuda else 1])
        if self.async_scheduling is None:
            self.async_scheduling = cuda
        if self.max_model_len is None:
            self.max_model_len = min(model_max_len or MAX_MODEL_LEN_CAP[0], MAX_MODEL_LEN_CAP[0 if cuda else 1])
        self.validate()

    @property
    def lora_config(self) -> LoRAConfig:
        """The LoRA tiers' sizes, as the registry and the model manager take them."""
        return LoRAConfig(
            max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, max_cpu_loras=self.max_cpu_loras,
            max_cpu_lora_bytes=self.max_cpu_lora_bytes, max_gpu_lora_bytes=self.max_gpu_lora_bytes,
            max_pinned_lora_bytes=self.max_pinned_lora_bytes, lora_dtype=self.lora_dtype,
            max_loading_workers=self.max_loading_workers,
        )

    @property
    def lora_slots(self) -> int | None:
        """Distinct adapters a step may use by count: ``max_loras`` (None: no count binds, the
        GPU pool's bytes do), or 0 without LoRA."""
        return self.max_loras if self.enable_lora else 0

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

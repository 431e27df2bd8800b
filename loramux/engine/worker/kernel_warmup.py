"""Warm up at start every Triton kernel configuration a step can use: no JIT compile while serving.

Our kernels pick their launch shape from the step (tile sizes, K splits, split-KV, the padded
sequence count): `shrink_config` / `expand_config` from the token count and the adapter
segments, `attention_config` from the token and sequence counts. Each distinct shape is a
distinct Triton compile, seconds each on first use: without this warm-up, the first requests of
a fresh process would pay them in their time to first token.

Step graphs (steps of up to ``max_graph_tokens`` tokens) are captured at start and compile
their own shapes. For the larger steps, which run eagerly, `plan_warmup` enumerates the steps
serving runs, computes for each the launch-configuration keys its kernels would use (from the
kernels' own config functions, on the host: no launch), and keeps one step for each key not seen
before; `warm_up_kernels` runs those steps through the runner's
forward (compiled or eager, as serving runs it), over the scratch KV block 0 (slot -1: nothing is
written; every block table row points at block 0). The candidate steps:

- one sequence's prefill chunk of T tokens, T = 1 .. ``max_num_batched_tokens``, every token on
  one adapter when LoRA is enabled (a zero adapter held in a slot for the warm-up only);
- B - 1 decode tokens beside one prefill chunk (T > B), B at both ends of each padded sequence
  count;
- decode tokens only (T = B), as steps run when no graph serves them.

A prefill-sized step's LoRA launch shapes depend on its token count alone, not on how its tokens
split between adapters (`loramux.kernels.tiles.shape_from_tokens_alone`), so the one-adapter
candidates reach every LoRA kernel such a step can launch, whatever its mix.

Not covered (each compiles on first use, once per machine: Triton's cache is on disk): eager
decode-sized steps (at most 256 tokens: ``enforce_eager``, or a step a graph would serve that runs
eagerly because it asks for prompt logprobs) with several adapters, and split-KV shapes of long
contexts.

Triton compiles one kernel at a time when a launch needs it. Where Triton has an asynchronous
compile mode (``triton.runtime._async_compile``), a first pass runs the plan with every launch
turned into a compile-only ``warmup`` call, so the compiles go to a thread pool side by side
(``LORAMUX_KERNEL_WARMUP_THREADS``, default 8; 1 compiles as the steps come); the second pass
then runs every step for real, its kernels already built.

``LORAMUX_KERNEL_WARMUP=0`` skips the warm-up.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from loramux import envs
from loramux.engine.worker.kv_cache import kv_cache_geometry
from loramux.engine.layers.lora_patch import matches_target
from loramux.engine.adapters.lora_validation import adapter_sizes
from loramux.engine.quantization.fp8 import has_fp8_layers
from loramux.kernels import LoRABatchMeta, build_lora_meta, fp8_gemm
from loramux.kernels.attention import attention_config
from loramux.kernels.expand import expand_launch
from loramux.kernels.shrink import shrink_launch
from loramux.kernels.tiles import cdiv, next_pow2, slot_lanes

if TYPE_CHECKING:
    from loramux.engine.worker.model_runner import ModelRunner

__all__ = ["ENV_VAR", "LoRAModuleShape", "WarmupStep", "attention_keys", "fp8_keys", "lora_keys", "plan_warmup",
           "run_warmup", "warm_up_kernels"]

logger = logging.getLogger(__name__)

ENV_VAR = envs.env_name("kernel_warmup")
THREADS_ENV_VAR = envs.env_name("kernel_warmup_threads")
WARMUP_ADAPTER = "__loramux_kernel_warmup__"


@dataclass(frozen=True)
class WarmupStep:
    """One warm-up step: ``num_seqs - 1`` decode tokens and one chunk of the rest (``num_seqs == 1``:
    a prefill chunk alone; ``num_tokens == num_seqs``: decodes only); ``lora``: every token on one
    adapter."""

    num_tokens: int
    num_seqs: int = 1
    lora: bool = False

    @property
    def chunk(self) -> int:
        """Tokens of the last sequence's chunk (the others decode one each)."""
        return self.num_tokens - (self.num_seqs - 1)

    @property
    def padded_tokens(self) -> int:
        return max(2, self.num_tokens)  # the runner pads a 1-token step to 2 (see _forward_packed)


@dataclass(frozen=True)
class LoRAModuleShape:
    """What a LoRA layer's kernel launches depend on: stacked rank ``n_slices * R``, input width,
    output slices, R and dtype. The steps warmed up here run eagerly, and an eager step adds each
    delta in line (`LoRAContext.beside`): its launches are sized for every multiprocessor."""

    stacked_rank: int
    in_features: int
    slice_sizes: tuple[int, ...]
    max_rank: int
    dtype: torch.dtype


# -- launch-configuration keys (host only) ------------------------------------------------------


def attention_keys(step: WarmupStep, *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                   dtype: torch.dtype, device: torch.device) -> set[Hashable]:
    """The paged-attention launches of ``step``: its `attention_config` and padded sequence count,
    the kernel's constexprs that vary by step (the table's width and stride are not specialised)."""
    tokens, seqs = step.padded_tokens, step.num_seqs
    width = cdiv(step.chunk, block_size)  # the chunk's sequence has the widest table
    cfg = attention_config(tokens, seqs, num_heads, num_kv_heads, head_dim, width, block_size, dtype, device)
    return {("attention", cfg, max(16, next_pow2(seqs)))}


def lora_keys(step: WarmupStep, modules: Iterable[LoRAModuleShape], *, num_slots: int,
              device: torch.device) -> set[Hashable]:
    """The shrink and expand launches of ``step`` for every LoRA module shape (none without LoRA)."""
    if not step.lora:
        return set()
    meta = _one_adapter_meta(step, num_slots)
    lanes = slot_lanes(meta)  # a constexpr of both kernels
    keys: set[Hashable] = set()
    for m in modules:
        shrink = shrink_launch(meta, m.stacked_rank, m.in_features, m.dtype, device, rank=m.max_rank)
        keys.add(("shrink", m.stacked_rank, m.in_features, m.dtype, shrink.config, shrink.split_k, lanes))
        cfg = expand_launch(meta, m.slice_sizes, m.max_rank, m.dtype, device)[0]
        keys.add(("expand", m.slice_sizes, m.max_rank, m.dtype, cfg, lanes))
    return keys


def fp8_keys(step: WarmupStep) -> set[Hashable]:
    """The FP8 GEMM launches of ``step`` whose shape varies by step: the decode-sized kernel's
    block rows (its column and K blocks are fixed per projection; cuBLASLt's larger GEMMs need
    no Triton compile)."""
    if step.padded_tokens > fp8_gemm.MAX_ROWS:
        return set()
    return {("fp8_gemm", fp8_gemm.block_rows(step.padded_tokens))}


def _one_adapter_meta(step: WarmupStep, num_slots: int) -> LoRABatchMeta:
    """What `build_lora_meta` makes of ``step``'s slots (one adapter, then the runner's padding
    row), on its host side, which is all the launch heuristics read; built from the T = 1 meta
    without its torch work (the plan asks for thousands of token counts)."""
    template = _ONE_ADAPTER_META.get(num_slots)
    if template is None:
        template = _ONE_ADAPTER_META[num_slots] = build_lora_meta(torch.tensor([0, -1], dtype=torch.int32), num_slots)
    T = step.num_tokens
    return dataclasses.replace(template, num_tokens=step.padded_tokens, num_lora_tokens=T, max_segment=T,
                               active_counts_host=(T,), _cache={})


_ONE_ADAPTER_META: dict[int, LoRABatchMeta] = {}


def plan_warmup(*, max_num_batched_tokens: int, max_num_seqs: int, num_heads: int, num_kv_heads: int,
                head_dim: int, block_size: int, dtype: torch.dtype, device: torch.device,
                lora_modules: Iterable[LoRAModuleShape] = (), num_slots: int = 1,
                min_tokens: int = 1, fp8: bool = False) -> tuple[list[WarmupStep], set]:
    """The warm-up steps (see the module docstring) and the launch keys they reach together:
    steps of ``min_tokens`` tokens or more (the smaller ones replay graphs); ``fp8``: the model's
    projections run FP8 GEMMs.

    A candidate is kept when it reaches a key no earlier candidate did, so every key any
    candidate reaches is reached by the plan, with one step per new key at most.
    """
    lora_modules = tuple(dict.fromkeys(lora_modules))
    lora = bool(lora_modules)
    geometry = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                    dtype=dtype, device=device)
    T = max_num_batched_tokens
    candidates = [WarmupStep(t, 1, lora) for t in range(1, T + 1)]
    # decodes beside a chunk: B at both ends of each padded sequence count (next_pow2 past 16), as
    # `attention_config` takes shorter query blocks as B grows (a 517-token step of 9 sequences
    # compiled one mid-serving when only B = 2 stood for 2..16)
    ends = {b for pad in (16, 32, 64, 128, 256, 512, 1024) for b in (pad // 2 + 1 if pad > 16 else 2, pad)}
    seq_counts = sorted({b for b in ends if b <= max_num_seqs} | {max_num_seqs})
    candidates += [WarmupStep(t, b, lora) for b in seq_counts if b > 1 for t in range(b + 1, T + 1)]
    candidates += [WarmupStep(b, b, lora) for b in range(2, min(max_num_seqs, T) + 1)]
    by_tokens: dict[int, set] = {}  # LoRA keys depend on the token count only (one adapter on all)
    plan, reached = [], set()
    for step in candidates:
        if step.num_tokens < min_tokens:
            continue
        if step.num_tokens not in by_tokens:
            by_tokens[step.num_tokens] = lora_keys(step, lora_modules, num_slots=num_slots, device=device)
        keys = attention_keys(step, **geometry) | by_tokens[step.num_tokens] | (fp8_keys(step) if fp8 else set())
        if not keys <= reached:
            plan.append(step)
            reached |= keys
    return plan, reached


def lora_module_shapes(lora_manager) -> list[LoRAModuleShape]:
    """The distinct shapes of a manager's LoRA layers that run the shrink/expand kernels."""
    shapes = [
        LoRAModuleShape(layer.n_slices * layer.max_lora_rank, layer.in_features, layer.output_sizes,
                        layer.max_lora_rank, layer.lora_dtype)
        for layer in lora_manager.layers.values() if not layer.is_embedding
    ]
    return list(dict.fromkeys(shapes))


# -- running the plan ---------------------------------------------------------------------------


@torch.inference_mode()
def warm_up_kernels(runner: ModelRunner) -> int:
    """Run `plan_warmup`'s steps through ``runner`` (its KV cache allocated); returns how many ran.

    With LoRA, a zero adapter of rank 1 on every module takes a free slot for the warm-up (its
    delta is zero; the kernels run as for any adapter) and leaves it, the slot counters as they
    were. Nothing is written to the KV cache.
    """
    if not envs.current().kernel_warmup:
        return 0
    config = runner.model.config.get_text_config()
    layers, kv_heads, head_dim = kv_cache_geometry(config)
    manager = runner.lora_manager
    shapes = lora_module_shapes(manager) if manager is not None else []
    try:
        plan, _ = plan_warmup(
            max_num_batched_tokens=runner.config.max_num_batched_tokens, max_num_seqs=runner.config.max_num_seqs,
            num_heads=config.num_attention_heads, num_kv_heads=kv_heads, head_dim=head_dim,
            block_size=runner.config.block_size, dtype=runner.kv.k.dtype, device=runner.device, lora_modules=shapes,
            num_slots=manager.num_slots if manager is not None else 1,
            min_tokens=runner.graphs.sizes[-1] + 1 if runner.graphs is not None else 1,
            fp8=runner.device.type == "cuda" and has_fp8_layers(runner.model),
        )
    except Exception as exc:  # host arithmetic only: the engine serves without it, slower on first use
        logger.warning(
            "kernel warm-up skipped: planning it failed (%s: %s); the first requests of each shape will "
            "compile Triton kernels. Report it; %s=0 silences this.", type(exc).__name__, exc, ENV_VAR,
        )
        return 0
    return run_warmup(runner, plan)


@torch.inference_mode()
def run_warmup(runner: ModelRunner, plan: list[WarmupStep]) -> int:
    """Run ``plan``'s steps through ``runner`` (on every tensor-parallel rank), a zero adapter in a
    slot for the steps with LoRA; returns how many ran."""
    manager = runner.lora_manager
    counters = dataclasses.asdict(manager.stats) if manager is not None else {}
    # held even when no step runs on it: its slot write builds the copy kernel every slot write
    # launches (`loramux.kernels.block_copy`), which nothing else builds before serving
    slot = _hold_zero_adapter(manager) if manager is not None else None
    try:
        if runner.device.type == "cuda" and runner.workers is None:
            # a sharded step needs every rank; the workers compile their kernels as it runs
            _compile_in_parallel(runner, plan, slot)
        for step in tqdm(plan, desc="Warming up kernels", unit="step", leave=False):
            _run_step(runner, step, slot)
    finally:
        if slot is not None:
            manager.deactivate(WARMUP_ADAPTER)
            for name, value in counters.items():  # the GPU tier's metrics count real adapters only
                setattr(manager.stats, name, value)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return len(plan)


def _compile_in_parallel(runner: ModelRunner, plan: list[WarmupStep], slot: int | None) -> None:
    """Compile the plan's Triton kernels in a thread pool: run its steps with each launch made
    a compile-only ``warmup`` (no kernel runs; the torch ops between them compute on whatever the
    skipped kernels left, and the results are dropped)."""
    threads = envs.current().kernel_warmup_threads
    try:
        from triton.runtime._async_compile import AsyncCompileMode
        from triton.runtime.jit import JITFunction
    except ImportError:  # a Triton without it: the steps compile their kernels one by one
        return
    if threads <= 1:
        return
    from concurrent.futures import ThreadPoolExecutor

    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    with ThreadPoolExecutor(threads, thread_name_prefix="loramux-triton-compile") as pool:
        with AsyncCompileMode(pool):  # on exit: every compile finished and registered
            JITFunction.run = compile_only
            try:
                for step in tqdm(plan, desc="Compiling kernels", unit="step", leave=False):
                    _run_step(runner, step, slot)
            finally:
                JITFunction.run = launch


def _hold_zero_adapter(manager) -> int:
    from pathlib import Path

    from loramux.registry import LoRAAdapter, LoRAModuleWeights

    modules = {}
    for layer in manager.layers.values():
        if layer.is_embedding:
            continue
        in_features, output_sizes = adapter_sizes(layer)  # the whole layer's: a shard's rank splits it
        for name, size in zip(layer.slice_names, output_sizes):
            if not matches_target(name, manager.target_modules):  # k of a fused qkv served for q/v only
                continue
            dtype = layer.lora_dtype
            modules[name] = LoRAModuleWeights(torch.zeros(1, in_features, dtype=dtype),
                                              torch.zeros(size, 1, dtype=dtype), 1.0)
    adapter = LoRAAdapter(name=WARMUP_ADAPTER, path=Path("."), modules=modules, lora_alpha=1.0,
                          target_modules=sorted(modules))
    # in one page-locked host buffer, as the CPU tier holds adapters: the slot write takes the
    # path serving does and compiles its kernel now (`loramux.engine.layers.slot_copy`)
    return manager.activate(adapter.pack(pin_memory=manager.device.type == "cuda"))


def _run_step(runner: ModelRunner, step: WarmupStep, slot: int | None) -> None:
    """One forward of ``step`` over block 0: decodes at position 0, the chunk from position 0."""
    width = cdiv(step.chunk, runner.config.block_size)
    decodes = step.num_seqs - 1
    positions = [0] * decodes + list(range(step.chunk))
    lora_slots = [slot] * step.num_tokens if slot is not None and step.lora else None
    runner._on_all_ranks(  # every tensor-parallel rank runs the step (its collectives need them all)
        "_forward_packed",
        ids=[0] * step.num_tokens, positions=positions, kv_slots=[-1] * step.num_tokens,
        tables=[[0]] * decodes + [[0] * width], seq_lens=[1] * decodes + [step.chunk],
        query_start=list(range(decodes + 1)) + [step.num_tokens],
        lora_slots=lora_slots, logits=[step.num_tokens - 1],
        logit_slots=[slot] if lora_slots is not None else None,
    )

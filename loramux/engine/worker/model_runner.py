"""Run one scheduled step: build its inputs once, one forward for every sequence, sample.

Per step the host builds plain lists (token ids, positions, cache slots, block tables, sequence
lengths, query offsets, adapter slots, logits rows), copies them to the device in one transfer
through a reusable pinned buffer, sets the adapter mapping once for all LoRA layers, runs the
model once with every token packed into one row, and samples; it returns without waiting for the
GPU (`LaunchedStep`: the engine reads the tokens back once the next step is queued, so the host
work between steps overlaps the GPU's). A decode whose input token is that not-yet-read token
takes its id on the device from the last step's sampled tokens (`fill_pending`).

On CUDA the model's decoder layer is compiled with ``torch.compile`` (regional compilation: one
graph every layer shares, see `loramux.engine.worker.compilation`; elementwise chains of the modeling
code fuse; attention and LoRA are custom ops the compiled graph calls), and every step of up to
``max_graph_tokens`` tokens (decodes, short prefills, mixed steps) replays a CUDA graph captured at
start for its padded token count (`StepGraphs`). After capture,
`warm_up_kernels` runs one step per distinct Triton launch configuration a step can use, so no
request pays for a kernel's JIT compile (`loramux.engine.worker.kernel_warmup`). ``enforce_eager=True``
runs everything eagerly; ``compilation=False`` keeps the graphs without compiling. CPU is eager.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loramux.engine.core.block_manager import blocks_needed
from loramux.engine.config import EngineConfig
from loramux.engine.worker.compilation import (CompiledRegions, compile_repeated_blocks, configure_compile_caches,
                                        restore_eager_blocks)
from loramux.engine.worker.cuda_graphs import StepGraphs, graph_batch_sizes, graph_token_sizes
from loramux.engine.worker.forward_context import AttentionMetadata, forward_context
from loramux.engine.worker.kv_cache import ATTN_IMPLEMENTATION, PagedKVCache
from loramux.engine.worker.prompt_logprobs import plan_prompt_logprobs, record_prompt_logprobs
from loramux.engine.worker.sampler import Sampler, SamplerOutput
from loramux.engine.core.sequence import Sequence
from loramux.engine.core.step_outputs import ModelRunnerOutput, SchedulerOutput
from loramux.engine.quantization.fp8 import has_fp8_layers
from loramux.engine.tensor_parallel.group import share_sampled
from loramux.kernels.dispatch import uses_triton

__all__ = ["LaunchedStep", "ModelRunner", "StepShape", "graph_batch_sizes", "graph_token_sizes"]

logger = logging.getLogger(__name__)

FIELD_ALIGN = 4  # int32s: 16 bytes


@dataclass(frozen=True)
class StepShape:
    """What one step computed (`ModelRunner.last_step`; step listeners get it in `BatchTimings`)."""

    num_seqs: int
    num_tokens: int  # tokens computed
    prompt_tokens: int  # of those, tokens of prompts (prefill chunks, recomputed preempted ones)
    padded_tokens: int  # tokens the forward ran: the graph's size, or num_tokens
    graph: bool  # replayed a CUDA graph


@dataclass
class LaunchedStep:
    """The runner's output of a step whose GPU work is queued, not awaited: the sequences it
    samples a token for, in row order, and their tokens (``sampled``, with the logprobs of the rows
    that asked). On CUDA the tokens are copied to page-locked host memory behind the step
    (``host_tokens``, there once ``copied`` completes), so reading them (`result`) waits for this
    step alone, never for one queued after."""

    seqs: list[Sequence]
    sampled: SamplerOutput | None
    host_tokens: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None
    #: tensor parallelism: reads the workers' answers for this step, failing if one died, before
    #: anything waits on the step (its collectives would never finish without that worker)
    ranks_ran: Callable[[], None] | None = None

    def token_ids(self) -> list[int]:
        """The sampled tokens, row by row, on the host: waits for the step's GPU work."""
        if self.ranks_ran is not None:
            self.ranks_ran()
        if not self.seqs:
            return []
        if self.copied is not None:
            self.copied.synchronize()
        return (self.host_tokens if self.host_tokens is not None else self.sampled.token_ids).tolist()

    def result(self) -> ModelRunnerOutput:
        """The step's tokens and logprobs on the host (waits for its GPU work)."""
        tokens = self.token_ids()  # the logprobs are on the host once the tokens are
        return ModelRunnerOutput(self.seqs, tokens, self.sampled.row_logprobs() if self.seqs else None)


class ModelRunner:
    """Owns the model's forward and the KV cache: ``runner.execute_model(scheduled) -> LaunchedStep``.

    :param config: the engine's resolved config: ``block_size``, ``max_num_batched_tokens`` (sizes
        the pinned buffer), ``max_num_seqs``, ``max_model_len`` (sizes the block tables),
        ``enforce_eager`` (no compile, no CUDA graphs), ``compilation`` (compile the forward on
        CUDA; graphs are captured either way), ``max_graph_tokens`` and ``cuda_graph_sizes``
        (which steps replay a CUDA graph, see `graph_token_sizes`; a step replays the smallest
        graph that holds it).
    :param model: a Hugging Face causal LM; its attention is switched to ``"loramux"``.
    :param sampler: turns the sampled rows' logits into tokens (None on a tensor-parallel worker).
    :param lora_manager: a ``LoRAModelManager`` (``set_mapping``), or None without LoRA.
    :param workers: with tensor parallelism, the `WorkerGroup` of ranks 1..N-1 (this runner is
        rank 0): every forward, KV-cache allocation and graph capture runs on each rank, in the
        same order, so their collectives pair up; only rank 0 samples.
    """

    def __init__(self, config: EngineConfig, model: torch.nn.Module, *, sampler: Sampler | None,
                 lora_manager=None, workers=None) -> None:
        self.config = config
        self.model = model
        self.workers = workers  # a tensor-parallel WorkerGroup: every forward runs on each rank
        self.sampler = sampler
        self.lora_manager = lora_manager
        T_max = config.max_num_batched_tokens
        if config.cuda_graph_sizes:
            self.graph_sizes = sorted({min(T, T_max) for T in config.cuda_graph_sizes})
        else:
            self.graph_sizes = graph_token_sizes(config.max_num_seqs, min(config.max_graph_tokens, T_max))
        self.max_graph_tokens = self.graph_sizes[-1]
        self.max_blocks = blocks_needed(config.max_model_len, config.block_size)
        self.device = next(model.parameters()).device
        self.kv: PagedKVCache | None = None
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        cuda = self.device.type == "cuda"
        # the torch reference LoRA kernels cannot take a static meta, so no graphs with them
        self.use_graphs = not config.enforce_eager and cuda and (lora_manager is None or uses_triton(self.device))
        self.compiled = not config.enforce_eager and cuda and config.compilation
        # per token: id, position, slot, adapter slot, and up to two logits rows with their slots
        # (prompt logprobs); per sequence: length, offset, a logits row and its slot; block tables
        T, S = T_max + 1, config.max_num_seqs + 1
        # (a graph's step: 8 fields per padded token, StepGraphs)
        capacity = max(6 * T + 4 * S + 4, 8 * self.max_graph_tokens) + S * self.max_blocks + FIELD_ALIGN * 16
        self._host = torch.empty(capacity, dtype=torch.int32, pin_memory=cuda)
        self._copied: torch.cuda.Event | None = None  # recorded after the last copy out of _host
        self._queued: torch.cuda.Event | None = None  # recorded after the last step's GPU work
        self.last_tokens: torch.Tensor | None = None  # what the last step sampled, on the device
        self.graphs: StepGraphs | None = None
        self.last_step: StepShape | None = None  # the last `run`'s shape
        #: start-up seconds by stage ("capture", "warmup"; compile time is in `regions`)
        self.startup_seconds: dict[str, float] = {}
        self.regions: CompiledRegions | None = None
        if cuda:  # compiled graphs and Triton kernels (ours too) on disk: a second start reuses them
            self.compile_caches = configure_compile_caches()
        if self.compiled:
            self.regions = compile_repeated_blocks(model)  # compiles lazily, at the first forward
        else:
            restore_eager_blocks(model)  # a model an earlier compiled runner used runs eagerly again

    # -- set-up ---------------------------------------------------------------------------------

    def _model_forward(self, ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """ids, positions: [T]; logits_indices: [N] -> logits [N, V]."""
        out = self.model(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                         logits_to_keep=logits_indices)
        return out.logits[0]

    def _on_all_ranks(self, method: str, *args, **kwargs):
        """``self.method(*args, **kwargs)`` here and on every tensor-parallel worker; returns ours.

        The workers' answers are read before returning, i.e. before anything here synchronises
        with the device: a collective whose peer died would never complete.
        """
        result, ran = self._launch_on_all_ranks(method, 0, *args, **kwargs)
        if ran is not None:
            ran()
        return result

    def _launch_on_all_ranks(self, method: str, sampled: int, *args, **kwargs) -> tuple[object, Callable[[], None] | None]:
        """Queue ``self.method(*args, **kwargs)`` here and on every tensor-parallel worker without
        waiting for the workers: returns ours, and (with workers) what reads their answers, which
        must run before anything here waits on the device. ``sampled``: the tokens this step
        samples, which `_sample` shares with the workers."""
        if self.workers is None:
            return getattr(self, method)(*args, **kwargs), None
        call = self.workers.call(method, *args, sampled=sampled, **kwargs)
        try:
            result = getattr(self, method)(*args, **kwargs)
        except Exception:
            self.workers.after_local_failure(method)  # a WorkerError if a worker died: the real cause
            raise
        return result, functools.partial(self.workers.wait, method, call)

    def allocate_kv_cache(self, num_blocks: int) -> PagedKVCache:
        return self._on_all_ranks("_allocate_kv_cache", num_blocks)

    def _allocate_kv_cache(self, num_blocks: int) -> PagedKVCache:
        text_config = self.model.config.get_text_config()
        dtype = next(self.model.parameters()).dtype
        self.kv = PagedKVCache(text_config, num_blocks=num_blocks, block_size=self.config.block_size, dtype=dtype,
                               device=self.device)
        return self.kv

    def profile_peak_bytes(self) -> int:
        """Activation memory of the largest step (``max_num_batched_tokens`` tokens of prefill),
        measured by running it once over a scratch cache (CUDA only; it also compiles)."""
        return self._on_all_ranks("_profile_peak_bytes")

    @torch.inference_mode()
    def _profile_peak_bytes(self) -> int:
        assert self.device.type == "cuda"
        T, bs = self.config.max_num_batched_tokens, self.config.block_size
        self._allocate_kv_cache(blocks_needed(T, bs) + 1)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        seq_blocks = list(range(1, blocks_needed(T, bs) + 1))
        self._forward_packed(
            ids=[0] * T, positions=list(range(T)),
            kv_slots=[seq_blocks[p // bs] * bs + p % bs for p in range(T)],
            tables=[seq_blocks], seq_lens=[T], query_start=[0, T], lora_slots=None, logits=[T - 1], logit_slots=None,
        )
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.kv = None
        torch.cuda.empty_cache()
        return peak

    def capture_graphs(self) -> None:
        """Capture every step graph now (CUDA, unless eager); no graph is captured later."""
        if self.use_graphs:
            self._on_all_ranks("_capture_graphs")

    @torch.inference_mode()  # the static inputs are inference tensors, as every step's inputs are
    def _capture_graphs(self) -> None:
        if not self.use_graphs:
            return
        assert self.kv is not None, "allocate the KV cache before capturing graphs"
        started = time.perf_counter()
        if has_fp8_layers(self.model):
            from loramux.kernels.fp8_gemm import reserve_counters

            reserve_counters(self.device)  # the decode FP8 GEMM's split-K counters, made outside a capture
        self.graphs = StepGraphs(self, self.graph_sizes)
        self.graphs.capture_all()
        self.startup_seconds["capture"] = time.perf_counter() - started
        logger.info("captured %d step graphs in %.1f s", self.graphs.num_graphs, self.startup_seconds["capture"])
        self.log_compilation()

    def log_compilation(self) -> None:
        """Log what compiling cost and where its artefacts are cached (once the forward has run)."""
        if self.regions is not None:
            logger.info(
                "torch.compile: %d decoder layers share %d compiled frame(s), %.1f s (caches: %s, %s)",
                len(self.regions.blocks), self.regions.frames, self.regions.compile_seconds,
                self.compile_caches.inductor, self.compile_caches.triton,
            )

    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """Compile, now, every Triton kernel configuration a step can use (CUDA; after the KV
        cache exists): one step per distinct launch configuration, over the scratch KV block."""
        from loramux.engine.worker.kernel_warmup import warm_up_kernels

        if self.device.type != "cuda" or not uses_triton(self.device):
            return
        assert self.kv is not None, "allocate the KV cache before warming up the kernels"
        started = time.perf_counter()
        steps = warm_up_kernels(self)
        self.startup_seconds["warmup"] = time.perf_counter() - started
        logger.info("warmed up the Triton kernels with %d steps in %.1f s", steps, self.startup_seconds["warmup"])

    def close(self, *, release_weights: bool = False) -> None:
        """Give the step graphs and the KV cache back (the engine closes); with ``release_weights``
        the model's weights too, in place: a closed engine's model is still referenced (by the
        engine a caller holds, its LoRA layers), and its memory must go to the next engine."""
        self.graphs = None
        self.kv = None
        if release_weights:
            for tensor in itertools.chain(self.model.parameters(), self.model.buffers()):
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)

    @property
    def graph_steps(self) -> int:
        return self.graphs.steps if self.graphs is not None else 0

    @property
    def num_graphs(self) -> int:
        return self.graphs.num_graphs if self.graphs is not None else 0

    # -- one step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, batch: SchedulerOutput) -> LaunchedStep:
        """Queue the step's GPU work: compute the scheduled tokens and sample for every sequence
        whose last token is among them. Returns without waiting for it (`LaunchedStep.result`
        reads the tokens back), so the host can prepare the next step meanwhile.

        Each sequence's GPU slot is ``seq.lora_slot`` (set by the scheduler at admission). A
        sequence whose last token is pending (sampled by the step launched before this one, not
        read back) gets that token's id on the device, from that step's sampled tokens.
        """
        tokens = batch.num_tokens
        prompt_tokens = sum(n for seq, n in batch.chunks if seq.num_computed < seq.num_prompt_tokens)
        if self.graphs is not None and self.graphs.fits(batch):
            sampled = [seq for seq, n in batch.chunks if seq.num_computed + n == seq.num_tokens]
            inputs = self.graphs.step_inputs(batch.chunks)
            self.last_step = StepShape(len(batch), tokens, prompt_tokens, inputs.num_tokens, graph=True)
            logits, ran = self._launch_on_all_ranks("_replay", len(sampled), inputs)
            return self._sample(sampled, logits[: len(sampled)], ran)
        self.last_step = StepShape(len(batch), tokens, prompt_tokens, max(tokens, 2), graph=False)
        ids, positions, kv_slots, tables, seq_lens, query_start = [], [], [], [], [], [0]
        lora_slots, logits, logit_slots, sampled, pending = [], [], [], [], ([], [])
        bs = self.config.block_size
        for seq, n in batch.chunks:
            start, end = seq.num_computed, seq.num_computed + n
            lora_slot = seq.lora_slot
            table = seq.block_table
            seq.add_input_ids(ids, pending, start, end)
            positions.extend(range(start, end))
            kv_slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            tables.append(table)
            seq_lens.append(end)
            query_start.append(query_start[-1] + n)
            lora_slots.extend([lora_slot] * n)
            if end == seq.num_tokens:  # the chunk reaches the last token: sample after it
                logits.append(len(ids) - 1)
                logit_slots.append(lora_slot)
                sampled.append(seq)
        uses_lora = any(s >= 0 for s in lora_slots)
        prompt_plan = plan_prompt_logprobs(batch.chunks)  # None unless a request asks for them
        if prompt_plan is not None:  # their rows come after the sampled ones
            logits, logit_slots = logits + prompt_plan.index, logit_slots + prompt_plan.slots
        out, ran = self._launch_on_all_ranks(
            "_forward_packed", len(sampled), ids=ids, positions=positions, kv_slots=kv_slots, tables=tables, seq_lens=seq_lens,
            query_start=query_start, lora_slots=lora_slots if uses_lora else None, logits=logits,
            logit_slots=logit_slots if uses_lora else None, pending=pending if pending[0] else None,
        )
        if prompt_plan is not None:
            record_prompt_logprobs(out[len(sampled) : len(sampled) + len(prompt_plan.index)], prompt_plan)
        return self._sample(sampled, out[: len(sampled)], ran)

    def _replay(self, inputs) -> torch.Tensor:
        return self.graphs.replay(inputs)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, ranks_ran: Callable[[], None] | None) -> LaunchedStep:
        sampled = self.sampler(logits, seqs) if seqs else None
        self.last_tokens = sampled.token_ids if seqs else None
        if seqs and self.workers is not None:  # the workers' next step may take pending ids from them
            share_sampled(sampled.token_ids)
        step = LaunchedStep(seqs, sampled, ranks_ran=ranks_ran)
        if self.device.type == "cuda":
            if seqs:  # non_blocking to the CPU: into page-locked memory, queued behind the step
                step.host_tokens = sampled.token_ids.to("cpu", non_blocking=True)
            self._queued = step.copied = torch.cuda.Event()
            self._queued.record()
        return step

    def computing(self) -> bool:
        """Whether the GPU still runs the last step's work (on the CPU, which runs it as it is
        queued: False). Host work beside the step is hidden until then."""
        return self._queued is not None and not self._queued.query()

    def fill_pending(self, ids: torch.Tensor, at: torch.Tensor, rows: torch.Tensor) -> None:
        """Write the pending tokens' ids into a step's token ids on the device: ``ids[at[i]] =``
        row ``rows[i]`` of the tokens the last step sampled (`Sequence.add_input_ids` left 0 there)."""
        assert self.last_tokens is not None, "a pending token, but the last step sampled nothing"
        ids.index_copy_(0, at.long(), self.last_tokens.index_select(0, rows).to(ids.dtype))

    def _forward_packed(self, *, ids, positions, kv_slots, tables, seq_lens, query_start, lora_slots, logits,
                        logit_slots, pending=None) -> torch.Tensor:
        """One eager (or compiled, dynamic-shape) forward over the packed step; logits [N, V].
        ``pending``: the token indices whose ids are still on the device, and their rows in the
        last step's sampled tokens (`Sequence.add_input_ids`)."""
        # at least 2 tokens and 2 logits rows: size-1 dims would get a compiled graph of their own
        # (dynamo specialises them), which would compile while serving; padding costs nothing
        if len(ids) < 2:
            ids, positions, kv_slots = ids + [0], positions + [0], kv_slots + [-1]  # writes nothing
            lora_slots = lora_slots + [-1] if lora_slots is not None else None
        if len(logits) < 2:  # repeat the one row (or take row 0 of a step that samples nothing)
            pad = 2 - len(logits)
            logits = logits + (logits[-1:] or [0]) * pad
            logit_slots = logit_slots + (logit_slots[-1:] or [-1]) * pad if logit_slots is not None else None
        width = max(len(t) for t in tables)
        flat_tables = [b for t in tables for b in t + [0] * (width - len(t))]
        fields = [ids, positions, kv_slots, seq_lens, query_start, logits, flat_tables]
        if lora_slots is not None:
            fields += [lora_slots, logit_slots]
        if pending is not None:
            fields += list(pending)
        device_fields = self.to_device(fields)
        t_ids, t_pos, t_slots, t_lens, t_qsl, t_logits, t_tables = device_fields[:7]
        if self.lora_manager is not None:
            if lora_slots is None:
                self.lora_manager.set_mapping(None)
            else:
                self.lora_manager.set_mapping(device_fields[7], device_fields[8])
        metadata = AttentionMetadata(
            k_cache=self.kv.k, v_cache=self.kv.v, slot_mapping=t_slots,
            block_tables=t_tables.view(len(tables), width), seq_lens=t_lens, query_start_loc=t_qsl,
        )
        # whole tensors, not views of the transfer buffer: the graphs' inputs are whole tensors
        # too, and the position ids reach every compiled layer, where a view's storage offset
        # would be guarded (a recompile per offset)
        t_ids = t_ids.clone()
        if pending is not None:
            self.fill_pending(t_ids, *device_fields[-2:])
        with forward_context(metadata):
            return self._model_forward(t_ids, t_pos.clone(), t_logits.clone())

    def to_device(self, fields: list[list[int]]) -> list[torch.Tensor]:
        """Copy int lists to the device in one transfer through the pinned buffer; views per field."""
        sizes = [len(f) for f in fields]
        # every field starts 16-byte aligned: Triton specializes a kernel on its pointers' alignment,
        # so packed offsets that vary with the batch would build new kernels while serving
        padded = [-(-n // FIELD_ALIGN) * FIELD_ALIGN for n in sizes]
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has left the buffer (it always has by now)
        host = self._host[:sum(padded)]
        values = []
        for field, size in zip(fields, padded):
            values.extend(field)
            values.extend([0] * (size - len(field)))
        host.copy_(torch.tensor(values, dtype=torch.int32))
        if self.device.type == "cuda":
            device = host.to(self.device, non_blocking=True)
        else:
            device = host.clone()
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return [view[:n] for view, n in zip(device.split(padded), sizes)]

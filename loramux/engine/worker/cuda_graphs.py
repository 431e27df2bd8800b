"""Steps as CUDA graphs, every one captured at start, none while serving.

One graph per padded token count ``T``: the decode sizes (2, 4, 8, then steps of 16 up to
``max_num_seqs``) and, above them, sizes a quarter of a power of two apart (..., 112, 128, 160,
192, 224, 256, 320, ...) up to ``max_graph_tokens`` (default 4096, capped at
``max_num_batched_tokens``), so a prefill or a mixed step of prefill chunks and decodes replays a
graph too. A step above a few hundred tokens is compute-bound and pays for its padding tokens'
GEMMs: the ladder keeps the padding under a quarter of the step, where powers of two would pad one
up to double. (Eagerly, the Python of a step's 32 layers costs several times the GPU's time for a
128-token prompt, and that host time lands in every request's time to first token; see
docs/benchmarks/many_adapters.md.) With LoRA enabled each size has a second graph for steps that
use adapters (the base graph launches no LoRA kernel at all, so a LoRA engine serving base
requests runs the base model's step), and, where some layers' GEMMs are big
(`BaseLayerWithLoRA.big_gemm`: gate_up and down at 8B), a third for steps whose adapters all leave
those layers alone (q/v adapters): there those layers run their base GEMM only, without the SMs a
delta beside it would take. The variant is chosen per replay from the adapters in use, not their
number: each of the three serves any mix of its kind.

A graph of ``T`` tokens holds up to ``T`` sequences (each has at least one token). Its inputs are
static device tensors filled before each replay in one transfer: per token the id, position,
cache slot and adapter slot; per sequence the length, the end of its tokens, the logits row it
samples from and that row's adapter slot; the block tables' used columns (a long
``max_model_len`` costs nothing per step). Padding tokens are one-token sequences of length 0:
they write no K/V, read no keys (attention gives zeros) and use no adapter; padding sequences
past them hold no token. The attention and LoRA kernels size their grids from shapes alone and
the LoRA kernel metadata is built inside the graph from the adapter slots (no host sync), so one
graph serves any mix of decodes, prefill chunks, adapters and base rows. Graphs share one memory
pool, and the graphs above ``max_num_seqs`` tokens (each samples at most ``max_num_seqs`` rows)
copy their logits into one tensor: an output a graph keeps is memory no other graph can reuse, and
``max_num_seqs`` rows of a large vocabulary are 16 MB a graph at 8B. Steps replay one at a time and
sample before the next, so one output serves them all; decode graphs keep their own (no copy on
the decode step). Steps that ask for prompt logprobs (logits for every prompt row) run eagerly.

Captures run in ``thread_local`` error mode and only before the engine serves: loader threads
(pinning host memory is a CUDA call) cannot invalidate a capture, and no capture ever meets a
running load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from loramux.engine.worker.forward_context import AttentionMetadata, forward_context
from loramux.engine.worker.prompt_logprobs import plan_prompt_logprobs

if TYPE_CHECKING:
    from loramux.engine.worker.model_runner import ModelRunner
    from loramux.engine.core.step_outputs import SchedulerOutput
    from loramux.engine.core.sequence import Sequence

__all__ = ["BASE", "LORA", "LORA_SMALL_GEMMS", "StepGraphs", "StepInputs", "graph_batch_sizes", "graph_token_sizes"]

#: The graph variants of a size: no adapter; adapters; adapters that leave every big-GEMM layer alone.
BASE, LORA, LORA_SMALL_GEMMS = "base", "lora", "lora, small GEMMs only"

#: Rows of the per-token and per-sequence fields: ids, positions, cache slots, adapter slots;
#: sequence lengths, token ends, logits rows, logits rows' adapter slots
_FIELDS = 8


@dataclass
class StepInputs:
    """One replay's inputs, on the host: the padded token count, the flattened fields and block
    tables (`StepGraphs._host_fields`), the adapter slots in use and the graph variant that
    serves them (`BASE`, `LORA`, `LORA_SMALL_GEMMS`), and the tokens whose ids are pending (their
    indices, and their rows in the last step's sampled tokens: `Sequence.add_input_ids`). Plain
    values, so a tensor-parallel driver can send them to its workers, whose graphs replay the
    same step."""

    num_tokens: int
    num_seqs: int
    host_fields: list[list[int]]
    active_slots: list[int]
    variant: str = BASE
    pending: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The padded decode batch sizes graphs are captured for: 2, 4, 8, 16, 32, 48, ... (a batch
    of one runs as two rows: size-1 dims would need a compiled graph of their own)."""
    sizes = {b for b in (2, 4, 8) if b < max_num_seqs} | set(range(16, max_num_seqs, 16)) | {max(2, max_num_seqs)}
    return sorted(sizes)


def graph_token_sizes(max_num_seqs: int, max_graph_tokens: int) -> list[int]:
    """Every padded token count a graph is captured for: the decode sizes, then above
    ``max_num_seqs`` the ladder 2, 4, 8, 16, steps of 16 to 128, then four sizes between
    consecutive powers of two (160, 192, 224, 256, 320, ...), and ``max_graph_tokens`` itself (a
    step of more tokens runs eagerly). A step of ``t`` tokens pads by less than ``max(16, t / 4)``."""
    sizes = graph_batch_sizes(max_num_seqs)
    size = 2
    while size < max_graph_tokens:
        if size > sizes[-1]:
            sizes.append(size)
        # a quarter of the power of two at or below size, at least 16
        size = 2 * size if size < 16 else size + max(16, (1 << (size.bit_length() - 1)) // 4)
    if max_graph_tokens > sizes[-1]:
        sizes.append(max_graph_tokens)
    return sizes


class StepGraphs:
    """The step graphs of one runner: ``capture_all()`` once, then ``replay(step_inputs(batch))``."""

    def __init__(self, runner: ModelRunner, sizes: list[int]) -> None:
        self.runner = runner
        self.sizes = sizes
        S, device = sizes[-1], runner.device
        # each graph reads the first T columns of every row (views at the same offsets whatever T:
        # nothing for dynamo to specialise on)
        self.fields = torch.zeros(_FIELDS, S, dtype=torch.int32, device=device)
        self.tables = torch.zeros(S, runner.max_blocks, dtype=torch.int32, device=device)
        self.query_start = torch.zeros(S + 1, dtype=torch.int32, device=device)  # [0] stays 0
        # the compiled forward's own inputs (token ids, positions, logits rows): whole tensors of
        # each size, not views, as in eager steps, so both calls pass the same guards
        # logits rows: one per sequence that samples, at most max_num_seqs (a big graph holds many
        # more tokens, and the LM head on all of them would cost a prefill's worth of work)
        rows = {T: min(T, max(2, runner.config.max_num_seqs)) for T in sizes}
        self.inputs = {T: (torch.zeros(T, dtype=torch.int32, device=device),
                           torch.zeros(T, dtype=torch.int32, device=device),
                           torch.zeros(rows[T], dtype=torch.int32, device=device)) for T in sizes}
        manager = runner.lora_manager
        self.variants: tuple[str, ...] = (BASE,)
        if manager is not None:
            self.variants += (LORA, LORA_SMALL_GEMMS) if manager.has_big_gemms else (LORA,)
        self._graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._shared_logits: torch.Tensor | None = None  # the output of every graph above max_num_seqs
        self._pool = None
        self.steps = 0  # steps served by a replay (tests and benchmarks read it)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def fits(self, batch: SchedulerOutput) -> bool:
        """A step of at most the largest graph's tokens that asks for no prompt logprobs."""
        tokens = sum(n for _, n in batch.chunks)
        return 0 < tokens <= self.sizes[-1] and plan_prompt_logprobs(batch.chunks) is None

    def step_inputs(self, chunks: list[tuple[Sequence, int]]) -> StepInputs:
        """The host side of a replay for the scheduled ``chunks`` (sequence, tokens this step)."""
        tokens = sum(n for _, n in chunks)
        T = next(t for t in self.sizes if t >= tokens)
        slots = sorted({seq.lora_slot for seq, _ in chunks if seq.lora_slot >= 0})
        pending = ([], [])
        fields = self._host_fields(chunks, T, pending)
        return StepInputs(T, len(chunks), fields, slots, self._variant(slots), pending)

    def _variant(self, slots: list[int]) -> str:
        if not slots:
            return BASE
        if LORA_SMALL_GEMMS in self.variants and self.runner.lora_manager.leaves_big_gemms(slots):
            return LORA_SMALL_GEMMS
        return LORA

    def _host_fields(self, chunks: list[tuple[Sequence, int]], T: int,
                     pending: tuple[list[int], list[int]]) -> list[list[int]]:
        """The static inputs' values for ``chunks`` padded to ``T`` tokens: the fields' rows
        flattened, then the sequences' block tables' used columns (the kernels read no column past
        a row's length, and padding rows none). Pending tokens go to ``pending``
        (`Sequence.add_input_ids`)."""
        bs = self.runner.config.block_size
        ids, positions, cache_slots, lora_slots = [], [], [], []
        lens, ends, logits_rows, logits_slots = [], [], [], []
        width = max((len(seq.block_table) for seq, _ in chunks), default=1)
        tables = []
        for seq, n in chunks:
            start, end = seq.num_computed, seq.num_computed + n
            table = seq.block_table
            seq.add_input_ids(ids, pending, start, end)
            positions.extend(range(start, end))
            cache_slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            lora_slots.extend([seq.lora_slot] * n)
            lens.append(end)
            ends.append(len(ids))
            tables.extend(table + [0] * (width - len(table)))
            if end == seq.num_tokens:  # the chunk reaches the last token: sample after it
                logits_rows.append(len(ids) - 1)
                logits_slots.append(seq.lora_slot)
        real = len(ids)
        # padding tokens: one-token sequences of length 0; then sequences of no token up to T
        # (a graph of T tokens reads T columns of each row: the host builds no more, whatever
        # the largest graph, since this runs before every step)
        ends += list(range(real + 1, T + 1))
        rows = [ids, positions, cache_slots, lora_slots, lens, ends, logits_rows, logits_slots]
        pads = [0, 0, -1, -1, 0, T, 0, -1]
        flat = [v for row, pad in zip(rows, pads) for v in row + [pad] * (T - len(row))]
        return [flat, tables]

    def _load(self, inputs: StepInputs) -> None:
        """Fill the static inputs: one copy of the fields, one of the block tables' used columns;
        then the pending tokens' ids, from the last step's sampled tokens."""
        T, B = inputs.num_tokens, inputs.num_seqs
        at, rows = inputs.pending
        flat, tables, *pending = self.runner.to_device(inputs.host_fields + ([at, rows] if at else []))
        self.fields[:, :T].copy_(flat.view(_FIELDS, T))
        self.query_start[1 : T + 1].copy_(self.fields[5, :T])
        if B:
            width = len(inputs.host_fields[1]) // B
            self.tables[:B, :width].copy_(tables.view(B, width))
        ids, positions, logits_rows = self.inputs[T]
        ids.copy_(self.fields[0, :T])
        if pending:
            self.runner.fill_pending(ids, *pending)
        positions.copy_(self.fields[1, :T])
        logits_rows.copy_(self.fields[6, : len(logits_rows)])

    def replay(self, inputs: StepInputs) -> torch.Tensor:
        """Run the step `step_inputs` described; returns logits ``[min(T, max_num_seqs), V]``: the
        sampled sequences' rows first, in their order (the rest is padding)."""
        self._load(inputs)
        if inputs.active_slots:
            self.runner.lora_manager.mark_used(inputs.active_slots)
        graph, logits = self._graphs[(inputs.num_tokens, inputs.variant)]
        graph.replay()
        self.steps += 1
        return logits

    @torch.inference_mode()
    def capture_all(self) -> None:
        keys = [(T, variant) for T in reversed(self.sizes) for variant in self.variants]  # largest first: pool reuse
        for T, variant in tqdm(keys, desc="Capturing step graphs", unit="graph", leave=False):
            self._graphs[(T, variant)] = self._capture(T, variant)

    def forward_fn(self, T: int, variant: str) -> Callable[[], torch.Tensor]:
        """The forward a graph of ``T`` tokens captures, reading the static inputs (which it
        builds, for LoRA, the kernel metadata from inside the graph); ``variant``: `BASE`, `LORA`
        or `LORA_SMALL_GEMMS`. Runs without a capture too (tests compare it with the eager step on
        the CPU)."""
        runner = self.runner
        _, _, cache_slots, lora_slots, lens, _, _, logits_slots = self.fields[:, :T]
        ids, pos, logits_rows = self.inputs[T]
        logits_slots = logits_slots[: len(logits_rows)]
        metadata = AttentionMetadata(
            k_cache=runner.kv.k, v_cache=runner.kv.v, slot_mapping=cache_slots, block_tables=self.tables[:T],
            seq_lens=lens, query_start_loc=self.query_start[: T + 1],
        )
        manager = runner.lora_manager
        max_seqs = runner.config.max_num_seqs
        shared = T > max_seqs

        def forward() -> torch.Tensor:
            if manager is not None:  # the kernel metadata is built inside the graph from the slots
                if variant != BASE:  # the logits rows' own slots only for a model whose LM head has LoRA
                    # a step's tokens belong to at most max_num_seqs sequences, one adapter each
                    manager.set_mapping(lora_slots, logits_slots if manager.has_logits_layer else None, static=True,
                                        skip_big=variant == LORA_SMALL_GEMMS, max_distinct=max_seqs)
                else:
                    manager.set_mapping(None)
            with forward_context(metadata):
                logits = runner._model_forward(ids, pos, logits_rows)
            return self._share(logits) if shared else logits

        return forward

    def _share(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` copied into the one output of the graphs above ``max_num_seqs`` (all of
        ``max_num_seqs`` rows), made by the first such forward: a warm-up, outside any capture."""
        if self._shared_logits is None:
            self._shared_logits = torch.empty_like(logits)
        return self._shared_logits.copy_(logits)

    def _capture(self, T: int, variant: str) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        runner = self.runner
        manager = runner.lora_manager
        self._load(StepInputs(T, 0, self._host_fields([], T, ([], [])), []))  # all padding
        forward = self.forward_fn(T, variant)
        # warm up outside the capture (compilation, autotuning, lazily made tables)
        stream = torch.cuda.Stream(runner.device)
        stream.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(runner.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: CUDA calls other threads make (a loader pinning memory) cannot invalidate it
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = forward()
        except Exception as exc:
            raise RuntimeError(
                f"capturing the step graph for {T} tokens failed ({type(exc).__name__}: {exc}); "
                "pass enforce_eager=True to run without graphs"
            ) from exc
        finally:
            if manager is not None:
                manager.set_mapping(None)
        return graph, logits

"""Decode steps as CUDA graphs, every one captured at start, none while serving.

One graph per padded batch size ``B`` (2, 4, 8, then steps of 16 up to ``max_num_seqs``), and
with LoRA enabled a second one per size for batches that use adapters (the base graph launches
no LoRA kernel at all, so a LoRA engine serving base requests runs the base model's step). The
graphs' inputs are the step's token ids, positions, cache slots, sequence lengths, adapter slots
and block tables, in static device tensors filled before each replay (one transfer; the tables'
used columns only, so a long ``max_model_len`` costs nothing per step); padding
rows write no K/V (slot -1), read no keys (length 0) and use no adapter. The LoRA kernel metadata
is built inside the graph from the adapter slots (no host sync; launch grids independent of the
adapter mix), so one graph serves any mix of adapters and base rows. Graphs share one memory pool.

Captures run in ``thread_local`` error mode and only before the engine serves: loader threads
(pinning host memory is a CUDA call) cannot invalidate a capture, and no capture ever meets a
running load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from loramux.engine.forward_context import AttentionMetadata, forward_context

if TYPE_CHECKING:
    from loramux.engine.model_runner import ModelRunner
    from loramux.engine.scheduler import ScheduledBatch
    from loramux.engine.sequence import Sequence

__all__ = ["DecodeGraphs", "DecodeInputs", "graph_batch_sizes"]


@dataclass
class DecodeInputs:
    """One replay's inputs, on the host: the padded batch size, the flattened per-row fields and
    block tables (`DecodeGraphs._host_fields`), and the adapter slots in use."""

    batch_size: int
    host_fields: list[list[int]]
    active_slots: list[int]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes decode graphs are captured for: 2, 4, 8, 16, 32, 48, ... (a batch of
    one runs as two rows: size-1 dims would need a compiled graph of their own)."""
    sizes = {b for b in (2, 4, 8) if b < max_num_seqs} | set(range(16, max_num_seqs, 16)) | {max(2, max_num_seqs)}
    return sorted(sizes)


class DecodeGraphs:
    """The decode graphs of one runner: ``capture_all()`` once, then ``replay(seqs, slots)``."""

    def __init__(self, runner: ModelRunner, sizes: list[int]) -> None:
        self.runner = runner
        self.sizes = sizes
        S, device = sizes[-1], runner.device
        # per row: token ids, positions, cache slots, lengths, adapter slots; each graph reads the
        # first B columns (views at the same offsets whatever B: nothing for dynamo to specialise on)
        self.fields = torch.zeros(5, S, dtype=torch.int32, device=device)
        self.tables = torch.zeros(S, runner.max_blocks, dtype=torch.int32, device=device)
        self.query_start = torch.arange(S + 1, dtype=torch.int32, device=device)  # one token per row
        # the compiled forward's own inputs (token ids, positions, logits rows): whole tensors of
        # each size, not views, as in eager steps, so both calls pass the same guards
        self.inputs = {B: (torch.zeros(B, dtype=torch.int32, device=device),
                           torch.zeros(B, dtype=torch.int32, device=device),
                           torch.arange(B, dtype=torch.int32, device=device)) for B in sizes}
        self.variants = (False, True) if runner.lora_manager is not None else (False,)
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.steps = 0  # decode steps served by a replay (tests and benchmarks read it)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def fits(self, batch: ScheduledBatch) -> bool:
        """A decode-only step no larger than the largest graph."""
        return 0 < len(batch.chunks) <= self.sizes[-1] and all(
            n == 1 and seq.num_computed + 1 == seq.num_tokens for seq, n in batch.chunks
        )

    def decode_inputs(self, seqs: list[Sequence], lora_slots: list[int]) -> DecodeInputs:
        """The host side of a replay for ``seqs`` (all decoding): plain lists, so a tensor-parallel
        driver can send them to its workers, whose graphs replay the same step."""
        B = next(b for b in self.sizes if b >= len(seqs))
        return DecodeInputs(B, self._host_fields(seqs, lora_slots, B), sorted({s for s in lora_slots if s >= 0}))

    def _host_fields(self, seqs: list[Sequence], lora_slots: list[int], B: int) -> list[list[int]]:
        """The static inputs' values for ``seqs`` padded to ``B`` rows: the five per-row fields
        flattened, then the block tables' used columns (the kernels read no column past a row's length)."""
        bs, pad = self.runner.block_size, self.sizes[-1] - len(seqs)
        positions = [s.num_computed for s in seqs]
        width = max((len(s.block_table) for s in seqs), default=1)
        fields = [
            [s.token_at(p) for s, p in zip(seqs, positions)] + [0] * pad,
            positions + [0] * pad,
            [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)] + [-1] * pad,
            [p + 1 for p in positions] + [0] * pad,
            list(lora_slots) + [-1] * pad,
        ]
        tables = [b for s in seqs for b in s.block_table + [0] * (width - len(s.block_table))]
        return [[v for f in fields for v in f], tables + [0] * ((B - len(seqs)) * width)]

    def _load(self, host_fields: list[list[int]], B: int) -> None:
        """Fill the static inputs: one copy of the fields, one of the block tables' used columns."""
        S = self.sizes[-1]
        flat, tables = self.runner.to_device(host_fields)
        width = max(1, len(host_fields[1]) // B)
        self.fields.copy_(flat.view(5, S))
        self.tables[:B, :width].copy_(tables.view(B, width))
        ids, positions, _ = self.inputs[B]
        ids.copy_(self.fields[0, :B])
        positions.copy_(self.fields[1, :B])

    def replay(self, inputs: DecodeInputs) -> torch.Tensor:
        """Run the step `decode_inputs` described; returns logits ``[B, V]`` (rows past the
        step's sequences: padding)."""
        self._load(inputs.host_fields, inputs.batch_size)
        if inputs.active_slots:
            self.runner.lora_manager.mark_used(inputs.active_slots)
        graph, logits = self._graphs[(inputs.batch_size, bool(inputs.active_slots))]
        graph.replay()
        self.steps += 1
        return logits

    @torch.inference_mode()
    def capture_all(self) -> None:
        keys = [(B, lora) for B in reversed(self.sizes) for lora in self.variants]  # largest first: pool reuse
        for B, lora in tqdm(keys, desc="Capturing decode graphs", unit="graph", leave=False):
            self._graphs[(B, lora)] = self._capture(B, lora)

    def _capture(self, B: int, lora: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        runner = self.runner
        self._load(self._host_fields([], [], B), B)  # all padding
        _, _, slots, lens, lora_slots = self.fields[:, :B]
        ids, pos, logits_rows = self.inputs[B]
        metadata = AttentionMetadata(
            k_cache=runner.kv.k, v_cache=runner.kv.v, slot_mapping=slots, block_tables=self.tables[:B],
            seq_lens=lens, query_start_loc=self.query_start[: B + 1],
        )
        manager = runner.lora_manager

        def forward() -> torch.Tensor:
            if manager is not None:  # the kernel metadata is built inside the graph from the slots
                if lora:
                    manager.set_mapping(lora_slots, static=True)
                else:
                    manager.set_mapping(None)
            with forward_context(metadata):
                return runner._model_forward(ids, pos, logits_rows)

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
                f"capturing the decode graph for batch size {B} failed ({type(exc).__name__}: {exc}); "
                "pass enforce_eager=True to run without graphs"
            ) from exc
        finally:
            if manager is not None:
                manager.set_mapping(None)
        return graph, logits

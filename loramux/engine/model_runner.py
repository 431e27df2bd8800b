"""Run one scheduled step: build its inputs once, one forward for every sequence, sample.

Per step the host builds plain lists (token ids, positions, cache rows, adapter slots, logits
rows), copies them to the device in a single transfer through a reusable pinned buffer, sets the
adapter mapping once for all LoRA layers, runs the model once with every token packed into one
row, and reads the sampled tokens back: one host sync for the tokens, plus the one the LoRA
metadata needs when a step uses adapters. Nothing inside the forward waits for the host.

On CUDA, decode-only steps replay CUDA graphs (unless ``enforce_eager``): the host cost of an
eager Hugging Face forward (thousands of launches, ~180 us per LoRA projection) is paid once per
graph, at capture. A graph is keyed by ``(B, R, L, A)``: the batch padded to a bucket ``B``
(1, 2, 4, 8, then multiples of 16, and ``max_num_seqs``), the cache rows ``[0, R)`` and keys
``[0, L)`` the decode attention reads (both rounded up, so a run sees a handful of shapes), and
``A``, a power-of-two bound on the distinct adapters in the batch (0: no adapter, the base
model's graph). Its inputs live in one static tensor, filled by a single copy before replay;
padding tokens write their K/V into the cache's scratch row and use no adapter. The LoRA
metadata is a static meta built inside the graph (no host sync; launch grids sized for ``B``
tokens over ``A`` slots), so the replay recomputes it from the slots of the step. Graphs are
captured lazily, the first time a key is met (one eager warm-up forward, then the capture), and
share one memory pool. Prefill and mixed steps stay eager.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loramux.engine.kv_cache import ATTN_IMPLEMENTATION, AttentionBatch, KVCache
from loramux.engine.prompt_logprobs import plan_prompt_logprobs, record_prompt_logprobs
from loramux.kernels.dispatch import uses_triton
from loramux.engine.sampler import Sampler
from loramux.engine.scheduler import ScheduledBatch
from loramux.engine.sequence import Sequence

__all__ = ["ModelRunner"]

ROW_ALIGN = 8
LEN_ALIGN = 64


def _round_up(value: int, multiple: int, limit: int) -> int:
    return min(-(-value // multiple) * multiple, limit)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes decode graphs are captured for: 1, 2, 4, 8, 16, 32, 48, ..."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_num_seqs} | set(range(16, max_num_seqs, 16)) | {max_num_seqs}
    return sorted(sizes)


def graph_key_length(length: int, limit: int) -> int:
    """Keys a decode graph attends over: ``length`` rounded up to 64, or to 1/8 of its power of
    two above 512 (at most 12.5% of extra keys, ~8 lengths per doubling)."""
    return _round_up(length, max(LEN_ALIGN, _next_pow2(length) // 8), limit)


class _DecodeGraph:
    """One captured decode step: its static inputs and the logits it leaves behind."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: torch.Tensor, logits: torch.Tensor) -> None:
        self.graph = graph
        self.inputs = inputs  # [4B + R] int64: ids, positions, rows, slots (per token), positions per row
        self.logits = logits  # [B, V]


class ModelRunner:
    """Owns the model's forward: ``runner.run(batch, slot_of) -> [(sequence, new token)]``.

    :param model: a Hugging Face causal LM; its attention is switched to ``"loramux"``.
    :param kv_cache: the cache the attention reads and writes.
    :param lora_manager: a ``LoRAModelManager`` (``set_mapping``), or None without LoRA.
    :param max_num_batched_tokens: the most tokens one step holds (sizes the pinned buffer).
    :param enforce_eager: never use CUDA graphs (they are used for decode-only steps on CUDA).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        *,
        sampler: Sampler,
        lora_manager=None,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enforce_eager: bool = False,
    ) -> None:
        self.model = model
        self.kv = kv_cache
        self.sampler = sampler
        self.lora_manager = lora_manager
        self.device = next(model.parameters()).device
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        # 4 per token, 4 per sequence, 2 per cache row; and 2 per token for prompt-logprob rows
        capacity = 6 * max_num_batched_tokens + 4 * max_num_seqs + 2 * kv_cache.num_rows
        self._host = torch.empty(capacity, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._copied = None  # a CUDA event after the last copy out of _host
        # CUDA graphs for decode-only steps; the torch reference kernels cannot take a static meta
        self.use_graphs = (
            not enforce_eager
            and self.device.type == "cuda"
            and (lora_manager is None or uses_triton(self.device))
        )
        self.graph_batch_sizes = graph_batch_sizes(max_num_seqs)
        self._graphs: dict[tuple[int, int, int, int], _DecodeGraph] = {}
        self._pool = None
        self.graph_steps = 0  # decode steps served by a graph replay (tests and benchmarks read it)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def release_graphs(self) -> None:
        """Drop every captured graph (and, with the last of them, their memory pool)."""
        self._graphs.clear()
        self._pool = None

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, slot_of: Callable[[str], int | None]) -> list[tuple[Sequence, int]]:
        """Compute the scheduled tokens and sample for every sequence whose last token was among them."""
        if (
            self.use_graphs
            and batch.chunks
            and len(batch.chunks) <= self.graph_batch_sizes[-1]
            and all(n == 1 and seq.num_computed + 1 == seq.num_tokens for seq, n in batch.chunks)
        ):
            return self._run_decode_graph([seq for seq, _ in batch.chunks], slot_of)
        # single-token chunks (decodes) first: the attention batches them together
        chunks = [c for c in batch.chunks if c[1] == 1] + [c for c in batch.chunks if c[1] > 1]
        ids, positions, rows, slots = [], [], [], []
        decode_rows, decode_pos = [], {}
        prefills = []
        logit_index, logit_slots, sampled = [], [], []
        for seq, n in chunks:
            start = seq.num_computed
            first = len(ids)
            slot = -1 if seq.lora_name is None else slot_of(seq.lora_name)
            ids.extend(seq.token_at(p) for p in range(start, start + n))
            positions.extend(range(start, start + n))
            rows.extend([seq.kv_row] * n)
            slots.extend([slot] * n)
            if n == 1:
                decode_rows.append(seq.kv_row)
                decode_pos[seq.kv_row] = start
            else:
                prefills.append((first, n, seq.kv_row, start))
            if start + n == seq.num_tokens:  # the chunk reaches the last token: sample after it
                logit_index.append(first + n - 1)
                logit_slots.append(slot)
                sampled.append(seq)
        # round the decode attention's shape up ([R rows, L keys]), so a run sees a handful of
        # shapes instead of a new one every step (kernel selection and plan caches key on shape)
        pad_rows = _round_up(max(decode_rows, default=-1) + 1, ROW_ALIGN, self.kv.num_rows) if decode_rows else 0
        pad_len = _round_up(max(decode_pos.values(), default=0) + 1, LEN_ALIGN, self.kv.max_len)
        pos_by_row = [decode_pos.get(r, 0) for r in range(pad_rows)]
        prompt_plan = plan_prompt_logprobs(chunks, slot_of)  # None unless a request asks for them
        if prompt_plan is not None:  # their rows come after the sampled ones
            logit_index, logit_slots = logit_index + prompt_plan.index, logit_slots + prompt_plan.slots
        fields = (ids, positions, rows, slots, decode_rows, pos_by_row, logit_index, logit_slots)
        device_fields = self._to_device(fields)
        t_ids, t_pos, t_rows, t_slots, t_dec_rows, t_dec_pos, t_logit_index, t_logit_slots = device_fields

        attention = AttentionBatch(
            kv=self.kv,
            write_rows=t_rows,
            write_positions=t_pos,
            num_decode=len(decode_rows),
            decode_rows=t_dec_rows,
            decode_positions=t_dec_pos,
            decode_pad_rows=pad_rows,
            decode_max_len=pad_len,
            prefills=prefills,
        )
        if self.lora_manager is not None:
            uses_lora = any(s >= 0 for s in slots)
            self.lora_manager.set_mapping(t_slots if uses_lora else None, t_logit_slots if uses_lora else None)
        out = self.model(
            input_ids=t_ids[None],
            position_ids=t_pos[None],
            use_cache=False,
            logits_to_keep=t_logit_index,
            loramux_batch=attention,
        )
        logits = out.logits[0]  # [B, V]
        if prompt_plan is not None:
            record_prompt_logprobs(logits[len(sampled):], prompt_plan)
        if not sampled:
            return []
        tokens = self.sampler(logits[: len(sampled)], sampled).token_ids
        return list(zip(sampled, tokens.tolist()))

    # -- CUDA graphs for decode-only steps ---------------------------------------------------------

    def _run_decode_graph(self, seqs: list[Sequence], slot_of) -> list[tuple[Sequence, int]]:
        n = len(seqs)
        B = next(b for b in self.graph_batch_sizes if b >= n)
        slots = [-1 if s.lora_name is None else slot_of(s.lora_name) for s in seqs]
        active = sorted({s for s in slots if s >= 0}) if self.lora_manager is not None else []
        A = min(_next_pow2(len(active)), self.lora_manager.context.num_slots) if active else 0
        rows = [s.kv_row for s in seqs]
        positions = [s.num_computed for s in seqs]
        R = _round_up(max(rows) + 1, ROW_ALIGN, self.kv.num_rows)
        L = graph_key_length(max(positions) + 1, self.kv.max_len)
        pad = B - n
        pos_by_row = [0] * R
        for row, pos in zip(rows, positions):
            pos_by_row[row] = pos
        flat = (
            [s.token_at(p) for s, p in zip(seqs, positions)] + [0] * pad
            + positions + [0] * pad
            + rows + [KVCache.SCRATCH_ROW] * pad
            + slots + [-1] * pad
            + pos_by_row
        )
        if active:
            self.lora_manager.mark_used(active)
        key = (B, R, L, A)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(B, R, L, A, flat)  # leaves this step's logits
        else:
            self._load(graph.inputs, flat)
            graph.graph.replay()
        self.graph_steps += 1
        tokens = self.sampler(graph.logits[:n], seqs).token_ids
        return list(zip(seqs, tokens.tolist()))

    def _capture(self, B: int, R: int, L: int, A: int, flat: list[int]) -> _DecodeGraph:
        inputs = torch.zeros(4 * B + R, dtype=torch.int64, device=self.device)
        self._load(inputs, flat)
        ids, positions, rows, slots, pos_by_row = inputs.split([B, B, B, B, R])
        attention = AttentionBatch(
            kv=self.kv,
            write_rows=rows,
            write_positions=positions,
            num_decode=B,
            decode_rows=rows,
            decode_positions=pos_by_row,
            decode_pad_rows=R,
            decode_max_len=L,
            prefills=[],
        )

        def forward() -> torch.Tensor:
            attention._per_step.clear()  # masks and scratch are made by (and inside) this forward
            if self.lora_manager is not None:
                self.lora_manager.set_mapping(slots if A else None, max_active=A or None)
            out = self.model(
                input_ids=ids[None],
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=0,
                loramux_batch=attention,
            )
            return out.logits[0]  # [B, V]

        # warm up outside the capture: kernel compilation and lazily made tables; it writes the
        # same keys and values the capture's replay writes
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                logits = forward()
        except Exception as exc:
            raise RuntimeError(
                f"capturing a CUDA graph of the decode step failed ({type(exc).__name__}: {exc}); "
                "pass enforce_eager=True to run without graphs"
            ) from exc
        finally:
            attention._per_step.clear()
        graph.replay()
        return _DecodeGraph(graph, inputs, logits)

    def _load(self, target: torch.Tensor, flat: list[int]) -> None:
        """Copy ``flat`` into the static tensor ``target`` through the pinned buffer (one transfer)."""
        target.copy_(self._stage(flat), non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def _stage(self, flat: list[int]) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the buffer (it always has by now)
        host = self._host[: len(flat)]
        host.copy_(torch.tensor(flat, dtype=torch.int64))
        return host

    # -- eager steps ----------------------------------------------------------------------------

    def _to_device(self, fields: tuple[list[int], ...]) -> list[torch.Tensor]:
        flat = [v for f in fields for v in f]
        host = self._stage(flat)
        if self.device.type == "cuda":
            device = host.to(self.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            device = host.clone()
        out, offset = [], 0
        for f in fields:
            out.append(device[offset : offset + len(f)])
            offset += len(f)
        return out

"""Run one scheduled step: build its inputs once, one forward for every sequence, sample.

Per step the host builds plain lists (token ids, positions, cache rows, adapter slots, logits
rows), copies them to the device in a single transfer through a reusable pinned buffer, sets the
adapter mapping once for all LoRA layers, runs the model once with every token packed into one
row, and reads the sampled tokens back: one host sync for the tokens, plus the one the LoRA
metadata needs when a step uses adapters. Nothing inside the forward waits for the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loramux.engine.kv_cache import ATTN_IMPLEMENTATION, AttentionBatch, KVCache
from loramux.engine.sampler import Sampler
from loramux.engine.scheduler import ScheduledBatch
from loramux.engine.sequence import Sequence

__all__ = ["ModelRunner"]

ROW_ALIGN = 8
LEN_ALIGN = 64


def _round_up(value: int, multiple: int, limit: int) -> int:
    return min(-(-value // multiple) * multiple, limit)


class ModelRunner:
    """Owns the model's forward: ``runner.run(batch, slot_of) -> [(sequence, new token)]``.

    :param model: a Hugging Face causal LM; its attention is switched to ``"loramux"``.
    :param kv_cache: the cache the attention reads and writes.
    :param lora_manager: a ``LoRAModelManager`` (``set_mapping``), or None without LoRA.
    :param max_num_batched_tokens: the most tokens one step holds (sizes the pinned buffer).
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
    ) -> None:
        self.model = model
        self.kv = kv_cache
        self.sampler = sampler
        self.lora_manager = lora_manager
        self.device = next(model.parameters()).device
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        capacity = 4 * max_num_batched_tokens + 4 * max_num_seqs
        self._host = torch.empty(capacity, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._copied = None  # a CUDA event after the last copy out of _host

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, slot_of: Callable[[str], int | None]) -> list[tuple[Sequence, int]]:
        """Compute the scheduled tokens and sample for every sequence whose last token was among them."""
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
        pad_rows = _round_up(max(decode_rows, default=-1) + 1, ROW_ALIGN, self.kv.rows) if decode_rows else 0
        pad_len = _round_up(max(decode_pos.values(), default=0) + 1, LEN_ALIGN, self.kv.max_len)
        pos_by_row = [decode_pos.get(r, 0) for r in range(pad_rows)]
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
        if not sampled:
            return []
        logits = out.logits[0]  # [B, V]
        tokens = self.sampler(logits, [s.params for s in sampled], [s.generator for s in sampled])
        return list(zip(sampled, tokens.tolist()))

    def _to_device(self, fields: tuple[list[int], ...]) -> list[torch.Tensor]:
        flat = [v for f in fields for v in f]
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the buffer (it always has by now)
        host = self._host[: len(flat)]
        host.copy_(torch.tensor(flat, dtype=torch.int64))
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

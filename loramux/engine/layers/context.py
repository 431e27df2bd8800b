"""`LoRAContext`: the per-forward adapter mapping every LoRA layer of one model reads.

The model manager fills it once per forward (`set_mapping`); the layers only read it, so the
kernel metadata (one host sync) is built once per step, not once per layer.
"""

from __future__ import annotations

import math

import torch

from loramux.kernels import LoRABatchMeta, build_lora_meta

__all__ = ["LoRAContext"]


class LoRAContext:
    """Which slot each token of the current forward uses, as kernel metadata.

    :param num_slots: the number of GPU slots (the adapter weight pool's; its owner may set it
        once the pool is sized).

    Layers see inputs of one of three row counts:

    - ``T`` rows (every token of the step): ``meta``, built from ``token_slots``;
    - the rows of the logits (``lm_head`` on the sampled positions only): ``logits_slots`` when
      the caller gave them, else, for Hugging Face's ``[B, k, H]`` layout (``logits_to_keep=k``
      on a ``[B, S]`` batch), the last ``k`` tokens of every row of ``token_slots``.
    """

    def __init__(self, num_slots: int = 1) -> None:
        self.num_slots = num_slots
        self.token_slots: torch.Tensor | None = None  # [T] int32, -1 = no adapter
        self.meta: LoRABatchMeta | None = None
        #: whether layers that can (`BaseLayerWithLoRA.delta_beside`) compute their delta beside
        #: their base GEMM: in a step graph (a static mapping) only. A plain bool, so a compiled
        #: layer's guard on it is cheap and its two values are its two variants, each compiled
        #: once. An eager step adds each delta in line instead: its exact metadata can show that
        #: no adapter of the step touches a layer, which then runs its base GEMM alone, where a
        #: delta of its own would be a [T, N] buffer of zeros written and read.
        self.beside = False
        #: a step graph's mapping whose adapters touch no big-GEMM layer (`BaseLayerWithLoRA.big_gemm`):
        #: those layers run their base GEMM alone (no carveout, no delta). Also a plain bool.
        self.skip_big = False
        self._logits_meta: LoRABatchMeta | None = None
        self._derived: dict[tuple[int, ...], LoRABatchMeta] = {}

    def set(
        self,
        token_slots: torch.Tensor | None,
        logits_slots: torch.Tensor | None = None,
        *,
        static: bool = False,
        skip_big: bool = False,
        max_distinct: int | None = None,
    ) -> None:
        """Build the metadata for the next forward; ``None`` means no adapter for any token.

        ``static``: a static meta for CUDA-graph capture (no host sync; launch grids from the
        token count and the number of slots only, so the graph replays for any mix of adapters),
        see `build_lora_meta`; ``max_distinct``: the most distinct slots a mapping it replays for
        holds (default: no bound but S and T). Layers then launch their kernels whatever the
        slots' ranks, since the graph replays with other adapters than those present at capture.

        ``skip_big`` (with ``static``): the graph replays only for adapters that leave every
        big-GEMM layer alone, which then run their base GEMM only.
        """
        self._derived = {}
        self._logits_meta = None
        self.beside = token_slots is not None and static
        self.skip_big = self.beside and skip_big
        if token_slots is None:
            self.token_slots = self.meta = None
            return
        self.token_slots = token_slots
        self.meta = build_lora_meta(token_slots, self.num_slots, static=static, max_distinct=max_distinct)
        if logits_slots is not None:
            self._logits_meta = build_lora_meta(logits_slots, self.num_slots, static=static, max_distinct=max_distinct)

    def meta_for(self, rows_shape: tuple[int, ...]) -> LoRABatchMeta | None:
        """The metadata for a layer input whose leading (non-feature) dims are ``rows_shape``."""
        meta = self.meta
        if meta is None:
            return None
        rows = math.prod(rows_shape)
        if rows == meta.num_tokens:
            return meta
        if self._logits_meta is not None and rows == self._logits_meta.num_tokens:
            return self._logits_meta
        derived = self._derived.get(rows_shape)
        if derived is None:
            derived = self._derive(rows_shape)
            self._derived[rows_shape] = derived
        return derived

    def logits_meta_for(self, rows_shape: tuple[int, ...]) -> LoRABatchMeta | None:
        """The metadata for the LM head's input: the logits rows' own slots when the caller gave
        them for this many rows (a CUDA graph's step may have as many logits rows as tokens, and
        they are not the same rows), else as `meta_for`."""
        logits_meta = self._logits_meta
        if logits_meta is not None and math.prod(rows_shape) == logits_meta.num_tokens:
            return logits_meta
        return self.meta_for(rows_shape)

    def _derive(self, rows_shape: tuple[int, ...]) -> LoRABatchMeta:
        batch, keep = (rows_shape[0], rows_shape[1]) if len(rows_shape) == 2 else (0, 0)
        total = self.meta.num_tokens
        if batch < 1 or keep < 1 or total % batch or keep > total // batch:
            raise ValueError(
                f"a LoRA layer got {rows_shape} rows of input but the mapping holds "
                f"{total} tokens; pass set_mapping(token_slots, logits_slots=...) with one slot "
                "per row of the logits when the model computes them on a subset of tokens"
            )
        # token_slots: [B, S] -> the last `keep` positions of every row, as HF's logits_to_keep
        meta = self.meta
        return build_lora_meta(self.token_slots.reshape(batch, -1)[:, -keep:].reshape(-1), self.num_slots,
                               static=meta.static, max_distinct=meta.num_active if meta.static else None)

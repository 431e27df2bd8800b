"""Per-step LoRA batch metadata: tokens grouped into segments by slot, built once per forward.

Every LoRA layer of one forward pass shares one `LoRABatchMeta`. Building it costs one
device->host copy (the per-slot counts); the kernels themselves never synchronise.

``build_lora_meta(..., static=True)`` builds a *static* meta instead, for CUDA-graph capture: no
host sync, and host values that depend only on ``T``, the number of slots ``S`` and a bound on
the distinct slots (``max_distinct``), never on which slots the tokens use. Its host layout is
the worst case over every mapping of ``T`` tokens to at most ``min(S, T, max_distinct)`` distinct
slots, so the launch grids the kernels size from it hold every real tile of any such mapping; the
tiles past the real ones find a zero-token segment and exit at once.
One graph captured with it therefore replays correctly for any mix of adapters and base rows
(all -1, one slot, every token its own slot). Built inside the capture, its device tensors are
recomputed from ``token_slots`` on every replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["LoRABatchMeta", "build_lora_meta"]

@dataclass(frozen=True, eq=False)
class LoRABatchMeta:
    """Tokens of one batch segmented by adapter slot (Punica's SGMV layout).

    Device tensors (on the device of `token_slots`):
      token_slots:       [T] int32, slot per token, -1 = no adapter
      sorted_token_ids:  [T] int32, token indices grouped by slot (ascending slot, stable);
                         the `num_lora_tokens` tokens with a slot come first, -1 tokens last
      active_slots:      [S] int32, slots with at least one token first (ascending), then the rest
      active_counts:     [S] int32, tokens of each entry of `active_slots` (0 past `num_active`)
      active_starts:     [S] int32, offset of each active slot's segment in `sorted_token_ids`
    Host values (read with the build's single sync):
      num_tokens, num_slots, num_active, num_lora_tokens, max_segment,
      active_slots_host / active_counts_host / active_starts_host: tuples of length num_active.
    A static meta (``build_lora_meta(..., static=True)``) has no exact host layout: ``num_active =
    min(S, T, max_distinct)`` (the most distinct slots of a mapping it serves), ``max_segment =
    T`` and ``active_counts_host`` is a worst case whose tile count bounds the real one for every
    tile height (``active_slots_host``/``active_starts_host`` are empty); its device arrays are
    padded past the kernels' slot vector with a valid slot.
    Everything on its host side is a function of (T, S, max_distinct) alone.
    """

    token_slots: torch.Tensor
    sorted_token_ids: torch.Tensor
    active_slots: torch.Tensor
    active_counts: torch.Tensor
    active_starts: torch.Tensor
    num_tokens: int
    num_slots: int
    num_active: int
    num_lora_tokens: int
    max_segment: int
    active_slots_host: tuple[int, ...]
    active_counts_host: tuple[int, ...]
    active_starts_host: tuple[int, ...]
    static: bool = False
    # per-launcher caches keyed by tile height (tile counts); filled lazily, host-only
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def device(self) -> torch.device:
        return self.token_slots.device

    def num_tiles(self, block_m: int) -> int:
        """Number of [block_m]-token tiles when every slot's segment is tiled separately."""
        key = ("tiles", block_m)
        n = self._cache.get(key)
        if n is None:
            n = sum((c + block_m - 1) // block_m for c in self.active_counts_host)
            self._cache[key] = n
        return n

    def exact(self) -> "LoRABatchMeta":
        """This meta with its exact host layout: itself, or for a static meta the meta
        ``build_lora_meta`` builds from the same ``token_slots`` (one host sync; cached). The torch
        reference reads it, so it takes a static meta too (never inside a graph capture)."""
        if not self.static:
            return self
        exact = self._cache.get("exact")
        if exact is None:
            exact = build_lora_meta(self.token_slots, self.num_slots)
            self._cache["exact"] = exact
        return exact

    def segments(self):
        """(slot, token_ids) per active slot; token_ids: [n] int64, a slice of the sorted ids.
        Cached: the reference path calls it for every layer. A static meta answers with the
        segments of its exact layout (one host sync)."""
        if self.static:
            return self.exact().segments()
        key = "segments"
        segs = self._cache.get(key)
        if segs is None:
            ids = self.sorted_token_ids.long()
            segs = tuple(
                (s, ids[st : st + c])
                for s, st, c in zip(self.active_slots_host, self.active_starts_host, self.active_counts_host)
            )
            self._cache[key] = segs
        return segs


def build_lora_meta(token_slots: torch.Tensor, num_slots: int, *, static: bool = False,
                    max_distinct: int | None = None) -> LoRABatchMeta:
    """Group the tokens of one batch by adapter slot.

    token_slots: [T] integer, slot index per token in [0, num_slots), -1 = no adapter.
    One device->host copy (the per-slot counts); everything else stays on token_slots' device.
    static: build a static meta instead (no host sync, capture-safe; launch grids that depend
    only on T, num_slots and max_distinct). Its slots are not checked: one outside [0, num_slots)
    counts as -1.
    max_distinct (static only): the most distinct slots a mapping it serves holds (a step's
    tokens belong to at most its sequences, one adapter each). Its grids hold that many segments,
    not min(S, T): past a few hundred slots most of a prefill-sized grid would be programs that
    exit. A mapping with more distinct slots loses the tiles past the bound (wrong deltas).
    """
    if not isinstance(token_slots, torch.Tensor):
        raise ValueError(f"build_lora_meta: token_slots must be a torch.Tensor, got {type(token_slots).__name__}")
    if token_slots.dim() != 1:
        raise ValueError(f"build_lora_meta: token_slots must be 1-D [T], got shape {tuple(token_slots.shape)}")
    if token_slots.dtype.is_floating_point or token_slots.dtype.is_complex or token_slots.dtype == torch.bool:
        raise ValueError(f"build_lora_meta: token_slots must be an integer tensor, got {token_slots.dtype}")
    if not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"build_lora_meta: num_slots must be a positive int, got {num_slots!r}")

    if not isinstance(static, bool):
        raise ValueError(f"build_lora_meta: static must be a bool, got {static!r} (max_active=A was replaced "
                         "by static=True, whose grids hold any number of distinct slots)")
    if max_distinct is not None and (not static or not isinstance(max_distinct, int) or max_distinct < 1):
        raise ValueError(f"build_lora_meta: max_distinct bounds a static meta's distinct slots: a positive int "
                         f"with static=True, got {max_distinct!r} (static={static})")
    if static:
        return _build_static_meta(token_slots, num_slots, max_distinct)

    T = token_slots.numel()
    slots = token_slots.to(torch.int64)
    # key: [T], -1 -> num_slots so that tokens without an adapter sort last
    key = torch.where(slots < 0, torch.full_like(slots, num_slots), slots)
    # counts: [S + 2]; the last bin catches out-of-range slots so they can be reported
    bad = (slots < -1) | (slots >= num_slots)
    key_checked = torch.where(bad, torch.full_like(slots, num_slots + 1), key)
    counts_all = torch.bincount(key_checked, minlength=num_slots + 2)
    sorted_token_ids = torch.argsort(key, stable=True).to(torch.int32)
    counts = counts_all[:num_slots]
    starts = torch.cumsum(counts, 0) - counts
    # active slots first, ascending (stable sort on "is empty")
    order = torch.argsort((counts == 0).to(torch.int8), stable=True)
    active_slots = order.to(torch.int32)
    active_counts = counts[order].to(torch.int32)
    active_starts = starts[order].to(torch.int32)

    counts_host = counts_all.tolist()  # the one host sync
    if counts_host[num_slots + 1]:
        raise ValueError(
            f"build_lora_meta: {counts_host[num_slots + 1]} token slot(s) outside [-1, {num_slots}); "
            f"token_slots must hold -1 or a slot index below num_slots={num_slots}"
        )
    act = [(s, c) for s, c in enumerate(counts_host[:num_slots]) if c > 0]
    slots_h = tuple(s for s, _ in act)
    counts_h = tuple(c for _, c in act)
    starts_h, acc = [], 0
    for c in counts_host[:num_slots]:
        if c > 0:
            starts_h.append(acc)
        acc += c
    return LoRABatchMeta(
        token_slots=token_slots.to(torch.int32),
        sorted_token_ids=sorted_token_ids,
        active_slots=active_slots,
        active_counts=active_counts,
        active_starts=active_starts,
        num_tokens=T,
        num_slots=num_slots,
        num_active=len(act),
        num_lora_tokens=sum(counts_h),
        max_segment=max(counts_h, default=0),
        active_slots_host=slots_h,
        active_counts_host=counts_h,
        active_starts_host=tuple(starts_h),
    )


def _slot_vector_pad(num_slots: int) -> int:
    # the kernels read at most num_active <= num_slots entries of the slot vectors, in lanes of up
    # to A_PAD = max(32, next_pow2(num_slots)) (`tiles.slot_lanes`); past num_slots every entry
    # holds a valid slot, so a read of the whole lane width would stay in bounds too
    return 2 * max(32, 1 << max(0, (num_slots - 1).bit_length())) + 1


def _build_static_meta(token_slots: torch.Tensor, num_slots: int, max_distinct: int | None) -> LoRABatchMeta:
    """The layout of build_lora_meta without a host sync: its device arrays from torch ops
    (`_static_arrays`) or, opted in on CUDA, one Triton launch (`loramux.kernels.static_meta`)."""
    from .static_meta import static_meta_arrays, use_meta_kernel  # imports triton: only when a step builds one

    T, S = token_slots.numel(), num_slots
    build = static_meta_arrays if use_meta_kernel(token_slots.device) else _static_arrays
    sorted_token_ids, active_slots, active_counts, active_starts = build(token_slots, S, _slot_vector_pad(S))
    a = min(S, T, max_distinct or S)
    # worst case over batches of T tokens on <= a slots: a - 1 + ceil((T - a + 1) / m) tiles of
    # height m (every other split of T into a segments has at most as many tiles)
    counts_h = (1,) * (a - 1) + (T - a + 1,) if a else ()
    return LoRABatchMeta(
        token_slots=token_slots.to(torch.int32),
        sorted_token_ids=sorted_token_ids,
        active_slots=active_slots,
        active_counts=active_counts,
        active_starts=active_starts,
        num_tokens=T,
        num_slots=S,
        num_active=a,
        num_lora_tokens=T,
        max_segment=T,
        active_slots_host=(),
        active_counts_host=counts_h,
        active_starts_host=(),
        static=True,
    )


def _static_arrays(token_slots: torch.Tensor, S: int, pad: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A static meta's device arrays by torch ops, no host sync (no bincount, no sort): counts by
    a one-hot sum, each token's place in its segment by a one-hot prefix sum. Returns
    (sorted_token_ids [T], active_slots, active_counts, active_starts [pad])."""
    T, device = token_slots.numel(), token_slots.device
    slots = token_slots.to(torch.int64)
    key = torch.where((slots < 0) | (slots >= S), torch.full_like(slots, S), slots)  # [T], S = none
    onehot = (key[:, None] == torch.arange(S + 1, device=device)[None, :]).to(torch.int32)  # [T, S+1]
    counts_all = onehot.sum(0)  # [S+1]
    starts_all = torch.cumsum(counts_all, 0) - counts_all
    within = (torch.cumsum(onehot, 0) * onehot).sum(1) - 1  # [T] rank of each token in its segment
    dest = starts_all[key] + within
    sorted_token_ids = torch.empty(T, dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, dest, torch.arange(T, dtype=torch.int32, device=device))
    counts, starts = counts_all[:S], starts_all[:S]
    # active slots first (ascending), then the rest: each slot's place without a sort
    used = (counts > 0).to(torch.int64)
    place = torch.where(used > 0, torch.cumsum(used, 0) - used, used.sum() + torch.cumsum(1 - used, 0) - (1 - used))
    order = torch.empty(S, dtype=torch.int64, device=device).scatter_(0, place, torch.arange(S, device=device))
    active_slots = order[:1].to(torch.int32).repeat(pad)  # past S: the first active slot (hot in cache)
    active_slots[:S] = order.to(torch.int32)
    active_counts = torch.zeros(pad, dtype=torch.int32, device=device)
    active_counts[:S] = counts[order].to(torch.int32)
    active_starts = torch.zeros(pad, dtype=torch.int32, device=device)
    active_starts[:S] = starts[order].to(torch.int32)
    return sorted_token_ids, active_slots, active_counts, active_starts

"""Pure-torch multi-LoRA shrink/expand: PEFT's mixed-batch semantics (group rows by adapter, add
B(A(x)) * scaling). The CPU path in production and the oracle in tests (it also runs in float64).

On the CPU the products run in float32 (float64 for float64 input), its fast path; on a GPU they run
in the weights' dtype with float32 accumulation, as PEFT does.

A static meta (``build_lora_meta(..., static=True)``) is accepted too: the reference reads its
exact layout (``meta.exact()``, one host sync), so it is the oracle for the graph path as well.
"""

from __future__ import annotations

import torch

from .checks import REF_DTYPES, check_expand, check_shrink
from .metadata import LoRABatchMeta
from .pool import pool_rows

__all__ = ["lora_shrink_ref", "lora_expand_ref"]


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _mm_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if (t.is_cuda and t.dtype in (torch.float16, torch.bfloat16)) else _acc_dtype(t)


def _slot_ranks(ranks: torch.Tensor | None, meta: LoRABatchMeta, R: int) -> list[int]:
    meta = meta.exact()
    if ranks is None:
        return [R] * meta.num_active
    # one small copy per (meta, ranks), not per layer call. The entry holds the tensor itself: a
    # key of its address alone matched a new temporary (``ranks.cpu()`` per call) that took a freed
    # one's memory, and handed it the old ranks
    key = ("ref_ranks", id(ranks), ranks._version, R)
    cached = meta._cache.get(key)
    if cached is None or cached[0] is not ranks:
        r_all = ranks.tolist()
        cached = (ranks, [max(0, min(R, int(r_all[s]))) for s in meta.active_slots_host])
        meta._cache[key] = cached
    return cached[1]


def _pool_units(pool_starts: torch.Tensor | None, meta: LoRABatchMeta) -> dict[int, int] | None:
    """Each active slot's first pool unit (one small copy per meta), or None without a pool."""
    if pool_starts is None:
        return None
    meta = meta.exact()
    key = ("ref_pool", id(pool_starts), pool_starts._version)
    cached = meta._cache.get(key)
    if cached is None or cached[0] is not pool_starts:
        starts = pool_starts.tolist()
        cached = (pool_starts, {s: int(starts[s]) for s in meta.active_slots_host})
        meta._cache[key] = cached
    return cached[1]


def lora_shrink_ref(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    scales: torch.Tensor,
    meta: LoRABatchMeta,
    ranks: torch.Tensor | None = None,
    *,
    pool_starts: torch.Tensor | None = None,
    max_rank: int | None = None,
) -> torch.Tensor:
    """buf[t, i*R:(i+1)*R] = (x[t] @ A[slot(t), i*R:(i+1)*R].T) * scales[slot(t), i].

    x: [T, H]; lora_a: [S, n_slices*R, H], or a pool [U, n_slices, H] read from ``pool_starts``
    with R = ``max_rank``; scales: [S, n_slices] float32; ranks: [S] or None.
    Returns buf: [T, n_slices*R] float32 (float64 for float64 x); rows of slot -1 tokens are 0, and
    so are a slot's slices whose scale is 0 (their rows are not read).
    """
    n_slices, R = check_shrink(x, lora_a, scales, meta, ranks, dtypes=REF_DTYPES, pool_starts=pool_starts,
                               max_rank=max_rank)
    meta = meta.exact()
    T, H = x.shape
    acc = _acc_dtype(x)
    mm = _mm_dtype(x)
    buf = torch.zeros(T, n_slices * R, dtype=acc, device=x.device)
    if meta.num_active == 0 or R == 0:
        return buf
    slot_ranks = _slot_ranks(ranks, meta, R)
    units = _pool_units(pool_starts, meta)
    for (slot, rows), r in zip(meta.segments(), slot_ranks):
        if r == 0:
            continue
        xs = x.index_select(0, rows).to(mm)  # [n, H]
        if units is None:
            a = lora_a[slot].view(n_slices, R, H)[:, :r]  # [n_slices, r, H]
        else:
            a = lora_a[units[slot] : units[slot] + r].transpose(0, 1)  # pool [r, n_slices, H]
        a = a.reshape(n_slices * r, H).to(mm)  # [n_slices*r, H]
        out = (xs @ a.t()).to(acc).view(-1, n_slices, r)  # [n, n_slices, r]
        scale = scales[slot].to(acc).view(1, n_slices, 1)
        # a slice with scale 0 (one the slot's adapter does not target) is not read: zeros, even
        # where its rows hold NaN (the Triton kernel masks them)
        out = torch.where(scale != 0, out * scale, 0.0)
        if r == R:
            buf.index_copy_(0, rows, out.view(-1, n_slices * R))
        else:
            full = torch.zeros(rows.numel(), n_slices, R, dtype=acc, device=x.device)
            full[:, :, :r] = out
            buf.index_copy_(0, rows, full.view(-1, n_slices * R))
    return buf


def lora_expand_ref(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    slice_sizes: tuple[int, ...],
    meta: LoRABatchMeta,
    ranks: torch.Tensor | None = None,
    *,
    pool_starts: torch.Tensor | None = None,
    store: bool = False,
    scales: torch.Tensor | None = None,
) -> None:
    """y[t, off_i:off_i+n_i] += buf[t, i*R:(i+1)*R] @ B[slot(t), off_i:off_i+n_i, :].T, in place
    (``store``: ``=``, on the rows of slots with a rank here; ``scales``: a slot's slices whose
    scale is 0 are left as they are, or zero with ``store``; see `loramux.kernels.lora_expand`).

    y: [T, sum(slice_sizes)] (any strides); buf: [T, n_slices*R] float32; lora_b: [S, sum(n_i), R],
    or a pool [U, sum(n_i)] holding a [sum(n_i), width] block per slot from ``pool_starts``
    (`loramux.kernels.pool`).
    The sum is formed in float32 (float64 for float64 y) and rounded once to y's dtype; rows of
    slot -1 tokens are not touched.
    """
    slice_sizes = tuple(slice_sizes) if isinstance(slice_sizes, list) else slice_sizes
    n_slices, R = check_expand(y, buf, lora_b, slice_sizes, meta, ranks, dtypes=REF_DTYPES, pool_starts=pool_starts,
                               scales=scales)
    meta = meta.exact()
    if meta.num_active == 0 or R == 0:
        return
    acc = _acc_dtype(y)
    mm = _mm_dtype(y)
    offs = [0]
    for n in slice_sizes:
        offs.append(offs[-1] + n)
    N = offs[-1]
    slot_ranks = _slot_ranks(ranks, meta, R)
    units = _pool_units(pool_starts, meta)
    sizes = torch.tensor(slice_sizes, device=y.device) if scales is not None else None
    for (slot, rows), r in zip(meta.segments(), slot_ranks):
        if r == 0:
            continue
        bs = buf.index_select(0, rows).view(-1, n_slices, R)[:, :, :r].to(mm)  # [n, n_slices, r]
        if units is None:
            b = lora_b[slot]  # [N, R]
        else:  # the slot's [N, width] block of the pool
            b = lora_b.view(-1)[units[slot] * N : (units[slot] + pool_rows(r)) * N].view(N, -1)
        delta = torch.cat(
            [bs[:, i] @ b[offs[i] : offs[i + 1], :r].to(mm).t() for i in range(n_slices)], dim=1
        )  # [n, N]
        old = y.index_select(0, rows)
        new = delta.to(y.dtype) if store else (old.to(acc) + delta.to(acc)).to(y.dtype)
        if scales is not None:  # the slices the slot's adapter does not target: y's columns, or zeros
            off = torch.repeat_interleave(scales[slot] == 0, sizes)
            new = torch.where(off, torch.zeros_like(old) if store else old, new)
        y.index_copy_(0, rows, new)

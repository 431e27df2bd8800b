"""The shrink of an embedding LoRA: a gather of one column of each token's A (Triton, one launch).

PEFT's embedding LoRA is ``delta = A.T[token] @ B.T * scaling``: its shrink reads, for token
``t`` of slot ``s``, ``A[s][j, token_id(t)]`` for every rank row ``j``. With the slots' A in a
pool (`loramux.engine.layers.embedding`: ``a_pool [U, 1, vocab]``, slot ``s``'s row ``j`` at
``starts[s] + j``) that is about ten small torch ops (slot lookups, index arithmetic, a gather, a
mask, a scale), ten launches at the head of every step graph, before the first layer can start:
on CUDA one Triton program per block of tokens does it instead. The expand is the usual kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import _use_triton
from .tiles import next_pow2

__all__ = ["embedding_shrink"]

#: Tokens a program gathers.
BLOCK_T = 32


@triton.jit(do_not_specialize=["T", "S"])
def _embedding_shrink_kernel(ids_ptr, slots_ptr, a_ptr, starts_ptr, ranks_ptr, scales_ptr, out_ptr,
                             T, S, R, stride_row, stride_scale, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    real = t < T
    slot = tl.load(slots_ptr + t, mask=real, other=-1)
    has = real & (slot >= 0) & (slot < S)
    s = tl.where(has, slot, 0)
    token = tl.load(ids_ptr + t, mask=real, other=0).to(tl.int64)
    start = tl.load(starts_ptr + s, mask=has, other=0).to(tl.int64)
    rank = tl.load(ranks_ptr + s, mask=has, other=0)
    scale = tl.load(scales_ptr + s * stride_scale, mask=has, other=0.0)
    j = tl.arange(0, BLOCK_R)
    rows = start[:, None] + j[None, :]
    a = tl.load(a_ptr + rows * stride_row + token[:, None], mask=has[:, None] & (j[None, :] < rank[:, None]),
                other=0.0)
    tl.store(out_ptr + t[:, None] * R + j[None, :], a.to(tl.float32) * scale[:, None],
             mask=real[:, None] & (j[None, :] < R))


def embedding_shrink(token_ids: torch.Tensor, token_slots: torch.Tensor, a_pool: torch.Tensor,
                     pool_starts: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor, max_rank: int
                     ) -> torch.Tensor:
    """``buf [T, max_rank]`` float32: ``a_pool[pool_starts[s] + j, 0, token_ids[t]] * scales[s, 0]``
    for token ``t`` of slot ``s = token_slots[t]`` and ``j < ranks[s]``, else 0 (0 for a token
    without a slot too). token_ids, token_slots: [T] integers; a_pool: [U, 1, vocab]; pool_starts,
    ranks: [S] int32; scales: [S, 1] float32. One launch on CUDA (no host sync: a CUDA graph
    captures it); torch ops elsewhere."""
    T, R = token_ids.numel(), max_rank
    if _use_triton(token_ids):
        out = torch.empty(T, R, dtype=torch.float32, device=token_ids.device)
        if T:
            _embedding_shrink_kernel[(triton.cdiv(T, BLOCK_T),)](
                token_ids, token_slots, a_pool, pool_starts, ranks, scales, out, T, pool_starts.numel(), R,
                a_pool.stride(0), scales.stride(0), BLOCK_T=BLOCK_T, BLOCK_R=max(16, next_pow2(R)))
        return out
    S = pool_starts.numel()
    slots = token_slots.long()
    has = (slots >= 0) & (slots < S)
    s = torch.where(has, slots, 0)
    j = torch.arange(R, device=token_ids.device)  # [R]
    rows = (pool_starts[s].long()[:, None] + j).clamp(max=max(0, a_pool.shape[0] - 1))  # [T, R]
    gathered = a_pool[rows, 0, token_ids.long()[:, None]].float()  # [T, R]
    keep = has[:, None] & (j < ranks[s][:, None])
    return torch.where(keep, gathered, 0.0) * scales[s, :1]

"""A static LoRA meta's device arrays in one Triton launch (on CUDA; ``LORAMUX_META_KERNEL=0`` turns it off).

A CUDA graph built with a static meta (`loramux.kernels.metadata`) recomputes the meta's device
arrays from ``token_slots`` on every replay. With torch ops that is about 60 small kernels a meta
(a second meta for the logits rows where the LM head has LoRA), launched one after the other
before the step's first layer: a good part of what one adapter costs a decode step. This kernel
computes the same arrays in one program: the slots' counts (a one-hot sum over blocks of tokens), their starts (a prefix sum),
each token's place in its slot's segment (a running count per slot), the active slots first in
ascending order, and the padding past the slot vector.

So it is on by default on CUDA; ``LORAMUX_META_KERNEL=0`` builds with the torch ops instead (a
fallback should a Triton version miscompile it). The CPU tests run it under Triton's interpreter
against the torch build.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loramux import envs

from .tiles import next_pow2

__all__ = ["ENV_VAR", "static_meta_arrays", "use_meta_kernel"]

ENV_VAR = envs.env_name("meta_kernel")
#: Tokens a loop iteration takes (a [BLOCK_T, S_PAD] one-hot in registers).
BLOCK_T = 16


def use_meta_kernel(device: torch.device) -> bool:
    """Whether static metas on ``device`` are built by this kernel: on CUDA unless
    ``LORAMUX_META_KERNEL=0``; elsewhere the torch ops build them."""
    return envs.current().meta_kernel and device.type == "cuda"


@triton.jit
def _one_hot(slots_ptr, t0, T, S, BLOCK_T: tl.constexpr, S_PAD: tl.constexpr):
    """Tokens t0.. of a block: (their indices, which are < T, their [BLOCK_T, S_PAD] one-hot over
    the lanes: lane s < S is slot s, lane S the tokens without an adapter, none past T)."""
    offs = t0 + tl.arange(0, BLOCK_T)
    valid = offs < T
    slot = tl.load(slots_ptr + offs, mask=valid, other=-1)
    key = tl.where((slot < 0) | (slot >= S), S, slot)
    key = tl.where(valid, key, S_PAD)
    return offs, valid, (key[:, None] == tl.arange(0, S_PAD)[None, :]).to(tl.int32)


# T is not specialized: one compiled kernel serves every graph size
@triton.jit(do_not_specialize=["T"])
def _static_meta_kernel(slots_ptr, sorted_ptr, act_slots_ptr, act_counts_ptr, act_starts_ptr,
                        T, S, PAD, BLOCK_T: tl.constexpr, S_PAD: tl.constexpr, P_PAD: tl.constexpr):
    lanes = tl.arange(0, S_PAD)
    # pass 1: tokens per lane
    counts = tl.zeros([S_PAD], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        _, _, onehot = _one_hot(slots_ptr, t0, T, S, BLOCK_T, S_PAD)
        counts += tl.sum(onehot, 0)
    starts = tl.cumsum(counts, 0) - counts
    # pass 2: each token's place, its lane's start plus the tokens of that lane before it
    seen = tl.zeros([S_PAD], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        offs, valid, onehot = _one_hot(slots_ptr, t0, T, S, BLOCK_T, S_PAD)
        rank = tl.cumsum(onehot, 0) - 1 + seen[None, :] + starts[None, :]
        tl.store(sorted_ptr + tl.sum(onehot * rank, 1), offs, mask=valid)
        seen += tl.sum(onehot, 0)
    # the slot vector: active slots first (ascending), then the rest, then the padding
    real = lanes < S
    used = ((counts > 0) & real).to(tl.int32)
    unused = ((counts == 0) & real).to(tl.int32)
    place = tl.where(used > 0, tl.cumsum(used, 0) - used, tl.sum(used, 0) + tl.cumsum(unused, 0) - unused)
    tl.store(act_slots_ptr + place, lanes, mask=real)
    tl.store(act_counts_ptr + place, counts, mask=real)
    tl.store(act_starts_ptr + place, starts, mask=real)
    first = tl.sum(tl.where(real & (place == 0), lanes, 0), 0)
    pads = tl.arange(0, P_PAD)
    past = (pads >= S) & (pads < PAD)
    zeros = tl.zeros([P_PAD], dtype=tl.int32)
    tl.store(act_slots_ptr + pads, zeros + first, mask=past)
    tl.store(act_counts_ptr + pads, zeros, mask=past)
    tl.store(act_starts_ptr + pads, zeros, mask=past)


def static_meta_arrays(token_slots: torch.Tensor, num_slots: int, pad: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids [T], active_slots, active_counts, active_starts [pad]), all int32, as
    `metadata._build_static_meta` lays them out; one launch, no host sync."""
    T, device = token_slots.numel(), token_slots.device
    assert pad >= num_slots, (pad, num_slots)
    slots = token_slots.to(torch.int32)
    sorted_ids = torch.empty(T, dtype=torch.int32, device=device)
    active = torch.empty(3, pad, dtype=torch.int32, device=device)
    _static_meta_kernel[(1,)](slots, sorted_ids, active[0], active[1], active[2], T, num_slots, pad,
                              BLOCK_T=BLOCK_T, S_PAD=next_pow2(num_slots + 1), P_PAD=next_pow2(pad), num_warps=4)
    return sorted_ids, active[0], active[1], active[2]

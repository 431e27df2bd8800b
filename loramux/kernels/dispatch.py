"""Pick the Triton kernels on CUDA and the torch reference elsewhere (LORAMUX_KERNELS overrides)."""

from __future__ import annotations

import os

import torch

from . import reference
from .metadata import LoRABatchMeta

ENV_VAR = "LORAMUX_KERNELS"


def uses_triton(device: torch.device | str) -> bool:
    """Whether tensors on ``device`` go through the Triton kernels (the only ones that take a
    static meta, so the only ones a CUDA graph can capture)."""
    return _use_triton_on(torch.device(device).type == "cuda")


def _use_triton(t: torch.Tensor) -> bool:
    return _use_triton_on(t.is_cuda)


def _use_triton_on(is_cuda: bool) -> bool:
    choice = os.environ.get(ENV_VAR, "").strip().lower()
    if choice in ("", "auto"):
        return is_cuda
    if choice == "triton":
        return True
    if choice == "torch":
        return False
    raise ValueError(f"{ENV_VAR}={choice!r} is not understood; use 'triton', 'torch' or leave it unset")


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    scales: torch.Tensor,
    meta: LoRABatchMeta,
    ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """buf[t, i*R:(i+1)*R] = (x[t] @ A[slot(t), i*R:(i+1)*R].T) * scales[slot(t), i].

    x: [T, H] fp16/bf16/fp32; lora_a: [S, n_slices*R, H] (x's dtype; slice i = rows i*R:(i+1)*R);
    scales: [S, n_slices] float32; ranks: optional [S] int32, true rank per slot (rows past it
    must be zero padding; they are skipped). Returns buf: [T, n_slices*R] float32, zeros past a
    slot's rank; rows of slot -1 tokens are unspecified. One kernel, no memset before it, no host
    sync (with a static meta it can be captured in a CUDA graph).
    """
    if _use_triton(x):
        from .shrink import lora_shrink_triton

        return lora_shrink_triton(x, lora_a, scales, meta, ranks)
    return reference.lora_shrink_ref(x, lora_a, scales, meta, ranks)


def lora_expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    slice_sizes: tuple[int, ...],
    meta: LoRABatchMeta,
    ranks: torch.Tensor | None = None,
) -> None:
    """y[t, off_i:off_i+n_i] += buf[t, i*R:(i+1)*R] @ B[slot(t), off_i:off_i+n_i, :].T, in place.

    y: [T, sum(slice_sizes)], any strides (a column slice of a wider output is fine);
    buf: [T, n_slices*R] float32 from lora_shrink; lora_b: [S, sum(slice_sizes), R] in y's dtype
    (columns past a slot's rank must be zero padding); ranks: as for lora_shrink.
    Products in float32 (16-bit: buf rounded to the weights' dtype for the tensor cores, as PEFT
    does), summed with y in float32 and rounded once to y's dtype. Rows of slot -1 tokens are left
    exactly untouched. No host sync: with a fixed meta it can be captured in a CUDA graph.
    """
    if _use_triton(y):
        from .expand import lora_expand_triton

        lora_expand_triton(y, buf, lora_b, tuple(slice_sizes), meta, ranks)
        return
    reference.lora_expand_ref(y, buf, lora_b, tuple(slice_sizes), meta, ranks)


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    ranks: torch.Tensor | None,
    slice_sizes: tuple[int, ...],
    meta: LoRABatchMeta,
) -> None:
    """``y += B[slot](A[slot](x)) * scale[slot]`` for every token and slice, in place: `lora_shrink`
    then `lora_expand`, the float32 intermediate made and dropped inside.

    x: [T, H]; y: [T, sum(slice_sizes)] (any strides); lora_a: [S, n_slices*R, H];
    lora_b: [S, sum(slice_sizes), R]; scales: [S, n_slices] float32; ranks: [S] int32 or None.
    Two kernels on CUDA (nothing else: no memset, no host sync), so a step captured with a static
    meta replays it for any mapping. Rows of slot -1 tokens, and of slots whose rank is 0, are
    left exactly as they were.
    """
    buf = lora_shrink(x, lora_a, scales, meta, ranks)  # [T, n_slices*R] float32
    lora_expand(y, buf, lora_b, slice_sizes, meta, ranks)

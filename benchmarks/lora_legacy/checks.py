"""Argument checks shared by the Triton launchers and the torch reference (ValueError on bad input)."""

from __future__ import annotations

import torch

from .metadata import LoRABatchMeta

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the reference also runs in float64 (the oracle in tests)
REF_DTYPES = FLOAT_DTYPES + (torch.float64,)


def _fail(op: str, msg: str) -> None:
    raise ValueError(f"{op}: {msg}")


def _check_common(op, meta, ranks, S, device, dtypes, tensors):
    if not isinstance(meta, LoRABatchMeta):
        _fail(op, f"meta must be a LoRABatchMeta from build_lora_meta, got {type(meta).__name__}")
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != device:
            _fail(op, f"{name} is on {t.device} but x/y is on {device}; put every tensor on one device")
    if meta.device != device:
        _fail(op, f"meta was built on {meta.device} but the tensors are on {device}")
    for name, t in tensors:
        if name in ("x", "y", "lora_a", "lora_b") and t.dtype not in dtypes:
            _fail(op, f"{name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if S != meta.num_slots:
        _fail(op, f"weights hold {S} slots but meta was built for num_slots={meta.num_slots}")
    if ranks is not None:
        if not isinstance(ranks, torch.Tensor) or ranks.shape != (S,) or ranks.dtype not in (torch.int32, torch.int64):
            _fail(op, f"ranks must be an int32/int64 tensor of shape [{S}], got "
                  f"{getattr(ranks, 'dtype', type(ranks).__name__)} {tuple(getattr(ranks, 'shape', ()))}")
        if ranks.device != device:
            _fail(op, f"ranks is on {ranks.device} but x/y is on {device}")


def check_shrink(x, lora_a, scales, meta, ranks, dtypes=FLOAT_DTYPES) -> tuple[int, int]:
    """Returns (n_slices, R). x: [T, H]; lora_a: [S, n_slices*R, H]; scales: [S, n_slices]."""
    op = "lora_shrink"
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        _fail(op, f"x must be a 2-D tensor [T, H], got shape {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(lora_a, torch.Tensor) or lora_a.dim() != 3:
        _fail(op, f"lora_a must be 3-D [S, n_slices*R, H], got shape {tuple(getattr(lora_a, 'shape', ()))}")
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2:
        _fail(op, f"scales must be 2-D [S, n_slices] float32, got shape {tuple(getattr(scales, 'shape', ()))}")
    _check_common(op, meta, ranks, lora_a.shape[0], x.device, dtypes,
                  [("x", x), ("lora_a", lora_a), ("scales", scales)])
    T, H = x.shape
    S, NR, H_a = lora_a.shape
    if T != meta.num_tokens:
        _fail(op, f"x has {T} tokens but meta was built for {meta.num_tokens}")
    if H_a != H:
        _fail(op, f"hidden size mismatch: x is [T, {H}] but lora_a is [S, NR, {H_a}]")
    if x.dtype != lora_a.dtype:
        _fail(op, f"x is {x.dtype} but lora_a is {lora_a.dtype}; store adapter weights in the activation dtype")
    if scales.shape[0] != S:
        _fail(op, f"scales has {scales.shape[0]} slots, lora_a has {S}")
    n_slices = scales.shape[1]
    if n_slices < 1 or NR % n_slices:
        _fail(op, f"lora_a rank dim {NR} is not n_slices*R with n_slices={n_slices} (from scales)")
    if scales.dtype != torch.float32 and not (dtypes is REF_DTYPES and scales.dtype == torch.float64):
        _fail(op, f"scales must be float32, got {scales.dtype}")
    R = NR // n_slices
    return n_slices, R


def check_expand(y, buf, lora_b, slice_sizes, meta, ranks, dtypes=FLOAT_DTYPES) -> tuple[int, int]:
    """Returns (n_slices, R). y: [T, sum(n_i)]; buf: [T, n_slices*R] f32; lora_b: [S, sum(n_i), R]."""
    op = "lora_expand"
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        _fail(op, f"y must be a 2-D tensor [T, N], got shape {tuple(getattr(y, 'shape', ()))}")
    if not isinstance(buf, torch.Tensor) or buf.dim() != 2:
        _fail(op, f"buf must be a 2-D tensor [T, n_slices*R], got shape {tuple(getattr(buf, 'shape', ()))}")
    if not isinstance(lora_b, torch.Tensor) or lora_b.dim() != 3:
        _fail(op, f"lora_b must be 3-D [S, N, R], got shape {tuple(getattr(lora_b, 'shape', ()))}")
    if (not isinstance(slice_sizes, (tuple, list)) or not slice_sizes
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in slice_sizes)):
        _fail(op, f"slice_sizes must be a non-empty tuple of positive ints, got {slice_sizes!r}")
    _check_common(op, meta, ranks, lora_b.shape[0], y.device, dtypes,
                  [("y", y), ("buf", buf), ("lora_b", lora_b)])
    T, N = y.shape
    S, N_b, R = lora_b.shape
    n_slices = len(slice_sizes)
    if T != meta.num_tokens or buf.shape[0] != T:
        _fail(op, f"y has {T} rows and buf {buf.shape[0]}, but meta was built for {meta.num_tokens} tokens")
    if sum(slice_sizes) != N or N_b != N:
        _fail(op, f"sum(slice_sizes)={sum(slice_sizes)}, y width {N} and lora_b rows {N_b} must all agree")
    if buf.shape[1] != n_slices * R:
        _fail(op, f"buf is [T, {buf.shape[1]}] but {n_slices} slices of rank {R} need [T, {n_slices * R}]")
    if buf.dtype != torch.float32 and not (dtypes is REF_DTYPES and buf.dtype == torch.float64):
        _fail(op, f"buf must be float32 (lora_shrink's output), got {buf.dtype}")
    if y.dtype != lora_b.dtype:
        _fail(op, f"y is {y.dtype} but lora_b is {lora_b.dtype}; store adapter weights in the activation dtype")
    return n_slices, R

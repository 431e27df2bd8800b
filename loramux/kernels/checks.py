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


def _check_scales_dtype(op, scales, dtypes) -> None:
    if scales.dtype != torch.float32 and not (dtypes is REF_DTYPES and scales.dtype == torch.float64):
        _fail(op, f"scales must be float32, got {scales.dtype}")


def check_shrink(x, lora_a, scales, meta, ranks, dtypes=FLOAT_DTYPES, *, pool_starts=None,
                 max_rank=None) -> tuple[int, int]:
    """Returns (n_slices, R). x: [T, H]; lora_a: [S, n_slices*R, H]; scales: [S, n_slices]. With
    ``pool_starts`` ([S] int32) lora_a is a pool [U, n_slices, H] and R is ``max_rank``."""
    op = "lora_shrink"
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        _fail(op, f"x must be a 2-D tensor [T, H], got shape {tuple(getattr(x, 'shape', ()))}")
    layout = "[S, n_slices*R, H]" if pool_starts is None else "[U, n_slices, H] (a pool)"
    if not isinstance(lora_a, torch.Tensor) or lora_a.dim() != 3:
        _fail(op, f"lora_a must be 3-D {layout}, got shape {tuple(getattr(lora_a, 'shape', ()))}")
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2:
        _fail(op, f"scales must be 2-D [S, n_slices] float32, got shape {tuple(getattr(scales, 'shape', ()))}")
    S = scales.shape[0]
    _check_common(op, meta, ranks, S, x.device, dtypes, [("x", x), ("lora_a", lora_a), ("scales", scales)])
    T, H = x.shape
    H_a = lora_a.shape[2]
    if T != meta.num_tokens:
        _fail(op, f"x has {T} tokens but meta was built for {meta.num_tokens}")
    if H_a != H:
        _fail(op, f"hidden size mismatch: x is [T, {H}] but lora_a's rows are {H_a} wide")
    if x.dtype != lora_a.dtype:
        _fail(op, f"x is {x.dtype} but lora_a is {lora_a.dtype}; store adapter weights in the activation dtype")
    n_slices = scales.shape[1]
    _check_scales_dtype(op, scales, dtypes)
    if pool_starts is not None:
        _check_pool(op, pool_starts, ranks, S, x.device)
        if lora_a.shape[1] != n_slices:
            _fail(op, f"the pool lora_a holds {lora_a.shape[1]} slices per unit but scales has {n_slices}")
        if not isinstance(max_rank, int) or max_rank < 1:
            _fail(op, f"max_rank (buf columns per slice) must be a positive int with a pool, got {max_rank!r}")
        return n_slices, max_rank
    NR = lora_a.shape[1]
    if lora_a.shape[0] != S:
        _fail(op, f"scales has {S} slots, lora_a has {lora_a.shape[0]}")
    if n_slices < 1 or NR % n_slices:
        _fail(op, f"lora_a rank dim {NR} is not n_slices*R with n_slices={n_slices} (from scales)")
    return n_slices, NR // n_slices


def _check_pool(op, pool_starts, ranks, S, device) -> None:
    """A pool is read at ``pool_starts[slot] + j`` for ``j < ranks[slot]``: both are needed."""
    if (not isinstance(pool_starts, torch.Tensor) or pool_starts.shape != (S,)
            or pool_starts.dtype not in (torch.int32, torch.int64)):
        _fail(op, f"pool_starts must be an int32/int64 tensor of shape [{S}], got "
              f"{getattr(pool_starts, 'dtype', type(pool_starts).__name__)} {tuple(getattr(pool_starts, 'shape', ()))}")
    if pool_starts.device != device:
        _fail(op, f"pool_starts is on {pool_starts.device} but x/y is on {device}")
    if ranks is None:
        _fail(op, "a pool needs ranks: rows past a slot's rank belong to other adapters")


def check_expand(y, buf, lora_b, slice_sizes, meta, ranks, dtypes=FLOAT_DTYPES, *,
                 pool_starts=None, scales=None) -> tuple[int, int]:
    """Returns (n_slices, R). y: [T, sum(n_i)]; buf: [T, n_slices*R] f32; lora_b: [S, sum(n_i), R].
    With ``pool_starts`` ([S] int32) lora_b is a pool [U, sum(n_i)] (a [sum(n_i), width] block
    per slot) and R comes from buf. ``scales``, when given: [S, n_slices] float32, as lora_shrink's."""
    op = "lora_expand"
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        _fail(op, f"y must be a 2-D tensor [T, N], got shape {tuple(getattr(y, 'shape', ()))}")
    if not isinstance(buf, torch.Tensor) or buf.dim() != 2:
        _fail(op, f"buf must be a 2-D tensor [T, n_slices*R], got shape {tuple(getattr(buf, 'shape', ()))}")
    dims, layout = (3, "[S, N, R]") if pool_starts is None else (2, "[U, N] (a pool)")
    if not isinstance(lora_b, torch.Tensor) or lora_b.dim() != dims:
        _fail(op, f"lora_b must be {dims}-D {layout}, got shape {tuple(getattr(lora_b, 'shape', ()))}")
    if (not isinstance(slice_sizes, (tuple, list)) or not slice_sizes
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in slice_sizes)):
        _fail(op, f"slice_sizes must be a non-empty tuple of positive ints, got {slice_sizes!r}")
    S = lora_b.shape[0] if pool_starts is None else meta.num_slots
    tensors = [("y", y), ("buf", buf), ("lora_b", lora_b)] + ([("scales", scales)] if scales is not None else [])
    _check_common(op, meta, ranks, S, y.device, dtypes, tensors)
    T, N = y.shape
    n_slices = len(slice_sizes)
    if pool_starts is not None:
        _check_pool(op, pool_starts, ranks, S, y.device)
        if not lora_b.is_contiguous():  # its slots' [N, width] blocks live in its flat storage
            _fail(op, f"the pool lora_b must be contiguous, got strides {tuple(lora_b.stride())}")
        N_b = lora_b.shape[1]
        R = buf.shape[1] // n_slices
    else:
        _, N_b, R = lora_b.shape
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
    if scales is not None:
        if tuple(scales.shape) != (S, n_slices):
            _fail(op, f"scales must be [S, n_slices] = [{S}, {n_slices}] float32, got shape {tuple(scales.shape)}")
        _check_scales_dtype(op, scales, dtypes)
    return n_slices, R


# --- paged attention and the KV write -----------------------------------------------------------

INDEX_DTYPES = (torch.int32, torch.int64)


def _shape(t) -> tuple:
    return tuple(getattr(t, "shape", ()))


def _check_cache(op, k_cache, v_cache, device, dtypes) -> tuple[int, int, int, int]:
    """Returns (num_blocks, block_size, Hkv, D). Caches: [num_blocks, block_size, Hkv, D]."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 4:
            _fail(op, f"{name} must be a 4-D tensor [num_blocks, block_size, num_kv_heads, head_dim], "
                      f"got shape {_shape(c)}")
        if c.device != device:
            _fail(op, f"{name} is on {c.device} but the tokens are on {device}; put every tensor on one device")
        if c.dtype not in dtypes:
            _fail(op, f"{name} has dtype {c.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        _fail(op, f"k_cache is {k_cache.dtype} {_shape(k_cache)} but v_cache is {v_cache.dtype} {_shape(v_cache)}; "
                  "allocate both with one shape and dtype")
    num_blocks, block_size, hkv, d = k_cache.shape
    if block_size < 1 or block_size & (block_size - 1):
        _fail(op, f"block_size (k_cache.shape[1]) is {block_size}; it must be a power of two (e.g. 16)")
    if hkv < 1 or d < 1:
        _fail(op, f"k_cache has {hkv} kv heads of dim {d}; both must be positive")
    return num_blocks, block_size, hkv, d


def check_write_kv(key, value, k_cache, v_cache, slot_mapping, dtypes=FLOAT_DTYPES) -> int:
    """Returns T. key/value: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]; slot_mapping: [T]."""
    op = "write_kv"
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            _fail(op, f"{name} must be a 3-D tensor [T, num_kv_heads, head_dim], got shape {_shape(t)}")
    device = key.device
    _, _, hkv, d = _check_cache(op, k_cache, v_cache, device, dtypes)
    if key.shape != value.shape:
        _fail(op, f"key is {_shape(key)} but value is {_shape(value)}; they must match")
    if key.shape[1:] != (hkv, d):
        _fail(op, f"key is [T, {key.shape[1]}, {key.shape[2]}] but the cache holds {hkv} kv heads of dim {d}")
    if value.device != device:
        _fail(op, f"value is on {value.device} but key is on {device}")
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        _fail(op, f"key/value are {key.dtype}/{value.dtype} but the cache is {k_cache.dtype}; "
                  "cast them to the cache dtype")
    T = key.shape[0]
    if (not isinstance(slot_mapping, torch.Tensor) or slot_mapping.shape != (T,)
            or slot_mapping.dtype not in INDEX_DTYPES):
        _fail(op, f"slot_mapping must be an int32/int64 tensor of shape [{T}], got "
                  f"{getattr(slot_mapping, 'dtype', type(slot_mapping).__name__)} {_shape(slot_mapping)}")
    if slot_mapping.device != device:
        _fail(op, f"slot_mapping is on {slot_mapping.device} but key is on {device}")
    return T


def check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                          sliding_window, softcap, out, dtypes=FLOAT_DTYPES) -> tuple[int, int, int, int, int]:
    """Returns (T, B, H, Hkv, D). q: [T, H, D]; block_tables: [B, max_blocks]; seq_lens: [B];
    query_start_loc: [B + 1]; out: None or [T, H, D] in q's dtype."""
    op = "paged_attention"
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        _fail(op, f"q must be a 3-D tensor [T, num_heads, head_dim], got shape {_shape(q)}")
    device = q.device
    _, _, hkv, d = _check_cache(op, k_cache, v_cache, device, dtypes)
    if q.dtype != k_cache.dtype:
        _fail(op, f"q is {q.dtype} but the cache is {k_cache.dtype}; use one dtype for q and the KV cache")
    T, H, dq = q.shape
    if dq != d:
        _fail(op, f"head_dim mismatch: q is [T, H, {dq}] but the cache holds head_dim {d}")
    if H % hkv:
        _fail(op, f"num_heads {H} is not a multiple of num_kv_heads {hkv} (GQA needs H = G * Hkv)")
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2 or block_tables.dtype not in INDEX_DTYPES:
        _fail(op, f"block_tables must be a 2-D int32 tensor [B, max_blocks], got "
                  f"{getattr(block_tables, 'dtype', type(block_tables).__name__)} {_shape(block_tables)}")
    B = block_tables.shape[0]
    for name, t, n in (("seq_lens", seq_lens, B), ("query_start_loc", query_start_loc, B + 1)):
        if not isinstance(t, torch.Tensor) or t.shape != (n,) or t.dtype not in INDEX_DTYPES:
            _fail(op, f"{name} must be an int32 tensor of shape [{n}] (block_tables has B={B} rows), got "
                      f"{getattr(t, 'dtype', type(t).__name__)} {_shape(t)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.device != device:
            _fail(op, f"{name} is on {t.device} but q is on {device}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        _fail(op, f"scale must be a positive float (usually head_dim ** -0.5), got {scale!r}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        _fail(op, f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        _fail(op, f"softcap must be None or a positive float, got {softcap!r}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype or out.device != device:
            _fail(op, f"out must be a {q.dtype} tensor of shape {_shape(q)} on {device}, got "
                      f"{getattr(out, 'dtype', type(out).__name__)} {_shape(out)} on {getattr(out, 'device', None)}")
    return T, B, H, hkv, d

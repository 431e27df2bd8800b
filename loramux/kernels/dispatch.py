"""Pick the Triton kernels on CUDA and the torch reference elsewhere (LORAMUX_KERNELS overrides)."""

from __future__ import annotations

import torch

from loramux import envs

from . import attention_reference, fp8_reference, reference
from .metadata import LoRABatchMeta

ENV_VAR = envs.env_name("kernels")


def uses_triton(device: torch.device | str) -> bool:
    """Whether tensors on ``device`` go through the Triton kernels (the only ones that take a
    static meta, so the only ones a CUDA graph can capture)."""
    return _use_triton_on(torch.device(device).type == "cuda")


def _use_triton(t: torch.Tensor) -> bool:
    return _use_triton_on(t.is_cuda)


def _use_triton_on(is_cuda: bool) -> bool:
    choice = envs.current().kernels  # read once, at start: not per dispatch
    return is_cuda if choice is None else choice == "triton"


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    scales: torch.Tensor,
    meta: LoRABatchMeta,
    ranks: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    pool_starts: torch.Tensor | None = None,
    max_rank: int | None = None,
    sms: int | None = None,
) -> torch.Tensor:
    """buf[t, i*R:(i+1)*R] = (x[t] @ A[slot(t), i*R:(i+1)*R].T) * scales[slot(t), i].

    x: [T, H] fp16/bf16/fp32; lora_a: [S, n_slices*R, H] (x's dtype; slice i = rows i*R:(i+1)*R);
    scales: [S, n_slices] float32; ranks: optional [S] int32, true rank per slot (rows past it
    must be zero padding; they are skipped); a slice whose scale is 0 for a slot (one its adapter
    does not target) is not read either. Returns buf: [T, n_slices*R] float32, zeros past a
    slot's rank and in its scale-0 slices; rows of slot -1 tokens, and of a slot whose rank is 0
    (the expand skips it), are unspecified. One kernel, no memset before it, no host sync (with a
    static meta it can be captured in a CUDA graph).

    out: buf's memory, given by the caller (a float32 [T, n_slices*R] tensor on x's device), so a
    shrink launched on a side stream writes into memory the main stream allocated; returned.

    pool_starts: the slots' weights live in a pool shared by adapters of different ranks (see
    `loramux.engine.layers.base`): lora_a is then [U, n_slices, H], slot s's rank row j of slice
    i being ``lora_a[pool_starts[s] + j, i]``, read for j < ranks[s] only (ranks is required);
    R = ``max_rank``.

    sms: size the Triton launch for this many multiprocessors instead of all of them (a launch
    beside a GEMM that leaves it those, `loramux.engine.layers.side_stream`); same result.
    """
    if _use_triton(x):
        from .shrink import lora_shrink_triton

        return lora_shrink_triton(x, lora_a, scales, meta, ranks, out=out, pool_starts=pool_starts,
                                  max_rank=max_rank, sms=sms)
    buf = reference.lora_shrink_ref(x, lora_a, scales, meta, ranks, pool_starts=pool_starts, max_rank=max_rank)
    if out is None:
        return buf
    if out.shape != buf.shape or out.dtype != buf.dtype or out.device != buf.device:
        raise ValueError(f"lora_shrink: out must be a {buf.dtype} {list(buf.shape)} tensor on {buf.device}, "
                         f"got {out.dtype} {list(out.shape)} on {out.device}")
    return out.copy_(buf)


def lora_expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    slice_sizes: tuple[int, ...],
    meta: LoRABatchMeta,
    ranks: torch.Tensor | None = None,
    *,
    pdl: bool | None = None,
    pool_starts: torch.Tensor | None = None,
    sms: int | None = None,
    store: bool = False,
    scales: torch.Tensor | None = None,
) -> None:
    """y[t, off_i:off_i+n_i] += buf[t, i*R:(i+1)*R] @ B[slot(t), off_i:off_i+n_i, :].T, in place.

    y: [T, sum(slice_sizes)], any strides (a column slice of a wider output is fine);
    buf: [T, n_slices*R] float32 from lora_shrink; lora_b: [S, sum(slice_sizes), R] in y's dtype
    (columns past a slot's rank must be zero padding); ranks: as for lora_shrink.
    Products in float32 (16-bit: buf rounded to the weights' dtype for the tensor cores, as PEFT
    does), summed with y in float32 and rounded once to y's dtype. Rows of slot -1 tokens are left
    exactly untouched. No host sync: with a fixed meta it can be captured in a CUDA graph.

    pdl: launch the Triton kernel with programmatic dependent launch (Hopper on; ignored
    elsewhere and by the torch reference); None takes ``LORAMUX_PDL`` (off unless 1).
    pool_starts: as for lora_shrink; lora_b is then a pool [U, N] (N = sum(slice_sizes)) holding
    slot s's B as one [N, w] block from element ``pool_starts[s] * N`` of its flat storage, w being
    its rank rounded up to `POOL_ROW_ALIGN` (`pool_rows`), the columns past the rank zero.
    sms: as for lora_shrink.
    store: ``=`` instead of ``+=``: the rows of tokens whose slot has a rank on this module are
    overwritten with their delta (rounded once to y's dtype; zeros in the slices ``scales`` turns
    off) and never read, the others left as they are: for a delta buffer of its own, which saves
    reading it (zeroed first where some rows are not written).
    scales: lora_shrink's scales [S, n_slices]: a slot's slices whose scale is 0 (slices its
    adapter does not target, whose buf columns lora_shrink left zero) are skipped, their B never
    read and y's columns left exactly as they are (``store``: set to zero).
    """
    if _use_triton(y):
        from .expand import lora_expand_triton

        lora_expand_triton(y, buf, lora_b, tuple(slice_sizes), meta, ranks, pdl=pdl, pool_starts=pool_starts,
                           sms=sms, store=store, scales=scales)
        return
    reference.lora_expand_ref(y, buf, lora_b, tuple(slice_sizes), meta, ranks, pool_starts=pool_starts, store=store,
                              scales=scales)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store a step's keys/values in the paged cache, in place: for every t with slot_mapping[t] >= 0,
    k_cache[slot // block_size, slot % block_size] = key[t] (and v_cache from value).

    key/value: [T, Hkv, D] in the cache's dtype; k_cache/v_cache: [num_blocks, block_size, Hkv, D]
    (fp16/bf16/fp32, block_size a power of two); slot_mapping: [T] int64 or int32, -1 = padding (not
    written). No host sync on the Triton path.
    """
    if _use_triton(key):
        from .attention import write_kv_triton

        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
        return
    attention_reference.write_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over a paged KV cache for a mixed batch of decode tokens and prefill chunks.

    q: [T, H, D]; sequence b's queries are q[query_start_loc[b]:query_start_loc[b+1]] (int32 [B+1],
    starting at 0), at positions seq_lens[b] - n_b .. seq_lens[b] - 1, where seq_lens ([B] int32)
    counts the tokens in the cache after this step's `write_kv`; each sees keys 0 .. its own position,
    found through block_tables ([B, max_blocks] int32; entries past a sequence's blocks may hold any
    valid id). H must be a multiple of Hkv (GQA). sliding_window: a key is visible when
    q_pos - k_pos < sliding_window; softcap: scores become tanh(s / softcap) * softcap. A sequence
    with seq_len 0 gets zeros. Softmax in float32, output [T, H, D] in q's dtype (written into
    `out` when given). The Triton path launches a grid sized from shapes only: no host sync, so it
    can be captured in a CUDA graph.
    """
    if _use_triton(q):
        from .attention import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale,
                                      sliding_window=sliding_window, softcap=softcap, out=out)
    return attention_reference.paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                                   scale=scale, sliding_window=sliding_window, softcap=softcap,
                                                   out=out)


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    ranks: torch.Tensor | None,
    slice_sizes: tuple[int, ...],
    meta: LoRABatchMeta,
    *,
    pdl: bool | None = None,
    pool_starts: torch.Tensor | None = None,
    max_rank: int | None = None,
) -> None:
    """``y += B[slot](A[slot](x)) * scale[slot]`` for every token and slice, in place: `lora_shrink`
    then `lora_expand`, the float32 intermediate made and dropped inside.

    x: [T, H]; y: [T, sum(slice_sizes)] (any strides); lora_a: [S, n_slices*R, H];
    lora_b: [S, sum(slice_sizes), R]; scales: [S, n_slices] float32; ranks: [S] int32 or None.
    Two kernels on CUDA (nothing else: no memset, no host sync), so a step captured with a static
    meta replays it for any mapping. Rows of slot -1 tokens, and of slots whose rank is 0, are
    left exactly as they were, as are a slot's slices whose scale is 0. pdl: the expand's, as for
    `lora_expand`. pool_starts, max_rank: the weights are pools, as for `lora_shrink` and
    `lora_expand`.
    """
    buf = lora_shrink(x, lora_a, scales, meta, ranks, pool_starts=pool_starts, max_rank=max_rank)
    lora_expand(y, buf, lora_b, slice_sizes, meta, ranks, pdl=pdl, pool_starts=pool_starts, scales=scales)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q [M, K] float8_e4m3fn, scale [M, 1] float32)``: one scale per row
    (`loramux.kernels.fp8_reference`). One Triton launch on CUDA, no host sync."""
    if x.is_cuda and _use_triton(x):
        from .fp8_quant import quantize_per_token_triton

        return quantize_per_token_triton(x)
    return fp8_reference.quantize_per_token_ref(x)


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    """``(xq @ weight.T) * x_scale * weight_scale`` in ``out_dtype``: ``xq [M, K]`` and ``weight
    [N, K]`` FP8, ``x_scale [M, 1]`` and ``weight_scale [N]`` float32 (`fp8_matmul_ref`'s scheme).

    On CUDA one FP8 GEMM: up to `fp8_gemm.MAX_ROWS` rows (a decode step) and K a multiple of
    `fp8_gemm.K_MULTIPLE` ours (`fp8_gemm_triton`, sized for every multiprocessor: it does not
    read a `gemm_carveout`), others through cuBLASLt (``torch._scaled_mm``, row-wise scales:
    x's [M, 1] and the weight's [1, N], both float32; weight.t() is the column-major operand it
    takes), written in bfloat16 (the one output dtype every device's row-wise kernel takes) and
    cast to ``out_dtype``. K and N must be multiples of 16. Elsewhere the torch reference.
    """
    if not (xq.is_cuda and _use_triton(xq)):
        return fp8_reference.fp8_matmul_ref(xq, x_scale, weight, weight_scale, out_dtype)
    from . import fp8_gemm as gemm

    if xq.shape[0] <= gemm.MAX_ROWS and weight.shape[1] % gemm.K_MULTIPLE == 0:
        return gemm.fp8_gemm_triton(xq, x_scale, weight, weight_scale, out_dtype)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                           out_dtype=torch.bfloat16)
    return out if out.dtype == out_dtype else out.to(out_dtype)

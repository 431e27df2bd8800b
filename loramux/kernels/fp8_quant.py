"""`quantize_per_token_triton`: rows to FP8 (e4m3) with one float32 scale per row, in one launch.

The scheme is `quantize_per_token_ref`'s (`loramux.kernels.fp8_reference`). An FP8 GEMM quantizes
its activations with it at every call, where a chain of torch ops would launch five kernels per
projection. One program a row, two passes over it (the amax, then the quantized values; the
second reads the row from L2). Divisions round to nearest (``div_rn``), as torch's do, so the
kernel and the reference give the same bits.

Under the CPU interpreter Triton's FP8 conversion rounds some values wrongly (a carry out of the
mantissa is lost), so the CPU runs the reference and the kernel is checked against it on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_reference import FP8_DTYPE, FP8_MAX, MIN_SCALE

__all__ = ["quantize_per_token_triton"]

BLOCK = 1024


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q,
                          FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    q_row = q_ptr + row * stride_q
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


def quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (fp16/bf16/fp32, unit column stride) -> ``(q [M, K] float8_e4m3fn,
    scale [M, 1] float32)``. No host sync: it can be captured in a CUDA graph."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"quantize_per_token: x must be a 2-D fp16/bf16/fp32 tensor of unit column stride, "
                         f"got {x.dtype} {list(x.shape)} with strides {x.stride()}")
    M, K = x.shape
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        _quantize_rows_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0),
                                    FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=BLOCK, num_warps=4)
    return q, scale

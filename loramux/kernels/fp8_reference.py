"""Pure-torch FP8 (e4m3) quantization and GEMM: the CPU path, and the oracle of the GPU's.

vLLM's default FP8 scheme: weights keep one float32 scale per output channel, activations are
quantized per token when they arrive (dynamic), and the GEMM multiplies the FP8 values and
applies both scales to its float32 sums:

    out[m, n] = (sum_k xq[m, k] * wq[n, k]) * x_scale[m] * w_scale[n]

Rows are quantized alike, whether a token's activations or a weight's output channel: row ``m``
gets ``scale[m] = max(amax(|x[m]|) / 448, 1 / (448 * 512))`` and ``q[m] = clamp(x[m] / scale[m],
-448, 448)`` in ``float8_e4m3fn``, so ``x ≈ q * scale``; the floor keeps a row of zeros from
dividing by zero. An e4m3 value has 3 mantissa bits, so its products are exact in float32 (float64
for float64 input), and the reference differs from cuBLAS's FP8 GEMM only in the order it sums.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_DTYPE", "FP8_MAX", "MIN_SCALE", "fp8_matmul_ref", "quantize_per_token_ref"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
#: the smallest scale a row gets (vLLM's floor)
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q [M, K] float8_e4m3fn, scale [M, 1] float32)``, one scale per row."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()  # [M, 1]
    # by a tensor, not the number: torch divides by a number as a product with its reciprocal on
    # CUDA, which rounds otherwise than the division the kernel (and the CPU) computes
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    q = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fp8_matmul_ref(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """``(xq @ wq.T) * x_scale * w_scale`` in ``out_dtype``: xq [M, K] and wq [N, K] FP8,
    x_scale [M, 1] and w_scale [N] float32; summed in float32 (float64 when ``out_dtype`` is)."""
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    out = (xq.to(acc) @ wq.to(acc).t()) * x_scale.to(acc) * w_scale.to(acc)
    return out.to(out_dtype)

"""`fp8_gemm_triton`: a decode step's FP8 GEMM (few rows, a whole weight to read), in one launch.

``out[m, n] = (sum_k xq[m, k] * wq[n, k]) * x_scale[m] * w_scale[n]`` (`fp8_matmul_ref`'s scheme),
summed in float32 on the tensor cores, written in the output dtype.

A step of a few dozen tokens reads the weight once and does little arithmetic on it, so its time is
the weight's bytes over the bandwidth the launch reaches. That takes programs on every
multiprocessor, each streaming its own columns of the weight: the column block is the widest that
still gives every multiprocessor a program (`fp8_gemm_config`), and each program holds all of
its rows (up to `MAX_ROWS`) over the whole K, its loads several blocks ahead. cuBLASLt's and
CUTLASS's row-wise FP8 kernels tile 128 columns at such sizes, which leaves most multiprocessors
of an H100 idle for a projection of 4,096 to 6,144 columns.

K must be a multiple of 16 (every FP8 layer's is, `Fp8Linear`); N any.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fp8_reference import FP8_DTYPE
from .tiles import interpreting, next_pow2, num_sms

__all__ = ["MAX_ROWS", "Fp8GemmConfig", "block_rows", "fp8_gemm_config", "fp8_gemm_triton"]

#: the most rows (tokens) one program holds; larger steps are compute-bound, where cuBLASLt's
#: tiles are the right ones
MAX_ROWS = 64


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K is a multiple of BLOCK_K (`fp8_gemm_config`): no mask along K
    for _ in tl.range(0, K // BLOCK_K, num_stages=STAGES):
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)  # [BM, BK]
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)  # [BN, BK]
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    x_scale = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
    w_scale = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
    y = acc * x_scale[:, None] * w_scale[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int


def block_rows(m: int) -> int:
    """A program's rows for an ``m``-row GEMM: all of them (up to `MAX_ROWS`), as a power of two,
    16 at least (the tensor cores' smallest tile)."""
    return max(16, next_pow2(min(m, MAX_ROWS)))


@functools.lru_cache(maxsize=256)
def fp8_gemm_config(m: int, n: int, k: int, programs: int) -> Fp8GemmConfig:
    """The launch shape for ``m`` rows of ``n`` columns over ``k``, for ``programs`` programs in
    flight at once (the multiprocessors the launch may use): `block_rows`, the widest column
    block (128, 64, 32, 16) whose grid still has ``programs`` programs, the longest K block that
    divides K."""
    block_m = block_rows(m)
    block_n = 16
    for width in (128, 64, 32):
        if -(-n // width) >= programs:
            block_n = width
            break
    block_k = next(b for b in (128, 64, 32, 16) if k % b == 0)
    return Fp8GemmConfig(block_m, block_n, block_k, num_stages=4, num_warps=4)


def fp8_gemm_triton(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """``xq [M, K]`` and ``wq [N, K]`` FP8 (unit column stride), ``x_scale [M, 1]`` and
    ``w_scale [N]`` float32 -> ``[M, N]`` in ``out_dtype``; ``config`` overrides the launch shape
    (tests, benchmarks). No host sync: it can be captured in a CUDA graph.

    The shape is sized for all the device's multiprocessors, with or without a `gemm_carveout`
    around the call (which cuBLASLt alone reads): a launch shape that changed with the carveout
    would be one more compile per shape, and the block rows (`block_m`) are then the one thing
    that varies by step, which the kernel warm-up covers by token count."""
    M, K = xq.shape
    N = wq.shape[0]
    if xq.dtype != FP8_DTYPE or wq.dtype != FP8_DTYPE or wq.shape[1] != K or K % 16 or xq.stride(1) != 1 \
            or wq.stride(1) != 1:
        raise ValueError(f"fp8_gemm: xq [M, K] and wq [N, K] must be {FP8_DTYPE} of unit column stride and K a "
                         f"multiple of 16, got {xq.dtype} {list(xq.shape)} and {wq.dtype} {list(wq.shape)}")
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return out
    if config is None:
        config = fp8_gemm_config(M, N, K, _multiprocessors(xq.device))
    grid = (triton.cdiv(N, config.block_n), triton.cdiv(M, config.block_m))
    _fp8_gemm_kernel[grid](xq, x_scale.reshape(-1), wq, w_scale.reshape(-1), out, M, N, K, xq.stride(0),
                           wq.stride(0), out.stride(0), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                           BLOCK_K=config.block_k, STAGES=config.num_stages, num_warps=config.num_warps,
                           num_stages=config.num_stages)
    return out


def _multiprocessors(device: torch.device) -> int:
    if interpreting():  # the CPU: a few programs, so the tests cover blocks side by side
        return 4
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())

"""`fp8_gemm_triton`: a decode step's FP8 GEMM (few rows, a whole weight to read), in one launch.

``out[m, n] = (sum_k xq[m, k] * wq[n, k]) * x_scale[m] * w_scale[n]`` (`fp8_matmul_ref`'s scheme),
summed in float32 on the tensor cores, written in the output dtype.

A step of a few dozen tokens reads the weight once and does little arithmetic on it, so its time is
the weight's bytes over the bandwidth the launch reaches, which takes a program streaming part of
the weight on every multiprocessor. cuBLASLt's row-wise FP8 kernels tile 128 columns at such sizes,
which leaves most multiprocessors of an H100 idle for a projection of 4,096 to 6,144 columns.

Here a program holds all the rows (up to `MAX_ROWS`) and a block of columns, over the whole K or
one of ``split_k`` parts of it. Narrower column blocks give more programs, but each re-reads the
activations from L2 (at 64 rows and K = 14,336 a column block of 16 reads as many activation bytes
as weight bytes); K parts give more programs for the cost of their float32 sums: each part's
program writes its sums to a scratch buffer and counts itself done on the tile's counter, and the
last one adds the parts, applies the scales and writes the tile (the counters start and end at
zero, so a CUDA graph replays the launch as is). `fp8_gemm_config` picks both. The counters are
one set per device, so two K-parted launches must not run at once on one device: the engine runs
its projections on one stream, one after the other.

K must be a multiple of `K_MULTIPLE` (the tensor cores' FP8 dot takes 32 at least); N any.
`loramux.kernels.dispatch.fp8_gemm` sends other K (a shard of a small model) to cuBLASLt.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fp8_reference import FP8_DTYPE
from .tiles import cdiv, interpreting, next_pow2, num_sms

__all__ = ["K_MULTIPLE", "MAX_ROWS", "Fp8GemmConfig", "block_rows", "fp8_gemm_config", "fp8_gemm_triton", "reserve_counters"]

#: the most rows (tokens) one program holds; larger steps are compute-bound, where cuBLASLt's
#: tiles are the right ones
MAX_ROWS = 64
#: what K must be a multiple of: the FP8 dot's smallest K block
K_MULTIPLE = 32
#: tiles the split-K counters cover (`reserve_counters`): the widest projection's at the narrowest
#: split column block, with room
MAX_TILES = 4096


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn,
                     stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # this program's K blocks: part pid_k of K // BLOCK_K (K is a multiple of BLOCK_K: no K mask)
    k_blocks = K // BLOCK_K
    per_part = tl.cdiv(k_blocks, SPLIT_K)
    k_first = pid_k * per_part
    k_end = tl.minimum(k_first + per_part, k_blocks)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k_first * BLOCK_K + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_first * BLOCK_K + offs_k)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in tl.range(k_first, k_end, num_stages=STAGES):
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)  # [BM, BK]
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)  # [BN, BK]
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = m_mask[:, None] & n_mask[None, :]
    tile = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]  # [BM, BN] offsets in an [M, N] matrix
    if SPLIT_K > 1:
        tl.store(part_ptr + pid_k * M * N + tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's sums stored before the count says so
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") != SPLIT_K - 1:
            return  # a later part adds this one's sums
        tl.debug_barrier()
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for part in tl.static_range(SPLIT_K):
            acc += tl.load(part_ptr + part * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter, 0)  # zero for the next launch (and the next replay of a graph)
    x_scale = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
    w_scale = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
    y = acc * x_scale[:, None] * w_scale[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    split_k: int = 1


def block_rows(m: int) -> int:
    """A program's rows for an ``m``-row GEMM: all of them (up to `MAX_ROWS`), as a power of two,
    16 at least (the tensor cores' smallest tile)."""
    return max(16, next_pow2(min(m, MAX_ROWS)))


@functools.lru_cache(maxsize=256)
def fp8_gemm_config(m: int, n: int, k: int, programs: int) -> Fp8GemmConfig:
    """The launch shape for ``m`` rows of ``n`` columns over ``k``, for ``programs`` programs in
    flight at once (the multiprocessors the launch may use): `block_rows`; column blocks of 64; the
    longest K block that divides K; then K parts (up to 4, each of 2 K blocks at least) until the
    programs reach ``programs x 32 / block rows``. Each part's float32 sums are written and read
    back, which costs more the more rows a tile holds, so 16-row tiles split to twice the
    multiprocessors and 64-row tiles only to half of them. Five pipeline stages: a multiprocessor
    running one program needs that many loads in flight to reach the bandwidth."""
    block_m = block_rows(m)
    block_n = 64
    block_k = next(b for b in (128, 64, K_MULTIPLE) if k % b == 0)
    tiles = cdiv(n, block_n) * cdiv(m, block_m)
    split_k = 1
    while split_k < 4 and tiles * split_k < programs * 32 // block_m and k // block_k >= 4 * split_k:
        split_k *= 2
    if tiles > MAX_TILES:
        split_k = 1
    return Fp8GemmConfig(block_m, block_n, block_k, num_stages=5, num_warps=4, split_k=split_k)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def reserve_counters(device: torch.device | str) -> None:
    """Allocate ``device``'s split-K tile counters (zeros; every launch leaves them zero). Call it
    before capturing CUDA graphs: a launch in a capture finds none otherwise, and runs unsplit."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


def _counters(device: torch.device) -> torch.Tensor | None:
    if device not in _COUNTERS and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        reserve_counters(device)
    return _COUNTERS.get(device)


def fp8_gemm_triton(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """``xq [M, K]`` and ``wq [N, K]`` FP8 (unit column stride), ``x_scale [M, 1]`` and
    ``w_scale [N]`` float32 -> ``[M, N]`` in ``out_dtype``; ``config`` overrides the launch shape
    (tests, benchmarks). No host sync: it can be captured in a CUDA graph.

    The shape is sized for all the device's multiprocessors, with or without a `gemm_carveout`
    around the call (which cuBLASLt alone reads): a launch shape that changed with the carveout
    would be one more compile per shape, and the block rows (`block_rows`) are then the one thing
    that varies by step, which the kernel warm-up covers by token count."""
    M, K = xq.shape
    N = wq.shape[0]
    if xq.dtype != FP8_DTYPE or wq.dtype != FP8_DTYPE or wq.shape[1] != K or K % K_MULTIPLE or xq.stride(1) != 1 \
            or wq.stride(1) != 1:
        raise ValueError(f"fp8_gemm: xq [M, K] and wq [N, K] must be {FP8_DTYPE} of unit column stride and K a "
                         f"multiple of {K_MULTIPLE}, got {xq.dtype} {list(xq.shape)} and {wq.dtype} {list(wq.shape)}")
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return out
    if config is None:
        config = fp8_gemm_config(M, N, K, _multiprocessors(xq.device))
    counters = _counters(xq.device) if config.split_k > 1 else None
    if counters is None or cdiv(N, config.block_n) * cdiv(M, config.block_m) > counters.numel():
        config = Fp8GemmConfig(config.block_m, config.block_n, config.block_k, config.num_stages, config.num_warps)
    parts = torch.empty(config.split_k, M, N, dtype=torch.float32, device=xq.device) if config.split_k > 1 else out
    grid = (cdiv(N, config.block_n), cdiv(M, config.block_m), config.split_k)
    _fp8_gemm_kernel[grid](xq, x_scale.reshape(-1), wq, w_scale.reshape(-1), out, parts,
                           counters if config.split_k > 1 else out, M, N, K, xq.stride(0), wq.stride(0),
                           out.stride(0), BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                           SPLIT_K=config.split_k, STAGES=config.num_stages, num_warps=config.num_warps,
                           num_stages=config.num_stages)
    return out


def _multiprocessors(device: torch.device) -> int:
    if interpreting():  # the CPU: a few programs, so the tests cover blocks and K parts side by side
        return 4
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())

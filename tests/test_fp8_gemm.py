"""The decode-sized FP8 GEMM (`loramux.kernels.fp8_gemm`) against the torch reference: under the
Triton interpreter on CPU, on the GPU in `test_fp8_gpu.py`."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_interpreter

from loramux.kernels.fp8_gemm import MAX_ROWS, Fp8GemmConfig, fp8_gemm_config, fp8_gemm_triton
from loramux.kernels.fp8_reference import fp8_matmul_ref, quantize_per_token_ref


def operands(m: int, n: int, k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator)
    w = torch.randn(n, k, generator=generator) / k**0.5
    xq, x_scale = quantize_per_token_ref(x)
    wq, w_scale = quantize_per_token_ref(w)
    return xq, x_scale, wq, w_scale.view(-1)


@needs_interpreter
@pytest.mark.parametrize(("m", "n", "k"), [(1, 32, 64), (5, 48, 96), (16, 64, 128), (33, 80, 256), (64, 16, 48)])
def test_the_gemm_sums_as_the_reference_does(m, n, k):
    xq, x_scale, wq, w_scale = operands(m, n, k)
    got = fp8_gemm_triton(xq, x_scale, wq, w_scale, torch.float32)
    # the products of e4m3 values are exact in float32: only the order of the sums differs
    torch.testing.assert_close(got, fp8_matmul_ref(xq, x_scale, wq, w_scale, torch.float32), rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_column_and_row_blocks_past_the_edges_write_nothing():
    xq, x_scale, wq, w_scale = operands(3, 40, 64, seed=1)
    config = Fp8GemmConfig(block_m=16, block_n=32, block_k=32, num_stages=2, num_warps=4)
    got = fp8_gemm_triton(xq, x_scale, wq, w_scale, torch.float32, config=config)
    assert got.shape == (3, 40)
    torch.testing.assert_close(got, fp8_matmul_ref(xq, x_scale, wq, w_scale, torch.float32), rtol=1e-5, atol=1e-5)


def test_the_launch_gives_every_multiprocessor_a_column_block():
    # Llama-3.1-8B's projections at 64 tokens on 132 multiprocessors (an H100)
    assert fp8_gemm_config(64, 28672, 4096, 132) == Fp8GemmConfig(64, 128, 128, 4, 4)  # gate_up: 224 blocks
    assert fp8_gemm_config(64, 6144, 4096, 132).block_n == 32  # q/k/v: 192 blocks
    assert fp8_gemm_config(64, 4096, 14336, 132).block_n == 16  # down: 256 blocks
    assert fp8_gemm_config(1, 4096, 4096, 132).block_m == 16  # the tensor cores' smallest tile
    assert fp8_gemm_config(MAX_ROWS, 4096, 48, 132).block_k == 16


def test_operands_it_cannot_take_are_refused():
    xq, x_scale, wq, w_scale = operands(4, 32, 64)
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        fp8_gemm_triton(xq.float(), x_scale, wq, w_scale, torch.float32)
    with pytest.raises(ValueError, match="K a multiple of 16"):
        fp8_gemm_triton(xq[:, :40], x_scale, wq[:, :40], w_scale, torch.float32)

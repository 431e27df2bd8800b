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
@pytest.mark.parametrize(("m", "n", "k"), [(1, 32, 64), (5, 48, 96), (16, 64, 128), (33, 80, 256), (64, 16, 96)])
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


@needs_interpreter
@pytest.mark.parametrize("split_k", [2, 3, 5])
def test_k_parts_add_up_in_the_last_program_and_leave_the_counters_zero(split_k):
    from loramux.kernels import fp8_gemm

    xq, x_scale, wq, w_scale = operands(7, 80, 256, seed=2)  # 8 K blocks of 32: parts of 4, 3 and 2 blocks
    config = Fp8GemmConfig(block_m=16, block_n=32, block_k=32, num_stages=2, num_warps=4, split_k=split_k)
    expected = fp8_matmul_ref(xq, x_scale, wq, w_scale, torch.float32)
    for _ in range(2):  # the second launch finds the counters as the first left them
        got = fp8_gemm_triton(xq, x_scale, wq, w_scale, torch.float32, config=config)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert not fp8_gemm._COUNTERS[torch.device("cpu")].any()


@needs_interpreter
def test_more_k_parts_than_k_blocks_leave_the_extra_parts_empty():
    xq, x_scale, wq, w_scale = operands(4, 32, 64, seed=3)
    config = Fp8GemmConfig(block_m=16, block_n=32, block_k=32, num_stages=2, num_warps=4, split_k=4)
    got = fp8_gemm_triton(xq, x_scale, wq, w_scale, torch.float32, config=config)
    torch.testing.assert_close(got, fp8_matmul_ref(xq, x_scale, wq, w_scale, torch.float32), rtol=1e-5, atol=1e-5)


def test_the_launch_parts_k_by_the_rows_a_tile_holds():
    # Llama-3.1-8B's projections on 132 multiprocessors (an H100), 64 columns a block: 64-row tiles
    # part K only up to half the multiprocessors (their float32 parts are costly to add up)...
    assert fp8_gemm_config(64, 28672, 4096, 132) == Fp8GemmConfig(64, 64, 128, 5, 4, split_k=1)  # gate_up
    assert fp8_gemm_config(64, 6144, 4096, 132).split_k == 1  # q/k/v: 96 tiles
    assert fp8_gemm_config(64, 4096, 14336, 132).split_k == 2  # down: 64 tiles
    # ...16-row tiles up to twice them, in 4 parts at most
    assert fp8_gemm_config(1, 6144, 4096, 132) == Fp8GemmConfig(16, 64, 128, 5, 4, split_k=4)
    assert fp8_gemm_config(16, 28672, 4096, 132).split_k == 1  # gate_up: 448 tiles
    assert fp8_gemm_config(MAX_ROWS, 4096, 96, 132).block_k == 32
    assert fp8_gemm_config(MAX_ROWS, 4096, 96, 132).split_k == 1  # 3 K blocks: too few to part


def test_operands_it_cannot_take_are_refused():
    xq, x_scale, wq, w_scale = operands(4, 32, 64)
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        fp8_gemm_triton(xq.float(), x_scale, wq, w_scale, torch.float32)
    with pytest.raises(ValueError, match="K a multiple of 32"):
        fp8_gemm_triton(xq[:, :48], x_scale, wq[:, :48], w_scale, torch.float32)

"""`loramux.kernels.embedding.embedding_shrink`: the embedding LoRA's gather in one Triton launch
equals the torch ops (CPU interpreter and `gpu`), for tokens of slots of several ranks, tokens
without a slot and slots outside the table."""

from __future__ import annotations

import pytest
import torch

from conftest import needs_cuda, needs_interpreter, setenv
from loramux.kernels.embedding import embedding_shrink


def inputs(T: int, S: int, R: int, vocab: int, device: str, seed: int):
    """A pool of rank rows laid out as `EmbeddingWithLoRA` keeps it: slot s's rows at starts[s]."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.randint(0, R + 1, (S,), generator=g, dtype=torch.int32)
    starts = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), ranks[:-1].long()]), 0).to(torch.int32)
    a_pool = torch.randn(int(ranks.sum()) + R, 1, vocab, generator=g).to(torch.bfloat16)
    scales = torch.rand(S, 1, generator=g) + 0.5
    ids = torch.randint(0, vocab, (T,), generator=g)
    slots = torch.randint(-1, S + 1, (T,), generator=g, dtype=torch.int32)  # -1 and S: no adapter
    return [t.to(device) for t in (ids, slots, a_pool, starts, ranks, scales)]


def check(device: str, monkeypatch) -> None:
    for T, S, R, seed in ((1, 1, 1, 0), (7, 3, 8, 1), (64, 32, 16, 2), (300, 5, 64, 3)):
        args = inputs(T, S, R, 1000, device, seed)
        setenv(monkeypatch, "LORAMUX_KERNELS", "torch")
        by_torch = embedding_shrink(*args, R)
        setenv(monkeypatch, "LORAMUX_KERNELS", "triton")
        by_kernel = embedding_shrink(*args, R)
        assert by_kernel.shape == (T, R) and by_kernel.dtype == torch.float32
        assert torch.equal(by_kernel, by_torch), (T, S, R)
        ids, slots, a_pool, starts, ranks, scales = (t.cpu() for t in args)
        t = int(((slots >= 0) & (slots < S)).nonzero()[0]) if ((slots >= 0) & (slots < S)).any() else None
        if t is not None:  # one row by hand: the slot's rank rows at its token, scaled, zeros after
            s, r = int(slots[t]), int(ranks[slots[t]])
            expected = a_pool[starts[s] : starts[s] + r, 0, ids[t]].float() * scales[s, 0]
            assert torch.equal(by_kernel[t, :r].cpu(), expected) and not by_kernel[t, r:].any()
        assert not by_kernel[((slots < 0) | (slots >= S)).to(by_kernel.device)].any()


@needs_interpreter
def test_one_launch_gathers_as_the_torch_ops_do(monkeypatch):
    check("cpu", monkeypatch)


@pytest.mark.gpu
@needs_cuda
def test_gpu_one_launch_gathers_as_the_torch_ops_do(monkeypatch):
    check("cuda", monkeypatch)

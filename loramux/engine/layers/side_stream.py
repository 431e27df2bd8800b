"""The side CUDA stream a LoRA projection's shrink runs on, beside the projection's base GEMM.

At decode a layer's two LoRA launches are latency-bound: the shrink reads a few rows of x and the
adapters' A, far from filling the GPU. Launched on a side stream before the base GEMM, it runs
beside the GEMM instead of after it; the expand then waits for it on the main stream. On an H100
(`benchmarks/lora_decode.py`, Llama-3.1-8B fused layout, rank 16, 64 tokens, 32 layers in one
CUDA graph) the LoRA cost of a layer fell from 46.5 to 37.6 us with 1 adapter and from 94.5 to
86.9 us with 32; putting the expand on the side stream too was slower.

One side stream per device, shared by every layer of every model in the process. The split-K
shrink keeps one counter table per device (`loramux.kernels.shrink`: two split-K shrinks must
never run at once on different streams). Every shrink that leaves the main stream goes to this
one stream, in launch order, after the main stream's earlier work and before its later work
(each layer joins the fork before it returns), so two shrinks never overlap.
"""

from __future__ import annotations

import torch

from loramux.kernels.dispatch import uses_triton

__all__ = ["shrink_beside_base", "side_stream"]

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def shrink_beside_base(device: torch.device | str) -> bool:
    """Whether LoRA projections on ``device`` launch their shrink on the side stream: on CUDA, when
    the Triton kernels run (`loramux.kernels.dispatch.uses_triton`). Elsewhere, and with the torch
    reference kernels (``LORAMUX_KERNELS=torch``), the shrink runs after the base layer, in order."""
    device = torch.device(device)
    return device.type == "cuda" and uses_triton(device)


def side_stream(device: torch.device | str) -> torch.cuda.Stream:
    """The side stream of CUDA ``device`` (its current device when it names no index), made on
    first use: by the warm-up run `loramux.engine.cuda_graphs` makes before each capture, so a
    capture finds it made."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:  # two threads racing here keep one stream between them
        stream = _SIDE_STREAMS.setdefault(index, torch.cuda.Stream(index))
    return stream

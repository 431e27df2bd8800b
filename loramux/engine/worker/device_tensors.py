"""Small host values (a batch's temperatures, token ids to mask) as device tensors, copied without
waiting for the GPU.

``torch.tensor(values, device="cuda")`` copies from pageable memory, which makes the host wait
until the stream's queued work is done: with async scheduling that is the whole step still
running, so sampling would undo the overlap. Staged through page-locked memory (PyTorch's caching
host allocator) the copy is queued like a kernel and the host goes on.
"""

from __future__ import annotations

import torch

__all__ = ["device_tensor"]


def device_tensor(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, queued behind its stream's work."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)

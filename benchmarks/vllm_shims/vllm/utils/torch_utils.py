"""`async_tensor_h2d` and `direct_register_custom_op`, as the LoRA ops use them."""

from __future__ import annotations

from typing import Callable

import torch


def async_tensor_h2d(data, device=None, dtype=None, out=None) -> torch.Tensor:
    """Host list or tensor -> device, through pinned memory when a GPU is present (as vLLM)."""
    pin = torch.cuda.is_available()
    if isinstance(data, torch.Tensor):
        t = data.to(dtype=dtype or data.dtype).pin_memory() if pin else data
    else:
        t = torch.tensor(data, dtype=dtype, pin_memory=pin, device="cpu")
    if out is not None:
        return out.copy_(t, non_blocking=True)
    return t.to(device=device, dtype=dtype, non_blocking=True)


def direct_register_custom_op(op_name: str, op_func: Callable, mutates_args=None, **_) -> None:
    """Registers nothing: the ops' own fallback (`except AttributeError`) then binds the plain
    function. The benchmark times CUDA-graph replays, where torch's op dispatch costs nothing."""

"""The tensor-parallel process group, each rank's device, and the all-reduce the forward calls.

NCCL between GPUs (rank ``r`` on ``cuda:r``), gloo on CPU; the ranks meet at
``tcp://127.0.0.1:<free port>`` (one host). The group is torch's default group, so one
tensor-parallel engine is open per process at a time.

The all-reduce is a torch custom op, ``loramux::all_reduce`` (in place), so ``torch.compile``
treats it as an opaque call and a CUDA graph records NCCL's kernel like any other (NCCL
collectives are capturable once the communicator exists; the warm-up runs before capture create
it).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["all_reduce", "destroy_group", "free_port", "init_group", "rank_device"]

#: how long a collective (and the rendezvous) may wait for a peer before failing; generous, since
#: the first forward compiles. A dead worker is noticed sooner, by its process sentinel.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_device(device: torch.device, rank: int, world_size: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:rank`` on CUDA (the ranks take GPUs 0..N-1), else ``device``.

    :raises ValueError: fewer GPUs than ranks, or a CUDA device index other than 0 with TP.
    """
    if device.type != "cuda":
        return device
    if device.index not in (None, 0):
        raise ValueError(
            f"device={str(device)!r} with tensor_parallel_size={world_size}: the ranks take cuda:0 to "
            f"cuda:{world_size - 1}; pass device='cuda' and choose GPUs with CUDA_VISIBLE_DEVICES."
        )
    available = torch.cuda.device_count()
    if available < world_size:
        raise ValueError(
            f"tensor_parallel_size={world_size} needs {world_size} GPUs, and {available} are visible; "
            "lower tensor_parallel_size or make more GPUs visible (CUDA_VISIBLE_DEVICES)."
        )
    return torch.device("cuda", rank)


def init_group(init_method: str, rank: int, world_size: int, device: torch.device) -> None:
    """Join the group as ``rank``; blocks until all ``world_size`` ranks have joined."""
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group is already open in this process (another "
            "tensor-parallel engine?); close() that engine before starting another."
        )
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT, device_id=device if cuda else None,
    )


def destroy_group(*, abort: bool = False) -> None:
    """Leave the group. A clean NCCL shutdown waits for every rank to shut down too, so after a
    rank died or was killed (``abort``) the communicator is aborted instead, which waits for no one."""
    if not dist.is_initialized():
        return
    abort_group = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch >= 2.5
    if abort and abort_group is not None and dist.get_backend() == "nccl":
        abort_group()
        if not dist.is_initialized():
            return
    dist.destroy_process_group()


@torch.library.custom_op("loramux::all_reduce", mutates_args=("tensor",))
def _all_reduce_op(tensor: torch.Tensor) -> None:
    """Sum ``tensor`` over the ranks, in place."""
    dist.all_reduce(tensor)


@_all_reduce_op.register_fake
def _(tensor) -> None:
    return None


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over the ranks, in place (it must be contiguous); returns it."""
    torch.ops.loramux.all_reduce(tensor)
    return tensor

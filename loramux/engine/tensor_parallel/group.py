"""The tensor-parallel process group, each rank's device, and the all-reduce the forward calls.

NCCL between GPUs (rank ``r`` on ``cuda:r``), gloo on CPU; the ranks meet at
``tcp://127.0.0.1:<free port>`` (one host). The group is torch's default group, so one
tensor-parallel engine is open per process at a time.

The all-reduce is a torch custom op, ``loramux::all_reduce`` (in place), so ``torch.compile``
treats it as an opaque call and a CUDA graph records its kernels like any other (NCCL
collectives are capturable once the communicator exists; the warm-up runs before capture create
it).

With ``LORAMUX_SYMM_MEM_ALL_REDUCE=1`` an all-reduce of up to `SYMMETRIC_MAX_BYTES` on CUDA goes
through a buffer every rank maps (torch's symmetric memory, `use_symmetric_memory`): the tensor
is copied in, one two-shot kernel has each rank sum its share of the elements straight from its
peers' buffers over NVLink and write the sums back to every peer, and the result is copied out.
A decode step's all-reduces are small (64 rows of 4,096 bf16 values: 512 KiB), where NCCL's
fixed cost dominates (the gain measured: docs/architecture.md). It is off by default because
NCCL's communicator can be aborted when a worker dies mid-step (`destroy_group`), while a
two-shot kernel waiting for a dead peer cannot. Larger tensors, other dtypes and CPU groups
always go through NCCL or gloo. No NVLink multicast is used: the kernel reads and writes its
peers' memory directly.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from loramux import envs

__all__ = ["SYMMETRIC_MAX_BYTES", "all_reduce", "destroy_group", "free_port", "init_group", "rank_device",
           "share_sampled", "symmetric_buffer", "use_symmetric_memory"]

logger = logging.getLogger(__name__)

#: how long a collective (and the rendezvous) may wait for a peer before failing; generous, since
#: the first forward compiles. A dead worker is noticed sooner, by its process sentinel.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


#: the largest all-reduce that goes through the symmetric-memory buffer (and the buffer's size at
#: most): a decode or short mixed step's; a prefill of thousands of tokens moves enough bytes that
#: NCCL's bandwidth, not its latency, sets its time.
SYMMETRIC_MAX_BYTES = 32 << 20
#: the dtypes torch's two-shot kernel sums
SYMMETRIC_DTYPES = (torch.bfloat16, torch.float32)

#: an aborted group's collectives stop within this (NCCL's kernels poll its abort flag); the
#: abort itself may take longer: it returns once no CUDA graph holds one of them
ABORT_STOP_S = 1.0
#: how long closing waits for the abort to return once the graphs are dropped
ABORT_WAIT_S = 30.0

_symmetric: torch.Tensor | None = None  # this rank's symmetric buffer, once `use_symmetric_memory` made it


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


def use_symmetric_memory(max_bytes: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Send this group's all-reduces of ``dtype`` up to ``min(max_bytes, SYMMETRIC_MAX_BYTES)``
    through a symmetric-memory buffer of that size; returns whether they will. Every rank calls it
    with the same arguments (the buffer's rendezvous is a collective), after `init_group`.

    Off (NCCL for all) unless ``LORAMUX_SYMM_MEM_ALL_REDUCE=1``, and on CPU, for other dtypes and
    where torch cannot map the peers' memory (the warning says why).
    """
    global _symmetric
    if device.type != "cuda" or dtype not in SYMMETRIC_DTYPES or not envs.current().symm_mem_all_reduce:
        return False
    numel = min(max_bytes, SYMMETRIC_MAX_BYTES) // dtype.itemsize
    try:
        import torch.distributed._symmetric_memory as symmetric_memory

        buffer = symmetric_memory.empty(numel, dtype=dtype, device=device)
        symmetric_memory.rendezvous(buffer, dist.group.WORLD.group_name)
    except (ImportError, RuntimeError) as exc:
        logger.warning("tensor-parallel all-reduces go through NCCL: no symmetric memory on %s (%s)", device, exc)
        return False
    _symmetric = buffer
    return True


def symmetric_buffer() -> torch.Tensor | None:
    """This rank's symmetric-memory buffer, or None while every all-reduce goes through NCCL."""
    return _symmetric


def destroy_group(*, abort: bool = False, release: Callable[[], None] | None = None) -> None:
    """Leave the group, calling ``release`` (what holds this rank's device memory: its CUDA graphs
    and KV cache) once this rank's collectives have stopped.

    A clean NCCL shutdown waits for every rank to shut down too, so after a rank died or was killed
    (``abort``) the communicator is aborted instead, in a thread: the abort stops at once the
    collectives stuck waiting for the dead rank, but NCCL frees a collective captured in a CUDA
    graph only with its graph, so the abort returns only after ``release`` dropped the graphs.
    """
    global _symmetric
    _symmetric = None  # its memory is mapped by the group's peers: released with the group
    abort_group = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch >= 2.5
    if abort and abort_group is not None and dist.is_initialized() and dist.get_backend() == "nccl":
        aborting = threading.Thread(target=abort_group, name="loramux-tp-abort", daemon=True)
        aborting.start()
        aborting.join(ABORT_STOP_S)  # where no graph holds a collective, the abort is done by now
        if release is not None:
            release()
        aborting.join(ABORT_WAIT_S)
        if aborting.is_alive():
            logger.warning("the tensor-parallel group's NCCL abort did not finish within %.0f s; this process "
                           "cannot start another tensor-parallel engine", ABORT_STOP_S + ABORT_WAIT_S)
        return
    if release is not None:
        release()
    if dist.is_initialized():
        dist.destroy_process_group()


@torch.library.custom_op("loramux::all_reduce", mutates_args=("tensor",))
def _all_reduce_op(tensor: torch.Tensor) -> None:
    """Sum ``tensor`` over the ranks, in place: through the symmetric buffer where it fits
    (a graph records the path its shapes take), else NCCL (gloo on CPU)."""
    buffer = _symmetric
    numel = tensor.numel()
    # the two-shot kernel moves 16 bytes a load: a tensor of another size goes through NCCL
    if buffer is not None and tensor.dtype == buffer.dtype and numel <= buffer.numel() \
            and numel * tensor.element_size() % 16 == 0 and tensor.is_contiguous():
        part = buffer[:numel]
        part.copy_(tensor.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(part, "sum", dist.group.WORLD.group_name)
        tensor.view(-1).copy_(part)
    else:
        dist.all_reduce(tensor)


@_all_reduce_op.register_fake
def _(tensor) -> None:
    return None


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over the ranks, in place (it must be contiguous); returns it."""
    torch.ops.loramux.all_reduce(tensor)
    return tensor


def share_sampled(tokens: torch.Tensor) -> torch.Tensor:
    """Rank 0's sampled token ids (int64, one per sampled row) on every rank, in place: on rank 0
    ``tokens`` is sent, elsewhere it is received into (a buffer of the same size). The next step's
    pending tokens take their ids from it on every rank, as rank 0 alone samples."""
    assert tokens.dtype == torch.int64, tokens.dtype  # every rank's buffer is int64
    tokens = tokens.contiguous()
    dist.broadcast(tokens, src=0)
    return tokens

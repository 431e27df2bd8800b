"""The tensor-parallel all-reduce on every GPU of the host, one process a rank:
`tests/test_tensor_parallel.py` runs it (it also runs by hand)::

    PYTHONPATH=. python tests/all_reduce_driver.py

Each rank joins the group, maps the symmetric buffer (``LORAMUX_SYMM_MEM_ALL_REDUCE=1``,
`use_symmetric_memory`, 1 MiB of bf16) and sums, in place: tensors that go through the buffer
(eagerly and in a CUDA graph, replayed with new values), and those that go through NCCL (larger
than the buffer, float16, a size the two-shot kernel does not take). The last line of output is ``RESULT {json}``: each case's
largest error against the exact sum, and whether the buffer was mapped.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.multiprocessing as mp

BUFFER_BYTES = 1 << 20


def cases(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Each case's tensor on ``rank``: values whose sum over the ranks is exact in its dtype."""
    def make(shape, dtype):
        return (torch.arange(shape[0] * shape[1], device=device).view(shape) % 64 + rank).to(dtype)

    return {"buffer, bf16": make((64, 4096), torch.bfloat16),  # a decode step's 512 KiB
            "nccl, larger than the buffer": make((256, 4096), torch.bfloat16),
            "nccl, float16": make((64, 4096), torch.float16),
            "nccl, 3 values": make((1, 3), torch.bfloat16)}


def expected(case: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return sum(case.double() - rank + r for r in range(world))


def run(rank: int, world: int, init_method: str, results) -> None:
    from loramux.engine.tensor_parallel.group import (all_reduce, destroy_group, init_group,
                                                      symmetric_buffer, use_symmetric_memory)

    device = torch.device("cuda", rank)
    init_group(init_method, rank, world, device)
    try:
        mapped = use_symmetric_memory(BUFFER_BYTES, torch.bfloat16, device)
        errors = {}
        for name, case in cases(rank, device).items():
            want = expected(case, rank, world)
            errors[name] = (all_reduce(case).double() - want).abs().max().item()
        # in a graph: captured once, replayed over new values written into its input
        x = cases(rank, device)["buffer, bf16"]
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            all_reduce(x.clone())  # the communicator and kernels exist before capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            all_reduce(x)
        for shift in (1, 2):
            fresh = cases(rank, device)["buffer, bf16"] + shift
            x.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize(device)
            want = expected(fresh, rank, world)
            errors[f"buffer, bf16, graph replay {shift}"] = (x.double() - want).abs().max().item()
        if rank == 0:
            results.put({"mapped": mapped, "buffer_bytes": symmetric_buffer().nbytes if mapped else 0,
                         "errors": errors})
    finally:
        destroy_group()


def main() -> int:
    from loramux.engine.tensor_parallel.group import free_port

    world = torch.cuda.device_count()
    if world < 2:
        print("needs 2 CUDA GPUs", file=sys.stderr)
        return 2
    os.environ["LORAMUX_SYMM_MEM_ALL_REDUCE"] = "1"  # the ranks read it at their start
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(run, args=(world, f"tcp://127.0.0.1:{free_port()}", results), nprocs=world)
    print("RESULT " + json.dumps(results.get()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What slows the engine's thread while adapters load beside it (issue 10): a decode-like step on
the GPU, the host work a prefetch does after it, and loader-like threads doing one kind of work
each, to tell page-locked allocations (``cudaHostAlloc``, the driver's lock) from the GIL.

    PYTHONPATH=. python benchmarks/host_contention.py [--steps 60] [--threads 4] [--json out.json]

Per condition: the engine thread's step wall time (a CUDA-graph replay of ~10 ms of GEMMs, then
a prefetch's host work: a small pinned tensor to the device, a foreach copy over 225 blocks, a
15 MB page-locked copy on a side stream, then the wait for the step's result), its median and
p99, and the prefetch part's median and p99. Loader threads, ``--threads`` of them:

- ``idle``: none;
- ``pin_new``: allocate page-locked buffers of new sizes (8-64 MB) and keep the last 64, as a CPU
  tier filling up does (each a ``cudaHostAlloc`` once PyTorch's host cache has no block of it);
- ``pin_cached``: the same sizes again, served from PyTorch's host cache;
- ``python``: pure-Python work (the GIL), as per-tensor checks of a loader do;
- ``pageable``: pageable buffers filled by numpy (memory traffic, GIL released).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONDITIONS = ("idle", "pin_new", "pin_cached", "python", "pageable")


def loader(kind: str, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    kept: list = []
    while not stop.is_set():
        mb = rng.randrange(8, 64)
        if kind in ("pin_new", "pin_cached"):
            size = (mb << 20) + (rng.randrange(1, 4096) * 4096 if kind == "pin_new" else 0)
            kept.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))
        elif kind == "python":
            kept.append(sum(i * i for i in range(20000)))
        elif kind == "pageable":
            buffer = torch.empty(mb << 20, dtype=torch.uint8)
            buffer.numpy().fill(1)
            kept.append(buffer)
        del kept[:-64]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(kind: str, threads: int, steps: int, graph, side, device) -> dict:
    blocks_dst = [torch.empty(4096, dtype=torch.bfloat16, device=device) for _ in range(225)]
    blocks_src = [torch.randn(4096, device=device).to(torch.bfloat16) for _ in range(225)]
    host = torch.empty(15 << 20, dtype=torch.uint8, pin_memory=True)
    staged = torch.empty(15 << 20, dtype=torch.uint8, device=device)
    stop = threading.Event()
    workers = [threading.Thread(target=loader, args=(kind, stop, i), daemon=True)
               for i in range(threads if kind != "idle" else 0)]
    for worker in workers:
        worker.start()
    time.sleep(0.5)
    step_ms, prefetch_ms = [], []
    try:
        for _ in range(steps):
            started = time.perf_counter()
            graph.replay()
            done = torch.cuda.Event()
            done.record()
            before = time.perf_counter()
            flat = torch.tensor([float(i) for i in range(225)]).pin_memory().to(device, non_blocking=True)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                staged.copy_(host, non_blocking=True)
                torch._foreach_copy_(blocks_dst, blocks_src)
            event = torch.cuda.Event()
            event.record(side)
            prefetch_ms.append(1e3 * (time.perf_counter() - before))
            done.synchronize()  # the host reads the sampled tokens
            del flat
            step_ms.append(1e3 * (time.perf_counter() - started))
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    torch.cuda.synchronize(device)
    return {"condition": kind, "threads": len(workers), "step_ms_median": statistics.median(step_ms),
            "step_ms_p99": percentile(step_ms, 0.99), "prefetch_ms_median": statistics.median(prefetch_ms),
            "prefetch_ms_p99": percentile(prefetch_ms, 0.99), "prefetch_ms_max": max(prefetch_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("host_contention.py measures CUDA calls: run it on a GPU")
    device = torch.device("cuda")
    weights = [torch.randn(4096, 4096, device=device, dtype=torch.bfloat16) for _ in range(40)]
    x = torch.randn(64, 4096, device=device, dtype=torch.bfloat16)

    def work():
        h = x
        for w in weights * 6:  # ~240 GEMMs of 64 x 4096 x 4096: a decode step's worth of weights
            h = h @ w
        return h

    warm = torch.cuda.Stream(device)
    warm.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(warm):
        work()
    torch.cuda.current_stream(device).wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    side = torch.cuda.Stream(device)
    rows = []
    for kind in args.conditions.split(","):
        row = measure(kind, args.threads, args.steps, graph, side, device)
        rows.append(row)
        print(" | ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(device), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

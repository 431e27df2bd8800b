"""What slows the engine's thread while adapters load beside it (issue 10): a decode-like step on
the GPU, the host work a prefetch does after it, and loader-like threads doing one kind of work
each, to tell page-locked allocations (``cudaHostAlloc``, the driver's lock) from the GIL.

    PYTHONPATH=. python benchmarks/host_contention.py [--steps 60] [--threads 4] [--json out.json]
        [--switch-interval 0.0005]

Per condition: the engine thread's step wall time (a CUDA-graph replay of ~10 ms of GEMMs, then
a prefetch's host work: a small pinned tensor to the device, a foreach copy over 225 blocks, a
15 MB page-locked copy on a side stream, then the wait for the step's result), its median and
p99, and the prefetch part's median and p99. Loader threads, ``--threads`` of them:

- ``idle``: none;
- ``pin_new``: allocate page-locked buffers of new sizes (8-64 MB) and keep the last 64, as a CPU
  tier filling up does (each a ``cudaHostAlloc`` once PyTorch's host cache has no block of it);
- ``pin_cached``: the same sizes again, served from PyTorch's host cache;
- ``python``: pure-Python work (the GIL), as per-tensor checks of a loader do;
- ``pageable``: pageable buffers filled by numpy (memory traffic, GIL released);
- ``arena``: the same sizes as ``pin_new``, carved from a `PinnedArena` page-locked before the
  run (as the engine's, at start) and given back as they are dropped: what loaders do now;
- ``loads``: real adapter loads through a `Registry` whose host memory is such an arena (files of
  Llama-3.1-8B's layout at tiny widths, 448 tensors each, in the page cache: a load is its Python).

``--switch-interval`` sets ``sys.setswitchinterval`` for the run (default: what the engine sets
when it starts serving, `SERVING_SWITCH_INTERVAL_S`; Python's own is 0.005).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONDITIONS = ("idle", "pin_new", "pin_cached", "python", "pageable", "arena", "loads")
ARENA_BYTES = 2 << 30
ARENA_KEPT = 8  # pieces each loader thread keeps: 4 threads x 8 x 36 MB on average fit the arena


def loader(kind: str, stop: threading.Event, seed: int, memory) -> None:
    rng = random.Random(seed)
    kept: list = []
    if kind == "loads":
        registry, requests = memory
        while not stop.is_set():
            registry.rebind(rng.choice(requests))  # read, parse, check, hash: a cold load each time
        return
    while not stop.is_set():
        mb = rng.randrange(8, 64)
        if kind in ("pin_new", "pin_cached"):
            size = (mb << 20) + (rng.randrange(1, 4096) * 4096 if kind == "pin_new" else 0)
            kept.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))
        elif kind == "arena":
            kept.append(memory.allocate((mb << 20) + rng.randrange(1, 4096) * 4096))
            del kept[:-ARENA_KEPT]
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


def loader_memory(kind: str, tmp: Path, *, pinned: bool = True):
    """What the ``arena`` and ``loads`` loaders use: an arena page-locked now, before the timed run
    (and for ``loads`` a registry over it and the requests of its adapters)."""
    if kind not in ("arena", "loads"):
        return None
    from loramux.registry.pinned_arena import PinnedArena

    arena = PinnedArena(ARENA_BYTES, pinned=pinned)
    if kind == "arena":
        return arena
    from transformers import LlamaConfig

    from benchmarks.adapter_trace import ALL_SEVEN, TraceAdapter, write_adapter_files
    from benchmarks.slot_churn import MAX_RANK, TINY_8B_LAYOUT
    from loramux.registry import LoRAConfig, LoRARequest, Registry

    fleet = [TraceAdapter(f"a{i}", i + 1, 16, ALL_SEVEN, seed=i) for i in range(32)]
    paths = write_adapter_files(fleet, LlamaConfig(**TINY_8B_LAYOUT), tmp, torch.float32, workers=4,
                                drop_cache=False)
    registry = Registry(LoRAConfig(max_loras=1, max_lora_rank=MAX_RANK, max_cpu_loras=16), resolvers=[],
                        host_memory=arena)
    requests = [LoRARequest(a.name, a.lora_int_id, str(paths[a.name])) for a in fleet]
    for request in requests:
        registry.get(request)  # layouts parsed, page cache warm
    return registry, requests


def measure(kind: str, threads: int, steps: int, graph, side, device, memory=None) -> dict:
    blocks_dst = [torch.empty(4096, dtype=torch.bfloat16, device=device) for _ in range(225)]
    blocks_src = [torch.randn(4096, device=device).to(torch.bfloat16) for _ in range(225)]
    host = torch.empty(15 << 20, dtype=torch.uint8, pin_memory=True)
    staged = torch.empty(15 << 20, dtype=torch.uint8, device=device)
    stop = threading.Event()
    workers = [threading.Thread(target=loader, args=(kind, stop, i, memory), daemon=True)
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
    row = {"condition": kind, "threads": len(workers), "step_ms_median": statistics.median(step_ms),
           "step_ms_p99": percentile(step_ms, 0.99), "prefetch_ms_median": statistics.median(prefetch_ms),
           "prefetch_ms_p99": percentile(prefetch_ms, 0.99), "prefetch_ms_max": max(prefetch_ms)}
    arena = memory[0].host_memory if isinstance(memory, tuple) else memory
    if arena is not None:  # loads that found no room took pageable memory: say how many
        row.update(arena_allocations=arena.stats.allocations, arena_fallbacks=arena.stats.fallbacks)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for the run (default: the engine's serving value)")
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
    from loramux.engine.serving_process import SERVING_SWITCH_INTERVAL_S

    interval = SERVING_SWITCH_INTERVAL_S if args.switch_interval is None else args.switch_interval
    sys.setswitchinterval(interval)
    rows = []
    with tempfile.TemporaryDirectory(prefix="host-contention-") as tmp:
        for kind in args.conditions.split(","):
            memory = loader_memory(kind, Path(tmp))
            row = measure(kind, args.threads, args.steps, graph, side, device, memory)
            del memory
            rows.append(row)
            print(" | ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(device), "switch_interval_s": interval,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""How much adapter loads beside it slow an engine-like thread through the GIL (issue 10), on the CPU,
and what Python's switch interval changes about it.

The engine's thread replays a step: ``--calls`` short calls that release the GIL (``time.sleep(0)``,
as a graph replay, a copy or a CUDA sync of a step's host work does), then ``--gpu-ms`` of waiting
with the GIL released (the GPU computing). Beside it, ``--threads`` loader threads load adapters through a
`Registry` (read, parse, check, validate, hash; the files in the page cache), in Llama-3.1-8B's
layout (`slot_churn.TINY_8B_LAYOUT`: 32 layers; rank 16 on all seven projections, 448 tensors a
file) at tiny widths, so that a load is its Python and not its bytes. A tier smaller than the
fleet makes every load a cold one.

Each call that gives the GIL up may have to wait for a thread running Python to hand it back, up
to the switch interval (``sys.setswitchinterval``, 5 ms by default). Per switch interval, the
step's median and p99 beside nothing, beside ``--threads`` threads of pure Python (the GIL alone:
no I/O, no allocation) and beside as many loader threads; the work those threads did a second
(loads, or Python loops: what a shorter interval costs them); and a load's thread CPU time alone
(what it can hold the GIL for, at most). On a machine with fewer cores than threads the loader
rows also measure the CPU being shared.

    PYTHONPATH=. python benchmarks/loader_gil.py [--switch-intervals 0.005,0.001,0.0005,0.0002] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.adapter_trace import ALL_SEVEN, TraceAdapter, write_adapter_files  # noqa: E402
from benchmarks.slot_churn import MAX_RANK, TINY_8B_LAYOUT  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def engine_steps(steps: int, calls: int, gpu_ms: float) -> list[float]:
    """Step wall times (ms) of the engine-like thread."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        for _ in range(calls):
            time.sleep(0)  # gives the GIL up and takes it back, as a graph replay or a CUDA sync does
        time.sleep(gpu_ms / 1e3)
        times.append(1e3 * (time.perf_counter() - started))
    return times


def loader(registry, requests, stop: threading.Event, done: list[int]) -> None:
    while not stop.is_set():
        for request in requests:
            if stop.is_set():
                return
            registry.rebind(request)  # a load from the file every time (the same content keeps its handle)
            done[0] += 1


def python_busy(stop: threading.Event, done: list[int]) -> None:
    """Pure Python that never gives the GIL up by itself (a per-tensor loop of a loader)."""
    while not stop.is_set():
        sum(i * i for i in range(2000))
        done[0] += 1


def measure(args, registry, requests, kind: str, threads: int) -> dict:
    stop = threading.Event()
    done = [0]
    share = max(1, len(requests) // max(threads, 1))
    if kind == "loads":
        workers = [threading.Thread(target=loader, args=(registry, requests[i * share:(i + 1) * share], stop, done),
                                    daemon=True) for i in range(threads)]
    else:
        workers = [threading.Thread(target=python_busy, args=(stop, done), daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    started = time.perf_counter()
    try:
        times = engine_steps(args.steps, args.calls, args.gpu_ms)
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    seconds = time.perf_counter() - started
    return {"beside": kind if threads else "nothing", "threads": threads, "step_ms_median": statistics.median(times),
            "step_ms_p99": percentile(times, 0.99), "their_work_per_s": done[0] / seconds}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--switch-intervals", default="0.005,0.001,0.0005,0.0002", help="seconds, comma-separated")
    parser.add_argument("--threads", type=int, default=1, help="loader (and Python-busy) threads")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--calls", type=int, default=20, help="GIL-releasing calls a step")
    parser.add_argument("--gpu-ms", type=float, default=5.0)
    parser.add_argument("--fleet", type=int, default=64, help="adapters (the CPU tier holds half)")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() after the warm-up, as the engine does once it serves")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    from loramux.engine.lora_model import LoRAModelManager
    from loramux.engine.siblings import fuse_siblings
    from loramux.registry import LoRAConfig, LoRARequest, Registry
    from loramux.registry.pinned_arena import PinnedArena

    config = LlamaConfig(**TINY_8B_LAYOUT)
    model = LlamaForCausalLM(config).eval()
    fuse_siblings(model)
    lora_config = LoRAConfig(max_loras=4, max_lora_rank=MAX_RANK, max_cpu_loras=max(4, args.fleet // 2))
    manager = LoRAModelManager(model, lora_config)
    fleet = [TraceAdapter(f"a{i}", i + 1, 16, ALL_SEVEN, seed=i) for i in range(args.fleet)]
    default_interval = sys.getswitchinterval()
    report: dict = {"switch_interval_default_s": default_interval, "threads": args.threads, "calls": args.calls,
                    "gpu_ms": args.gpu_ms, "rows": []}
    with tempfile.TemporaryDirectory(prefix="loader-gil-") as tmp:
        paths = write_adapter_files(fleet, config, Path(tmp), torch.float32, workers=2, drop_cache=False)
        requests = [LoRARequest(a.name, a.lora_int_id, str(paths[a.name])) for a in fleet]
        arena = PinnedArena(64 << 20, pinned=False)  # pre-faulted memory, as the engine's pinned arena is
        registry = Registry(lora_config, resolvers=[], validate=manager.validate, host_memory=arena)
        for request in requests:  # page cache, layouts, validation: warm, as after a while of serving
            registry.get(request)
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        cpu_started = time.thread_time()
        for request in requests:
            registry.rebind(request)
        report["load_thread_cpu_ms"] = 1e3 * (time.thread_time() - cpu_started) / len(requests)
        try:
            for interval in (float(x) for x in args.switch_intervals.split(",")):
                sys.setswitchinterval(interval)
                for kind, threads in (("nothing", 0), ("python", args.threads), ("loads", args.threads)):
                    row = {"switch_interval_s": interval, **measure(args, registry, requests, kind, threads)}
                    report["rows"].append(row)
                    print(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                          flush=True)
        finally:
            sys.setswitchinterval(default_interval)
            gc.unfreeze()  # a caller in this process (the tests) gets its collector back
    print(f"a load's thread CPU time alone: {report['load_thread_cpu_ms']:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

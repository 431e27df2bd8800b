"""Adapter-affine vs random routing on Ray Serve, on CPU with the embedded model (issue 16's target).

Two replicas with CPU tiers of 8 serve 16 adapters (copies of the demo adapters under 16 names,
found on demand in a resolver dir, so each name is its own cold load). The same trace — one seed,
adapters drawn uniformly — runs twice in one run, on one local Ray cluster:

* ``affine``: the loramux application as shipped (Ray Serve's model multiplexing on the adapter);
* ``random``: the same application with ``adapter_affinity: false`` (Ray's power-of-two choices
  on queue length alone, blind to adapters).

Each mode first sends one request per adapter (not timed, not counted), then the timed trace.
Reported per mode: requests/s, and cold loads per request (requests whose adapter was not in the
answering replica's CPU tier, from the ``x-loramux-cold-load`` header); then the ratios.

    python benchmarks/ray_routing.py --out docs/benchmarks/ray_routing_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _adapters(root: Path, count: int) -> list[str]:
    from loramux.serving.server import demo_adapters

    demos = [path for _, path, _ in demo_adapters()]
    names = [f"adapter-{i:02d}" for i in range(count)]
    for i, name in enumerate(names):
        shutil.copytree(demos[i % len(demos)], root / name)
    return names


def _run_trace(base_url: str, trace: list[str], args: argparse.Namespace) -> dict:
    def ask(client: httpx.Client, model: str) -> str:
        response = client.post("/v1/completions", json={
            "model": model, "prompt": "Tell me about the sea.", "max_tokens": args.max_tokens, "temperature": 0})
        response.raise_for_status()
        return response.headers["x-loramux-cold-load"]

    with httpx.Client(base_url=base_url, timeout=300) as client, ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(lambda model: ask(client, model), sorted(set(trace))))  # warm-up: one each
        started = time.perf_counter()
        cold = list(pool.map(lambda model: ask(client, model), trace))
        seconds = time.perf_counter() - started
    return {"requests": len(trace), "seconds": round(seconds, 3), "requests_per_s": round(len(trace) / seconds, 3),
            "cold_loads": cold.count("1"), "cold_loads_per_request": round(cold.count("1") / len(trace), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--cpu-tier", type=int, default=8, help="max_cpu_loras per replica")
    parser.add_argument("--max-loras", type=int, default=8, help="adapters usable in one step per replica")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()

    import ray
    from ray import serve

    from loramux.serving.ray import build_application

    workdir = Path(tempfile.mkdtemp(prefix="loramux-ray-bench-"))
    names = _adapters(workdir, args.adapters)
    rng = random.Random(args.seed)
    trace = [rng.choice(names) for _ in range(args.requests)]
    ray.init(address="local", num_cpus=2 * args.replicas, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    results = {}
    try:
        for mode in ("affine", "random"):
            serve.run(build_application({
                "num_replicas": args.replicas, "replica_num_cpus": 1, "lora_resolver_dir": str(workdir),
                "max_loras": args.max_loras, "max_cpu_loras": args.cpu_tier, "adapter_affinity": mode == "affine",
            }), name=f"bench-{mode}", route_prefix="/")
            results[mode] = _run_trace(f"http://127.0.0.1:{port}", trace, args)
            print(mode, results[mode], flush=True)
            serve.delete(f"bench-{mode}")
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    affine, rand = results["affine"], results["random"]
    report = {
        "device": f"CPU ({platform.processor() or platform.machine()}), {args.replicas} replicas on one machine",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "results": results,
        "throughput_ratio_affine_over_random": round(affine["requests_per_s"] / rand["requests_per_s"], 3),
        # None when affine routing had no cold load at all (the ratio is unbounded)
        "cold_load_ratio_random_over_affine": (
            round(rand["cold_loads_per_request"] / affine["cold_loads_per_request"], 2) if affine["cold_loads"] else None),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

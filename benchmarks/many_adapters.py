"""Thousands of adapters under churn (issue 10, item 5): throughput and TTFT as N grows past the tiers.

    PYTHONPATH=. python benchmarks/many_adapters.py                    # CPU: embedded model, small
    PYTHONPATH=. python benchmarks/many_adapters.py --tag h100         # CUDA: Llama-3.1-8B shapes, dummy
    PYTHONPATH=. python benchmarks/many_adapters.py --plot docs/benchmarks/many_adapters_h100.json

For each N (default 4, 32, 256, 1000 on CUDA) one trace (``benchmarks/adapter_trace.py``): N
adapters of a mix of ranks (8-64) and target sets (q/v, q/k/v/o, all seven), Zipf(1) popularity,
Poisson arrivals, every request 128 prompt + 64 generated tokens (``ignore_eos``). The adapters a
trace uses are written as PEFT files on local disk, dropped from the page cache, and registered by
path, so a cold load reads the disk. One engine (on CUDA ``max_loras=256``, ``max_cpu_loras=256``
and a 10 GiB adapter pool, what 32 rank-64 slots took: tiers smaller than N) is built once and
serves every N; each N has fresh adapter names, and the previous
N's adapters are unloaded, so each trace starts with cold tiers.

The arrival rate defaults to ``--load`` (0.75) times the capacity measured on the same engine
first: a saturated burst over 4 warm adapters (busy, not drowning). Per N: output tokens/s, TTFT
p50/p99, cold against warm TTFT, failed requests, tier loads and evictions under Poisson arrivals;
then, from cold tiers and page cache again, ``--saturated-requests`` over the same adapters all at
once: the throughput at saturation (under Poisson arrivals an engine that keeps up just serves the
rate). Before that, the Poisson trace is replayed ``--warm-replays`` times more with new prompts
while its adapters are in host memory (mostly not in a GPU slot): the TTFT cliff past the slots,
without the disk a cold start waits for (the p99 target is judged on the median replay; the cold
ratio is reported beside it; one replay's p99 at N = 1,000 moved 217-676 ms between runs of the
same code on an H100). Then the same burst once more with new prompts, its adapters now in host memory (the CPU
tier, and the page cache for those it had to evict): S-LoRA's setting, whose mark (2,000 adapters
within ~5% of 5) kept every adapter in host memory; the cold burst is bound by the disk instead.
The issue's targets: saturated throughput at the largest N within 5% of the smallest (judged on
the host-warm bursts; the cold ratio is reported beside it), p99
TTFT at the largest N at most 2x the smallest's, cold TTFT p50 at most warm p50 + 1.5 x (adapter
bytes / disk read bandwidth), the bandwidth measured in this run by reading fresh adapter files
with the page cache dropped.
Every step of the calibration, the Poisson traces and the last host-warm burst is logged (its
tokens, padded size and time; in the Poisson traces also its phases and the slowest steps,
`adapter_trace.STEP_PHASES`), as is what compiled while a trace served (dynamo frames, Triton
kernels) and the engine's start-up stages.
Writes ``many_adapters_<tag>.json`` and ``.md`` into ``--out``; ``--plot`` draws the PNG from a JSON
(matplotlib, the ``bench`` extra: a separate step, as the GPU machine has no matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loramux.serving.options import parse_byte_size  # noqa: E402

from benchmarks._common import (  # noqa: E402
    copy_bandwidth,
    device_name,
    disk_bandwidth,
    drop_from_page_cache,
    filesystem_of,
    read_seconds,
    sync,
)
from benchmarks.adapter_trace import (  # noqa: E402
    DEFAULT_MIX,
    FEEDS,
    AdapterKind,
    Trace,
    TraceRequest,
    adapter_nbytes,
    make_trace,
    run_trace,
    summarize,
    summarize_steps,
    write_adapter_files,
)
from benchmarks.startup_check import compiles_watched, engine_stages  # noqa: E402

GB = 1e9
# the CPU default: a 2-layer Llama small enough that 2 cores replay every trace in seconds
TINY_CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)


def build_engine(args):
    """Load the model and build the one engine every N runs on."""
    from loramux.engine.llm_engine import LLMEngine
    from loramux.engine.model_loader import load_model

    if args.model == "tiny":  # random weights from a small config: the CPU smoke run
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)).to(args.weights_dtype).eval()
    else:
        model = load_model(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format)[0]
    max_rank = max(kind.rank for kind in args.mix)
    return LLMEngine(model, enable_lora=True, max_loras=args.max_loras, max_lora_rank=max_rank,
                     max_cpu_loras=args.max_cpu_loras, max_gpu_lora_bytes=args.max_gpu_lora_bytes,
                     max_num_seqs=args.max_num_seqs,
                     max_model_len=args.prompt_len + args.output_len + 8,
                     max_num_batched_tokens=max(args.max_num_batched_tokens, args.max_num_seqs),
                     enforce_eager=args.enforce_eager, cuda_graph_sizes=args.cuda_graph_sizes,
                     async_scheduling=not args.no_async_scheduling)


def measure_disk(engine, args, root: Path) -> dict:
    """Read bandwidth of fresh adapter files (of the mix, written, synced and dropped from the page
    cache) and of one ``--disk-probe-mb`` file; bytes/s. The adapter files' figure judges the cold
    target."""
    probe = make_trace(8, 8, rate=math.inf, prompt_len=1, vocab_size=2, seed=args.seed + 99, mix=args.mix,
                       zipf_exponent=0, name_prefix="probe")
    adapters = probe.adapters
    paths = write_adapter_files(adapters, engine.model.config, root / "probe", args.weights_dtype)
    files = [paths[a.name] / "adapter_model.safetensors" for a in adapters]
    drop_from_page_cache(*files)
    seconds = sum(read_seconds(f) for f in files)
    nbytes = sum(f.stat().st_size for f in files)
    shutil.rmtree(root / "probe")
    sequential = disk_bandwidth(root, nbytes=args.disk_probe_mb << 20)
    return {"filesystem": filesystem_of(root), "adapter_files_read_bytes_per_s": nbytes / seconds,
            "adapter_files_read_bytes": nbytes, **sequential}


def calibrate(engine, args, root: Path, vocab: int) -> dict:
    """Requests/s the engine serves in a saturated burst (three batches of ``max_num_seqs`` requests
    at once) over 4 warm adapters, after one untimed burst that compiles and loads: the capacity
    the default rate is a fraction of (``capacity_req_s``). Then the same adapters under Poisson
    arrivals at that capacity: what the engine serves when every step mixes a new prompt into the
    decodes, as under the traces (``under_arrivals_req_s``). Each with its steps (`summarize_steps`)."""
    trace = make_trace(4, 3 * args.max_num_seqs, rate=math.inf, prompt_len=args.prompt_len, vocab_size=vocab,
                       seed=args.seed + 7, mix=args.mix, name_prefix="warm")
    paths = write_adapter_files(trace.adapters, engine.model.config, root / "warm", args.weights_dtype)
    capacity, steps = 0.0, []
    for attempt in range(2):
        if attempt:  # the same adapters, new prompts (no prefix-cache hits)
            trace = make_trace(4, 3 * args.max_num_seqs, rate=math.inf, prompt_len=args.prompt_len, vocab_size=vocab,
                               seed=args.seed + 7, mix=args.mix, name_prefix="warm", request_seed=attempt)
        steps.clear()
        records = run_trace(engine, trace, paths, max_tokens=args.output_len, steps=steps, feed=args.feed)
        summary = summarize(records)
        if summary["failed"]:
            raise RuntimeError(f"the warm-up burst failed {summary['failed']} requests: {summary['failures']}")
        capacity = summary["requests"] / summary["seconds"]
        print(f"  burst {attempt + 1}: {summary['tokens_per_s']:.0f} tok/s, {capacity:.1f} req/s", flush=True)
    arrivals = make_trace(4, 4 * args.max_num_seqs, rate=capacity, prompt_len=args.prompt_len, vocab_size=vocab,
                          seed=args.seed + 7, mix=args.mix, name_prefix="warm", request_seed=2)
    arrival_steps = []
    served = summarize(run_trace(engine, arrivals, paths, max_tokens=args.output_len, steps=arrival_steps,
                                 feed=args.feed))
    under_arrivals = served["requests"] / served["seconds"]
    print(f"  arrivals at {capacity:.1f} req/s: {served['tokens_per_s']:.0f} tok/s, {under_arrivals:.1f} req/s served",
          flush=True)
    for adapter in trace.adapters:
        engine.remove_lora(adapter.name)
    shutil.rmtree(root / "warm")
    return {"capacity_req_s": capacity, "capacity_steps": summarize_steps(steps),
            "under_arrivals_req_s": under_arrivals, "under_arrivals_steps": summarize_steps(arrival_steps)}


def cold_alone(engine, args, root: Path, vocab: int, disk_bytes_per_s: float) -> dict:
    """One request at a time on the idle engine, ``--cold-alone`` adapters of the mix: each first
    cold (in no tier, its files out of the page cache), then again with a fresh prompt, resident
    in its GPU slot. The cold TTFT bound for a load that has the disk to itself, as the bandwidth
    in it was measured; a trace's cold loads share the disk with the loads around them."""
    probe = make_trace(args.cold_alone, args.cold_alone, rate=math.inf, prompt_len=args.prompt_len, vocab_size=vocab,
                       seed=args.seed + 55, mix=args.mix, zipf_exponent=0, name_prefix="alone", first_id=90_001)
    adapters = probe.adapters
    paths = write_adapter_files(adapters, engine.model.config, root / "alone", args.weights_dtype)
    sizes = {a.name: adapter_nbytes(engine.model.config, a.rank, a.targets, args.weights_dtype) for a in adapters}
    rng = random.Random(args.seed + 56)
    each = []
    for adapter in adapters:
        drop_from_page_cache(*(paths[adapter.name] / f for f in ("adapter_model.safetensors", "adapter_config.json")))
        records = {}
        for label in ("cold", "warm"):
            prompt = [rng.randrange(1, vocab) for _ in range(args.prompt_len)]
            alone = Trace([adapter], [TraceRequest(f"{adapter.name}-{label}", 0.0, adapter, prompt)])
            records[label] = run_trace(engine, alone, paths, max_tokens=1, adapter_bytes=lambda a: sizes[a.name])[0]
        cold, warm = records["cold"], records["warm"]
        if cold.error or warm.error or not cold.cold or warm.cold:
            raise RuntimeError(f"cold-alone probe of {adapter.name}: cold {cold}, warm {warm}")
        each.append({"adapter": adapter.name, "bytes": sizes[adapter.name], "cold_ttft_ms": 1e3 * cold.ttft_s,
                     "warm_ttft_ms": 1e3 * warm.ttft_s, "load_ms": 1e3 * (cold.adapter_ready_s - cold.arrival_s)})
    unload(engine, adapters, paths)
    shutil.rmtree(root / "alone")
    p50 = {key: statistics.median(e[key] for e in each) for key in ("bytes", "cold_ttft_ms", "warm_ttft_ms", "load_ms")}
    bound = p50["warm_ttft_ms"] + 1.5 * 1e3 * p50["bytes"] / disk_bytes_per_s
    return {"cold_p50_ms": p50["cold_ttft_ms"], "warm_p50_ms": p50["warm_ttft_ms"], "load_p50_ms": p50["load_ms"],
            "adapter_bytes_p50": p50["bytes"], "bound_ms": bound, "passed": p50["cold_ttft_ms"] <= bound, "each": each}


def tier_counts(engine) -> dict[str, int]:
    """The tiers' cumulative loads and evictions, as /metrics reads them; on CUDA also the caching
    allocator's device allocations and its retries (a retry frees the cache: a device-wide sync
    the host waits on, wherever in the step it falls)."""
    from loramux.serving.engine_info import read_tiers

    counts = {}
    for tier, stats in read_tiers(engine).items():
        for name in ("loads", "evictions"):
            counts[f"{tier}_{name}"] = getattr(stats, name) or 0
    device = engine.setup.device
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        counts["cuda_mallocs"] = stats.get("num_device_alloc", 0)
        counts["cuda_alloc_retries"] = stats.get("num_alloc_retries", 0)
    return counts


def run_one(engine, args, root: Path, n: int, vocab: int, index: int) -> dict:
    """``n`` adapters: write the files of those used, replay the Poisson trace, then (from cold tiers
    and page cache again) a saturated burst over the same adapters; unload them, delete the files."""
    config = engine.model.config
    common = dict(prompt_len=args.prompt_len, vocab_size=vocab, seed=args.seed + index, mix=args.mix,
                  zipf_exponent=args.zipf_exponent, name_prefix=f"n{n}-", first_id=1 + 100_000 * (index + 1))
    trace = make_trace(n, args.num_requests, rate=args.rate, **common)
    burst = make_trace(n, args.saturated_requests, rate=math.inf, request_seed=1, **common) \
        if args.saturated_requests else None
    used = list({a.name: a for t in (trace, burst) if t for a in t.used_adapters()}.values())
    sizes = {a.name: adapter_nbytes(config, a.rank, a.targets, args.weights_dtype) for a in used}
    total = sum(sizes.values())
    if total > args.max_disk_gb * GB:
        raise SystemExit(f"N={n}: the {len(used)} adapters used need {total / GB:.1f} GB of disk, over "
                         f"--max-disk-gb={args.max_disk_gb}; raise it, or lower N or --num-requests")
    t0 = time.perf_counter()
    paths = write_adapter_files(used, config, root / f"n{n}", args.weights_dtype, workers=args.write_workers)
    written_s = time.perf_counter() - t0
    print(f"N={n}: wrote {len(used)} adapter files ({total / GB:.2f} GB) in {written_s:.1f} s; "
          f"replaying {len(trace.requests)} requests over {trace.requests[-1].arrival_s:.1f} s", flush=True)
    before = tier_counts(engine)
    steps, phases, load_calls = [], [], {}
    with compiles_watched() as compiled:
        records = run_trace(engine, trace, paths, max_tokens=args.output_len, adapter_bytes=lambda a: sizes[a.name],
                            progress=lambda done, total_, s: print(f"  {done}/{total_} finished, {s:.0f} s", flush=True),
                            steps=steps, phases=phases, load_calls=load_calls, feed=args.feed)
    after = tier_counts(engine)
    result = {"adapters": n, **summarize(records), "adapter_bytes_written": total, "write_seconds": written_s,
              **{key: after[key] - before.get(key, 0) for key in after},
              "load_average_1m": os.getloadavg()[0],  # other work on the host skews every number
              "poisson_steps": summarize_steps(steps, phases), "compiled_while_serving": compiled,
              # the cold path's parts over the trace's loads (loading threads): p50 ms a call
              "load_parts_p50_ms": {name: statistics.median(t) * 1e3 for name, t in load_calls.items() if t}}
    print(f"  N={n}: {result['tokens_per_s']:.0f} tok/s, TTFT p50 {result['ttft_p50_ms']:.0f} ms, p99 "
          f"{result['ttft_p99_ms']:.0f} ms; {result['cold_requests']} cold; {result['failed']} failed", flush=True)
    # the same arrivals again, new prompts, the adapters now in host memory (the CPU tier, the page
    # cache past it) but mostly not in a GPU slot: the TTFT cliff the issue asks about, without the
    # disk that a cold start waits for
    # (near capacity one replay's p99 is a few requests' waits: the median of several is reported)
    replays = [summarize(run_trace(engine, with_new_prompts(trace, vocab, args.seed + index + 7 + 100 * rep), paths,
                                   max_tokens=args.output_len, feed=args.feed)) for rep in range(args.warm_replays)]
    keys = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms")
    result["host_warm_poisson"] = {key: statistics.median(r[key] or 0.0 for r in replays) for key in keys}
    result["host_warm_poisson"].update(failed=sum(r["failed"] for r in replays),
                                       each=[{key: r[key] for key in keys} for r in replays])
    result["failed"] += result["host_warm_poisson"]["failed"]
    warm = result["host_warm_poisson"]
    print(f"  N={n} again, host-warm (median of {len(replays)}): {warm['tokens_per_s']:.0f} tok/s, TTFT p50 "
          f"{warm['ttft_p50_ms']:.0f} ms, p99 {warm['ttft_p99_ms']:.0f} ms "
          f"(each: {', '.join(f'{r[keys[2]]:.0f}' for r in replays)})", flush=True)
    unload(engine, used, paths)
    if burst is not None:  # throughput at saturation: what S-LoRA's mark compares
        result["saturated_wave_adapter_bytes"] = wave_adapter_bytes(burst, sizes, args.max_num_seqs)
        saturated = summarize(run_trace(engine, burst, paths, max_tokens=args.output_len, feed=args.feed))
        # host-warm bursts are short (seconds): one stall moved a single burst by 1.6x between runs,
        # so the median of --saturated-repeats bursts is reported (each one kept in the JSON)
        warm = []
        for rep in range(args.saturated_repeats):
            warm_steps, warm_phases = [], []  # the last burst's are reported
            warm.append(summarize(run_trace(engine, with_new_prompts(burst, vocab, args.seed + index + 1000 * rep),
                                            paths, max_tokens=args.output_len, steps=warm_steps, phases=warm_phases,
                                            feed=args.feed)))
        warm_tps = [w["tokens_per_s"] or 0.0 for w in warm]
        warm_failed = sum(w["failed"] for w in warm)
        result.update(saturated_requests=saturated["requests"], saturated_failed=saturated["failed"] + warm_failed,
                      saturated_tokens_per_s=saturated["tokens_per_s"],
                      saturated_warm_tokens_per_s=statistics.median(warm_tps),
                      saturated_warm_tokens_per_s_each=warm_tps, saturated_warm_steps=summarize_steps(warm_steps, warm_phases))
        result["failed"] += saturated["failed"] + warm_failed
        print(f"  N={n} saturated: {saturated['tokens_per_s']:.0f} tok/s from cold tiers, "
              f"{statistics.median(warm_tps):.0f} tok/s host-warm (median of {', '.join(f'{t:.0f}' for t in warm_tps)}), "
              f"over {saturated['requests']} requests; {saturated['failed'] + warm_failed} failed", flush=True)
        unload(engine, used, paths)
    shutil.rmtree(root / f"n{n}")
    return result


def wave_adapter_bytes(burst: Trace, sizes: dict[str, int], batch: int) -> float:
    """Mean bytes of the distinct adapters in each wave of ``batch`` requests of a burst: what a
    decode step of a full batch reads on top of the model's weights, the burst's bytes floor."""
    waves = [burst.requests[i:i + batch] for i in range(0, len(burst.requests), batch)]
    return statistics.mean(sum(sizes[name] for name in {r.adapter.name for r in wave}) for wave in waves)


def with_new_prompts(trace: Trace, vocab: int, seed: int) -> Trace:
    """The same requests over the same adapters with fresh prompts (no prefix-cache hits)."""
    rng = random.Random(seed)
    return Trace(trace.adapters, [
        TraceRequest(f"{r.request_id}-again", r.arrival_s, r.adapter,
                     [rng.randrange(1, vocab) for _ in r.prompt_token_ids])
        for r in trace.requests
    ])


def unload(engine, adapters, paths: dict[str, Path]) -> None:
    """Leave no trace of ``adapters``: out of both tiers and out of the page cache."""
    for adapter in adapters:
        engine.remove_lora(adapter.name)
    drop_from_page_cache(*(paths[a.name] / f for a in adapters for f in ("adapter_model.safetensors",
                                                                          "adapter_config.json")))


def check_targets(results: list[dict], disk_bytes_per_s: float, model_bytes: int | None = None,
                  cold_alone: dict | None = None) -> dict:
    """The issue's targets, each with the numbers it was judged on (None: not measurable here).
    ``model_bytes``: the model's weights, for the throughput target's bytes floor (the ratio a step
    reading the model and its wave's adapters, and nothing else, would give). ``cold_alone``: the
    `cold_alone` probe, judged as its own target beside the traces' cold requests."""
    small, large = results[0], results[-1]
    checks = {"no_failed_requests": {"failed": sum(r["failed"] for r in results),
                                     "passed": all(r["failed"] == 0 for r in results)}}
    # at saturation where measured (under Poisson arrivals an engine that keeps up serves the rate),
    # adapters in host memory as in S-LoRA's mark; from cold tiers and disk beside it
    key = "saturated_warm_tokens_per_s" if small.get("saturated_warm_tokens_per_s") else "tokens_per_s"
    if len(results) > 1 and small[key] and large.get(key):
        ratio = large[key] / small[key]
        checks["throughput_within_5pct"] = {"largest_over_smallest": ratio, "measured": key, "passed": ratio >= 0.95}
        if small.get("saturated_tokens_per_s") and large.get("saturated_tokens_per_s"):
            checks["throughput_within_5pct"]["cold_tiers_largest_over_smallest"] = (
                large["saturated_tokens_per_s"] / small["saturated_tokens_per_s"])
        if model_bytes and small.get("saturated_wave_adapter_bytes") and large.get("saturated_wave_adapter_bytes"):
            checks["throughput_within_5pct"]["bytes_floor"] = (
                (model_bytes + small["saturated_wave_adapter_bytes"]) / (model_bytes + large["saturated_wave_adapter_bytes"]))
    if len(results) > 1 and small["ttft_p99_ms"] and large["ttft_p99_ms"] is not None:
        # judged on the host-warm replay where measured (a cold start waits for the disk, which the
        # cold TTFT bound judges); the cold traces' ratio beside it
        warm_small, warm_large = small.get("host_warm_poisson"), large.get("host_warm_poisson")
        cold_ratio = large["ttft_p99_ms"] / small["ttft_p99_ms"]
        if warm_small and warm_large and warm_small["ttft_p99_ms"] and warm_large["ttft_p99_ms"] is not None:
            ratio = warm_large["ttft_p99_ms"] / warm_small["ttft_p99_ms"]
            checks["p99_ttft_at_most_2x"] = {"largest_over_smallest": ratio, "measured": "host_warm_poisson",
                                             "cold_largest_over_smallest": cold_ratio, "passed": ratio <= 2.0}
        else:
            checks["p99_ttft_at_most_2x"] = {"largest_over_smallest": cold_ratio, "passed": cold_ratio <= 2.0}
    cold = {}
    for r in results:
        if r["cold_ttft_p50_ms"] is None or r["warm_ttft_p50_ms"] is None:
            continue
        bound = r["warm_ttft_p50_ms"] + 1.5 * 1e3 * r["cold_adapter_bytes_p50"] / disk_bytes_per_s
        # where a cold TTFT goes: the load (to the "ready" event), then the engine's wait after it
        cold[r["adapters"]] = {"cold_p50_ms": r["cold_ttft_p50_ms"], "bound_ms": bound,
                               "passed": r["cold_ttft_p50_ms"] <= bound,
                               "load_p50_ms": r.get("cold_ready_p50_ms"),
                               "after_load_p50_ms": r.get("cold_ready_to_first_token_p50_ms"),
                               **{key: r.get(f"cold_{key}") for key in ("handed_over_p50_ms", "load_run_p50_ms",
                                                                        "registry_p50_ms")},
                               "load_parts_p50_ms": r.get("load_parts_p50_ms")}
    checks["cold_ttft_bound"] = {"per_n": cold, "passed": all(c["passed"] for c in cold.values()) if cold else None}
    if cold_alone:
        checks["cold_ttft_bound_alone"] = {key: value for key, value in cold_alone.items() if key != "each"}
    return checks


def markdown(report: dict) -> str:
    options, disk = report["options"], report["disk"]
    fmt = lambda v, f="{:.0f}": "" if v is None else f.format(v)  # noqa: E731
    loads = ", ".join(f"{r.get('load_average_1m', 0):.1f}" for r in report["results"])
    lines = [
        f"**{report['device']}**, {report['model']} ({options['dtype']}, {report['mode']}); one engine, "
        f"max_loras={options['max_loras']}, max_cpu_loras={options['max_cpu_loras']}, "
        f"GPU adapter memory {_gpu_memory(options)}, "
        f"max_num_seqs={options['max_num_seqs']}; {options['num_requests']} requests per N "
        f"({options['prompt_len']} prompt + {options['output_len']} generated tokens), Poisson arrivals at "
        f"{report['rate_req_s']:.1f} req/s ({options['load']:.2f} x the measured capacity of "
        f"{report['capacity_req_s']:.1f} req/s in a burst{_under_arrivals(report)}), "
        f"Zipf({options['zipf_exponent']}) popularity, ranks "
        f"{sorted({k['rank'] for k in options['mix']})}, q/v, q/k/v/o and all-seven targets; requests handed "
        f"to the engine {'as they arrive, by a thread' if options.get('feed') == 'thread' else 'between steps'}.",
        f"Disk ({disk['filesystem']}): fresh adapter files read at {disk['adapter_files_read_bytes_per_s'] / GB:.2f} "
        f"GB/s (page cache dropped), sequential {disk['disk_bytes_per_s'] / GB:.2f} GB/s. Host load average "
        f"(1 min) after each N: {loads} on {os.cpu_count()} CPUs.",
        "",
        "| N | used | GB on disk | tokens/s (Poisson) | saturated tokens/s, cold tiers | saturated, host-warm | "
        "vs first | TTFT p50 (ms) | p99 (ms) | again host-warm (median replay): p50 | p99 | "
        "cold req. | cold p50 (ms) | warm p50 (ms) | CPU loads | CPU evictions | GPU evictions | failed |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: |",
    ]
    key = "saturated_warm_tokens_per_s" if report["results"][0].get("saturated_warm_tokens_per_s") else "tokens_per_s"
    first = report["results"][0][key]
    for r in report["results"]:
        lines.append(
            f"| {r['adapters']} | {r['adapters_used']} | {r['adapter_bytes_written'] / GB:.2f} | "
            f"{fmt(r['tokens_per_s'])} | {fmt(r.get('saturated_tokens_per_s'))} | "
            f"{fmt(r.get('saturated_warm_tokens_per_s'))} | "
            f"{fmt(r[key] / first if first and r.get(key) else None, '{:.3f}x')} | "
            f"{fmt(r['ttft_p50_ms'])} | {fmt(r['ttft_p99_ms'])} | "
            f"{fmt(r.get('host_warm_poisson', {}).get('ttft_p50_ms'))} | "
            f"{fmt(r.get('host_warm_poisson', {}).get('ttft_p99_ms'))} | {r['cold_requests']} | {fmt(r['cold_ttft_p50_ms'])} | "
            f"{fmt(r['warm_ttft_p50_ms'])} | {r.get('cpu_loads', '')} | {r.get('cpu_evictions', '')} | "
            f"{r.get('gpu_evictions', '')} | {r['failed']} |")
    lines += steps_table(report)
    lines += ["", "Targets (issue 10):", ""]
    for name, check in report["targets"].items():
        verdict = {True: "**met**", False: "**not met**", None: "not measurable"}[check["passed"]]
        detail = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in check.items() if k != "passed"}
        lines.append(f"- {name}: {verdict} {json.dumps(detail)}")
    return "\n".join(lines) + "\n"


# the steps table's GPU tier column: `adapter_trace.LORA_PARTS`, in the order its header names them
TIER_COLUMN = ("lora.slot_write", "lora.make_room", "lora.can_place")


def steps_table(report: dict) -> list[str]:
    """Markdown lines: where the step time went in the capacity burst, each Poisson trace and the
    last host-warm burst, by the tokens each forward ran (reports before step logging have none)."""
    phases = [("capacity burst, 4 adapters", report.get("capacity_steps")),
              ("4 adapters, arrivals at capacity", report.get("under_arrivals_steps"))]
    for r in report["results"]:
        phases += [(f"N={r['adapters']} Poisson", r.get("poisson_steps")),
                   (f"N={r['adapters']} host-warm burst", r.get("saturated_warm_steps"))]
    phases = [(name, steps) for name, steps in phases if steps and steps["steps"]]
    if not phases:
        return []
    lines = ["", f"Steps (graph sizes {report.get('graph_sizes') or 'none: eager'}): mean wall time of "
             "`engine.step()`, by the tokens its forward ran (a graph's padded size), as "
             "size: ms x steps (mean tokens computed), the six most frequent sizes (all in the JSON):", "",
             "| phase | steps | mean ms | with prompt tokens | padding | GPU tier on the engine's thread, ms in all: "
             "slot writes / evictions / placement checks | by size |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, steps in phases:
        frequent = sorted(steps["by_padded_tokens"].items(), key=lambda item: -item[1]["steps"])[:6]
        sizes = "; ".join(f"{T}: {g['ms_mean']:.1f} x {g['steps']} ({g['tokens_mean']:.0f})"
                          for T, g in sorted(frequent, key=lambda item: int(item[0])))
        total = steps.get("phase_ms_total")  # timed in the Poisson traces and the last host-warm burst
        tier = " / ".join(f"{total.get(part, 0.0):.0f}" for part in TIER_COLUMN) if total else ""
        lines.append(f"| {name} | {steps['steps']} | {steps['step_ms_mean']:.2f} | {steps['with_prompt_share']:.0%} | "
                     f"{steps['padding_share']:.0%} | {tier} | {sizes} |")
    return lines


def plot(json_path: Path) -> Path:
    """Throughput and TTFT p50/p99 against N (log x) from a results JSON; writes a PNG beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(Path(json_path).read_text())
    results = report["results"]
    n = [r["adapters"] for r in results]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(n, [r["tokens_per_s"] for r in results], "o-", label="Poisson arrivals")
    if all(r.get("saturated_tokens_per_s") for r in results):
        left.plot(n, [r["saturated_tokens_per_s"] for r in results], "s-", label="saturated, cold tiers")
    if all(r.get("saturated_warm_tokens_per_s") for r in results):
        left.plot(n, [r["saturated_warm_tokens_per_s"] for r in results], "^-", label="saturated, host-warm")
    left.legend()
    left.set(xscale="log", xlabel="adapters (N)", ylabel="output tokens/s", title="throughput")
    left.set_ylim(bottom=0)
    for key, label in (("ttft_p50_ms", "p50"), ("ttft_p99_ms", "p99"), ("cold_ttft_p50_ms", "cold p50"),
                       ("warm_ttft_p50_ms", "warm p50")):
        right.plot(n, [r[key] for r in results], "o-", label=label)
    right.set(xscale="log", xlabel="adapters (N)", ylabel="ms", title="time to first token")
    right.set_ylim(bottom=0)
    right.legend()
    for axes in (left, right):  # the N values themselves as ticks, not powers of ten
        axes.set_xticks(n, [str(value) for value in n])
        axes.minorticks_off()
    options = report["options"]
    figure.suptitle(f"{report['device']}: {report['model']}, max_loras={options['max_loras']}, "
                    f"max_cpu_loras={options['max_cpu_loras']}, {report['rate_req_s']:.1f} req/s", fontsize=9)
    figure.tight_layout()
    out = Path(json_path).with_suffix(".png")
    figure.savefig(out, dpi=120)
    return out


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b" if cuda else "tiny",
                        help="default: llama-3.1-8b (dummy weights) on CUDA, 'tiny' (TINY_CONFIG, random) on CPU; "
                        "a model id, dir or shipped dummy config name")
    parser.add_argument("--load-format", default="dummy" if cuda else "auto")
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    parser.add_argument("--adapters", default="4,32,256,1000" if cuda else "2,8,32", help="the N values, ascending")
    parser.add_argument("--num-requests", type=int, default=512 if cuda else 24, help="per N")
    parser.add_argument("--prompt-len", type=int, default=128 if cuda else 16)
    parser.add_argument("--output-len", type=int, default=64 if cuda else 8)
    parser.add_argument("--warm-replays", type=int, default=3 if cuda else 1,
                        help="host-warm replays of each Poisson trace; the median is reported and judged")
    parser.add_argument("--saturated-repeats", type=int, default=3 if cuda else 1,
                        help="host-warm bursts per N; their median is reported")
    parser.add_argument("--saturated-requests", type=int, default=256 if cuda else 16,
                        help="per N, all at once after the Poisson trace: throughput at saturation (0: skip)")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="arrivals per second (default 0: --load x the measured capacity; inf: all at once)")
    parser.add_argument("--load", type=float, default=0.75, help="the default rate as a fraction of capacity")
    parser.add_argument("--zipf-exponent", type=float, default=1.0)
    # on CUDA: a 10 GiB pool (what 32 slots of rank 64 took at 8B) shared by 256 slots
    parser.add_argument("--max-loras", type=int, default=256 if cuda else 4)
    parser.add_argument("--max-cpu-loras", type=int, default=256 if cuda else 8)
    parser.add_argument("--max-gpu-lora-bytes", type=parse_byte_size, default=10 << 30 if cuda else None,
                        metavar="SIZE", help="GPU memory for adapter weights, shared by rank (default on CUDA "
                        "10GiB; on the CPU room for --max-loras adapters of the mix's largest rank)")
    parser.add_argument("--max-num-seqs", type=int, default=64 if cuda else 16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096 if cuda else 256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="read every step's tokens back before the next step (the engine's old loop)")
    parser.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="T",
                        help="the padded token counts to capture step graphs for (default: the engine's)")
    parser.add_argument("--max-disk-gb", type=float, default=20.0, help="refuse a trace whose files need more")
    parser.add_argument("--write-workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--disk-probe-mb", type=int, default=256, help="the sequential-read probe file's size")
    parser.add_argument("--adapter-dir", default=None, help="where adapter files go (default: the temp dir)")
    parser.add_argument("--feed", choices=FEEDS, default="steps",
                        help="how requests reach the engine: 'steps' adds those that arrived between steps (the "
                        "runs so far), 'thread' adds each as it arrives from a thread, as the server's intake does")
    parser.add_argument("--cold-alone", type=int, default=8 if cuda else 2, metavar="K",
                        help="adapters whose cold and warm TTFT are measured alone on the idle engine (0 skips)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--tag", default="gpu" if cuda else "cpu", help="file names: many_adapters_<tag>.json/.md")
    parser.add_argument("--plot", type=Path, default=None, help="only draw the PNG of this results JSON")
    args = parser.parse_args(argv)
    try:
        args.adapters = sorted(int(x) for x in args.adapters.split(","))
    except ValueError:
        parser.error(f"--adapters {args.adapters!r}: give N values as comma-separated ints, e.g. 4,32,256,1000")
    if args.adapters[0] < 1:
        parser.error(f"--adapters {args.adapters}: every N must be >= 1")
    if args.rate < 0:
        parser.error(f"--rate {args.rate}: give arrivals per second > 0, inf (all at once) or 0 (--load x capacity)")
    if not 0 < args.load <= 1:
        parser.error(f"--load {args.load}: give a fraction of the measured capacity in (0, 1]")
    if args.cold_alone < 0:
        parser.error(f"--cold-alone {args.cold_alone}: must be >= 0 (0 skips the probe)")
    for option in ("num_requests", "disk_probe_mb", "max_loras", "max_cpu_loras", "max_num_seqs", "saturated_repeats"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} {getattr(args, option)}: must be >= 1")
    if args.saturated_requests < 0:
        parser.error(f"--saturated-requests {args.saturated_requests}: must be >= 0 (0 skips the saturated burst)")
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        parser.error(f"--dtype {args.dtype!r}: give a torch dtype name, e.g. bfloat16, float16 or float32")
    args.device = torch.device("cuda" if cuda else "cpu")
    args.weights_dtype = getattr(torch, args.dtype)
    args.mix = DEFAULT_MIX
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plot is not None:
        print(plot(args.plot))
        return
    started = time.perf_counter()
    bandwidth = copy_bandwidth(args.device)  # before the engine: its KV cache takes the free memory
    if args.device.type == "cuda":
        torch.cuda.empty_cache()  # hand the probe's 2 GiB back, or the KV cache is sized without them
    engine_started = time.perf_counter()
    engine = build_engine(args)
    sync(args.device)
    engine_seconds = time.perf_counter() - engine_started
    vocab = engine.vocab_size
    mode = "eager" if args.enforce_eager or args.device.type != "cuda" else "compiled + graphs"
    mode += ", synchronous loop" if args.no_async_scheduling else ", async scheduling"
    print(f"{device_name(args.device)}: engine ready in {time.perf_counter() - started:.0f} s ({mode})", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.adapter_dir:
        Path(args.adapter_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="many-adapters-", dir=args.adapter_dir) as tmp:
        root = Path(tmp)
        disk = measure_disk(engine, args, root)
        print(f"disk ({disk['filesystem']}): adapter files {disk['adapter_files_read_bytes_per_s'] / GB:.2f} GB/s, "
              f"sequential {disk['disk_bytes_per_s'] / GB:.2f} GB/s", flush=True)
        calibration = calibrate(engine, args, root, vocab)
        capacity = calibration["capacity_req_s"]
        alone = cold_alone(engine, args, root, vocab, disk["adapter_files_read_bytes_per_s"]) if args.cold_alone else None
        if alone:
            print(f"cold adapter alone: TTFT p50 {alone['cold_p50_ms']:.1f} ms against {alone['bound_ms']:.1f} "
                  f"(warm {alone['warm_p50_ms']:.1f} ms)", flush=True)
        args.rate = args.rate or args.load * capacity
        print(f"capacity {capacity:.1f} req/s; arrivals at {args.rate:.1f} req/s", flush=True)
        options = {key: getattr(args, key) for key in (
            "dtype", "load_format", "num_requests", "prompt_len", "output_len", "load", "zipf_exponent", "max_loras",
            "max_cpu_loras", "max_gpu_lora_bytes", "max_num_seqs", "max_num_batched_tokens", "enforce_eager",
            "no_async_scheduling", "cuda_graph_sizes", "feed", "seed")}
        options["gpu_pool_rank_rows"] = engine.lora_manager.pool_units if engine.lora_manager is not None else 0
        options["mix"] = [{"rank": k.rank, "targets": k.targets, "share": k.share} for k in args.mix]
        report = {"device": device_name(args.device), "model": _model_label(args),
                  "mode": mode, "torch": torch.__version__, "options": options, "disk": disk,
                  "copy_bandwidth_GBps": bandwidth and bandwidth / GB, **calibration, "rate_req_s": args.rate,
                  "graph_sizes": engine.runner.graph_sizes if engine.runner.graphs is not None else [],
                  "engine_start": engine_stages(engine, engine_seconds), "cold_alone": alone, "results": []}
        model_bytes = sum(p.nbytes for p in engine.model.parameters())
        for index, n in enumerate(args.adapters):
            report["results"].append(run_one(engine, args, root, n, vocab, index))
            report["targets"] = check_targets(report["results"], disk["adapter_files_read_bytes_per_s"],
                                              model_bytes=model_bytes, cold_alone=alone)
            save(report, args)  # what was measured survives a later failure
    report["total_seconds"] = time.perf_counter() - started
    json_path = save(report, args)
    print(markdown(report))
    print(f"wrote {json_path} and {json_path.with_suffix('.md')} in {report['total_seconds']:.0f} s")


def _under_arrivals(report: dict) -> str:
    """What the engine served under arrivals at its burst capacity, and the rate as a share of it
    (older reports lack it)."""
    served = report.get("under_arrivals_req_s")
    if not served:
        return ""
    return (f"; under arrivals at that capacity it served {served:.1f} req/s, so the traces' rate is "
            f"{report['rate_req_s'] / served:.2f} x that")


def _gpu_memory(options: dict) -> str:
    """The GPU tier's memory as the report states it (older reports lack the fields)."""
    size = options.get("max_gpu_lora_bytes")
    rows = options.get("gpu_pool_rank_rows")
    text = "max_loras x max rank" if size is None else f"{size / GB:.1f} GB"
    return text + (f" ({rows} rank rows per layer, pooled)" if rows else "")


def _model_label(args) -> str:
    if args.model == "tiny":
        return "tiny Llama ({num_hidden_layers} layers, hidden {hidden_size}, random)".format(**TINY_CONFIG)
    name = args.model or "SmolLM2-135M-Instruct (embedded)"
    return f"{name} (dummy weights)" if args.load_format == "dummy" else name


def save(report: dict, args) -> Path:
    path = args.out / f"many_adapters_{args.tag}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    path.with_suffix(".md").write_text(markdown(report))
    return path


__all__ = ["AdapterKind", "check_targets", "main", "markdown", "plot"]

if __name__ == "__main__":
    main()

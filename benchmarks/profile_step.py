"""Where a step's time goes: torch.profiler over decode steps (graph replays) and one prefill step,
kernels grouped by name, for the base model, N adapters (``--adapters``: rank 16, all seven
projections) and batches drawn from a fleet as `many_adapters.py` draws them (``--fleet``)
(GPU; 8B dummy by default). Each decode batch also reports the wall time of 10 unprofiled steps,
host included, with async scheduling (``step_wall_us``) and without (``step_wall_sync_us``).

    PYTHONPATH=. TORCH_LOGS=recompiles python benchmarks/profile_step.py --out prof.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import kernel_device_times  # noqa: E402
from benchmarks.adapter_trace import DEFAULT_MIX, make_trace  # noqa: E402
from benchmarks.throughput import ALL_SEVEN, QV, random_adapter  # noqa: E402
from loramux import LoRARequest, SamplingParams  # noqa: E402
from loramux.engine.llm_engine import LLMEngine  # noqa: E402
from loramux.engine.model_loader import load_model  # noqa: E402


def host_profile(fn, top: int):
    """``fn()`` under cProfile: (its result, the ``top`` functions by own time, as text)."""
    profiler = cProfile.Profile()
    profiler.enable()
    result = fn()
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(top)
    return result, stream.getvalue()


def kernel_table(prof, steps: int, top: int = 25) -> str:
    """Device time per kernel name (per step), largest first."""
    times = kernel_device_times(prof, steps)
    lines = [f"device time per step: {sum(us for us, _ in times.values()) / 1e3:.3f} ms over "
             f"{sum(n for _, n in times.values())} kernels"]
    for name, (us, n) in list(times.items())[:top]:
        lines.append(f"{us:9.1f} us  {n:5d}x  {name}")
    return "\n".join(lines)


#: Kernels of a step graph's decoder layers, in launch order: the attention kernel starts a layer
#: (o_proj, gate_up, down and the next layer's qkv follow it), cuBLAS GEMMs are ``nvjet_*``.
ATTENTION, GEMM, EXPAND = "_paged_attention_kernel", "nvjet", "_expand_kernel"
PROJECTIONS = ("o", "gate_up", "down", "qkv")


def replay_timeline(trace_path: Path, idle_us: float = 300.0, min_kernels: int = 400) -> dict:
    """Where a decode replay's GPU time goes, from a chrome trace of `torch.profiler`: the replays
    (kernels split where the GPU idled ``idle_us``; those of at least ``min_kernels``), and their
    medians: the span of a replay, the span before its first attention kernel (the graph's own
    preparation: the LoRA meta, the embedding, the first layer's norm and qkv), a layer's span
    (attention to attention), each projection's GEMM and, for each delta computed beside a GEMM
    (its expand paired with the last GEMM started before it), how long after the GEMM the
    expand ended (> 0: the join waited)."""
    events = sorted((e for e in json.loads(trace_path.read_text())["traceEvents"]
                     if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"])
    replays, last_end = [], None
    for event in events:
        if last_end is None or event["ts"] - last_end > idle_us:
            replays.append([])
        replays[-1].append(event)
        last_end = max(last_end or 0.0, event["ts"] + event["dur"])
    spans: dict[str, list[float]] = {}
    add = lambda key, value: spans.setdefault(key, []).append(value)  # noqa: E731
    end = lambda e: e["ts"] + e["dur"]  # noqa: E731
    for kernels in (r for r in replays if len(r) >= min_kernels):
        starts = [i for i, e in enumerate(kernels) if e["name"].startswith(ATTENTION)]
        if not starts:
            continue
        add("replay_us", end(max(kernels, key=end)) - kernels[0]["ts"])
        add("before_first_attention_us", kernels[starts[0]]["ts"] - kernels[0]["ts"])
        for a, b in zip(starts, starts[1:]):
            layer = kernels[a:b + 1]
            add("layer_us", layer[-1]["ts"] - layer[0]["ts"])
            gemms = [e for e in layer if e["name"].startswith(GEMM)]
            for name, gemm in zip(PROJECTIONS, gemms):
                add(f"{name}_gemm_us", gemm["dur"])
            for expand in (e for e in layer if e["name"].startswith(EXPAND)):
                beside = [i for i, gemm in enumerate(gemms[:len(PROJECTIONS)]) if gemm["ts"] <= expand["ts"]]
                if beside:
                    add(f"{PROJECTIONS[beside[-1]]}_delta_after_gemm_us", end(expand) - end(gemms[beside[-1]]))
    summary = {key: statistics.median(values) for key, values in spans.items()}
    summary["replays"] = len(spans.get("replay_us", []))
    return summary


def ttft_profile(model, args) -> None:
    """Time to first token of one 128-token request: base, an adapter already in a GPU slot, and
    one that must first be copied into a slot (max_loras=1); wall time of each repeat, then
    host (CPU op self time) and device (kernels) profiles of the resident-adapter case."""
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    adapters = [random_adapter(model.config, name, 16, ALL_SEVEN, i, device, dtype)
                for i, name in enumerate("ab")]
    engine = LLMEngine(model, enable_lora=True, max_loras=1, max_cpu_loras=4, max_lora_rank=16,
                       max_num_seqs=max(args.batch), max_model_len=1100,
                       max_num_batched_tokens=8192)
    for adapter in adapters:
        engine.registry.bind(adapter)
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(1, vocab, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def ttft(lora, n=[0]):
        n[0] += 1
        engine.add_request(f"t{n[0]}", {"prompt_token_ids": prompt}, params, lora)
        sync()
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return 1e3 * (time.perf_counter() - t0)

    a, b = LoRARequest("a", 1), LoRARequest("b", 2)
    report = []
    for label, lora in (("base", None), ("adapter a (first use)", a), ("adapter a (resident)", a),
                        ("base", None), ("adapter b (slot swap)", b), ("adapter a (slot swap)", a),
                        ("adapter a (resident)", a), ("base", None)):
        report.append(f"{label:28s} {ttft(lora):8.1f} ms")
    for label, lora in (("base", None), ("adapter a (resident)", a)):
        ttft(lora)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            wall = ttft(lora)
        report += ["", f"== TTFT {label}: {wall:.1f} ms", kernel_table(prof, 1),
                   prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)]
    ttft(a)
    wall, table = host_profile(lambda: ttft(a), 45)
    report += ["", f"== cProfile, TTFT adapter a (resident): {wall:.1f} ms", table]
    report += slot_write_profile(engine, model, sync)
    text = "\n".join(report)
    args.out.write_text(text + "\n")
    print(text)


def slot_write_profile(engine, model, sync) -> list[str]:
    """Copying a pinned host adapter (as the CPU tier holds them) into a GPU slot: wall time of
    each write, then a host profile of one."""
    manager = engine.lora_manager
    dtype, cuda = next(model.parameters()).dtype, torch.cuda.is_available()
    adapters = [random_adapter(model.config, f"pinned{i}", 16, ALL_SEVEN, 50 + i, "cpu", dtype) for i in range(2)]
    adapters = [engine.registry.bind(a.pin_memory() if cuda else a) for a in adapters]
    report = ["", f"== slot writes of a pinned rank-16 adapter ({adapters[0].nbytes / 1e6:.0f} MB), 1 slot"]
    for i in range(4):
        sync()
        t0 = time.perf_counter()
        manager.activate(adapters[i % 2])
        host = time.perf_counter() - t0
        sync()
        report.append(f"write {i}: host {1e3 * host:.1f} ms, until the copy landed {1e3 * (time.perf_counter() - t0):.1f} ms")
    _, table = host_profile(lambda: (manager.activate(adapters[0]), sync()), 20)
    return report + [table]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--batch", default="64", type=lambda text: [int(b) for b in text.split(",")],
                        help="decode batch sizes, e.g. 16,64,256 (one engine for all)")
    parser.add_argument("--out", type=Path, default=Path("profile.txt"))
    parser.add_argument("--ttft", action="store_true", help="only: one 128-token request's time to first token")
    parser.add_argument("--adapters", default="1",
                        help="adapter counts to profile beside the base step, e.g. 1,32 (\"\": none)")
    parser.add_argument("--fleet", default="",
                        help="also profile a batch drawn from a fleet of N adapters as many_adapters.py draws its "
                             "requests (mixed ranks and targets, Zipf popularity), e.g. 4,1000 (N/seed: other requests "
                             "over the same adapters); max_lora_rank is then the mix's largest rank, as there")
    parser.add_argument("--decode-only", action="store_true", help="skip the prefill profiles")
    parser.add_argument("--qv", action="store_true",
                        help="--adapters' adapters target q and v only (default: all seven)")
    parser.add_argument("--qv-adapters", default="",
                        help="also profile batches of this many q/v adapters (rank 16), e.g. 1,32, beside --adapters'")
    parser.add_argument("--sampled", action="store_true",
                        help="decode with temperature 0.8, top-p 0.9 and 5 logprobs a token (default: greedy)")
    parser.add_argument("--json", type=Path, default=None, help="also write the timelines as JSON")
    args = parser.parse_args()
    if args.ttft:  # runs on the CPU too (embedded model): a check of the script
        cuda = torch.cuda.is_available()
        model = load_model(args.model if cuda else None, dtype="bfloat16" if cuda else "float32",
                           device="cuda" if cuda else "cpu", load_format="dummy" if cuda else "auto")[0]
        return ttft_profile(model, args)
    counts = [int(n) for n in args.adapters.split(",") if n]
    qv_counts = [int(n) for n in args.qv_adapters.split(",") if n]
    model = load_model(args.model, dtype="bfloat16", device="cuda", load_format="dummy")[0]
    vocab = model.config.vocab_size
    targets = QV if args.qv else ALL_SEVEN
    adapters = [random_adapter(model.config, f"a{i}", 16, targets, 1 + i, "cuda", torch.bfloat16)
                for i in range(max(counts, default=0))]
    adapters += [random_adapter(model.config, f"qv{i}", 16, QV, 500 + i, "cuda", torch.bfloat16)
                 for i in range(max(qv_counts, default=0))]
    sizes = args.batch
    batches = []  # (batch size, label, each request's adapter)
    for size in sizes:
        batches.append((size, "base", [None] * size))
        for prefix, label, numbers, first_id in (("a", "", counts, 1), ("qv", " q/v", qv_counts, 500)):
            batches += [(size, f"{n}{label} adapter{'s' * (n > 1)}",
                         [LoRARequest(f"{prefix}{i % n}", first_id + i % n) for i in range(size)]) for n in numbers]
        for fleet in (f for f in args.fleet.split(",") if f):
            n, _, seed = fleet.partition("/")  # N, or N/seed: another batch over the same N adapters
            trace = make_trace(int(n), size, rate=math.inf, prompt_len=1, vocab_size=vocab,
                               name_prefix=f"fleet{fleet.replace('/', 's')}-b{size}-",
                               first_id=1000 * (1 + len(batches)), request_seed=int(seed) if seed else None)
            used = trace.used_adapters()
            adapters += [random_adapter(model.config, a.name, a.rank, a.targets, a.seed, "cuda", torch.bfloat16)
                         for a in used]
            big = sum("gate_proj" in a.targets for a in used)
            batches.append((size, f"fleet {fleet} ({len(used)} distinct, {big} on all 7)",
                            [LoRARequest(r.adapter.name, r.adapter.lora_int_id) for r in trace.requests]))
    t0 = time.perf_counter()
    distinct = max(len({lora.lora_name for lora in loras if lora}) for _, _, loras in batches)
    max_rank = max(kind.rank for kind in DEFAULT_MIX) if args.fleet else 16
    engine = LLMEngine(model, enable_lora=True, max_loras=max(8, distinct), max_lora_rank=max_rank,
                       max_cpu_loras=max(8, len(adapters)), max_num_seqs=max(sizes), max_model_len=1100,
                       max_num_batched_tokens=8192)
    report = [f"engine init {time.perf_counter() - t0:.1f} s, {engine.runner.num_graphs} graphs"]
    for adapter in adapters:
        engine.registry.bind(adapter)
    prompts = torch.randint(1, vocab, (max(sizes), 128), generator=torch.Generator().manual_seed(0)).tolist()
    timelines = {}
    for size, label, loras in batches:
        params = (SamplingParams(temperature=0.8, top_p=0.9, logprobs=5, max_tokens=100, ignore_eos=True)
                  if args.sampled else SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        for i, (p, lora) in enumerate(zip(prompts, loras)):
            engine.add_request(f"{size}-{label}{i}", {"prompt_token_ids": p}, params, lora)
        for _ in range(20):  # prefill, then decode steps
            engine.step()
        for _ in range(40):  # a fleet's adapters are placed a few a step: until every request decodes
            running = engine.scheduler.running
            if len(running) == size and all(seq.num_computed >= 128 for seq in running):
                break
            engine.step()
        else:  # a profile of a smaller batch than its label says would mislead
            raise SystemExit(f"batch {size}, {label}: {len(engine.scheduler.running)} of {size} requests decode at "
                             "once (the KV cache or the GPU adapter slots are short); profile fewer sizes, "
                             "adapters or fleets in one run")
        wall_ms = {}  # the host's and the GPU's step, unprofiled: the synchronous loop, then async
        for overlapped in (False, True):
            engine.async_scheduling = overlapped
            engine.step()  # the switch
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                engine.step()
            torch.cuda.synchronize()
            wall_ms[overlapped] = (time.perf_counter() - t0) / 10 * 1e3
        engine.async_scheduling = False  # replays apart, so the timeline tells each one's span
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.step()
            torch.cuda.synchronize()
        engine.async_scheduling = True
        report += ["", f"== decode, batch {size}, {label}", kernel_table(prof, 5)]
        # the timeline (kernels inside the graph replays, both streams): chrome://tracing or perfetto
        key = label if len(sizes) == 1 else f"batch {size}, {label}"
        trace = args.out.with_suffix(f".decode-{re.sub(r'[^0-9a-z]+', '-', key)}.trace.json")
        prof.export_chrome_trace(str(trace))
        timelines[key] = replay_timeline(trace) | {"step_wall_us": 1e3 * wall_ms[True],
                                                   "step_wall_sync_us": 1e3 * wall_ms[False]}
        report += ["timeline (medians, us): " + ", ".join(f"{k} {v:.1f}" for k, v in timelines[key].items())]
        while engine.has_unfinished_requests():
            engine.step()
        if args.decode_only:
            continue
        # one prefill step of 8 x 1024 tokens (a first round warms its kernels up); fresh prompts each
        # round, or the prefix cache serves the second from the first's blocks and it computes 8 tokens
        for round_ in range(2):
            generator = torch.Generator().manual_seed(1 + round_)
            long = torch.randint(1, vocab, (8, 1024), generator=generator).tolist()
            for i, p in enumerate(long):
                engine.add_request(f"{size}-{label}-p{round_}-{i}", {"prompt_token_ids": p},
                                   SamplingParams(max_tokens=1), loras[i % len(loras)])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                while engine.has_unfinished_requests():
                    engine.step()
                torch.cuda.synchronize()
            wall = 1e3 * (time.perf_counter() - t0)
        report += ["", f"== prefill 8 x 1024, {label}: wall {wall:.1f} ms", kernel_table(prof, 1)]
    text = "\n".join(report)
    args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "batch": sizes,
                                         "timelines": timelines}, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()

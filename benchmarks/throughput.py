"""The engine against its floor (issues 12 and 13): decode step, tokens/s, prefill, TTFT, startup,
concurrency, with and without adapters, and PEFT's own mixed-batch generation.

    PYTHONPATH=. python benchmarks/throughput.py                      # CPU: the embedded model, small
    PYTHONPATH=. python benchmarks/throughput.py --model llama-3.1-8b --load-format dummy   # GPU
    PYTHONPATH=. python benchmarks/throughput.py --model llama-3.1-8b --load-format dummy -tp 2   # 2 GPUs

Every request has the same random prompt length and generates exactly ``--output-len`` tokens
(``ignore_eos``), all submitted at once (``max_num_seqs`` = the number of requests, so every decode
step holds the whole batch). Per scenario: tokens/s over the whole run and the median time of the
decode steps that hold the full batch. The floor of a decode step is the bytes it must read
(weights, the active adapters, the KV in use at the median step) over the device-copy bandwidth
measured in this run. Adapters are random, on all seven projections or on q/v only, put in the CPU
tier and warmed into GPU slots before the clock starts. Also: prefill tokens/s (8 x 1024-token
prompts), time to first token of one 128-token request on a fresh prompt (base; an adapter in host
memory that must first take a GPU slot; the same adapter then resident; a cold adapter from
disk), the engine's start-up (load, compile, graph capture, kernel warm-up; ``--startup`` measures a
first and a second start in fresh processes, see benchmarks/startup_check.py), and how many 1k-token requests run at once at
``max_model_len=32768`` (``--concurrency``). Writes JSON and a markdown table naming the device.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.startup_check import engine_stages  # noqa: E402
from loramux import LoRARequest, SamplingParams  # noqa: E402
from loramux.engine.llm_engine import LLMEngine  # noqa: E402
from loramux.engine.model_loader import load_model  # noqa: E402
from loramux.registry import LoRAAdapter  # noqa: E402

from benchmarks._common import (  # noqa: E402  (ALL_SEVEN, QV, random_adapter: imported from here by others)
    ALL_SEVEN,
    QV,
    copy_bandwidth,
    device_name,
    drop_from_page_cache,
    random_adapter,
    save_peft_files,
    sync,
)

class StepTimer:
    """Wraps the engine's model runner: every step's period and the batch it held. A step's
    period runs from the moment the host has the last step's tokens to the moment it has this
    one's: its GPU work and the host work the GPU did not hide, the loop's real cost per step,
    with or without async scheduling (where ``run`` returns at once, and the host waits for a
    step's tokens while the next one computes)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.launches: list[list] = []  # [sequences, tokens, launched at, kv tokens, tokens read at]
        self.engine = engine
        run = engine.runner.run

        def timed(batch):
            kv_tokens = sum(seq.num_computed + n for seq, n in batch.chunks)
            launch = [len(batch), batch.num_tokens, time.perf_counter(), kv_tokens, None]
            self.launches.append(launch)
            step = run(batch)
            read = step.token_ids

            def token_ids():
                tokens = read()
                launch[4] = time.perf_counter()
                return tokens

            step.token_ids = token_ids
            return step

        engine.runner.run = timed

    def stop(self) -> None:
        """After the workload's last token: ``records`` = (sequences, tokens, seconds, kv tokens)."""
        self.records, last = [], None
        for seqs, n, launched, kv, read in self.launches:
            if read is not None:  # (a step whose tokens were dropped is never read)
                self.records.append((seqs, n, read - (launched if last is None else max(last, launched)), kv))
                last = read
        del self.engine.runner.run  # the class's method again


_FRESH = iter(range(1, 1 << 30))  # a new seed for every workload


def run_workload(engine: LLMEngine, prompts, loras, output_len: int) -> dict:
    """Serve one request per prompt length in ``prompts`` (new random tokens every call: no run
    finds an earlier one's prompts in the prefix cache, as the adapter runs, whose blocks key on
    the adapter, never could) and time it."""
    vocab = engine.runner.model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(next(_FRESH))
    prompts = [torch.randint(1, vocab, (len(p),), generator=generator).tolist() for p in prompts]
    timer = StepTimer(engine)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"w{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt}, params, lora)
    sync(engine.setup.device)
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - t0
    timer.stop()
    full = sorted((t, kv) for seqs, n, t, kv in timer.records if seqs == len(prompts) and n == len(prompts))
    median = full[len(full) // 2] if full else (None, None)
    # the steps that are not full-batch decodes (prefill, the batch's tail): where the rest of the time goes
    others = [(seqs, n, round(1e3 * t, 2)) for seqs, n, t, _ in timer.records if not (seqs == n == len(prompts))]
    return {"requests": len(prompts), "generated_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "decode_step_ms": median[0] and 1e3 * median[0], "decode_kv_tokens": median[1], "decode_steps_timed": len(full),
            "decode_steps_ms": 1e3 * sum(t for t, _ in full), "other_steps_ms": sum(ms for *_, ms in others),
            # the wall time no step's period covers: the first step's host work before its launch, the last outputs
            "outside_steps_ms": 1e3 * (elapsed - sum(t for _, _, t, _ in timer.records)), "other_steps": others[:16]}


def time_to_first_token(engine: LLMEngine, prompt, lora) -> float:
    """Seconds to the first token of one request. ``prompt`` is a length: a fresh random prompt of
    it is drawn, so no earlier run's prefix-cache blocks serve it."""
    vocab = engine.runner.model.config.get_text_config().vocab_size
    prompt = torch.randint(1, vocab, (prompt,), generator=torch.Generator().manual_seed(time.monotonic_ns())).tolist()
    engine.add_request(f"ttft{time.monotonic_ns()}", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), lora)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        if any(out.outputs[0].token_ids for out in engine.step()):
            break
    return time.perf_counter() - t0


def warm_up(engine: LLMEngine, loras, vocab: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i, lora in enumerate(dict.fromkeys(loras)):
        engine.add_request(f"warm{i}", {"prompt_token_ids": [1 + i % (vocab - 1)] * 4}, params, lora)
    while engine.has_unfinished_requests():
        engine.step()


def in_turn(group: list, n: int, count: int) -> list:
    """``count`` requests' adapters: the first ``n`` of ``group``, in turn."""
    return [group[i % n] for i in range(count)]


def scenario(n: int, label: str) -> str:
    """A workload's name in the tables: "1 adapter (all 7)", "32 adapters (q/v)"."""
    return f"{n} adapter{'s' if n > 1 else ''} ({label})"


def close(engine: LLMEngine) -> None:
    engine.close()
    engine.kv_cache = engine.runner.kv = None
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


def engine_options(args, **extra) -> dict:
    options = dict(max_num_seqs=args.num_requests, max_model_len=args.prompt_len + args.output_len + 8,
                   max_num_batched_tokens=max(args.max_num_batched_tokens, args.num_requests),
                   enforce_eager=args.enforce_eager, compilation=not args.no_compile,
                   async_scheduling=not args.no_async_scheduling)
    options.update(extra)
    return options


def base_runs(args, model, prompts, record, result) -> None:
    vocab = model.config.get_text_config().vocab_size
    t0 = time.perf_counter()
    extra = dict(max_model_len=max(args.prompt_len + args.output_len, args.prefill_len) + 8)
    if args.concurrency:
        extra = dict(max_num_seqs=max(args.num_requests, 256), max_model_len=32768)
    engine = LLMEngine(model, enable_lora=False, **engine_options(args, **extra))
    result["startup"]["base_engine_init_s"] = time.perf_counter() - t0
    result["startup"]["base_engine"] = engine_stages(engine, result["startup"]["base_engine_init_s"])
    result["num_gpu_blocks"] = engine.kv_cache.num_blocks
    warm_up(engine, [None], vocab)
    run_workload(engine, prompts, [None] * len(prompts), min(args.output_len, 16))  # first-use costs
    record({"scenario": "base (LoRA disabled)", "rank": 0, "adapters": 0,
            **run_workload(engine, prompts, [None] * len(prompts), args.output_len)}, [])
    long = torch.randint(1, vocab, (8, args.prefill_len), generator=torch.Generator().manual_seed(1)).tolist()
    t0 = time.perf_counter()
    run_workload(engine, long, [None] * 8, 1)
    result["prefill_tokens_per_s"] = 8 * args.prefill_len / (time.perf_counter() - t0)
    result["ttft_ms"] = {"base": 1e3 * time_to_first_token(engine, len(prompts[0]), None)}
    if args.concurrency:  # 1k-token requests at max_model_len=32768: how many run at once
        reqs = torch.randint(1, vocab, (256, 1000), generator=torch.Generator().manual_seed(2)).tolist()
        most = 0
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        for i, p in enumerate(reqs):
            engine.add_request(f"c{i}", {"prompt_token_ids": p}, params)
        while engine.has_unfinished_requests():
            engine.step()
            most = max(most, sum(1 for s in engine.scheduler.running if s.num_uncomputed <= 1))
        result["concurrent_1k_requests_at_32k"] = most
        result["kv_blocks_tokens"] = (engine.kv_cache.num_blocks - 1) * engine.kv_cache.block_size
    close(engine)


def lora_runs(args, model, prompts, rank: int, record, result) -> None:
    """Base, then 1 / 8 / 32 adapters (all seven projections; q/v only at the first rank)."""
    config, vocab = model.config, model.config.get_text_config().vocab_size
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    most = max(args.adapters)
    sets = {"all 7": ALL_SEVEN} | ({"q/v": QV} if rank == args.ranks[0] else {})
    adapters = {label: [random_adapter(config, f"r{rank}-{label}-{i}", rank, targets, 1000 * rank + i, device, dtype)
                        for i in range(most)] for label, targets in sets.items()}
    engine = LLMEngine(model, enable_lora=True, max_loras=most, max_lora_rank=rank,
                       max_cpu_loras=most * len(sets) + 1, **engine_options(args))
    requests = {}
    for label, group in adapters.items():
        requests[label] = []
        for adapter in group:
            engine.registry.bind(adapter)  # built on the device already: served as it is
            requests[label].append(LoRARequest(adapter.name, len(requests[label]) + 1))
    warm_up(engine, [None], vocab)
    run_workload(engine, prompts, [None] * len(prompts), min(args.output_len, 16))  # first-use costs, as for base
    record({"scenario": "base via LoRA engine", "rank": rank, "adapters": 0,
            **run_workload(engine, prompts, [None] * len(prompts), args.output_len)}, [])
    for label, group in requests.items():
        for n in args.adapters if label == "all 7" else (1, most):
            loras = in_turn(group, n, len(prompts))
            warm_up(engine, group[:n], vocab)  # into GPU slots before the clock starts
            run = {"scenario": scenario(n, label), "rank": rank, "adapters": n,
                   **run_workload(engine, prompts, loras, args.output_len)}
            record(run, adapters[label][:n])
    if rank == args.ranks[0] and args.repeats > 1:
        result["interleaved"] = interleaved_runs(engine, prompts, requests, args)
    if rank == args.ranks[0]:
        # adapters as a server gets them, from their files: one read into host memory first (the
        # CPU tier, page-locked) that must take a GPU slot (the q/v runs took every slot: it
        # evicts one), the same one then resident; and one cold, its files out of the page cache
        with tempfile.TemporaryDirectory() as tmp:
            paths = {}
            for name, seed in (("host", 8), ("cold", 7)):
                adapter = random_adapter(config, name, rank, ALL_SEVEN, seed, "cpu", dtype)
                paths[name] = save_peft_files(adapter, rank, Path(tmp) / name)
            result["cold_adapter_bytes"] = adapter.nbytes
            engine.add_lora(LoRARequest("host", 10_001, str(paths["host"])))
            host = LoRARequest("host", 10_001)
            result["ttft_ms"]["adapter in host memory, not in a slot"] = 1e3 * time_to_first_token(engine, len(prompts[0]), host)
            result["ttft_ms"]["resident adapter"] = 1e3 * time_to_first_token(engine, len(prompts[0]), host)
            drop_from_page_cache(*paths["cold"].iterdir())
            result["ttft_ms"]["cold adapter (disk)"] = 1e3 * time_to_first_token(
                engine, len(prompts[0]), LoRARequest("cold", 10_000, str(paths["cold"])))
    close(engine)


#: What a round keeps of each run: the wall time split into its full-batch decode steps, the other
#: steps (the prefill) and the time outside every step, so a round's tokens/s ratio can be traced
#: to the part of the run that moved.
ROUND_KEYS = ("decode_step_ms", "tokens_per_s", "decode_steps_ms", "other_steps_ms", "outside_steps_ms")


def interleaved_runs(engine: LLMEngine, prompts, requests: dict, args) -> dict:
    """Base and adapter workloads in turn on one LoRA engine, ``--repeats`` rounds: each adapter
    workload's decode step and tokens/s over the base run of its own round, and the median over
    the rounds. Base steps moved by up to 6% between runs and between engines doing the same GPU
    work, as much as one adapter costs: a single pair of runs cannot settle a 5% mark. With
    ``--compare-sync`` each round runs every workload, base included, with async scheduling and
    then without (labels ending in ", sync"), on the same engine."""
    vocab = engine.runner.model.config.get_text_config().vocab_size
    most = max(args.adapters)
    workloads = {scenario(n, label): in_turn(group, n, len(prompts)) for label, group in requests.items()
                 for n in (1, most)}
    configured = engine.async_scheduling  # as the engine was built (--no-async-scheduling, tensor parallelism)
    modes = {"": configured} | ({", sync": False} if args.compare_sync else {})
    rounds = []
    for _ in range(args.repeats):
        row = {}
        for suffix, overlapped in modes.items():
            engine.async_scheduling = overlapped
            base = run_workload(engine, prompts, [None] * len(prompts), args.output_len)
            row["base" + suffix] = {key: base[key] for key in ROUND_KEYS}
            for label, loras in workloads.items():
                warm_up(engine, loras, vocab)  # into GPU slots before the clock starts
                run = run_workload(engine, prompts, loras, args.output_len)
                row[label + suffix] = {key: run[key] for key in ROUND_KEYS} | {
                    "step_vs_base": run["decode_step_ms"] / base["decode_step_ms"],
                    "tokens_vs_base": run["tokens_per_s"] / base["tokens_per_s"]}
        engine.async_scheduling = configured
        rounds.append(row)
        print("  round:", {k: round(v.get("step_vs_base", v["decode_step_ms"]), 3) for k, v in row.items()}, flush=True)
    keys = {label: ("decode_step_ms", "tokens_per_s") for label in rounds[0] if label.startswith("base")}
    keys |= {label: ("step_vs_base", "tokens_vs_base") for label in rounds[0] if not label.startswith("base")}
    summary = {label: {key: {"median": statistics.median(r[label][key] for r in rounds),
                             "min": min(r[label][key] for r in rounds), "max": max(r[label][key] for r in rounds)}
                       for key in names} for label, names in keys.items()}
    if args.compare_sync:  # async over sync, per workload: tokens/s and the step
        summary["async over sync"] = {
            label: {key: statistics.median(r[label][key] / r[label + ", sync"][key] for r in rounds)
                    for key in ("tokens_per_s", "decode_step_ms")}
            for label in ["base", *workloads]}
    return {"rounds": rounds, "summary": summary}


def qv_engine_runs(args, model, prompts, rank: int, record) -> None:
    """q/v adapters on an engine told its fleet targets q/v only (``lora_target_modules``): it wraps
    the fused qkv projection alone, where the default engine wraps all seven and launches the
    kernels of the other projections for every step, whatever the batch's adapters target."""
    config, vocab = model.config, model.config.get_text_config().vocab_size
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    most = max(args.adapters)
    adapters = [random_adapter(config, f"qv-engine-r{rank}-{i}", rank, QV, 5000 + i, device, dtype)
                for i in range(most)]
    engine = LLMEngine(model, enable_lora=True, max_loras=most, max_lora_rank=rank, max_cpu_loras=most + 1,
                       lora_target_modules=list(QV), **engine_options(args))
    requests = []
    for adapter in adapters:
        engine.registry.bind(adapter)
        requests.append(LoRARequest(adapter.name, len(requests) + 1))
    warm_up(engine, [None], vocab)
    run_workload(engine, prompts, [None] * len(prompts), min(args.output_len, 16))  # first-use costs
    for n in (1, most):
        loras = in_turn(requests, n, len(prompts))
        warm_up(engine, requests[:n], vocab)
        record({"scenario": scenario(n, "q/v, engine wraps q/v only"), "rank": rank,
                "adapters": n, **run_workload(engine, prompts, loras, args.output_len)}, adapters[:n])
    close(engine)


def peft_run(args, model, prompts, rank: int, n: int, device) -> dict:
    """PEFT's mixed batch: ``generate(adapter_names=...)`` with ``n`` random adapters."""
    from peft import LoraConfig, get_peft_model

    config = dict(r=rank, lora_alpha=2 * rank, target_modules=list(ALL_SEVEN), init_lora_weights=False)
    peft_model = get_peft_model(model, LoraConfig(**config), adapter_name="p0", autocast_adapter_dtype=False)
    for i in range(1, n):
        peft_model.add_adapter(f"p{i}", LoraConfig(**config))
    peft_model.to(device).eval()
    names = [f"p{i % n}" for i in range(len(prompts))]
    input_ids = torch.tensor(prompts, device=device)

    def generate(new_tokens: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            peft_model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), adapter_names=names,
                                do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        sync(device)
        return time.perf_counter() - t0

    generate(2)  # warm-up
    short, long = generate(2), generate(2 + args.peft_tokens)
    step = (long - short) / args.peft_tokens
    return {"scenario": f"PEFT mixed batch, {n} adapters", "rank": rank, "adapters": n, "requests": len(prompts),
            "generated_tokens": len(prompts) * args.peft_tokens, "seconds": long,
            "tokens_per_s": len(prompts) / step, "decode_step_ms": 1e3 * step}


def startup(args) -> dict:
    """A first and a second start of a LoRA engine, each in a fresh process sharing one new compile
    cache dir: load, compile, capture, warm-up seconds and what compiled while serving
    (`benchmarks/startup_check.py`)."""
    from benchmarks.startup_check import parent

    options = argparse.Namespace(model=args.model, dtype=args.dtype, device="cuda", lora=True, cache_dir=None,
                                 max_num_seqs=args.num_requests, max_model_len=2048)
    try:
        result = parent(options)
    except SystemExit as failed:
        return {"error": str(failed)}
    return {name: {k: result[name][k] for k in ("stages", "total_s", "process_s", "layer_frames",
                                                "frames_while_serving", "triton_kernels_while_serving")}
            for name in ("cold", "second")}


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b" if cuda else None)
    parser.add_argument("--load-format", default="dummy" if cuda else "auto")
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    parser.add_argument("--num-requests", type=int, default=64 if cuda else 16)
    parser.add_argument("--prompt-len", type=int, default=128 if cuda else 32)
    parser.add_argument("--output-len", type=int, default=128 if cuda else 16)
    parser.add_argument("--prefill-len", type=int, default=1024, help="prompt length of the prefill test (8 requests)")
    parser.add_argument("--adapters", default="1,8,32")
    parser.add_argument("--ranks", default="16,64")
    parser.add_argument("--peft-adapters", type=int, default=32 if cuda else 0)
    parser.add_argument("--peft-tokens", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192 if cuda else 1024)
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of base and adapter runs in turn on the first LoRA engine (>1: medians)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="read every step's tokens back before the next step (the engine's old loop)")
    parser.add_argument("--compare-sync", action="store_true",
                        help="the interleaved rounds (--repeats > 1) run every workload without async scheduling too")
    parser.add_argument("--no-compile", action="store_true", help="CUDA graphs without torch.compile")
    parser.add_argument("--concurrency", action="store_true", help="1k-token requests at max_model_len=32768")
    parser.add_argument("--startup", action="store_true", help="first and second start in fresh processes")
    parser.add_argument("--only", choices=["base", "lora", "all"], default="all")
    parser.add_argument("--qv-engine", action="store_true",
                        help="also q/v adapters on an engine that wraps q/v only (lora_target_modules)")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=None, metavar="N",
                        help="measure TP=1 and TP=N instead (0, 1 and 32 adapters; benchmarks/tensor_parallel.py)")
    parser.add_argument("--json", type=Path, default=Path("throughput.json"))
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    args.adapters = [int(x) for x in args.adapters.split(",")]
    args.ranks = [int(x) for x in args.ranks.split(",")]
    if args.tensor_parallel_size:
        import tensor_parallel  # noqa: PLC0415 -- benchmarks/ is the script's dir, so on sys.path

        tensor_parallel.run(args)
        return
    device = torch.device("cuda" if cuda else "cpu")
    t0 = time.perf_counter()
    model = load_model(args.model, dtype=args.dtype, device=device, load_format=args.load_format)[0]
    sync(device)
    bandwidth = copy_bandwidth(device)
    result = {"device": device_name(device), "model": args.model or "SmolLM2-135M-Instruct (embedded)",
              "dtype": args.dtype, "torch": torch.__version__, "num_requests": args.num_requests,
              "prompt_len": args.prompt_len, "output_len": args.output_len,
              "mode": "eager" if args.enforce_eager or not cuda else ("graphs" if args.no_compile else "compiled + graphs"),
              "copy_bandwidth_GBps": bandwidth and bandwidth / 1e9, "model_bytes": sum(p.nbytes for p in model.parameters()),
              "startup": {"load_s": time.perf_counter() - t0}, "ttft_ms": {}, "runs": []}
    layers, kv_heads, head_dim = _geometry(model)
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * model.dtype.itemsize
    print(f"{result['device']}: {result['model']} ({args.dtype}), {result['mode']}", flush=True)

    def record(run: dict, used: list[LoRAAdapter]) -> None:
        run["adapter_bytes"] = sum(a.nbytes for a in used)
        if bandwidth and run.get("decode_step_ms"):
            floor_bytes = result["model_bytes"] + run["adapter_bytes"] + run["decode_kv_tokens"] * kv_bytes_per_token
            run["floor_ms"] = 1e3 * floor_bytes / bandwidth
            run["vs_floor"] = run["decode_step_ms"] / run["floor_ms"]
        base = result["runs"][0] if result["runs"] else None  # LoRA disabled
        if base and base.get("decode_step_ms") and run.get("decode_step_ms"):
            run["step_vs_base"] = run["decode_step_ms"] / base["decode_step_ms"]
            run["tokens_vs_base"] = run["tokens_per_s"] / base["tokens_per_s"]
        result["runs"].append(run)
        print(f"  {run['scenario']} (rank {run['rank']}): {run['tokens_per_s']:.1f} tok/s, step "
              f"{run.get('decode_step_ms') or 0:.2f} ms, x{run.get('vs_floor', 0):.2f} floor", flush=True)
        save(args, result)

    prompts = _prompts(model, args)
    if args.only in ("base", "all"):
        base_runs(args, model, prompts, record, result)
    if args.only in ("lora", "all"):
        for index, rank in enumerate(args.ranks):
            if index or args.only == "all":  # a fresh, unwrapped model for each LoRA engine
                del model
                gc.collect()
                model = load_model(args.model, dtype=args.dtype, device=device, load_format=args.load_format)[0]
            lora_runs(args, model, prompts, rank, record, result)
        if args.qv_engine:
            del model
            gc.collect()
            model = load_model(args.model, dtype=args.dtype, device=device, load_format=args.load_format)[0]
            qv_engine_runs(args, model, prompts, args.ranks[0], record)
    if args.peft_adapters:
        del model
        gc.collect()
        model = load_model(args.model, dtype=args.dtype, device=device, load_format=args.load_format)[0]
        peft = peft_run(args, model, prompts, args.ranks[0], args.peft_adapters, device)
        ours = next((r for r in result["runs"] if r["rank"] == args.ranks[0] and r["adapters"] == args.peft_adapters), None)
        if ours:
            peft["loramux_speedup_step"] = peft["decode_step_ms"] / ours["decode_step_ms"]
        result["runs"].append(peft)
        save(args, result)
    if args.startup and cuda:
        del model
        gc.collect()
        torch.cuda.empty_cache()
        result["startup"]["fresh_processes"] = startup(args)
    print(save(args, result))


def _prompts(model, args) -> list[list[int]]:
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(1, vocab, (args.num_requests, args.prompt_len), generator=torch.Generator().manual_seed(0)).tolist()


def _geometry(model) -> tuple[int, int, int]:
    from loramux.engine.kv_cache import kv_cache_geometry

    return kv_cache_geometry(model.config)


def save(args, result: dict) -> str:
    """Write what has been measured so far (a later failure keeps the earlier numbers)."""
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    if args.markdown:
        args.markdown.write_text(table)
    return table


def markdown(result: dict) -> str:
    bw = result["copy_bandwidth_GBps"]
    fmt = lambda v, f="{:.2f}": "" if v is None else f.format(v)  # noqa: E731
    lines = [
        f"**{result['device']}**, {result['model']} ({result['dtype']}, torch {result['torch']}), {result['mode']}; "
        f"{result['num_requests']} requests x ({result['prompt_len']} prompt + {result['output_len']} generated) "
        f"tokens" + (f"; measured copy bandwidth {bw:.0f} GB/s" if bw else ""),
        "",
        "| scenario | rank | tokens/s | vs base | decode step (ms) | vs base | floor (ms) | step / floor |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['scenario']} | {r['rank'] or ''} | {r['tokens_per_s']:.1f} | {fmt(r.get('tokens_vs_base'), '{:.3f}x')} | "
            f"{fmt(r.get('decode_step_ms'))} | {fmt(r.get('step_vs_base'), '{:.3f}x')} | {fmt(r.get('floor_ms'))} | "
            f"{fmt(r.get('vs_floor'), '{:.2f}x')} |"
        )
    if "interleaved" in result:
        lines += ["", f"Base and adapter runs in turn on the LoRA engine, {len(result['interleaved']['rounds'])} rounds: "
                  "median (min-max) over the rounds of each run against its round's base run", "",
                  "| workload | decode step vs base | tokens/s vs base |", "| --- | ---: | ---: |"]
        summary = dict(result["interleaved"]["summary"])
        over_sync = summary.pop("async over sync", None)
        for label, stats in summary.items():
            if label.startswith("base"):  # its own numbers: decode step (ms), tokens/s
                cells = [f"{r['median']:.2f} ms ({r['min']:.2f}-{r['max']:.2f})" if key == "decode_step_ms"
                         else f"{r['median']:.0f} tok/s ({r['min']:.0f}-{r['max']:.0f})" for key, r in stats.items()]
            else:
                cells = [f"{r['median']:.3f}x ({r['min']:.3f}-{r['max']:.3f})" for r in stats.values()]
            lines.append(f"| {label} | {' | '.join(cells)} |")
        if over_sync:
            lines += ["", "Async scheduling over the synchronous loop, same engine, medians over the rounds:", "",
                      "| workload | tokens/s, async / sync | decode step, async / sync |", "| --- | ---: | ---: |"]
            lines += [f"| {label} | {r['tokens_per_s']:.3f}x | {r['decode_step_ms']:.3f}x |"
                      for label, r in over_sync.items()]
    extras = {k: result.get(k) for k in ("prefill_tokens_per_s", "ttft_ms", "startup", "num_gpu_blocks",
                                        "concurrent_1k_requests_at_32k", "kv_blocks_tokens", "cold_adapter_bytes")}
    lines += ["", "```", json.dumps({k: v for k, v in extras.items() if v is not None}, indent=1), "```"]
    peft = next((r for r in result["runs"] if r["scenario"].startswith("PEFT")), None)
    if peft and "loramux_speedup_step" in peft:
        lines += ["", f"loramux vs PEFT's mixed batch at {peft['adapters']} adapters (rank {peft['rank']}): "
                  f"{peft['loramux_speedup_step']:.1f}x faster per decode step."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

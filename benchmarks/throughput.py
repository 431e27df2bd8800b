"""The engine against its floor: decode step, tokens/s, prefill and time to first token, with and
without adapters (q/v and all seven projections, 1 to 32 adapters), base requests on a LoRA engine
before and after adapter traffic, many requests flowing through continuous batching, PEFT's own
mixed batch, tensor parallelism (``-tp N``) and an FP8 base model (``-q fp8``).

    PYTHONPATH=. python benchmarks/throughput.py                     # CUDA: Llama-3.1-8B shapes, dummy weights
    PYTHONPATH=. python benchmarks/throughput.py -tp 2               # TP=1 against TP=2 (2 GPUs)
    PYTHONPATH=. python benchmarks/throughput.py -q fp8              # bf16 against FP8 (sm_89 and newer)
    PYTHONPATH=. python benchmarks/throughput.py --model tiny --num-requests 4 --prompt-len 8 \\
        --output-len 4 --prefill-len 16 --adapters 1,2 --ranks 8 --flow-requests 8 --out /tmp  # CPU smoke

The batch: every request has the same random prompt length and generates exactly ``--output-len``
tokens (``ignore_eos``), all submitted at once (``max_num_seqs`` = the number of requests, so every
decode step holds the whole batch). Per scenario: tokens/s over the whole run and the median time
of the decode steps that hold the full batch, taken from the engine's step listener (a step's
period runs from the host having the last step's tokens to having this one's: its GPU work and the
host work the GPU did not hide). The floor of a decode step is the bytes it must read (weights, the
input embedding by its tokens' rows alone, the active adapters, the KV in use at the median step)
over the device-copy bandwidth measured in this run. Adapters are random, bound in memory and warmed into GPU slots before the clock starts.

The flow: ``--flow-requests`` requests (128 + 64 tokens on CUDA) through the same engines'
``max_num_seqs`` sequences, so prefill chunks mix with decodes as in a server: the base engine, the
LoRA engine's base requests before any adapter ran, one and many q/v adapters, and base requests
again after them. Also: prefill tokens/s (8 x ``--prefill-len`` tokens), the time to first token of
one request (base; an adapter in host memory that must take a GPU slot; the same adapter resident;
a cold adapter read from disk), the engine's start-up stages, and with ``--repeats`` base and
adapter runs in turn (medians over rounds: one pair of runs cannot settle a few percent).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import stats  # noqa: E402
from benchmarks._common import (  # noqa: E402
    ALL_SEVEN,
    QV,
    cell,
    copy_bandwidth,
    default_out,
    device_name,
    drop_from_page_cache,
    engine_stages,
    forward_weight_bytes,
    load_bench_model,
    projection_shapes,
    random_adapter,
    save_peft_files,
    sync,
    write_result,
)
from loramux import LoRARequest, SamplingParams  # noqa: E402
from loramux.engine.worker.kv_cache import kv_cache_geometry  # noqa: E402
from loramux.engine.llm_engine import LLMEngine  # noqa: E402
from loramux.engine.worker.model_loader import dummy_config  # noqa: E402

TITLE = "Throughput"
COMPARED_ADAPTER_COUNTS = (0, 1, 32)


class StepTimer:
    """Every forward of a workload, from the engine's step listener: its batch (sequences, tokens,
    KV tokens) and its period, from the moment the host has the last forward's tokens (or this one
    launched, if later) to the moment it has this one's."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.batches = engine, []
        engine.add_step_listener(self._heard)

    def _heard(self, timings) -> None:
        self.batches.extend(timings.received)

    def stop(self) -> list[tuple[int, int, float, int]]:
        """(sequences, tokens, seconds, kv tokens) per forward, in launch order."""
        self.engine.remove_step_listener(self._heard)
        records, last = [], None
        for b in self.batches:
            records.append((b.num_seqs, b.num_tokens, b.received_at - max(last or b.launched_at, b.launched_at),
                            b.kv_tokens))
            last = b.received_at
        return records


_FRESH = iter(range(1, 1 << 30))  # a new seed for every workload


def random_prompts(vocab: int, count: int, length: int, seed: int | None = None) -> list[list[int]]:
    generator = torch.Generator().manual_seed(next(_FRESH) if seed is None else seed)
    return torch.randint(1, vocab, (count, length), generator=generator).tolist()


def run_workload(engine: LLMEngine, prompts, loras, output_len: int) -> dict:
    """Serve one request per prompt in ``prompts`` (new random tokens of each length every call: no
    run finds an earlier one's prompts in the prefix cache) and time it."""
    prompts = [random_prompts(engine.vocab_size, 1, len(p))[0] for p in prompts]
    timer = StepTimer(engine)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"w{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt}, params, lora)
    sync(engine.config.device)
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - t0
    records = timer.stop()
    full = [(t, kv) for seqs, n, t, kv in records if seqs == n == len(prompts)]
    step = stats.median(t for t, _ in full)
    kv = stats.median(kv for _, kv in full)
    return {"requests": len(prompts), "generated_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "decode_step_ms": step and 1e3 * step, "decode_kv_tokens": kv, "decode_steps_timed": len(full),
            "decode_steps_ms": 1e3 * sum(t for t, _ in full),
            "other_steps_ms": 1e3 * sum(t for seqs, n, t, _ in records if not seqs == n == len(prompts)),
            # the wall time no forward's period covers: the first forward's host work, the last outputs
            "outside_steps_ms": 1e3 * (elapsed - sum(t for _, _, t, _ in records))}


def time_to_first_token(engine: LLMEngine, prompt_len: int, lora) -> float:
    """Seconds to the first token of one request on a fresh random prompt of ``prompt_len`` tokens."""
    engine.add_request(f"ttft{time.monotonic_ns()}", {"prompt_token_ids": random_prompts(engine.vocab_size, 1, prompt_len)[0]},
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), lora)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        if any(out.outputs[0].token_ids for out in engine.step()):
            break
    return time.perf_counter() - t0


def warm_up(engine: LLMEngine, loras) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i, lora in enumerate(dict.fromkeys(loras)):
        engine.add_request(f"warm{time.monotonic_ns()}-{i}", {"prompt_token_ids": [1 + i] * 4}, params, lora)
    while engine.has_unfinished_requests():
        engine.step()


def in_turn(group: list, n: int, count: int) -> list:
    """``count`` requests' adapters: the first ``n`` of ``group``, in turn (n = 0: none)."""
    return [group[i % n] if n else None for i in range(count)]


def scenario(n: int, label: str) -> str:
    """A workload's name in the tables: "1 adapter (all 7)", "32 adapters (q/v)"."""
    return f"{n} adapter{'s' if n > 1 else ''} ({label})"


def bind_adapters(engine: LLMEngine, adapters) -> list[LoRARequest]:
    """Serve in-memory adapters as they are (already on the device) and name them for requests."""
    requests = []
    for adapter in adapters:
        engine.registry.bind(adapter)
        requests.append(LoRARequest(adapter.name, len(requests) + 1))
    return requests


def close(engine: LLMEngine) -> None:
    engine.close()
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


def engine_options(args, **extra) -> dict:
    options = dict(max_num_seqs=args.num_requests, max_model_len=args.prompt_len + max(args.output_len, args.flow_output_len) + 8,
                   max_num_batched_tokens=max(args.max_num_batched_tokens, args.num_requests),
                   enforce_eager=args.enforce_eager, async_scheduling=not args.no_async_scheduling)
    return options | extra


def flow(engine: LLMEngine, args, loras: list, label: str, record_flow) -> None:
    """``--flow-requests`` requests, all queued at once, through the engine's ``max_num_seqs``."""
    if args.flow_requests:
        prompts = [[0] * args.prompt_len] * args.flow_requests
        record_flow({"scenario": label, **run_workload(engine, prompts, in_turn(loras, len(loras), len(prompts)),
                                                       args.flow_output_len)})


def base_runs(args, model, prompts, record, record_flow, result) -> None:
    t0 = time.perf_counter()
    extra = dict(max_model_len=max(args.prompt_len + max(args.output_len, args.flow_output_len), args.prefill_len) + 8)
    engine = LLMEngine(model, enable_lora=False, **engine_options(args, **extra))
    result["startup"]["base_engine"] = engine_stages(engine, time.perf_counter() - t0)
    result["num_gpu_blocks"] = engine.kv_cache.num_blocks
    warm_up(engine, [None])
    run_workload(engine, prompts, [None] * len(prompts), min(args.output_len, 16))  # first-use costs
    record({"scenario": "base (LoRA disabled)", "rank": 0, "adapters": 0,
            **run_workload(engine, prompts, [None] * len(prompts), args.output_len)}, [])
    flow(engine, args, [], "base (LoRA disabled)", record_flow)
    t0 = time.perf_counter()
    run_workload(engine, [[0] * args.prefill_len] * 8, [None] * 8, 1)
    result["prefill_tokens_per_s"] = 8 * args.prefill_len / (time.perf_counter() - t0)
    result["ttft_ms"] = {"base": 1e3 * time_to_first_token(engine, args.prompt_len, None)}
    close(engine)


def lora_runs(args, model, prompts, rank: int, record, record_flow, result) -> None:
    """Base, then 1 to 32 adapters (all seven projections; q/v only at the first rank); at the first
    rank also the flow before and after the adapters, the rounds and the time to first token."""
    first = rank == args.ranks[0]
    config, device, dtype = model.config, next(model.parameters()).device, next(model.parameters()).dtype
    most = max(args.adapters)
    sets = {"all 7": ALL_SEVEN} | ({"q/v": QV} if first else {})
    adapters = {label: [random_adapter(config, f"r{rank}-{label}-{i}", rank, targets, 1000 * rank + i, device, dtype)
                        for i in range(most)] for label, targets in sets.items()}
    engine = LLMEngine(model, enable_lora=True, max_loras=most, max_lora_rank=rank,
                       max_cpu_loras=most * len(sets) + 1, **engine_options(args))
    requests = {label: bind_adapters(engine, group) for label, group in adapters.items()}
    warm_up(engine, [None])
    run_workload(engine, prompts, [None] * len(prompts), min(args.output_len, 16))  # first-use costs, as for base
    record({"scenario": "base via LoRA engine", "rank": rank, "adapters": 0,
            **run_workload(engine, prompts, [None] * len(prompts), args.output_len)}, [])
    if first:
        flow(engine, args, [], "base via LoRA engine, before adapter traffic", record_flow)
    for label, group in requests.items():
        for n in args.adapters if label == "all 7" else sorted({1, most}):
            loras = in_turn(group, n, len(prompts))
            warm_up(engine, group[:n])  # into GPU slots before the clock starts
            record({"scenario": scenario(n, label), "rank": rank, "adapters": n,
                    **run_workload(engine, prompts, loras, args.output_len)}, adapters[label][:n])
    if not first:
        return close(engine)
    for n in sorted({1, most}):
        warm_up(engine, requests["q/v"][:n])
        flow(engine, args, requests["q/v"][:n], scenario(n, "q/v"), record_flow)
    flow(engine, args, [], "base via LoRA engine, after adapter traffic", record_flow)
    if args.repeats > 1:
        result["interleaved"] = interleaved_runs(engine, prompts, requests, args)
    # adapters as a server gets them, from their files: one read into host memory first (the CPU
    # tier) that must take a GPU slot (the q/v runs took every slot: it evicts one), the same one
    # then resident; and one cold, its files out of the page cache
    with tempfile.TemporaryDirectory() as tmp:
        files = {name: random_adapter(config, name, rank, ALL_SEVEN, seed, "cpu", dtype) for name, seed in (("host", 8),
                                                                                                          ("cold", 7))}
        paths = {name: save_peft_files(adapter, rank, Path(tmp) / name) for name, adapter in files.items()}
        result["cold_adapter_bytes"] = files["cold"].nbytes
        engine.add_lora(LoRARequest("host", 10_001, str(paths["host"])))
        host = LoRARequest("host", 10_001)
        result["ttft_ms"]["adapter in host memory, not in a slot"] = 1e3 * time_to_first_token(engine, args.prompt_len, host)
        result["ttft_ms"]["resident adapter"] = 1e3 * time_to_first_token(engine, args.prompt_len, host)
        drop_from_page_cache(*paths["cold"].iterdir())
        result["ttft_ms"]["cold adapter (disk)"] = 1e3 * time_to_first_token(
            engine, args.prompt_len, LoRARequest("cold", 10_000, str(paths["cold"])))
    close(engine)


#: What a round keeps of each run: the wall time split into its full-batch decode steps, the other
#: steps (the prefill) and the time outside every step, so a round's ratio can be traced to the
#: part of the run that moved.
ROUND_KEYS = ("decode_step_ms", "tokens_per_s", "decode_steps_ms", "other_steps_ms", "outside_steps_ms")


def interleaved_runs(engine: LLMEngine, prompts, requests: dict, args) -> dict:
    """Base and adapter workloads in turn on one LoRA engine, ``--repeats`` rounds: each adapter
    workload's decode step and tokens/s over the base run of its own round, and their spread over
    the rounds. Base steps move between runs by as much as one adapter costs, so only workloads
    measured beside their own base run are compared."""
    most = max(args.adapters)
    workloads = {scenario(n, label): in_turn(group, n, len(prompts)) for label, group in requests.items()
                 for n in sorted({1, most})}
    rounds = []
    for _ in range(args.repeats):
        base = run_workload(engine, prompts, [None] * len(prompts), args.output_len)
        row = {"base": {key: base[key] for key in ROUND_KEYS}}
        for label, loras in workloads.items():
            warm_up(engine, loras)  # into GPU slots before the clock starts
            run = run_workload(engine, prompts, loras, args.output_len)
            row[label] = {key: run[key] for key in ROUND_KEYS} | {
                "step_vs_base": stats.ratio(run["decode_step_ms"], base["decode_step_ms"]),
                "tokens_vs_base": stats.ratio(run["tokens_per_s"], base["tokens_per_s"])}
        rounds.append(row)
    keys = {"base": ("decode_step_ms", "tokens_per_s")} | {label: ("step_vs_base", "tokens_vs_base") for label in workloads}
    summary = {label: {key: stats.spread(r[label][key] for r in rounds) for key in names} for label, names in keys.items()}
    return {"rounds": rounds, "summary": summary}


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


# -- tensor parallelism ---------------------------------------------------------------------------


def per_rank_bytes(config, dtype: torch.dtype, tp: int, adapter_bytes: int, fp8: bool = False) -> int:
    """Bytes of weights (projections sharded) and adapters one rank reads per decode step: the
    output layer's table whole (replicated), the input embedding's only by its tokens' rows (none
    counted: a few KB)."""
    c = config.get_text_config()
    projections = sum(i * o for i, o in projection_shapes(config).values()) * c.num_hidden_layers
    output_table = c.vocab_size * c.hidden_size
    return projections // tp * (1 if fp8 else dtype.itemsize) + output_table * dtype.itemsize + adapter_bytes // tp


def compare_runs(args, variants: dict[str, dict]) -> dict:
    """Engines side by side, one per ``variants`` options (random weights from the config), each
    serving the batch with 0, 1 and 32 adapters of the first ``--ranks`` on all seven projections;
    each step against the bytes one rank reads over GPU 0's copy bandwidth; the targets: each
    variant's step over the first's, LoRA's extra cost in each, rank 0's weights and KV blocks."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    bandwidth = copy_bandwidth(device)
    gc.collect()
    torch.cuda.empty_cache() if cuda else None
    config = dummy_config(args.model)
    dtype = getattr(torch, args.dtype)
    rank, vocab = args.ranks[0], config.get_text_config().vocab_size
    prompts = random_prompts(vocab, args.num_requests, args.prompt_len, seed=0)
    layers, kv_heads, head_dim = kv_cache_geometry(config)
    result = {"model": args.model, "dtype": args.dtype, "num_requests": args.num_requests, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "mode": "eager" if args.enforce_eager or not cuda else "compiled + graphs",
              "copy_bandwidth_GBps": bandwidth and bandwidth / 1e9, "lora_rank": rank, "runs": [], "memory": {}}
    adapters = [random_adapter(config, f"tp-{i}", rank, ALL_SEVEN, 1000 + i, "cpu", dtype)
                for i in range(max(COMPARED_ADAPTER_COUNTS))]
    for label, options in variants.items():
        tp, fp8 = options.get("tensor_parallel_size", 1), options.get("quantization") == "fp8"
        engine = LLMEngine(args.model, load_format="dummy", dtype=args.dtype, enable_lora=True,
                           max_loras=max(COMPARED_ADAPTER_COUNTS), max_lora_rank=rank,
                           max_cpu_loras=max(COMPARED_ADAPTER_COUNTS) + 1, **engine_options(args), **options)
        result["memory"][label] = {"weight_bytes": sum(p.nbytes for p in engine.runner.model.parameters()),
                                   "kv_blocks": engine.kv_cache.num_blocks}
        requests = bind_adapters(engine, adapters)
        warm_up(engine, [None])
        run_workload(engine, prompts, [None] * len(prompts), min(args.output_len, 16))  # first-use costs
        for n in COMPARED_ADAPTER_COUNTS:
            if n:
                warm_up(engine, requests[:n])
            run = {"scenario": f"{label}, {n} adapter{'s' if n != 1 else ''}", "variant": label, "tp": tp, "adapters": n,
                   **run_workload(engine, prompts, in_turn(requests, n, len(prompts)), args.output_len)}
            if bandwidth and run["decode_step_ms"]:
                kv = run["decode_kv_tokens"] * 2 * layers * (kv_heads // tp) * head_dim * dtype.itemsize
                read = per_rank_bytes(config, dtype, tp, sum(a.nbytes for a in adapters[:n]), fp8) + kv
                run["floor_ms"] = 1e3 * read / bandwidth
                run["vs_floor"] = run["decode_step_ms"] / run["floor_ms"]
            result["runs"].append(run)
            print(f"  {run['scenario']}: {run['tokens_per_s']:.1f} tok/s, step {run['decode_step_ms'] or 0:.2f} ms", flush=True)
        close(engine)
        del engine  # what closing leaves (its LoRA slot pools) goes before the next engine sizes its KV cache
    step = {(r["variant"], r["adapters"]): r["decode_step_ms"] for r in result["runs"]}
    first, *others = variants
    extra = {f"{label}, {n} adapters": stats.ratio(step[label, n], step[label, 0])
             for label in variants for n in COMPARED_ADAPTER_COUNTS[1:]}
    result["targets"] = {
        "step_ratio": {f"{label} / {first}, {n} adapters": stats.ratio(step[label, n], step[first, n])
                       for label in others for n in COMPARED_ADAPTER_COUNTS},
        "lora_extra_cost_percent": {key: None if r is None else 100 * (r - 1) for key, r in extra.items()}}
    return result


# -- the run --------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b" if cuda else "tiny",
                        help="a shipped config name (random weights on CUDA), a model id or dir, or 'tiny'")
    parser.add_argument("--load-format", default="dummy" if cuda else "auto")
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    parser.add_argument("--num-requests", type=int, default=64 if cuda else 8, help="the batch, and max_num_seqs")
    parser.add_argument("--prompt-len", type=int, default=128 if cuda else 16)
    parser.add_argument("--output-len", type=int, default=128 if cuda else 8)
    parser.add_argument("--prefill-len", type=int, default=1024 if cuda else 64, help="the prefill test's prompts (8)")
    parser.add_argument("--adapters", default="1,8,32" if cuda else "1,4")
    parser.add_argument("--ranks", default="16,64" if cuda else "8")
    parser.add_argument("--flow-requests", type=int, default=512 if cuda else 24,
                        help="requests of the flow through max_num_seqs sequences (0: none)")
    parser.add_argument("--flow-output-len", type=int, default=64 if cuda else 6)
    parser.add_argument("--peft-adapters", type=int, default=32 if cuda else 0, help="PEFT's mixed batch (0: none)")
    parser.add_argument("--peft-tokens", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192 if cuda else 256)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of base and adapter runs in turn (>1: spreads)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument("--only", choices=["base", "lora", "all"], default="all")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=None, metavar="N",
                        help="measure TP=1 and TP=N instead (0, 1 and 32 adapters)")
    parser.add_argument("-q", "--quantization", choices=["fp8"], default=None,
                        help="measure the model in --dtype and quantized so instead (0, 1 and 32 adapters)")
    parser.add_argument("--out", type=Path, default=default_out(), help="folder for throughput.json / throughput_tp.json "
                        "(default: docs/benchmarks on CUDA, benchmark-results without)")
    args = parser.parse_args(argv)
    args.adapters = [int(x) for x in args.adapters.split(",")]
    args.ranks = [int(x) for x in args.ranks.split(",")]
    return args


def main(argv=None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if args.tensor_parallel_size or args.quantization:  # engines side by side, each from the config
        tp = args.tensor_parallel_size
        variants = ({f"TP={n}": {"tensor_parallel_size": n} for n in sorted({1, tp})} if tp
                    else {args.dtype: {}, args.quantization.upper(): {"quantization": args.quantization}})
        result = compare_runs(args, variants)
        stem, name = ("throughput_tp", f"{tp} x {device_name(device)}") if tp else ("throughput_fp8", device_name(device))
        path = write_result(args.out / f"{stem}.json", "throughput", name, result, argv)
        print(compare_markdown(result))
        return path
    t0 = time.perf_counter()
    model = load_bench_model(args.model, args.dtype, device, args.load_format)
    sync(device)
    bandwidth = copy_bandwidth(device)
    result = {"model": args.model or "SmolLM2-135M-Instruct (embedded)", "dtype": args.dtype,
              "num_requests": args.num_requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
              "mode": "eager" if args.enforce_eager or not cuda else "compiled + graphs",
              "copy_bandwidth_GBps": bandwidth and bandwidth / 1e9, "model_bytes": forward_weight_bytes(model),
              "startup": {"load_s": time.perf_counter() - t0}, "ttft_ms": {}, "runs": [],
              "flow": {"requests": args.flow_requests, "prompt_len": args.prompt_len, "output_len": args.flow_output_len,
                       "max_num_seqs": args.num_requests, "runs": []}}
    layers, kv_heads, head_dim = kv_cache_geometry(model.config)
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * model.dtype.itemsize
    path = args.out / "throughput.json"
    print(f"{device_name(device)}: {result['model']} ({args.dtype}), {result['mode']}", flush=True)

    def save() -> None:  # what has been measured so far survives a later failure
        write_result(path, "throughput", device_name(device), result, argv)

    def record(run: dict, used: list) -> None:
        run["adapter_bytes"] = sum(a.nbytes for a in used)
        if bandwidth and run.get("decode_step_ms"):
            floor_bytes = result["model_bytes"] + run["adapter_bytes"] + run["decode_kv_tokens"] * kv_bytes_per_token
            run["floor_ms"] = 1e3 * floor_bytes / bandwidth
            run["vs_floor"] = run["decode_step_ms"] / run["floor_ms"]
        base = result["runs"][0] if result["runs"] else None  # LoRA disabled
        if base:
            run["step_vs_base"] = stats.ratio(run.get("decode_step_ms"), base["decode_step_ms"])
            run["tokens_vs_base"] = stats.ratio(run["tokens_per_s"], base["tokens_per_s"])
        result["runs"].append(run)
        print(f"  {run['scenario']} (rank {run['rank']}): {run['tokens_per_s']:.1f} tok/s, step "
              f"{run.get('decode_step_ms') or 0:.2f} ms, x{run.get('vs_floor', 0):.2f} floor", flush=True)
        save()

    def record_flow(run: dict) -> None:
        runs = result["flow"]["runs"]
        run["tokens_vs_base"] = stats.ratio(run["tokens_per_s"], runs[0]["tokens_per_s"]) if runs else None
        runs.append(run)
        print(f"  flow, {run['scenario']}: {run['tokens_per_s']:.1f} tok/s", flush=True)
        save()

    def fresh_model():
        nonlocal model
        del model
        gc.collect()
        model = load_bench_model(args.model, args.dtype, device, args.load_format)
        return model

    prompts = random_prompts(model.config.get_text_config().vocab_size, args.num_requests, args.prompt_len, seed=0)
    if args.only in ("base", "all"):
        base_runs(args, model, prompts, record, record_flow, result)
    if args.only in ("lora", "all"):
        for index, rank in enumerate(args.ranks):  # a fresh, unwrapped model for each LoRA engine
            lora_runs(args, fresh_model() if index or args.only == "all" else model, prompts, rank, record,
                      record_flow, result)
    if args.peft_adapters:
        peft = peft_run(args, fresh_model(), prompts, args.ranks[0], args.peft_adapters, device)
        ours = next((r for r in result["runs"] if r["rank"] == args.ranks[0] and r["adapters"] == args.peft_adapters
                     and r["scenario"].endswith("(all 7)")), None)
        peft["loramux_speedup_step"] = stats.ratio(peft["decode_step_ms"], ours and ours["decode_step_ms"])
        result["runs"].append(peft)
    save()
    print(markdown(result))
    return path


# -- the results page -----------------------------------------------------------------------------


def markdown(result: dict) -> str:
    bw = result["copy_bandwidth_GBps"]
    lines = [f"{result['model']} ({result['dtype']}), {result['mode']}; {result['num_requests']} requests x "
             f"({result['prompt_len']} prompt + {result['output_len']} generated) tokens, all at once"
             + (f"; measured copy bandwidth {bw:.0f} GB/s" if bw else ""), "",
             "| scenario | rank | tokens/s | vs base | decode step (ms) | vs base | floor (ms) | step / floor |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["runs"]:
        lines.append(f"| {r['scenario']} | {r['rank'] or ''} | {r['tokens_per_s']:.1f} | "
                     f"{cell(r.get('tokens_vs_base'), '{:.3f}x')} | {cell(r.get('decode_step_ms'))} | "
                     f"{cell(r.get('step_vs_base'), '{:.3f}x')} | {cell(r.get('floor_ms'))} | "
                     f"{cell(r.get('vs_floor'), '{:.2f}x')} |")
    peft = next((r for r in result["runs"] if r["scenario"].startswith("PEFT")), None)
    if peft and peft.get("loramux_speedup_step"):
        lines += ["", f"loramux against PEFT's mixed batch at {peft['adapters']} adapters (rank {peft['rank']}): "
                  f"{peft['loramux_speedup_step']:.1f}x faster per decode step."]
    flow = result.get("flow", {})
    if not flow.get("runs"):
        lines += ["", "Continuous batching (many requests through `max_num_seqs` sequences): not measured in this run."]
    else:
        lines += ["", f"Continuous batching: {flow['requests']} requests x ({flow['prompt_len']} prompt + "
                  f"{flow['output_len']} generated) tokens through {flow['max_num_seqs']} sequences, prefill chunks "
                  "mixed with decodes (the LoRA engine's rows in the order they ran):", "",
                  "| workload | tokens/s | vs base engine |", "| --- | ---: | ---: |"]
        lines += [f"| {r['scenario']} | {r['tokens_per_s']:.1f} | {cell(r['tokens_vs_base'], '{:.3f}x')} |"
                  for r in flow["runs"]]
    if result.get("interleaved"):
        summary = result["interleaved"]["summary"]
        lines += ["", f"Base and adapter runs in turn on the LoRA engine, {len(result['interleaved']['rounds'])} "
                  "rounds: median (min-max) of each run against its own round's base run", "",
                  "| workload | decode step vs base | tokens/s vs base |", "| --- | ---: | ---: |"]
        for label, cells in summary.items():
            specs = ("{:.2f}", "{:.0f}") if label == "base" else ("{:.3f}", "{:.3f}")
            units = (" ms", " tok/s") if label == "base" else ("x", "x")
            lines.append(f"| {label} | " + " | ".join(
                f"{spec.format(s['median'])}{unit} ({spec.format(s['min'])}-{spec.format(s['max'])})"
                for spec, unit, s in zip(specs, units, cells.values())) + " |")
    extra = [f"prefill {result['prefill_tokens_per_s']:.0f} tokens/s" if result.get("prefill_tokens_per_s") else None,
             *(f"time to first token, {k}: {v:.1f} ms" for k, v in result.get("ttft_ms", {}).items()),
             *(f"engine start ({result['model']}, LoRA disabled): {v:.1f} s" for v in
               [result["startup"].get("base_engine", {}).get("engine_s")] if v)]
    lines += ["", *(f"- {line}" for line in extra if line)]
    return "\n".join(lines) + "\n"


def compare_markdown(result: dict) -> str:
    lines = [f"{result['model']} ({result['dtype']}), {result['mode']}; {result['num_requests']} requests x "
             f"({result['prompt_len']} prompt + {result['output_len']} generated) tokens; adapters of rank "
             f"{result['lora_rank']} on all seven projections", "",
             "| scenario | tokens/s | decode step (ms) | floor per rank (ms) | step / floor |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['scenario']} | {r['tokens_per_s']:.1f} | {cell(r['decode_step_ms'])} | {cell(r.get('floor_ms'))} | "
              f"{cell(r.get('vs_floor'), '{:.2f}x')} |" for r in result["runs"]]
    targets = result["targets"]
    lines += ["", *(f"- decode step {k}: {cell(v, '{:.3f}x')}" for k, v in targets["step_ratio"].items()),
              *(f"- LoRA's extra step cost, {k}: {cell(v, '{:.1f}%')}" for k, v in targets["lora_extra_cost_percent"].items()),
              *(f"- {label} (rank 0): weights {m['weight_bytes'] / 2**30:.2f} GiB, {m['kv_blocks']} KV-cache blocks"
                for label, m in result.get("memory", {}).items())]
    return "\n".join(lines) + "\n"


def plot(document: dict, path: Path) -> None:
    """Tokens/s of each scenario against the base engine's, batch and flow, as bars."""
    import matplotlib.pyplot as plt

    result = document["result"]
    rows = [(r["scenario"] + (f", r{r['rank']}" if r["rank"] else ""), r["tokens_vs_base"])
            for r in result["runs"][1:] if r.get("tokens_vs_base")]
    rows += [("flow: " + r["scenario"], r["tokens_vs_base"]) for r in result.get("flow", {}).get("runs", [])[1:]]
    figure, axes = plt.subplots(figsize=(8, 0.3 * len(rows) + 1.2))
    axes.barh([label for label, _ in rows][::-1], [value for _, value in rows][::-1])
    axes.axvline(1.0, color="k", lw=0.8)
    axes.set(xlabel="tokens/s against the base engine", title=f"{document['device']}: {result['model']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


#: JSON stem -> (heading, renderer, the command that measures it), for benchmarks/report.py
SECTIONS = {"throughput": ("One GPU", markdown, "PYTHONPATH=. python benchmarks/throughput.py"),
            "throughput_flow": ("Continuous batching", markdown,
                                "PYTHONPATH=. python benchmarks/throughput.py --adapters 1 --flow-requests 512"),
            "throughput_tp": ("Tensor parallelism", compare_markdown, "PYTHONPATH=. python benchmarks/throughput.py -tp 2"),
            "throughput_fp8": ("FP8 base model", compare_markdown, "PYTHONPATH=. python benchmarks/throughput.py -q fp8")}

if __name__ == "__main__":
    main()

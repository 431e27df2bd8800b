"""Offline throughput of the engine: base model, 1, 8 and 32 distinct adapters, and PEFT's own
mixed-batch generation on the same prompts (issue 6).

    PYTHONPATH=. python benchmarks/throughput.py                       # CPU: the embedded model
    PYTHONPATH=. python benchmarks/throughput.py --model llama-3.1-8b --load-format dummy   # GPU

Every request has the same random prompt length and generates exactly ``--output-len`` tokens
(``ignore_eos``), all submitted at once (``max_num_seqs`` = the number of requests, so every
decode step holds the whole batch). Adapters are random, on every attention and MLP projection,
and are loaded before the clock starts (one warm-up request each), so the numbers are the steady
state. Per scenario: tokens/s over the whole run, and the median time of the decode steps that
hold the full batch. Against the base model: the extra step time per scenario and, on CUDA, the
time to read those adapters' weights once at the device-copy bandwidth measured in this run.
PEFT: ``generate(adapter_names=...)`` on the same prompts, step time from two runs of different
lengths. Writes JSON and a markdown table, both naming the device.

On CUDA the engines replay CUDA graphs for decode steps (``--enforce-eager`` turns them off).
``--quick``: rank 16 only, 32 generated tokens, no PEFT (a smoke run before the full one).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loramux import LoRARequest, SamplingParams  # noqa: E402
from loramux.engine.llm_engine import LLMEngine  # noqa: E402
from loramux.engine.model_loader import load_model  # noqa: E402
from loramux.registry import LoRAAdapter, LoRAModuleWeights  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read + write), the HBM ceiling."""
    if device.type != "cuda":
        return None
    src = torch.empty(2**30 // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.nbytes / min(times)


def random_adapter(model, name: str, rank: int, seed: int) -> LoRAAdapter:
    """A random LoRA of ``rank`` on every projection, in the model's dtype and device."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    modules = {}
    for module_name, module in model.named_modules():
        if module_name.rsplit(".", 1)[-1] in PROJECTIONS and isinstance(module, torch.nn.Linear):
            like = dict(device=device, dtype=module.weight.dtype, generator=generator)
            a = torch.randn(rank, module.in_features, **like) / module.in_features**0.5
            b = torch.randn(module.out_features, rank, **like) * 0.01
            modules[module_name] = LoRAModuleWeights(a, b, 2.0)
    return LoRAAdapter(name=name, path=Path("."), modules=modules, lora_alpha=2 * rank, target_modules=list(PROJECTIONS))


class StepTimer:
    """Wraps the engine's model runner: wall time of every forward, and the batch it held."""

    def __init__(self, engine: LLMEngine) -> None:
        self.records: list[tuple[int, int, float]] = []  # (sequences, tokens, seconds)
        run = engine.runner.run

        def timed(batch, slot_of):
            t0 = time.perf_counter()
            out = run(batch, slot_of)  # returns after the sampled tokens reach the host
            self.records.append((len(batch), batch.num_tokens, time.perf_counter() - t0))
            return out

        engine.runner.run = timed


def run_workload(engine: LLMEngine, prompts, loras, output_len: int) -> dict:
    graph_steps = engine.runner.graph_steps
    timer = StepTimer(engine)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"w{i}", {"prompt_token_ids": prompt}, params, lora)
    sync(engine.setup.device)
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - t0
    full = [t for seqs, n, t in timer.records if seqs == len(prompts) and n == len(prompts)]
    return {
        "requests": len(prompts),
        "generated_tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "decode_step_ms": 1e3 * statistics.median(full) if full else None,
        "decode_steps_timed": len(full),
        "graph_steps": engine.runner.graph_steps - graph_steps,
    }


def warm_up(engine: LLMEngine, loras, vocab: int) -> None:
    """Compile kernels and put every adapter in the CPU tier (and a GPU slot) before timing."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i, lora in enumerate(dict.fromkeys(loras)):
        engine.add_request(f"warm{i}", {"prompt_token_ids": [1 + i % (vocab - 1)] * 4}, params, lora)
    while engine.has_unfinished_requests():
        engine.step()


def lora_engine_runs(args, model, prompts, rank: int, record) -> None:
    """Base, then 1 / 8 / 32 adapters through one LoRA engine; ``record(run, adapters_used)`` each."""
    most = max(args.adapters)
    # built from the model before the engine wraps its layers
    adapters = [random_adapter(model, f"r{rank}-{i}", rank, seed=1000 * rank + i) for i in range(most)]
    engine = LLMEngine(
        model, enable_lora=True, max_loras=most, max_lora_rank=rank, max_cpu_loras=most,
        max_num_seqs=len(prompts), max_model_len=args.prompt_len + args.output_len + 8,
        max_num_batched_tokens=max(args.max_num_batched_tokens, len(prompts)), enforce_eager=args.enforce_eager,
    )
    for adapter in adapters:  # built on the device already: bound as they are, not pinned
        engine.registry.bind(adapter)
    requests = [LoRARequest(a.name, i + 1) for i, a in enumerate(adapters)]
    warm_up(engine, [None] + requests, model.config.get_text_config().vocab_size)
    for n in [0, *args.adapters]:
        loras = [requests[i % n] if n else None for i in range(len(prompts))]
        scenario = "base via LoRA engine" if n == 0 else f"{n} adapter{'s' if n > 1 else ''}"
        run = {"scenario": scenario, "rank": rank, "adapters": n, **run_workload(engine, prompts, loras, args.output_len)}
        record(run, adapters[:n])
        print(f"  rank {rank}, {scenario}: {run['tokens_per_s']:.1f} tok/s, step {run['decode_step_ms']} ms", flush=True)
    engine.close()


@torch.inference_mode()
def peft_runs(args, model, prompts, rank: int, n: int, device) -> dict:
    """PEFT's mixed batch: ``generate(adapter_names=...)`` with ``n`` random adapters."""
    from peft import LoraConfig, get_peft_model

    config = dict(r=rank, lora_alpha=2 * rank, target_modules=list(PROJECTIONS), init_lora_weights=False)
    # adapters in the model dtype, as loramux keeps them (PEFT would upcast them to float32)
    peft_model = get_peft_model(model, LoraConfig(**config), adapter_name="p0", autocast_adapter_dtype=False)
    for i in range(1, n):
        peft_model.add_adapter(f"p{i}", LoraConfig(**config))
    peft_model.to(device).eval()
    names = [f"p{i % n}" for i in range(len(prompts))]
    input_ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(input_ids)

    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):  # called once per generated token: timestamps the steps
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            sync(device)
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def generate(new_tokens: int) -> tuple[float, list[float]]:
        clock = StepClock()
        sync(device)
        t0 = time.perf_counter()
        peft_model.generate(input_ids=input_ids, attention_mask=mask, adapter_names=names, do_sample=False,
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            stopping_criteria=StoppingCriteriaList([clock]))
        sync(device)
        steps = [b - a for a, b in zip(clock.times, clock.times[1:])]  # decode steps (the first is the prefill)
        return time.perf_counter() - t0, steps

    generate(2)  # warm-up
    seconds, steps = generate(args.peft_tokens)
    return {"scenario": f"PEFT mixed batch, {n} adapters", "rank": rank, "adapters": n, "requests": len(prompts),
            "generated_tokens": len(prompts) * args.peft_tokens, "seconds": seconds,
            "tokens_per_s": len(prompts) * args.peft_tokens / seconds,
            "decode_step_ms": 1e3 * statistics.median(steps), "decode_steps_timed": len(steps)}


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b" if cuda else None, help="default: 8B dummy on CUDA, the embedded model on CPU")
    parser.add_argument("--load-format", default="dummy" if cuda else "auto")
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    parser.add_argument("--num-requests", type=int, default=64 if cuda else 16)
    parser.add_argument("--prompt-len", type=int, default=128 if cuda else 32)
    parser.add_argument("--output-len", type=int, default=128 if cuda else 16)
    parser.add_argument("--adapters", default="1,8,32", help="distinct adapters per scenario")
    parser.add_argument("--ranks", default="16,64")
    parser.add_argument("--peft-adapters", type=int, default=32)
    parser.add_argument("--peft-tokens", type=int, default=16 if cuda else 6)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192 if cuda else 1024)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    parser.add_argument("--quick", action="store_true", help="rank 16 only, 32 generated tokens, no PEFT")
    parser.add_argument("--json", type=Path, default=Path("throughput.json"))
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.output_len, args.peft_adapters = "16", min(args.output_len, 32), 0
    args.adapters = [int(x) for x in args.adapters.split(",")]
    ranks = [int(x) for x in args.ranks.split(",")]
    device = torch.device("cuda" if cuda else "cpu")

    def fresh_model():
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        return load_model(args.model, dtype=args.dtype, device=device, load_format=args.load_format)[0]

    model = fresh_model()
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (args.num_requests, args.prompt_len), generator=generator).tolist()
    result = {
        "device": device_name(device), "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "load_format": args.load_format, "dtype": args.dtype, "torch": torch.__version__,
        "num_requests": args.num_requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "cuda_graphs": cuda and not args.enforce_eager,
        "copy_bandwidth_GBps": None, "model_bytes": sum(p.nbytes for p in model.parameters()), "runs": [],
    }
    bandwidth = copy_bandwidth(device)
    result["copy_bandwidth_GBps"] = bandwidth and bandwidth / 1e9
    print(f"{result['device']}: {result['model']} ({args.dtype})", flush=True)

    base = LLMEngine(model, enable_lora=False, max_num_seqs=args.num_requests,
                     max_model_len=args.prompt_len + args.output_len + 8,
                     max_num_batched_tokens=max(args.max_num_batched_tokens, args.num_requests),
                     enforce_eager=args.enforce_eager)
    warm_up(base, [None], vocab)
    if cuda:  # one untimed pass: first-use costs (kernel selection per shape, allocator growth)
        run_workload(base, prompts, [None] * len(prompts), args.output_len)
    base_run = {"scenario": "base (LoRA disabled)", "rank": 0, "adapters": 0,
                **run_workload(base, prompts, [None] * len(prompts), args.output_len)}
    result["runs"].append(base_run)
    save(args, result)
    print(f"  base: {base_run['tokens_per_s']:.1f} tok/s, step {base_run['decode_step_ms']} ms", flush=True)
    base.close()
    del base

    def record(run: dict, used: list[LoRAAdapter]) -> None:
        run["adapter_bytes"] = sum(a.nbytes for a in used)
        if base_run["decode_step_ms"] and run["decode_step_ms"]:
            run["extra_step_ms"] = run["decode_step_ms"] - base_run["decode_step_ms"]
            run["step_vs_base"] = run["decode_step_ms"] / base_run["decode_step_ms"]
        if bandwidth and used and "extra_step_ms" in run:
            run["adapter_read_ms"] = 1e3 * run["adapter_bytes"] / bandwidth
            run["extra_vs_read"] = run["extra_step_ms"] / run["adapter_read_ms"]
        result["runs"].append(run)
        save(args, result)

    # PEFT right after the first rank, so a failure in a later stage keeps its comparison
    stages = ranks[:1] + (["peft"] if args.peft_adapters else []) + ranks[1:]
    for index, stage in enumerate(stages):
        if index:
            del model
            model = fresh_model()
        if stage == "peft":
            peft = peft_runs(args, model, prompts, ranks[0], args.peft_adapters, device)
            ours = next((r for r in result["runs"] if r["rank"] == ranks[0] and r["adapters"] == args.peft_adapters), None)
            if ours:
                peft["loramux_speedup_step"] = peft["decode_step_ms"] / ours["decode_step_ms"]
                peft["loramux_speedup_tokens_per_s"] = ours["tokens_per_s"] / peft["tokens_per_s"]
            result["runs"].append(peft)
            save(args, result)
            print(f"  PEFT: {peft['tokens_per_s']:.1f} tok/s, step {peft['decode_step_ms']:.1f} ms", flush=True)
            continue

        lora_engine_runs(args, model, prompts, stage, record)
    print(save(args, result))


def save(args, result: dict) -> str:
    """Write what has been measured so far (a later failure keeps the earlier numbers)."""
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    if args.markdown:
        args.markdown.write_text(table)
    return table


def markdown(result: dict) -> str:
    bw = result["copy_bandwidth_GBps"]
    lines = [
        f"**{result['device']}**, {result['model']} ({result['dtype']}, torch {result['torch']}); "
        f"{result['num_requests']} requests x ({result['prompt_len']} prompt + {result['output_len']} generated) tokens"
        + ("; decode steps in CUDA graphs" if result.get("cuda_graphs") else "; eager")
        + (f"; measured copy bandwidth {bw:.0f} GB/s" if bw else ""),
        "",
        "| scenario | rank | tokens/s | decode step (ms) | vs base | extra (ms) | adapters' read time (ms) | extra / read |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    fmt = lambda v, f="{:.2f}": "" if v is None else f.format(v)  # noqa: E731
    for r in result["runs"]:
        lines.append(
            f"| {r['scenario']} | {r['rank'] or ''} | {r['tokens_per_s']:.1f} | {fmt(r['decode_step_ms'])} | "
            f"{fmt(r.get('step_vs_base'), '{:.3f}x')} | {fmt(r.get('extra_step_ms'))} | "
            f"{fmt(r.get('adapter_read_ms'))} | {fmt(r.get('extra_vs_read'))} |"
        )
    peft = next((r for r in result["runs"] if r["scenario"].startswith("PEFT")), None)
    if peft and "loramux_speedup_step" in peft:
        lines += ["", f"loramux vs PEFT's mixed batch at {peft['adapters']} adapters (rank {peft['rank']}): "
                  f"{peft['loramux_speedup_step']:.1f}x faster per decode step, "
                  f"{peft['loramux_speedup_tokens_per_s']:.1f}x the tokens/s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

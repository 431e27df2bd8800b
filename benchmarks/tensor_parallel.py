"""Tensor parallelism (issue 15): decode step and tokens/s at TP=1 and TP=N, with 0, 1 and 32 adapters.

Run through ``throughput.py`` on a host with N GPUs (``nvidia-h200-x2`` for N=2):

    PYTHONPATH=. python benchmarks/throughput.py --tensor-parallel-size 2 \\
        --model llama-3.1-8b --load-format dummy --num-requests 64 --json tp.json --markdown tp.md

For each TP size, one engine (random weights from the config; at TP=N each rank builds only its
share, so a 70B shape fits where the whole model would not) serves the same batch three ways: base requests through the LoRA engine, every request on
one adapter, and the requests spread over 32 adapters (rank ``--ranks``' first, all seven
projections, random, bound in memory and warmed into slots before the clock starts). Reported per
run: tokens/s, the median decode step holding the whole batch, and its floor: the bytes one rank
reads (its shard of the projections, the replicated embeddings and ``lm_head``, its part of the
adapters and of the KV) over the copy bandwidth measured on GPU 0. Then the issue's two targets:
TP=N's step over TP=1's (target at most 0.6x for N=2 at batch 64), and LoRA's extra step cost in
percent at each TP size (target: no larger under TP=N than under TP=1).
"""

from __future__ import annotations

import gc
import json

import torch

from loramux import LoRARequest
from loramux.engine.kv_cache import kv_cache_geometry
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.model_loader import _dummy_config_and_tokenizer  # the config alone, no weights

ADAPTER_COUNTS = (0, 1, 32)


def per_rank_bytes(config, dtype: torch.dtype, tp: int, adapter_bytes: int) -> int:
    """Bytes of weights and adapters one rank reads per decode step (the KV is added per run)."""
    from throughput import projection_shapes  # benchmarks/ is on sys.path when run from there

    c = config.get_text_config()
    projections = sum(i * o for i, o in projection_shapes(config).values()) * c.num_hidden_layers
    embeddings = c.vocab_size * c.hidden_size * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    return (projections // tp + embeddings) * dtype.itemsize + adapter_bytes // tp


def run(args) -> dict:
    """Measure TP=1 and TP=``args.tensor_parallel_size``; returns (and saves) the result."""
    from throughput import ALL_SEVEN, copy_bandwidth, device_name, engine_options, random_adapter, run_workload, warm_up

    sizes = sorted({1, args.tensor_parallel_size})
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    bandwidth = copy_bandwidth(device)
    gc.collect()
    torch.cuda.empty_cache() if cuda else None
    config, _ = _dummy_config_and_tokenizer(args.model)
    dtype = getattr(torch, args.dtype)
    rank = args.ranks[0]
    vocab = config.get_text_config().vocab_size
    prompts = torch.randint(1, vocab, (args.num_requests, args.prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()
    layers, kv_heads, head_dim = kv_cache_geometry(config)
    result = {"device": f"{sizes[-1]} x {device_name(device)}",
              "model": args.model, "dtype": args.dtype, "torch": torch.__version__,
              "num_requests": args.num_requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
              "mode": "eager" if args.enforce_eager or not cuda else "compiled + graphs",
              "copy_bandwidth_GBps": bandwidth and bandwidth / 1e9, "lora_rank": rank, "runs": []}
    adapters = [random_adapter(config, f"tp-{i}", rank, ALL_SEVEN, 1000 + i, "cpu", dtype)
                for i in range(max(ADAPTER_COUNTS))]
    for tp in sizes:
        engine = LLMEngine(args.model, load_format=args.load_format, dtype=args.dtype, tensor_parallel_size=tp,
                           enable_lora=True, max_loras=max(ADAPTER_COUNTS), max_lora_rank=rank,
                           max_cpu_loras=max(ADAPTER_COUNTS) + 1, **engine_options(args))
        requests = []
        for i, adapter in enumerate(adapters):
            engine.registry.bind(adapter)
            requests.append(LoRARequest(adapter.name, i + 1))
        warm_up(engine, [None], vocab)
        run_workload(engine, prompts, [None] * len(prompts), min(args.output_len, 16))  # first-use costs
        for n in ADAPTER_COUNTS:
            loras = [requests[i % n] if n else None for i in range(len(prompts))]
            if n:
                warm_up(engine, requests[:n], vocab)
            run = {"scenario": f"TP={tp}, {n} adapter{'s' if n != 1 else ''}", "tp": tp, "adapters": n,
                   **run_workload(engine, prompts, loras, args.output_len)}
            if bandwidth and run.get("decode_step_ms"):
                kv = run["decode_kv_tokens"] * 2 * layers * (kv_heads // tp) * head_dim * dtype.itemsize
                used = sum(a.nbytes for a in adapters[:n])
                run["floor_ms"] = 1e3 * (per_rank_bytes(config, dtype, tp, used) + kv) / bandwidth
                run["vs_floor"] = run["decode_step_ms"] / run["floor_ms"]
            result["runs"].append(run)
            print(f"  {run['scenario']}: {run['tokens_per_s']:.1f} tok/s, step {run.get('decode_step_ms') or 0:.2f} ms",
                  flush=True)
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache() if cuda else None
    result["targets"] = targets(result["runs"], sizes)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    if args.markdown:
        args.markdown.write_text(table)
    print(table)
    return result


def targets(runs: list[dict], sizes: list[int]) -> dict:
    """TP=N's decode step over TP=1's, per adapter count, and LoRA's extra cost (%) per TP size."""
    step = {(r["tp"], r["adapters"]): r.get("decode_step_ms") for r in runs}
    out: dict = {"step_ratio": {}, "lora_extra_cost_percent": {}}
    top = sizes[-1]
    for n in ADAPTER_COUNTS:
        if step.get((1, n)) and step.get((top, n)):
            out["step_ratio"][f"TP={top}/TP=1, {n} adapters"] = step[(top, n)] / step[(1, n)]
    for tp in sizes:
        for n in ADAPTER_COUNTS[1:]:
            if step.get((tp, 0)) and step.get((tp, n)):
                out["lora_extra_cost_percent"][f"TP={tp}, {n} adapters"] = 100 * (step[(tp, n)] / step[(tp, 0)] - 1)
    return out


def markdown(result: dict) -> str:
    fmt = lambda v, f="{:.2f}": "" if v is None else f.format(v)  # noqa: E731
    lines = [
        f"**{result['device']}**, {result['model']} ({result['dtype']}, torch {result['torch']}), {result['mode']}; "
        f"{result['num_requests']} requests x ({result['prompt_len']} prompt + {result['output_len']} generated) "
        f"tokens; adapters of rank {result['lora_rank']} on all seven projections",
        "",
        "| scenario | tokens/s | decode step (ms) | floor per rank (ms) | step / floor |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in result["runs"]:
        lines.append(f"| {r['scenario']} | {r['tokens_per_s']:.1f} | {fmt(r.get('decode_step_ms'))} | "
                     f"{fmt(r.get('floor_ms'))} | {fmt(r.get('vs_floor'), '{:.2f}x')} |")
    lines += ["", "```", json.dumps(result["targets"], indent=1), "```"]
    return "\n".join(lines) + "\n"

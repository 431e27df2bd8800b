"""Where the time to a first token goes, step by step (issues 10 and 13).

One 128-token request at a time on an engine whose GPU slots are all taken, for: the base model;
an adapter resident in its slot; an adapter in host memory (read from its files into the CPU
tier, page-locked, by ``add_lora``) that must take a slot, evicting one; and a cold adapter (its
files out of the page cache). The scenarios run in turn, ``--repeats`` times. Per request: the
time to its first token, ``add_request``'s own time, and for each step its wall time, the batch
its forward ran and the milliseconds of each step phase (collect, prefetch, schedule, forward,
receive) and of the GPU tier's parts (placement check, eviction, slot write), timed as
benchmarks/adapter_trace.py times a trace's steps. ``--profile`` adds a torch profile (CPU and
CUDA) of one more host-memory adapter's first token.

    PYTHONPATH=. python benchmarks/first_token.py                        # GPU: Llama-3.1-8B shapes
    PYTHONPATH=. python benchmarks/first_token.py --rank 8 --targets q/v --tag h100_qv8

Writes ``first_token_<tag>.json`` and ``.md`` under ``--out`` (default docs/benchmarks).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    device_name,
    drop_from_page_cache,
    random_adapter,
    save_peft_files,
    save_report,
)
from benchmarks.adapter_trace import TARGET_SETS, _phases_timed  # noqa: E402
from loramux import LoRARequest, SamplingParams  # noqa: E402
from loramux.engine.llm_engine import LLMEngine  # noqa: E402
from loramux.engine.model_loader import load_model  # noqa: E402

SCENARIOS = ("base", "resident adapter", "adapter in host memory", "cold adapter")


def first_token(engine: LLMEngine, prompt_len: int, lora: LoRARequest | None) -> dict:
    """One request's time to its first token (ms), ``add_request``'s own, and its steps' parts."""
    vocab = engine.vocab_size
    prompt = torch.randint(1, vocab, (prompt_len,), generator=torch.Generator().manual_seed(time.monotonic_ns()))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    steps = []
    with _phases_timed(engine, True) as spent:
        added = time.perf_counter()
        engine.add_request(f"t{time.monotonic_ns()}", {"prompt_token_ids": prompt.tolist()}, params, lora)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            spent.clear()
            engine.runner.last_step = None
            began = time.perf_counter()
            outputs = engine.step()
            shape = engine.runner.last_step
            steps.append({"ms": 1e3 * (time.perf_counter() - began),
                          "tokens": None if shape is None else shape.padded_tokens,
                          "graph": None if shape is None else shape.graph,
                          **{name: 1e3 * seconds for name, seconds in spent.items()}})
            if any(out.outputs[0].token_ids for out in outputs):
                break
        ttft = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return {"ttft_ms": 1e3 * ttft, "add_request_ms": 1e3 * (start - added), "steps": steps}


def run(args) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model, dtype=args.dtype, device=device, load_format=args.load_format)[0]
    config = model.config
    targets = TARGET_SETS[args.targets]
    engine = LLMEngine(model, enable_lora=True, max_loras=args.slots, max_lora_rank=args.rank,
                       max_cpu_loras=args.slots + 2 * args.repeats + 2, max_num_seqs=16,
                       max_model_len=args.prompt_len + 16, max_num_batched_tokens=max(1024, args.prompt_len))
    ids = iter(range(1, 1 << 30))

    def adapter_files(name: str, seed: int) -> Path:
        adapter = random_adapter(config, name, args.rank, targets, seed, "cpu", dtype)
        return save_peft_files(adapter, args.rank, Path(tmp) / name)

    with tempfile.TemporaryDirectory() as tmp:
        # the slots' adapters, made on the device and bound as they are: they only fill the slots
        resident = []
        for i in range(args.slots):
            adapter = random_adapter(config, f"slot{i}", args.rank, targets, 1000 + i, device, dtype)
            engine.registry.bind(adapter)
            resident.append(LoRARequest(adapter.name, next(ids)))
        host, cold = [], []
        for rep in range(args.repeats + 1):  # one more of each for the warm-up
            request = LoRARequest(f"host{rep}", next(ids), str(adapter_files(f"host{rep}", 5000 + rep)))
            engine.add_lora(request)  # read into the CPU tier: page-locked host memory, no slot
            host.append(LoRARequest(request.lora_name, request.lora_int_id))
            cold.append(LoRARequest(f"cold{rep}", next(ids), str(adapter_files(f"cold{rep}", 7000 + rep))))
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for i, lora in enumerate([None, *resident]):  # every slot taken, each path's first-use costs paid
            engine.add_request(f"fill{i}", {"prompt_token_ids": [1 + i % 100] * 4}, params, lora)
        while engine.has_unfinished_requests():
            engine.step()
        runs: dict[str, list[dict]] = {name: [] for name in SCENARIOS}
        for rep in range(args.repeats + 1):
            drop_from_page_cache(*Path(cold[rep].lora_path).iterdir())
            requests = dict(zip(SCENARIOS, (None, resident[-1], host[rep], cold[rep])))
            for name, lora in requests.items():
                result = first_token(engine, args.prompt_len, lora)
                if rep:  # the first round is the warm-up
                    runs[name].append(result)
            if rep:
                print(f"round {rep}: " + ", ".join(f"{name} {runs[name][-1]['ttft_ms']:.1f} ms" for name in SCENARIOS),
                      flush=True)
        report = {"device": device_name(device), "model": args.model or "SmolLM2-135M-Instruct (embedded)",
                  "dtype": args.dtype, "torch": torch.__version__, "rank": args.rank, "targets": args.targets,
                  "slots": args.slots, "prompt_len": args.prompt_len,
                  "adapter_bytes": sum(w.nbytes for w in engine.registry.cache.get(
                      engine.lora_handle(host[-1].lora_name).id).modules.values()),
                  "ttft_ms_median": {name: statistics.median(r["ttft_ms"] for r in results)
                                     for name, results in runs.items()},
                  "runs": runs}
        if args.profile and cuda:
            report["profile"] = profile_one(engine, args, adapter_files("profiled", 9999), next(ids))
    return report


def profile_one(engine: LLMEngine, args, path: Path, lora_id: int) -> dict:
    """A torch profile of one host-memory adapter's first token: the ops with the most CPU time
    and the most CUDA time (tables in the report)."""
    from torch.profiler import ProfilerActivity, profile

    engine.add_lora(LoRARequest("profiled", lora_id, str(path)))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = first_token(engine, args.prompt_len, LoRARequest("profiled", lora_id))
    averages = prof.key_averages()
    return {"run": result, "cpu_table": averages.table(sort_by="self_cpu_time_total", row_limit=25),
            "cuda_table": averages.table(sort_by="self_cuda_time_total", row_limit=25)}


def phase_medians(results: list[dict]) -> str:
    """The median milliseconds of each step part, over the requests, summed over each one's steps."""
    names = sorted({name for r in results for step in r["steps"] for name in step} - {"ms", "tokens", "graph"})
    return ", ".join(f"{name} {statistics.median(sum(s.get(name, 0.0) for s in r['steps']) for r in results):.2f}"
                     for name in names)


def markdown(report: dict) -> str:
    lines = [f"**{report['device']}**, {report['model']} ({report['dtype']}); adapters of rank {report['rank']} on "
             f"{report['targets']} ({report['adapter_bytes'] / 1e6:.1f} MB), {report['slots']} GPU slots all taken; one "
             f"{report['prompt_len']}-token request at a time, medians over {len(report['runs']['base'])} rounds.", "",
             "| scenario | TTFT (ms) | steps | step parts, ms (median over the requests, summed over their steps) |",
             "| --- | ---: | ---: | --- |"]
    for name, results in report["runs"].items():
        steps = statistics.median(len(r["steps"]) for r in results)
        lines.append(f"| {name} | {report['ttft_ms_median'][name]:.2f} | {steps:.0f} | {phase_medians(results)} |")
    if "profile" in report:
        lines += ["", "Profile of one host-memory adapter's first token (CPU, then CUDA):", "", "```",
                  report["profile"]["cpu_table"], report["profile"]["cuda_table"], "```"]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b" if cuda else None)
    parser.add_argument("--load-format", default="dummy" if cuda else "auto")
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", choices=sorted(TARGET_SETS), default="all 7")
    parser.add_argument("--slots", type=int, default=32 if cuda else 4)
    parser.add_argument("--repeats", type=int, default=5 if cuda else 2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="a torch profile of one more host-memory adapter")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--tag", default="gpu" if cuda else "cpu", help="file names: first_token_<tag>.json/.md")
    args = parser.parse_args(argv)
    for option in ("rank", "repeats", "prompt_len"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} {getattr(args, option)}: must be >= 1")
    if args.slots < 3:  # a round places two adapters, each evicting the least recently used
        parser.error(f"--slots {args.slots}: must be >= 3 (the resident adapter, and room to place two more)")
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    report = run(args)
    return save_report(args.out, f"first_token_{args.tag}", report, markdown(report))


if __name__ == "__main__":
    main()

"""The host's share of an engine step in the many-adapters trace: the GPU's step replaced by a
fixed sleep, so that only host time differs between N = 4 and N = 1,000 adapters.

The engine is the real one (scheduler, loader threads, CPU tier, pooled GPU tier, step-graph
inputs, and the process settings the engine makes on CUDA: `prepare_process_for_serving`) on
Llama-3.1-8B's layout at tiny widths (`slot_churn.TINY_8B_LAYOUT`), 256 slots sharing rows by
rank as `many_adapters.py` runs them on CUDA. The forward is not run: each step builds a
graph step's host inputs and samples a fixed token, and the GPU is a clock: a step's work takes
``--gpu-ms`` from when the work before it ends, and reading its tokens back sleeps until then
(releasing the GIL, as a wait on the GPU does), so async scheduling hides host work as it does
on a GPU. Reported per N: the mean step, its host share the GPU does not hide (the step less
``--gpu-ms``), and the host time per step and per call of the parts that grow with N (GPU-tier
placements and clears, prefetch, scheduling).

    python benchmarks/trace_host.py [--gpu-ms 12] [--adapters 4,1000] [--preload]
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

from benchmarks.adapter_trace import make_trace, run_trace, summarize, summarize_steps, write_adapter_files  # noqa: E402
from benchmarks.slot_churn import MAX_RANK, TINY_8B_LAYOUT  # noqa: E402


def build_engine(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    from loramux.engine.cuda_graphs import StepGraphs, graph_token_sizes
    from loramux.engine.llm_engine import LLMEngine
    from loramux.engine.model_runner import LaunchedStep, StepShape
    from loramux.engine.sampler import SamplerOutput

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_8B_LAYOUT)).eval()
    engine = LLMEngine(model, max_loras=args.slots, max_lora_rank=MAX_RANK, max_cpu_loras=args.slots,
                       max_gpu_lora_bytes=args.gpu_lora_mb << 20, max_num_seqs=64, max_model_len=256,
                       max_num_batched_tokens=4096, num_gpu_blocks_override=4096)
    runner = engine.runner
    graphs = StepGraphs(runner, graph_token_sizes(64, 512))

    gpu = {"free_at": 0.0}  # when the GPU's queued work ends

    class ClockedStep(LaunchedStep):
        def token_ids(self) -> list[int]:
            time.sleep(max(0.0, self.done_at - time.perf_counter()))
            return super().token_ids()

    def run(batch):  # a graph step's host work; its GPU work ends --gpu-ms after the work before it
        sampled = [seq for seq, n in batch.chunks if seq.num_computed + n == seq.num_tokens]
        if graphs.fits(batch):
            inputs = graphs.step_inputs(batch.chunks)
            runner.to_device(inputs.host_fields)
            if inputs.active_slots:
                runner.lora_manager.mark_used(inputs.active_slots)
        runner.last_step = StepShape(len(batch), batch.num_tokens, 0, batch.num_tokens, graph=True)
        gpu["free_at"] = max(time.perf_counter(), gpu["free_at"]) + args.gpu_ms / 1e3
        step = ClockedStep(sampled, SamplerOutput(torch.full((len(sampled),), 7)) if sampled else None)
        step.done_at = gpu["free_at"]
        return step

    runner.run = run
    return engine


def timed(obj, name: str, key: str, spent: dict) -> None:
    """Wrap ``obj.name`` to add its wall time and calls to ``spent[key]``."""
    method = getattr(obj, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds, calls = spent.get(key, (0.0, 0))
            spent[key] = (seconds + time.perf_counter() - started, calls + 1)

    setattr(obj, name, wrapper)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-ms", type=float, default=12.0, help="the GPU's step, as a sleep")
    parser.add_argument("--adapters", default="4,1000", help="the N values")
    parser.add_argument("--requests", type=int, default=400, help="per N")
    parser.add_argument("--rate", type=float, default=56.0, help="arrivals per second")
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--gpu-lora-mb", type=int, default=240, help="the pool (240: ~7 rank rows a slot)")
    parser.add_argument("--preload", action="store_true", help="load every adapter into the CPU tier first")
    args = parser.parse_args(argv)
    from loramux.engine.serving_process import prepare_process_for_serving

    engine = build_engine(args)
    prepare_process_for_serving(freeze_gc=True)  # as the engine does on CUDA, whose host this is
    try:
        return run_traces(engine, args)
    finally:
        gc.unfreeze()  # a caller in this process (the tests) gets its collector back


def run_traces(engine, args) -> list[dict]:
    """Each N's trace through ``engine``: its step, host share and the timed parts."""
    spent: dict[str, tuple[float, int]] = {}
    manager, adapters = engine.lora_manager, engine.adapters
    for obj, name, key in ((manager, "_write_slot", "placements"), (manager, "_clear_slot", "clears"),
                           (adapters, "prefetch", "prefetch"), (engine.scheduler, "schedule", "schedule")):
        timed(obj, name, key, spent)
    from loramux import LoRARequest

    results = []
    with tempfile.TemporaryDirectory(prefix="trace-host-") as tmp:
        for index, n in enumerate(int(x) for x in args.adapters.split(",")):
            trace = make_trace(n, args.requests, rate=args.rate, prompt_len=128, vocab_size=512, seed=index,
                               name_prefix=f"n{n}-", first_id=1 + 100_000 * (index + 1))
            paths = write_adapter_files(trace.used_adapters(), engine.model.config, Path(tmp) / f"n{n}",
                                        torch.float32, workers=2)
            if args.preload:
                for a in trace.used_adapters():
                    engine.registry.get(LoRARequest(a.name, a.lora_int_id, str(paths[a.name])))
            spent.clear()
            steps = []
            summary = summarize(run_trace(engine, trace, paths, max_tokens=64, steps=steps))
            step_ms = summarize_steps(steps)["step_ms_mean"]
            parts = {key: {"ms_per_step": 1e3 * s / len(steps), "ms_per_call": 1e3 * s / calls, "calls": calls}
                     for key, (s, calls) in spent.items()}
            results.append({"adapters": n, "used": summary["adapters_used"], "failed": summary["failed"],
                            "steps": len(steps), "step_ms": step_ms, "host_ms": step_ms - args.gpu_ms,
                            "ttft_p50_ms": summary["ttft_p50_ms"], "parts": parts})
            print(f"N={n} ({summary['adapters_used']} used): step {step_ms:.2f} ms, host {step_ms - args.gpu_ms:.2f} ms; "
                  + ", ".join(f"{k} {p['ms_per_step']:.2f} ms/step ({p['calls']} x {p['ms_per_call']:.2f} ms)"
                              for k, p in parts.items()), flush=True)
    return results


if __name__ == "__main__":
    main()

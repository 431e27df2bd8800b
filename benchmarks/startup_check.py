"""Engine start-up, cold and second, each in a fresh process (issue 12: < 90 s cold, < 20 s second).

    PYTHONPATH=. python benchmarks/startup_check.py                      # 8B shapes, dummy weights, LoRA
    PYTHONPATH=. python benchmarks/startup_check.py --no-lora --model qwen2.5-7b

Two fresh processes start the same engine with the same cache dir (a new, empty one unless
``--cache-dir`` names one): the first compiles everything (cold), the second finds the compiled
graphs and kernels on disk. Each reports its stages: load (dummy weights), compile (the calls
that compiled a frame of the decoder layer), capture (decode graphs), warm-up (one step per
Triton launch configuration), the rest of the engine's start (profile run, KV cache), and the
frames dynamo compiled. Then each serves steps of several shapes (prefills of 1 to 1000 tokens,
decode batches, base and adapter rows mixed) and counts what compiled while serving: dynamo frames
and Triton kernels (Triton's ``jit_post_compile_hook``; a kernel read from the disk cache counts
too). Both should be 0. Prints a table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# prompt length x requests of the serving check: one token, short and long prefills, a full decode batch
SERVING_SHAPES = ((1, 1), (7, 1), (100, 3), (33, 17), (1000, 2), (130, 64))


def engine_stages(engine, engine_seconds: float) -> dict:
    """Where an engine's start went: compile, capture, warm-up, page-locking the CPU tier's arena,
    the rest (profile run, KV cache)."""
    runner = engine.runner
    parts = {"compile_s": runner.regions.compile_seconds if runner.regions else 0.0,
             "capture_s": runner.startup_seconds.get("capture", 0.0),
             "warmup_s": runner.startup_seconds.get("warmup", 0.0),
             "pinned_arena_wait_s": engine.setup.pinning.waited if engine.setup.pinning else 0.0}
    stages = {"engine_s": engine_seconds, **parts, "other_s": engine_seconds - sum(parts.values()),
              "pinned_arena_s": engine.setup.pinning.seconds if engine.setup.pinning else 0.0}  # on its thread
    return stages


@contextlib.contextmanager
def compiles_watched():
    """What compiled inside the block: dynamo frames and Triton kernels (built, or read from the
    disk cache), each a stall of the step that needed it. Yields a dict filled on exit."""
    import triton

    from loramux.engine.compilation import compiled_frames

    knobs = getattr(triton, "knobs", None)
    built: list[str] = []
    frames = compiled_frames()
    watched: dict = {}
    if knobs is not None:
        knobs.runtime.jit_post_compile_hook = lambda **kw: built.append(kw["repr"][:300])
    try:
        yield watched
    finally:
        if knobs is not None:
            knobs.runtime.jit_post_compile_hook = None
        watched.update(dynamo_frames=compiled_frames() - frames,
                       triton_kernels=len(built) if knobs is not None else None, kernels=built)


def child(args) -> dict:
    """One start in this process: its stages in seconds, then what compiled while serving."""
    import torch

    from benchmarks.throughput import ALL_SEVEN, random_adapter
    from loramux import LoRARequest, SamplingParams
    from loramux.engine.compilation import compiled_frames
    from loramux.engine.llm_engine import LLMEngine
    from loramux.engine.model_loader import load_model

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    model = load_model(args.model, dtype=args.dtype, device=device, load_format="dummy")[0]
    sync()
    t1 = time.perf_counter()
    options = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    if args.lora:
        options.update(enable_lora=True, max_loras=4, max_lora_rank=16)
    else:
        options.update(enable_lora=False)
    engine = LLMEngine(model, **options)
    sync()
    t2 = time.perf_counter()
    runner = engine.runner
    from torch._dynamo.utils import counters

    # second start: expect fxgraph_cache_hit and autograd_cache_hit, no misses
    caches = {k: v for group in ("inductor", "aot_autograd") for k, v in counters[group].items() if "cache" in k}
    result = {"stages": {"load_s": t1 - t0, **engine_stages(engine, t2 - t1)}, "total_s": t2 - t0,
              "graphs": runner.num_graphs, "layer_frames": runner.regions.frames if runner.regions else 0,
              "frames_at_start": compiled_frames(), "compile_caches": caches}

    # serving: count dynamo frames and Triton kernels built from here on
    with compiles_watched() as compiled:
        lora = None
        if args.lora:
            engine.registry.bind(random_adapter(model.config, "a", 16, ALL_SEVEN, 1, device, model.dtype))
            lora = LoRARequest("a", 1)
        vocab = model.config.get_text_config().vocab_size
        steps = []
        for length, n in SERVING_SHAPES:
            t = time.perf_counter()
            for i in range(n):
                prompt = [(3 + 7 * i + j) % vocab for j in range(length)]
                params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
                engine.add_request(f"{length}-{n}-{i}", {"prompt_token_ids": prompt}, params, lora if i % 2 else None)
            while engine.has_unfinished_requests():
                engine.step()
            steps.append({"requests": n, "prompt_len": length, "seconds": time.perf_counter() - t})
    result.update(serving=steps, frames_while_serving=compiled["dynamo_frames"],
                  triton_kernels_while_serving=compiled["triton_kernels"],
                  triton_kernels_built=sorted({kernel.split("[")[0] for kernel in compiled["kernels"]}))
    return result


def parent(args) -> dict:
    """Start the engine twice, each in a fresh process sharing one cache dir; their results."""
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="loramux-startup-"))
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(LORAMUX_CACHE_DIR=str(cache), PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    command = [sys.executable, __file__, "--child", "--model", args.model, "--dtype", args.dtype, "--device", args.device,
               "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)]
    command += [] if args.lora else ["--no-lora"]
    runs = {}
    for name in ("cold", "second"):
        print(f"{name} start (cache dir {cache}) ...", flush=True)
        started = time.perf_counter()
        out = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
        process_s = time.perf_counter() - started
        line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("RESULT ")), None)
        if line is None:
            print(out.stdout[-3000:], out.stderr[-6000:], sep="\n")
            raise SystemExit(f"the {name} start failed (exit {out.returncode})")
        runs[name] = {**json.loads(line[len("RESULT "):]), "process_s": process_s}
        print(f"  engine up in {runs[name]['total_s']:.1f} s", flush=True)
    import torch

    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    return {"device": device, "torch": torch.__version__, "model": args.model,
            "dtype": args.dtype, "lora": args.lora, "cache_dir": str(cache), **runs}


def table(result: dict) -> str:
    cold, second = result["cold"], result["second"]
    lines = [f"**{result['device']}**, {result['model']} ({result['dtype']}, dummy weights, torch {result['torch']}), "
             f"{'LoRA engine' if result['lora'] else 'LoRA disabled'}, {cold['graphs']} decode graphs",
             "", "| stage | cold (s) | second start (s) |", "| --- | ---: | ---: |"]
    for stage in ("load_s", "compile_s", "capture_s", "warmup_s", "pinned_arena_wait_s", "other_s", "engine_s",
                  "pinned_arena_s"):
        lines.append(f"| {stage[:-2]} | {cold['stages'][stage]:.1f} | {second['stages'][stage]:.1f} |")
    lines.append(f"| **load + engine** | **{cold['total_s']:.1f}** | **{second['total_s']:.1f}** |")
    lines.append(f"| whole process (imports, serving check) | {cold['process_s']:.1f} | {second['process_s']:.1f} |")
    lines += ["", "| | cold | second |", "| --- | ---: | ---: |"]
    for key in ("layer_frames", "frames_at_start", "frames_while_serving", "triton_kernels_while_serving"):
        lines.append(f"| {key.replace('_', ' ')} | {cold[key]} | {second[key]} |")
    lines.append(f"| compile cache (inductor, AOTAutograd) | {cold['compile_caches']} | {second['compile_caches']} |")
    built = sorted(set(cold["triton_kernels_built"]) | set(second["triton_kernels_built"]))
    if built:
        lines += ["", f"Triton kernels built while serving: {', '.join(built)}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b", help="a config name (loramux/data/configs) or path")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda", help="cuda (what this measures), or cpu (a smoke test: eager)")
    parser.add_argument("--no-lora", dest="lora", action="store_false", help="start the engine with LoRA disabled")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--cache-dir", default=None, help="compile cache dir (default: a new empty one: a cold start)")
    parser.add_argument("--json", type=Path, default=Path("startup.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    result = parent(args)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()

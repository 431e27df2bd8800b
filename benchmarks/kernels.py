"""Our multi-LoRA Triton kernels (shrink, expand) against the torch reference, a dense matmul with
one adapter's weights (the floor), and vLLM's Triton LoRA ops with their tuned launch configs, on
Llama-3-8B's layer shapes in bfloat16.

    python benchmarks/vllm_ops.py                                # once, needs PyPI: vLLM's ops
    PYTHONPATH=. python benchmarks/kernels.py                    # CUDA: every case
    PYTHONPATH=. python benchmarks/kernels.py --smoke --out /tmp  # CPU smoke: tiny shapes, Triton interpreter

Cases: the fused q/k/v, o, gate/up and down projections, ranks 16 and 64, 1 to 8,192 tokens, the
tokens spread over 1 or 32 adapters. Timing: the median of 25 CUDA-graph replays (so the host's
launch cost is left out), each after a 256 MiB buffer is read (so L2 is cold); on a CPU, wall clock.
Ours launches with an exact meta (eager steps) and, up to the engine's largest graph, with the
static meta its CUDA graphs use. vLLM runs its tuned configs (``benchmarks/vllm_configs/``, where
the folder has this GPU's; its defaults elsewhere: the page names the source) with its default
metadata (a grid over max_loras + 1 adapters) and with the specialized one (the active adapters
only); the speedup is against the faster of the two. Also per case: the fewest bytes each op must
move, our achieved bandwidth as a fraction of the device-to-device copy bandwidth measured in the
same run, and each side's relative error against a float32 reference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import stats, vllm_ops  # noqa: E402
from benchmarks._common import cell, default_out, write_result  # noqa: E402
from loramux.engine.config import EngineConfig  # noqa: E402

TITLE = "Kernels"
LAYERS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
          "down": (14336, (4096,))}  # name: (hidden in, output slices)
RANKS = (16, 64)
TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)
ADAPTERS = (1, 32)
DECODE_MAX, PREFILL_MIN = 256, 1024
GRAPH_MAX = EngineConfig.max_graph_tokens  # the default: steps up to it replay a graph (static meta)
SMOKE_SCALE = 16  # --smoke divides every width by this


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Median time of one call in µs: replayed from a CUDA graph after a read of a 256 MiB buffer
    (cold L2), eager where capture fails; wall clock on a CPU."""

    def __init__(self, device, reps: int = 25):
        self.device, self.reps = device, reps
        self.flush = torch.ones(64 * 2**20, dtype=torch.int32, device=device) if device.type == "cuda" else None
        self.eager_fallbacks = 0

    def __call__(self, fn, reps: int | None = None) -> float:
        reps = reps or self.reps
        fn()
        sync(self.device)
        if self.device.type != "cuda":
            times = []
            for _ in range(min(reps, 3)):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run = graph.replay
        except Exception as e:  # noqa: BLE001 - report and time eagerly
            self.eager_fallbacks += 1
            print(f"  graph capture failed ({type(e).__name__}: {str(e)[:80]}); timing eagerly", file=sys.stderr)
            sync(self.device)
            graph, run = None, fn
        t0 = time.perf_counter()
        run()
        sync(self.device)
        if time.perf_counter() - t0 > 0.02:  # a slow op (the torch reference at prefill): fewer runs
            reps = max(5, reps // 4)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            self.flush.sum()
            start.record()
            run()
            end.record()
        sync(self.device)
        del graph
        return statistics.median(start.elapsed_time(end) * 1e3 for start, end in events)


def copy_ceiling(device, timer: Timer) -> float | None:
    """Device-copy bandwidth in GB/s (bytes read + written): the best of graph-replayed copies of
    1 GiB and an elementwise kernel (a graph may turn ``copy_`` into a slower copy-engine memcpy)."""
    if device.type != "cuda":
        return None
    a = torch.empty(512 * 2**20, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    for _ in range(20):  # let the clocks settle
        b.copy_(a)
    best = min(timer(lambda: b.copy_(a), reps=10), timer(lambda: torch.mul(a, 1.0, out=b), reps=10))
    return 4 * a.numel() / best / 1e3


def make_case(layer, R, T, S, device, dtype, seed=0, dims=None):
    H, sizes = dims or LAYERS[layer]
    g = torch.Generator(device="cpu").manual_seed(seed)
    slots = torch.randint(0, S, (T,), generator=g)
    n, N = len(sizes), sum(sizes)
    x = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
    A = (torch.randn(S, n * R, H, generator=g) / H ** 0.5).to(device=device, dtype=dtype)
    B = (torch.randn(S, N, R, generator=g) / R ** 0.5).to(device=device, dtype=dtype)
    y = torch.randn(T, N, generator=g).to(device=device, dtype=dtype)
    scales = torch.full((S, n), vllm_ops.SCALE, device=device)
    return x, A, B, y, scales, sizes, slots.to(torch.int32).to(device)


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def bytes_moved(T_active: int, active: int, H: int, N: int, R: int, n_slices: int, itemsize: int = 2) -> dict:
    """The fewest bytes each op moves: its tokens' inputs and outputs, the active adapters' weights."""
    return {"shrink": T_active * H * itemsize + active * n_slices * R * H * itemsize + T_active * n_slices * R * 4,
            "expand": 2 * T_active * N * itemsize + T_active * n_slices * R * 4 + active * N * R * itemsize}


def run_case(mods, layer, R, T, S, device, timer, ceiling, dims=None) -> dict:
    from loramux.kernels import build_lora_meta, reference
    from loramux.kernels.expand import lora_expand_triton
    from loramux.kernels.shrink import lora_shrink_triton

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter's bfloat16 is wrong
    x, A, B, y, scales, sizes, slots = make_case(layer, R, T, S, device, dtype, dims=dims)
    meta = build_lora_meta(slots, S)
    row = dict(layer=layer, R=R, T=T, adapters=S, active=meta.num_active)
    # correctness: each side's shrink -> expand against the float32 reference
    buf = lora_shrink_triton(x, A, scales, meta)
    y_ours = y.clone()
    lora_expand_triton(y_ours, buf, B, sizes, meta)
    buf_ref = reference.lora_shrink_ref(x.float(), A.float(), scales, meta)
    y_ref = y.float()
    reference.lora_expand_ref(y_ref, buf_ref, B.float(), sizes, meta)
    row.update(err_shrink_ours=rel_err(buf.float(), buf_ref), err_expand_ours=rel_err(y_ours.float() - y.float(), y_ref - y.float()))
    A0, B0, h16 = A[0], B[0], buf[:, :R].to(x.dtype).contiguous()  # one adapter's weights: the dense floor
    times = {"ours_shrink": lambda: lora_shrink_triton(x, A, scales, meta),
             "ours_expand": lambda: lora_expand_triton(y, buf, B, sizes, meta),
             "ref_shrink": lambda: reference.lora_shrink_ref(x, A, scales, meta),
             "ref_expand": lambda: reference.lora_expand_ref(y, buf, B, sizes, meta),
             "dense_shrink": lambda: torch.mm(x, A0.t()),
             "dense_expand": lambda: y.addmm_(h16, B0.t())}
    if T <= GRAPH_MAX:  # the engine's CUDA-graph steps launch with a static meta: time that launch too
        static = build_lora_meta(slots, S, static=True)
        times |= {"graph_shrink": lambda: lora_shrink_triton(x, A, scales, static),
                  "graph_expand": lambda: lora_expand_triton(y, buf, B, sizes, static)}
    if mods is not None:
        side, spec = (vllm_ops.VLLMSide(mods, x, A, B, sizes, slots, S, specialize=s) for s in (False, True))
        row |= {f"vllm_{op}_config": cfg for op, cfg in vllm_ops.kernel_configs(mods, side.config_keys()).items()}
        buf_v = side.shrink(x).clone()
        y_v = y.clone()
        side.expand(y_v, buf_v)
        sync(device)
        row.update(err_shrink_vllm=rel_err(buf_v.permute(1, 0, 2).reshape(T, -1), buf_ref),
                   err_expand_vllm=rel_err(y_v.float() - y.float(), y_ref - y.float()))
        times |= {"vllm_shrink": lambda: side.shrink(x), "vllm_expand": lambda: side.expand(y, buf_v),
                  "vllm_spec_shrink": lambda: spec.shrink(x), "vllm_spec_expand": lambda: spec.expand(y, buf_v)}
    del y_ours, y_ref, buf_ref
    row |= {f"{name}_us": timer(fn) for name, fn in times.items()}
    moved = bytes_moved(meta.num_lora_tokens, meta.num_active, x.shape[1], y.shape[1], R, len(sizes))
    for op in ("shrink", "expand"):
        row[f"{op}_bw_frac"] = stats.ratio(moved[op] / row[f"ours_{op}_us"] / 1e3, ceiling)
        row[f"{op}_vs_ref"] = row[f"ref_{op}_us"] / row[f"ours_{op}_us"]
        if mods is not None:
            row[f"vllm_best_{op}_us"] = min(row[f"vllm_{op}_us"], row[f"vllm_spec_{op}_us"])
            row[f"speedup_{op}"] = row[f"vllm_best_{op}_us"] / row[f"ours_{op}_us"]
            if f"graph_{op}_us" in row:
                row[f"speedup_graph_{op}"] = row[f"vllm_best_{op}_us"] / row[f"graph_{op}_us"]
    return row


def summarize(rows: list[dict]) -> dict:
    """Per op: the geometric mean of the speedups over vLLM at decode, prefill and in all, wins,
    the worst case; the geometric mean over the torch reference; the largest errors."""
    out = {}
    for op in ("shrink", "expand"):
        out[f"{op}_vs_ref_geomean"] = stats.geomean(r[f"{op}_vs_ref"] for r in rows if f"{op}_vs_ref" in r)
        out[f"{op}_max_err_ours"] = max(r[f"err_{op}_ours"] for r in rows)
        timed = [r for r in rows if f"speedup_{op}" in r]
        if not timed:
            continue
        for name, picked in (("decode", [r for r in timed if r["T"] <= DECODE_MAX]),
                             ("prefill", [r for r in timed if r["T"] >= PREFILL_MIN]), ("all", timed)):
            out[f"{op}_{name}_geomean"] = stats.geomean(r[f"speedup_{op}"] for r in picked)
            out[f"{op}_{name}_wins"] = f"{sum(r[f'speedup_{op}'] > 1 for r in picked)}/{len(picked)}"
        graph = [r[f"speedup_graph_{op}"] for r in timed if f"speedup_graph_{op}" in r]
        out[f"{op}_graph_wins"] = f"{sum(s > 1 for s in graph)}/{len(graph)}"
        worst = min(timed, key=lambda r: r[f"speedup_{op}"])
        out[f"{op}_worst"] = {k: worst[k] for k in ("layer", "R", "T", "adapters", f"speedup_{op}")}
        out[f"{op}_max_err_vllm"] = max(r[f"err_{op}_vllm"] for r in timed)
    return out


def _compile_worker(k: int, n: int, cases: list) -> None:
    """Compile worker ``k`` of ``n``: launch its share of the cases once, filling Triton's disk cache."""
    from loramux.kernels import build_lora_meta
    from loramux.kernels.expand import lora_expand_triton
    from loramux.kernels.shrink import lora_shrink_triton

    device = torch.device("cuda")
    for layer, R, T, S in cases[k::n]:
        x, A, B, y, scales, sizes, slots = make_case(layer, R, T, S, device, torch.bfloat16)
        for meta in (build_lora_meta(slots, S), *([build_lora_meta(slots, S, static=True)] if T <= GRAPH_MAX else [])):
            lora_expand_triton(y, lora_shrink_triton(x, A, scales, meta), B, sizes, meta)


def parallel_compile(cases: list, workers: int) -> None:
    """Fill Triton's on-disk cache from ``workers`` processes, so the timed pass never waits on the compiler."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_compile_worker, args=(k, workers, cases)) for k in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        if p.is_alive():
            p.kill()


def main(argv=None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (widths / 16), a few cases: checks the script")
    ap.add_argument("--only", help="comma-separated layers")
    ap.add_argument("--tokens", help="comma-separated token counts")
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting new cases after this many seconds")
    ap.add_argument("--vllm-ops", default=vllm_ops.DEFAULT_OPS, help="folder written by benchmarks/vllm_ops.py")
    ap.add_argument("--no-vllm", action="store_true", help="time ours and the torch reference only")
    ap.add_argument("--vllm-configs", choices=vllm_ops.CONFIG_MODES, default="tuned",
                    help="tuned: vLLM's tuned configs where --vllm-config-dir has this GPU's; default: its built-in ones")
    ap.add_argument("--vllm-config-dir", default=vllm_ops.TUNED_CONFIGS)
    ap.add_argument("--workers", type=int, default=12, help="parallel compile processes (CUDA only)")
    ap.add_argument("--out", type=Path, default=default_out(), help="folder for kernels.json")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module imports triton
    mods = None
    if not args.no_vllm and (device.type == "cuda" or os.path.isdir(args.vllm_ops)):
        mods = vllm_ops.load_vllm(args.vllm_ops)
        vllm_ops.use_configs(args.vllm_configs if device.type == "cuda" else "default", args.vllm_config_dir)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    timer = Timer(device)
    ceiling = copy_ceiling(device, timer)
    layers = args.only.split(",") if args.only else list(LAYERS)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else TOKENS
    cases = [(layer, R, T, S) for layer in layers for R in RANKS for S in ADAPTERS for T in tokens]
    if args.smoke:
        cases = [(layer, 16, T, S) for layer in ("qkv", "down") if layer in layers for T in (1, 16) for S in (1, 4)]
    if device.type == "cuda" and args.workers > 1:
        parallel_compile(cases, args.workers)
    env = {"triton": __import__("triton").__version__, "copy_GBps": ceiling, "smoke": args.smoke}
    if mods is not None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        env |= {"vllm_version": vllm_ops.vllm_version(args.vllm_ops), "vllm_configs": args.vllm_configs,
                "vllm_config_source": vllm_ops.config_sources(mods, name) if device.type == "cuda" else None}
    rows, started = [], time.time()
    for layer, R, T, S in cases:
        if args.budget_s and time.time() - started > args.budget_s:
            print(f"budget reached: skipping {layer} r{R} a{S} T={T}", flush=True)
            continue
        dims = None
        if args.smoke:
            H, sizes = LAYERS[layer]
            dims = (H // SMOKE_SCALE, tuple(n // SMOKE_SCALE for n in sizes))
        row = run_case(mods, layer, R, T, S, device, timer, ceiling, dims=dims)
        rows.append(row)
        print(f"{layer:8s} r{R:<3d} T={T:<5d} a={S:<2d} shrink {row['ours_shrink_us']:8.1f} us "
              f"(vLLM {row.get('vllm_best_shrink_us', float('nan')):8.1f}) | expand {row['ours_expand_us']:8.1f} us "
              f"(vLLM {row.get('vllm_best_expand_us', float('nan')):8.1f})", flush=True)
    env["eager_fallbacks"], env["elapsed_s"] = timer.eager_fallbacks, time.time() - started
    result = {"env": env, "summary": summarize(rows), "rows": rows}
    device_label = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(markdown(result))
    return write_result(args.out / "kernels.json", "kernels", device_label, result, argv)


# -- the results page -----------------------------------------------------------------------------


def _speedup(row: dict, op: str) -> str:
    if f"speedup_{op}" not in row:
        return ""
    graph = f" ({row[f'speedup_graph_{op}']:.2f}x)" if f"speedup_graph_{op}" in row else ""
    return f"{row[f'speedup_{op}']:.2f}x{graph}"


def markdown(result: dict) -> str:
    env, summ, rows = result["env"], result["summary"], result["rows"]
    vllm = "vllm_version" in env
    lines = [f"Triton {env['triton']}" + (f"; copy bandwidth {env['copy_GBps']:.0f} GB/s" if env.get("copy_GBps") else "")
             + (f"; vLLM {env['vllm_version']}, configs {env['vllm_configs']}"
                + "".join(f", {op} from {src}" for op, src in (env.get("vllm_config_source") or {}).items())
                if vllm else "; vLLM not measured") + f"; {len(rows)} cases, times in µs.", ""]
    if vllm and "shrink_all_geomean" in summ:
        lines += ["| op | vs vLLM, decode (T <= 256): geomean | wins | prefill (T >= 1024) | wins | all | graph launch "
                  "wins | worst case |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for op in ("shrink", "expand"):
            w = summ[f"{op}_worst"]
            lines.append(f"| {op} | {cell(summ[f'{op}_decode_geomean'], '{:.2f}x')} | {summ[f'{op}_decode_wins']} | "
                         f"{cell(summ[f'{op}_prefill_geomean'], '{:.2f}x')} | {summ[f'{op}_prefill_wins']} | "
                         f"{cell(summ[f'{op}_all_geomean'], '{:.2f}x')} | {summ[f'{op}_graph_wins']} | {w['layer']} r{w['R']} "
                         f"T={w['T']} a={w['adapters']}: {w[f'speedup_{op}']:.2f}x |")
        lines.append("")
    lines += ["Speedup = the other side's time / ours (in brackets: ours launched with the static meta of the engine's "
              "graphs). 'of copy': our achieved bandwidth over the device's copy bandwidth.", "",
              "| layer | R | T | adapters | shrink | vs vLLM | vs torch | of copy | dense mm | expand | vs vLLM | vs torch | "
              "of copy | dense addmm |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
              "| ---: | ---: |"]
    for r in rows:
        cells = []
        for op, dense in (("shrink", "dense_shrink_us"), ("expand", "dense_expand_us")):
            frac = r.get(f"{op}_bw_frac")
            cells += [f"{r[f'ours_{op}_us']:.1f}", _speedup(r, op),
                      f"{r[f'{op}_vs_ref']:.2f}x" if f"{op}_vs_ref" in r else "",
                      "" if frac is None else f"{frac:.0%}", f"{r[dense]:.1f}" if dense in r else ""]
        lines.append(f"| {r['layer']} | {r['R']} | {r['T']} | {r['adapters']} | " + " | ".join(cells) + " |")
    errors = [f"{op} ours {summ[f'{op}_max_err_ours']:.1e}"
              + (f", vLLM {summ[f'{op}_max_err_vllm']:.1e}" if f"{op}_max_err_vllm" in summ else "")
              for op in ("shrink", "expand") if summ.get(f"{op}_max_err_ours") is not None]
    lines += ["", "Largest relative error against float32: " + "; ".join(errors)]
    return "\n".join(lines) + "\n"


def plot(document: dict, path: Path) -> None:
    """Our time against vLLM's (best of its two metadata) by token count, one panel per op."""
    import matplotlib.pyplot as plt

    rows = [r for r in document["result"]["rows"] if "speedup_shrink" in r]
    if not rows:
        return
    figure, panels = plt.subplots(1, 2, figsize=(11, 4))
    for axes, op in zip(panels, ("shrink", "expand")):
        for layer in dict.fromkeys(r["layer"] for r in rows):
            for R in sorted({r["R"] for r in rows}):
                for S, mark in ((1, "o-"), (32, "s--")):
                    picked = sorted((r["T"], r[f"speedup_{op}"]) for r in rows if (r["layer"], r["R"], r["adapters"]) == (layer, R, S))
                    if picked:
                        axes.plot(*zip(*picked), mark, label=f"{layer} r{R}, {S} ad.")
        axes.axhline(1.0, color="k", lw=0.8)
        axes.set(xscale="log", xlabel="tokens", ylabel="vLLM's time / ours", title=op)
    panels[1].legend(fontsize=6, ncol=2)
    figure.suptitle(f"{document['device']}: loramux against vLLM {document['result']['env'].get('vllm_version')}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


#: JSON stem -> (heading, renderer, the command that measures it), for benchmarks/report.py
SECTIONS = {"kernels": ("", markdown, "PYTHONPATH=. python benchmarks/kernels.py")}

if __name__ == "__main__":
    main()

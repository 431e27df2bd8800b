"""Decode-step LoRA cost at Llama-3.1-8B shapes (issue 13): one captured graph for any adapter mix.

    PYTHONPATH=. python benchmarks/lora_decode.py --out results/            # GPU, ~5 min on an H100
    PYTHONPATH=. python benchmarks/lora_decode.py --out results/ --pdl      # + the new path with PDL
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/lora_decode.py --smoke --out /tmp/lora_decode

One decoder layer's seven projections (q, k, v, o, gate, up, down) on `--layers` layers with their
own weights (32: a whole Llama-3.1-8B step, so L2 holds no adapter from one layer to the next),
S = 32 slots, bfloat16, every adapter on every projection. Layouts: `fused` (qkv 4096 -> 4096/1024/1024
and gate_up 4096 -> 14336/14336 as one module each: 4 LoRA modules a layer) and `separate` (7, as
the engine wraps Hugging Face's Llama today). Mixes over T tokens: 1, 8 or 32 distinct adapters
("n" uses min(n, T)), and "8-half" (8 adapters on half the tokens, the other half base rows).

Paths, each one CUDA graph of the whole step (meta build + every layer), replayed 20+ times after
warm-up, so the launch gaps are those a real decode step sees:
- base: the base projections alone (y = x @ W.T), when --base (default);
- new: loramux.kernels: static=True meta, lora_apply (no memset); ONE graph per T, captured with
  every row base (-1) and replayed for every mix;
- new_pdl (--pdl): the new path launched with programmatic dependent launch.
LoRA paths include the base GEMMs when --base is on, so "new - base" is what LoRA costs a step.
(The previous path, e25c560's kernels with a zeroed split-K buffer and a graph per adapter count,
was timed against this one on an H100: docs/benchmarks/engine-h100.md; git history has it.)

Also reported: the bytes-read floor of the LoRA work (the active adapters' A and B, x, and y
read + written on the rows with an adapter) over the device-copy bandwidth measured in the run.
Writes lora_decode.json and lora_decode.md (device named) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

LAYOUTS = {  # name: [(module, hidden in, output slices)]
    "fused": [("qkv", 4096, (4096, 1024, 1024)), ("o", 4096, (4096,)), ("gate_up", 4096, (14336, 14336)),
              ("down", 14336, (4096,))],
    "separate": [("q", 4096, (4096,)), ("k", 4096, (1024,)), ("v", 4096, (1024,)), ("o", 4096, (4096,)),
                 ("gate", 4096, (14336,)), ("up", 4096, (14336,)), ("down", 14336, (4096,))],
}
TOKENS = (1, 8, 64, 128, 256)
RANKS = (16, 64)
MIXES = ("1", "8", "32", "8-half")
SLOTS = 32


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mix_slots(mix: str, T: int, S: int, gen: torch.Generator) -> torch.Tensor:
    """token_slots [T] of a mix: n distinct adapters (min(n, T)) in random token order, from the
    last slot down (their weights end the stacked buffers); "-half": half the tokens base."""
    n = min(int(mix.split("-")[0]), T, S)
    used = torch.arange(S - 1, S - 1 - n, -1)
    slots = used[torch.arange(T) % n][torch.randperm(T, generator=gen)]
    if mix.endswith("half"):
        slots[torch.randperm(T, generator=gen)[: T // 2]] = -1
    return slots.to(torch.int32)


class Layers:
    """Per-layer weights of one layout at one rank: base W [N, H] and LoRA A/B for S slots."""

    def __init__(self, layout, n_layers, R, S, device, dtype, base, scale=1):
        self.mods = [(name, H // scale, tuple(n // scale for n in sizes)) for name, H, sizes in LAYOUTS[layout]]
        self.R, self.S = R, S
        self.layers = []
        for _ in range(n_layers):
            layer = []
            for _, H, sizes in self.mods:
                n, N = len(sizes), sum(sizes)
                w = dict(
                    A=(torch.randn(S, n * R, H, device=device, dtype=dtype) * H**-0.5),
                    B=(torch.randn(S, N, R, device=device, dtype=dtype) * R**-0.5),
                    scales=torch.full((S, n), 2.0, device=device),
                    ranks=torch.full((S,), R, dtype=torch.int32, device=device),
                    W=(torch.randn(N, H, device=device, dtype=dtype) * H**-0.5) if base else None,
                )
                layer.append(w)
            self.layers.append(layer)

    def lora_bytes(self, slots: torch.Tensor, es: int = 2) -> int:
        """Bytes one layer's LoRA must read at least: active adapters' A and B, x, y's LoRA rows
        (read + write)."""
        d = len(set(int(s) for s in slots.tolist() if s >= 0))
        t_act = int((slots >= 0).sum())
        total = 0
        for _, H, sizes in self.mods:
            n, N = len(sizes), sum(sizes)
            total += d * (n * self.R * H + N * self.R) * es + slots.numel() * H * es + 2 * t_act * N * es
        return total if d else 0


def make_io(layers: Layers, T: int, device, dtype):
    xs = [torch.randn(T, H, device=device, dtype=dtype) for _, H, _ in layers.mods]
    ys = [torch.zeros(T, sum(sizes), device=device, dtype=dtype) for _, _, sizes in layers.mods]
    return xs, ys


def step_fn(path: str, layers: Layers, xs, ys, slots_buf, base: bool):
    """The whole step of one path as a function (captured into a graph on CUDA)."""
    from loramux.kernels import build_lora_meta, lora_apply

    sizes = [s for _, _, s in layers.mods]

    def run():
        if path != "base":
            meta = build_lora_meta(slots_buf, layers.S, static=True)
        for layer in layers.layers:
            for w, x, y, sz in zip(layer, xs, ys, sizes):
                if base:
                    torch.mm(x, w["W"].t(), out=y)
                if path != "base":
                    lora_apply(y, x, w["A"], w["B"], w["scales"], w["ranks"], sz, meta)

    return run


class Graph:
    """A captured step (CUDA) or the plain function (CPU smoke run)."""

    def __init__(self, fn, device):
        self.fn, self.device, self.graph = fn, device, None
        if device.type != "cuda":
            fn()
            return
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):  # warm-up: compile, make tables
            fn()
        torch.cuda.current_stream(device).wait_stream(s)
        sync(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            fn()
        sync(device)

    def replay(self):
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()

    def time_us(self, reps: int) -> float:
        """Median time of one replay of the whole step."""
        if self.graph is None:
            t0 = time.perf_counter()
            self.replay()
            return (time.perf_counter() - t0) * 1e6
        for _ in range(3):
            self.replay()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for st, en in ev:
            st.record()
            self.replay()
            en.record()
        sync(self.device)
        return statistics.median(st.elapsed_time(en) * 1e3 for st, en in ev)


def copy_bandwidth(device) -> float:
    """Device copy, bytes read + written per second (eager copy_ of 1 GiB, median of 10), GB/s."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(512 * 2**20, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    for _ in range(10):
        b.copy_(a)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]
    for st, en in ev:
        st.record()
        b.copy_(a)
        en.record()
    sync(device)
    t = statistics.median(st.elapsed_time(en) * 1e-3 for st, en in ev)
    return 2 * a.numel() * 2 / t / 1e9


def check_against_reference(layers, xs, slots, device, dtype) -> float:
    """The graph path's kernels on layer 0, eagerly, against the torch reference from the same y:
    worst relative error of the deltas (inf if a base row changed or a value is not finite)."""
    from loramux.kernels import build_lora_meta, lora_apply, reference

    worst = 0.0
    new_meta = build_lora_meta(slots, layers.S, static=True)
    exact = build_lora_meta(slots, layers.S)
    for w, x, (_, _, sizes) in zip(layers.layers[0], xs, layers.mods):
        y0 = torch.randn(x.shape[0], sum(sizes), device=device, dtype=dtype)
        y_ref, y_new = y0.clone(), y0.clone()
        buf = reference.lora_shrink_ref(x, w["A"], w["scales"], exact, w["ranks"])
        reference.lora_expand_ref(y_ref, buf, w["B"], tuple(sizes), exact, w["ranks"])
        lora_apply(y_new, x, w["A"], w["B"], w["scales"], w["ranks"], sizes, new_meta)
        d_ref, d_new = (y_ref.double() - y0.double()), (y_new.double() - y0.double())
        base_rows = (slots < 0)
        if not torch.equal(y_new[base_rows], y0[base_rows]):
            return float("inf")
        if not torch.isfinite(d_new).all():
            return float("inf")
        denom = d_ref.norm().item()
        worst = max(worst, (d_new - d_ref).norm().item() / denom if denom else (d_new - d_ref).norm().item())
    return worst


def run(args, device, dtype, env, save):
    rows, t0 = [], time.time()
    gen = torch.Generator().manual_seed(0)
    scale = 64 if args.smoke else 1
    S = args.slots
    bw = env["copy_GBps"]
    for layout in args.layouts:
        for R in args.ranks:
            if args.budget_s and time.time() - t0 > args.budget_s:
                print(f"budget reached: skipping {layout} r{R}", flush=True)
                env.setdefault("skipped", []).append(f"{layout} r{R}")
                continue
            layers = Layers(layout, args.layers, R, S, device, dtype, args.base, scale)
            for T in args.tokens:
                xs, ys = make_io(layers, T, device, dtype)
                slots_buf = torch.full((T,), -1, dtype=torch.int32, device=device)
                graphs = {"base": Graph(step_fn("base", layers, xs, ys, slots_buf, True), device)} if args.base else {}
                graphs["new"] = Graph(step_fn("new", layers, xs, ys, slots_buf, args.base), device)  # all rows base
                if args.pdl:
                    os.environ["LORAMUX_TRITON_PDL"] = "1"
                    try:
                        graphs["new_pdl"] = Graph(step_fn("new_pdl", layers, xs, ys, slots_buf, args.base), device)
                    except Exception as exc:  # noqa: BLE001 - report it and go on without PDL
                        env.setdefault("pdl_errors", []).append(f"{type(exc).__name__}: {str(exc)[:200]}")
                        print(f"  PDL capture failed: {exc}", flush=True)
                    finally:
                        os.environ.pop("LORAMUX_TRITON_PDL", None)
                for mix in args.mixes:
                    slots = mix_slots(mix, T, S, gen).to(device)
                    slots_buf.copy_(slots)
                    distinct = len(set(int(s) for s in slots.tolist() if s >= 0))
                    row = dict(layout=layout, R=R, T=T, mix=mix, distinct=distinct, layers=args.layers)
                    row["err_vs_reference"] = check_against_reference(layers, xs, slots, device, dtype)
                    for name, g in graphs.items():
                        row[f"{name}_step_us"] = g.time_us(args.reps)
                    nb = layers.lora_bytes(slots.cpu())
                    row["lora_bytes_per_layer"] = nb
                    row["floor_us_per_layer"] = nb / (bw * 1e3) if bw == bw else float("nan")
                    for name in ("base", "new", "new_pdl"):
                        if f"{name}_step_us" in row:
                            row[f"{name}_us_per_layer"] = row[f"{name}_step_us"] / args.layers
                    rows.append(row)
                    print(_line(row), flush=True)
                del graphs, xs, ys
            del layers
            if device.type == "cuda":
                torch.cuda.empty_cache()
            env["elapsed_s"] = time.time() - t0
            save(rows)  # after every (layout, rank): a run cut short keeps what it measured
    env["elapsed_s"] = time.time() - t0
    return rows


def _line(r):
    parts = [f"{r['layout']:8s} r{r['R']:<3d} T={r['T']:<4d} {r['mix']:>6s}"]
    for name in ("base", "new", "new_pdl"):
        if f"{name}_us_per_layer" in r:
            parts.append(f"{name} {r[f'{name}_us_per_layer']:7.1f}")
    parts.append(f"floor {r['floor_us_per_layer']:6.1f} us/layer, err {r['err_vs_reference']:.0e}")
    return " | ".join(parts)


def markdown(rows, env, n_layers, S, dtype):
    have = [n for n in ("base", "new", "new_pdl") if rows and f"{n}_us_per_layer" in rows[0]]
    L = ["# LoRA decode step: one graph for any adapter mix (issue 13)", "",
         f"Device: **{env.get('device')}**; torch {env.get('torch')}, triton {env.get('triton')}; "
         f"copy bandwidth {env.get('copy_GBps', float('nan')):.0f} GB/s (read + write); {n_layers} layers per "
         f"captured step; us per layer (step / layers) and ms per 32-layer step; {dtype}, {S} slots.", ""]
    if env.get("pdl_errors"):
        L += [f"PDL capture failed: {env['pdl_errors'][0]}", ""]
    if env.get("skipped"):
        L += [f"Not run (time budget): {', '.join(env['skipped'])}; rerun with --layouts/--ranks.", ""]
    head = "| layout | R | T | mix | " + " | ".join(f"{n} us" for n in have)
    if "base" in have:
        head += " | new − base"
        if "new_pdl" in have:
            head += " | pdl − base"
    head += " | LoRA floor us | 32-layer step ms (" + " / ".join(have) + ") | err |"
    L += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [r["layout"], str(r["R"]), str(r["T"]), r["mix"]]
        cells += [f"{r[f'{n}_us_per_layer']:.1f}" for n in have]
        if "base" in have:
            cells.append(f"{r['new_us_per_layer'] - r['base_us_per_layer']:.1f}")
            if "new_pdl" in have:
                cells.append(f"{r['new_pdl_us_per_layer'] - r['base_us_per_layer']:.1f}")
        cells.append(f"{r['floor_us_per_layer']:.1f}")
        cells.append(" / ".join(f"{r[f'{n}_us_per_layer'] * 32 / 1e3:.2f}" for n in have))
        cells.append(f"{r['err_vs_reference']:.0e}")
        L.append("| " + " | ".join(cells) + " |")
    return "\n".join(L) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for lora_decode.json / .md")
    ap.add_argument("--layouts", default="fused,separate")
    ap.add_argument("--ranks", default=",".join(map(str, RANKS)))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--layers", type=int, default=32, help="layers (own weights each) in one captured step")
    ap.add_argument("--slots", type=int, default=SLOTS, help="GPU slots (max_loras)")
    ap.add_argument("--reps", type=int, default=20, help="timed replays per graph (median)")
    ap.add_argument("--no-base", dest="base", action="store_false", help="LoRA kernels only, no base GEMMs")
    ap.add_argument("--pdl", action="store_true", help="also time the new path with programmatic dependent launch")
    ap.add_argument("--budget-s", type=float, default=420,
                    help="start no new (layout, rank) block after this many seconds (0: no limit); results are "
                         "written after every block")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (1/64), 2 layers: a CPU check of the script")
    args = ap.parse_args(argv)
    args.layouts = args.layouts.split(",")
    args.ranks = [int(r) for r in args.ranks.split(",")]
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.mixes = args.mixes.split(",")
    bad = [x for x in args.layouts if x not in LAYOUTS] + [m for m in args.mixes if m.split("-")[0] not in
                                                          ("1", "8", "32") or m.count("-") > 1]
    if bad:
        sys.exit(f"unknown layout or mix {bad}; layouts: {', '.join(LAYOUTS)}; mixes like 1, 8, 32, 8-half")
    if args.smoke:
        args.layers, args.ranks, args.reps, args.slots = 1, [16], 1, 8
        args.tokens = [t for t in args.tokens if t <= 8] or [1]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        if not args.smoke:
            sys.exit("no CUDA device: use --smoke (with TRITON_INTERPRET=1) for the CPU check")
        os.environ.setdefault("LORAMUX_KERNELS", "triton")
    # the interpreter's bfloat16 is wrong: float16 on the CPU (smoke runs only)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    import triton

    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
           "torch": torch.__version__, "triton": triton.__version__, "copy_GBps": copy_bandwidth(device),
           "args": {k: v for k, v in vars(args).items()}}
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        env["sms"] = torch.cuda.get_device_properties(device).multi_processor_count
    print(env, flush=True)
    os.makedirs(args.out, exist_ok=True)

    def save(rows):
        md = markdown(rows, env, args.layers, args.slots, str(dtype).replace("torch.", ""))
        with open(os.path.join(args.out, "lora_decode.json"), "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "lora_decode.md"), "w") as f:
            f.write(md)
        return md

    rows = run(args, device, dtype, env, save)
    print(save(rows))
    bad_rows = [r for r in rows if not r["err_vs_reference"] < 2e-2]
    if bad_rows:
        sys.exit(f"{len(bad_rows)} case(s) where the graph path disagrees with the reference: {bad_rows[0]}")


if __name__ == "__main__":
    main()

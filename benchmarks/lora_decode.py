"""Decode-step LoRA cost at Llama-3.1-8B shapes (issue 13): the two-kernel path against the base GEMMs.

    PYTHONPATH=. python benchmarks/lora_decode.py --out results/               # GPU, < 2 min on an H100
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/lora_decode.py --smoke --out /tmp/lora_decode  # CPU, ~30 s

One decoder layer's projections on `--layers` layers with their own weights (32: a whole
Llama-3.1-8B step, so L2 holds no adapter from one layer to the next), S = 32 slots, bfloat16.
Layouts: `fused` (default; the engine's fused sibling projections, engine/siblings.py: qkv 4096 ->
4096/1024/1024 and gate_up 4096 -> 14336/14336 as one module each, plus o and down: 4 LoRA modules
a layer) and `separate` (7 modules). Mixes over T tokens: "n" = n distinct adapters (min(n, T))
on every module; "8-half" = 8 adapters on half the tokens, the other half base rows; "n-qv" = n
adapters that target q and v only (every other module rank 0, the k slice of qkv scale 0; one
graph for any mix still launches every module's kernels).

Paths, each ONE CUDA graph of the whole step (static meta build + every layer), captured with
every row base (-1) and replayed for every mix, 20+ times after warm-up:
- base: the base projections alone (y = x @ W.T) (--no-base drops it and the GEMMs of the others);
- two: lora_shrink + lora_expand per module (two launches, no memset), what lora_apply runs;
- overlap: the same, with the shrink on a side stream forked before the base GEMM and joined
  before the expand, as the engine's LoRA layers run it (engine/layers/side_stream.py);
- overlap_pdl: overlap with the expand launched with programmatic dependent launch (`pdl=True`:
  its launch and prologue overlap the end of the GEMM and the shrink; Hopper on). Where PDL is
  not available (the CPU smoke run, a GPU before Hopper) it runs exactly as overlap, and the
  output says so (`pdl_available` in the JSON's env);
- delta: shrink, zeroing and expand all on the side stream, into a delta buffer of their own, beside
  the base GEMM; the step adds nothing after the join (the compiled layer would fold `y + delta`
  into the pointwise kernel that reads y next: RoPE, SiLU-mul, the residual add and norm);
- overlap_pool: overlap with the weights in the engine's rank-row pool (issue 10: adapters of
  different ranks share one pool per layer, each slot read from its own start; here every slot
  holds R rows at a shuffled start), against overlap's one [S, n*R, H] block per slot;
- overlap_exact: overlap with an exact meta (grids sized from this mix's tiles, a graph captured
  per mix): what the static grid's one-size launch costs against launches fitted to the batch.
The LoRA paths include the base GEMMs, so "two - base" is what LoRA costs a step. (A fused
one-launch kernel, and the whole delta on the side stream with one add after the join, were
tried here and removed: docs/benchmarks/engine-h100.md; "delta" is that idea without the add.)
Before timing a mix, layer 0 of each LoRA path runs eagerly and is compared with the torch
reference in bf16 (relative error of the delta, base rows bit-exact): a path over 2e-2 stops the run.
Also reported: the bytes-read floor of the LoRA work (the active adapters' A and B, x, and y
read + written on the rows with an adapter) over the device-copy bandwidth measured in the run.
`--kernel-times` also profiles each graph's replays and stores the device time per kernel name in
the JSON rows (`<path>_kernels_us_per_step`): where a path's time goes, kernel by kernel.
Writes lora_decode.json (everything, the kernels' registers and spills included) and
lora_decode.md (device named) to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import re
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
MIXES = ("1", "8", "32", "8-half", "1-qv", "32-qv")
SLOTS = 32
PATHS = ("base", "two", "overlap", "overlap_pdl", "overlap_pool", "delta", "overlap_exact")
LORA_PATHS = PATHS[1:]
#: Variants named by pattern: `_carve{k}` runs the base GEMMs through cuBLASLt told to leave k SMs
#: free (`torch._C._set_sm_carveout_experimental`) and sizes the LoRA launches for those k SMs;
#: `_prio` puts the side stream at high priority; `_add` adds the delta into y after the join.
#: `base_carve{k}` is the base GEMMs alone under the carveout.
#: `_lt` prefers cuBLASLt without a carveout; `_wide` keeps the LoRA launches sized for every SM;
#: `_nozero` skips the delta's zeroing (wrong output on base rows: timing only, not checked).
VARIANT = re.compile(r"^(base|delta|overlap)((?:_carve\d+|_prio|_add|_lt|_wide|_nozero)*)$")
TOL = 2e-2
PDL_NOTE = ("PDL is not available on {device} (it needs CUDA compute capability 9.0+, the Triton interpreter off, "
            "and a Triton with gdc_wait and launch_pdl): overlap_pdl runs exactly as overlap")
#: q/v-only adapters: the (module, slice) pairs they target, per layout
QV_TARGETS = {"fused": {("qkv", 0), ("qkv", 2)}, "separate": {("q", 0), ("v", 0)}}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mix_slots(mix: str, T: int, S: int, gen: torch.Generator) -> torch.Tensor:
    """token_slots [T] of a mix: n distinct adapters (min(n, T)) in random token order, from the
    last slot down (their weights end the stacked buffers); "-half": half the tokens base."""
    n = min(int(mix.split("-")[0]), T, S)  # "1-qv": one adapter (which modules it targets: Layers.target)
    used = torch.arange(S - 1, S - 1 - n, -1)
    slots = used[torch.arange(T) % n][torch.randperm(T, generator=gen)]
    if mix.endswith("half"):
        slots[torch.randperm(T, generator=gen)[: T // 2]] = -1
    return slots.to(torch.int32)


class Layers:
    """Per-layer weights of one layout at one rank: base W [N, H] and LoRA A/B for S slots."""

    def __init__(self, layout, n_layers, R, S, device, dtype, base, scale=1, pool=False):
        self.mods = [(name, H // scale, tuple(n // scale for n in sizes)) for name, H, sizes in LAYOUTS[layout]]
        self.R, self.S, self.layout = R, S, layout
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
                if pool:  # the same weights in the engine's pool: slot s at rows perm[s] * R
                    perm = torch.randperm(S, device=device)
                    w["starts"] = (perm * R).to(torch.int32)
                    w["A_pool"] = torch.empty(S * R, n, H, device=device, dtype=dtype)
                    w["A_pool"].view(S, R, n, H)[perm] = w["A"].view(S, n, R, H).transpose(1, 2)
                    w["B_pool"] = torch.empty(S * R, N, device=device, dtype=dtype)  # [N, R] blocks
                    w["B_pool"].view(S, N, R)[perm] = w["B"]
                layer.append(w)
            self.layers.append(layer)

    def target(self, qv_only: bool) -> None:
        """Every module targeted by every slot, or (qv_only) q and v only: ranks 0 on the other
        modules and scale 0 on the other slices, in place (the captured graphs read these)."""
        for layer in self.layers:
            for (name, _, sizes), w in zip(self.mods, layer):
                slices = [not qv_only or (name, i) in QV_TARGETS[self.layout] for i in range(len(sizes))]
                w["scales"].copy_(torch.tensor([2.0 if on else 0.0 for on in slices]).expand_as(w["scales"]))
                w["ranks"].fill_(self.R if any(slices) else 0)

    def lora_bytes(self, slots: torch.Tensor, es: int = 2) -> int:
        """Bytes one layer's LoRA must read at least: active adapters' A and B, x, y's LoRA rows
        (read + write)."""
        d = len(set(int(s) for s in slots.tolist() if s >= 0))
        t_act = int((slots >= 0).sum())
        total = 0
        for (_, H, sizes), w in zip(self.mods, self.layers[0]):
            on = [float(v) != 0.0 for v in w["scales"][0].tolist()]
            if not any(on):
                continue
            n_on, N_on = sum(on), sum(n for n, o in zip(sizes, on) if o)
            total += d * (n_on * self.R * H + N_on * self.R) * es + slots.numel() * H * es + 2 * t_act * N_on * es
        return total if d else 0


def make_io(layers: Layers, T: int, device, dtype):
    xs = [torch.randn(T, H, device=device, dtype=dtype) for _, H, _ in layers.mods]
    ys = [torch.zeros(T, sum(sizes), device=device, dtype=dtype) for _, _, sizes in layers.mods]
    return xs, ys


def step_fn(path: str, layers: Layers, xs, ys, slots_buf, base: bool):
    """The whole step of one path as a function (captured into a graph on CUDA)."""
    from loramux.engine.layers.side_stream import gemm_carveout
    from loramux.kernels import build_lora_meta
    from loramux.kernels.expand import lora_expand_triton
    from loramux.kernels.shrink import lora_shrink_triton

    sizes = [s for _, _, s in layers.mods]
    carve = int(m.group(1)) if (m := re.search(r"_carve(\d+)", path)) else 0
    prio = "_prio" in path
    family = path.split("_")[0] if VARIANT.match(path) and path not in PATHS else path

    side = torch.cuda.Stream(xs[0].device, priority=-1 if prio else 0) if xs[0].is_cuda else None
    deltas: dict = {}

    def fork():
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(xs[0].device))
        return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()

    def join():
        if side is not None:
            torch.cuda.current_stream(xs[0].device).wait_stream(side)

    exact = build_lora_meta(slots_buf, layers.S) if path.endswith("exact") else None  # this mix only

    def gemm(x, W, y):
        if not x.is_cuda:
            torch.mm(x, W.t(), out=y)
            return
        with gemm_carveout(carve), cublaslt() if "_lt" in path else contextlib.nullcontext():
            torch.mm(x, W.t(), out=y)

    sms = carve if carve and "_wide" not in path else None  # the LoRA launches sized for the SMs left

    def run():
        if family != "base":
            meta = exact or build_lora_meta(slots_buf, layers.S, static=True)
        for layer in layers.layers:
            for w, x, y, sz in zip(layer, xs, ys, sizes):
                if family == "base":
                    gemm(x, w["W"], y)
                elif path == "two":
                    if base:
                        torch.mm(x, w["W"].t(), out=y)
                    buf = lora_shrink_triton(x, w["A"], w["scales"], meta, w["ranks"])
                    lora_expand_triton(y, buf, w["B"], tuple(sz), meta, w["ranks"], pdl=False)
                elif family.startswith("overlap"):  # the engine's: the shrink on a side stream
                    buf = torch.empty(x.shape[0], w["A"].shape[1], dtype=torch.float32, device=x.device)
                    pooled = path == "overlap_pool"
                    a, b = (w["A_pool"], w["B_pool"]) if pooled else (w["A"], w["B"])
                    starts = w["starts"] if pooled else None
                    with fork():
                        lora_shrink_triton(x, a, w["scales"], meta, w["ranks"], out=buf, pool_starts=starts,
                                           max_rank=layers.R, sms=sms)
                    if base:
                        gemm(x, w["W"], y)
                    join()
                    # only overlap_pdl asks for PDL: LORAMUX_PDL in the environment changes no other path
                    lora_expand_triton(y, buf, b, tuple(sz), meta, w["ranks"], pdl=path == "overlap_pdl",
                                       pool_starts=starts, sms=sms)
                elif family == "delta":  # the whole delta beside the GEMM into its own buffer, no add: what
                    # a layer folding `y + delta` into its next pointwise kernel would cost
                    dy = deltas.setdefault(id(y), torch.empty_like(y))
                    with fork():
                        buf = lora_shrink_triton(x, w["A"], w["scales"], meta, w["ranks"], sms=sms)
                        if "_nozero" not in path:
                            dy.zero_()
                        lora_expand_triton(dy, buf, w["B"], tuple(sz), meta, w["ranks"], pdl=False, sms=sms)
                    if base:
                        gemm(x, w["W"], y)
                    join()
                    if not base or not x.is_cuda or path.endswith("_add"):  # the reference check reads y
                        y.add_(dy)
                elif base:
                    torch.mm(x, w["W"].t(), out=y)

    return run


@contextlib.contextmanager
def cublaslt():
    """Matrix products in this block through cuBLASLt (the carveout's BLAS) without a carveout."""
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def kernel_resources() -> list[dict]:
    """Registers, spills and shared memory of every compiled LoRA kernel (best effort: Triton's
    caches are not a public API), so a slow variant can be told from an occupancy cliff."""
    from loramux.kernels import expand, shrink

    out = []
    for name, fn in (("shrink", shrink._shrink_kernel), ("expand", expand._expand_kernel)):
        try:
            for device, caches in getattr(fn, "device_caches", {}).items():
                for kernel in caches[0].values():
                    kernel._init_handles()
                    consts = {k: v for k, v in getattr(kernel, "src", None).constants.items()} \
                        if getattr(kernel, "src", None) is not None else {}
                    out.append({"kernel": name, "regs": kernel.n_regs, "spills": kernel.n_spills,
                                "shared": kernel.metadata.shared, "num_warps": kernel.metadata.num_warps,
                                "constexprs": {str(k): str(v) for k, v in consts.items()}})
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            out.append({"kernel": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
    return out


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

    def kernel_times(self, replays: int = 5) -> dict:
        """Device time per kernel name, per replay: {name: (us, launches)} (a captured graph)."""
        from benchmarks._common import kernel_device_times

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                self.replay()
            sync(self.device)
        return kernel_device_times(prof, replays)

    def timeline(self) -> list[tuple[str, int, float, float]]:
        """One replay's kernels as (name, stream, start us, duration us), in start order: which
        kernels overlap and where the gaps are."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            self.replay()
            sync(self.device)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        t0 = min((e.time_range.start for e in kernels), default=0)
        return sorted((e.name[:60], int(getattr(e, "device_resource_id", -1)), e.time_range.start - t0,
                       e.time_range.end - e.time_range.start) for e in kernels)

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


def check_against_reference(path, layers, xs, slots, device, dtype) -> float:
    """One path's kernels on layer 0, eagerly, against the torch reference from the same y:
    worst relative error of the deltas (inf if a base row changed or a value is not finite)."""
    from loramux.kernels import build_lora_meta, reference

    worst = 0.0
    exact = build_lora_meta(slots, layers.S)
    one_layer = Layers.__new__(Layers)
    one_layer.__dict__.update(layers.__dict__, layers=layers.layers[:1])
    for (_, _, sizes), x, w in zip(layers.mods, xs, layers.layers[0]):
        y0 = torch.randn(x.shape[0], sum(sizes), device=device, dtype=dtype)
        y_ref = y0.clone()
        buf = reference.lora_shrink_ref(x, w["A"], w["scales"], exact, w["ranks"])
        reference.lora_expand_ref(y_ref, buf, w["B"], tuple(sizes), exact, w["ranks"])
        w["_y_ref"], w["_y0"] = y_ref, y0
    ys = [w["_y0"].clone() for w in layers.layers[0]]
    slots_buf = slots.clone()
    step_fn(path, one_layer, xs, ys, slots_buf, False)()
    for y_new, w in zip(ys, layers.layers[0]):
        y_ref, y0 = w.pop("_y_ref"), w.pop("_y0")
        d_ref, d_new = (y_ref.double() - y0.double()), (y_new.double() - y0.double())
        base_rows = slots < 0
        if not torch.equal(y_new[base_rows], y0[base_rows]) or not torch.isfinite(d_new).all():
            return float("inf")
        denom = d_ref.norm().item()
        worst = max(worst, (d_new - d_ref).norm().item() / denom if denom else (d_new - d_ref).norm().item())
    return worst


def checked(row, path, err, save, rows, env):
    """Record a path's error; one over TOL stops the run (after saving what was measured)."""
    row[f"{path}_err"] = err
    if not err < TOL:
        env["failed_check"] = dict(row)
        save(rows)
        raise AssertionError(f"{path} disagrees with the torch reference (rel err {err:.2e} > {TOL}): {row}")


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
            layers = Layers(layout, args.layers, R, S, device, dtype, args.base, scale,
                            pool="overlap_pool" in args.paths)
            for T in args.tokens:
                xs, ys = make_io(layers, T, device, dtype)
                slots_buf = torch.full((T,), -1, dtype=torch.int32, device=device)
                graphs = {"base": Graph(step_fn("base", layers, xs, ys, slots_buf, True), device)} if args.base else {}
                for path in args.paths:  # captured with every row base: one graph for every mix
                    if not path.endswith("exact"):
                        graphs[path] = Graph(step_fn(path, layers, xs, ys, slots_buf, args.base), device)
                for mix in args.mixes:
                    layers.target(qv_only=mix.endswith("-qv"))
                    slots = mix_slots(mix, T, S, gen).to(device)
                    slots_buf.copy_(slots)
                    distinct = len(set(int(s) for s in slots.tolist() if s >= 0))
                    for path in args.paths:  # exact grids: captured for this mix
                        if path.endswith("exact"):
                            graphs[path] = Graph(step_fn(path, layers, xs, ys, slots_buf, args.base), device)
                    row = dict(layout=layout, R=R, T=T, mix=mix, distinct=distinct, layers=args.layers)
                    for path in graphs:
                        if "_nozero" in path:
                            row[f"{path}_err"] = float("nan")
                        elif not path.startswith("base"):
                            checked(row, path, check_against_reference(path, layers, xs, slots, device, dtype),
                                    save, rows, env)
                    for name, g in graphs.items():
                        row[f"{name}_step_us"] = g.time_us(args.reps)
                        row[f"{name}_us_per_layer"] = row[f"{name}_step_us"] / args.layers
                        if args.kernel_times and g.graph is not None:
                            row[f"{name}_kernels_us_per_step"] = g.kernel_times()
                        if args.timeline and g.graph is not None and mix == args.mixes[0]:
                            row[f"{name}_timeline"] = g.timeline()
                    nb = layers.lora_bytes(slots.cpu())
                    row["lora_bytes_per_layer"] = nb
                    row["floor_us_per_layer"] = nb / (bw * 1e3) if bw == bw else float("nan")
                    rows.append(row)
                    print(_line(row), flush=True)
                layers.target(qv_only=False)
                del graphs, xs, ys
            del layers
            if device.type == "cuda":
                torch.cuda.empty_cache()
            env["elapsed_s"] = time.time() - t0
            save(rows)  # after every (layout, rank): a run cut short keeps what it measured
    env["elapsed_s"] = time.time() - t0
    return rows


def _have(r):
    return [k[: -len("_us_per_layer")] for k in r if k.endswith("_us_per_layer") and k != "floor_us_per_layer"]


def _line(r):
    parts = [f"{r['layout']:8s} r{r['R']:<3d} T={r['T']:<4d} {r['mix']:>6s}"]
    for name in _have(r):
        parts.append(f"{name} {r[f'{name}_us_per_layer']:7.1f}")
    parts.append(f"floor {r['floor_us_per_layer']:6.1f} us/layer")
    parts.append("err " + " ".join(f"{p} {r[f'{p}_err']:.0e}" for p in _have(r) if f"{p}_err" in r))
    return " | ".join(parts)


def markdown(rows, env, n_layers, S, dtype):
    have = _have(rows[0]) if rows else []
    lora = [p for p in have if p != "base"]  # base_carve rows too: their GEMMs against the default's
    L = ["# LoRA decode step: the two-kernel path (shrink + expand) over the base GEMMs (issue 13)", "",
         f"Device: **{env.get('device')}**; torch {env.get('torch')}, triton {env.get('triton')}; "
         f"copy bandwidth {env.get('copy_GBps', float('nan')):.0f} GB/s (read + write); {n_layers} layers per "
         f"captured step (one graph per path and T, for every mix); us per layer (step / layers); {dtype}, "
         f"{S} slots. `x − base` is what LoRA costs; `+%` the step over the base GEMMs alone.", ""]
    if "overlap_pdl" in have and not env.get("pdl_available"):
        L += [f"Note: {PDL_NOTE.format(device=env.get('device'))}.", ""]
    if env.get("failed_check"):
        L += [f"**Stopped: a path disagreed with the reference**: {env['failed_check']}", ""]
    if env.get("skipped"):
        L += [f"Not run (time budget): {', '.join(env['skipped'])}; rerun with --layouts/--ranks.", ""]
    head = "| layout | R | T | mix | " + " | ".join(f"{n} us" for n in have)
    if "base" in have:
        head += " | " + " | ".join(f"{n} − base (+%)" for n in lora)
    head += " | LoRA floor us | err (" + " / ".join(lora) + ") |"
    L += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [r["layout"], str(r["R"]), str(r["T"]), r["mix"]]
        cells += [f"{r[f'{n}_us_per_layer']:.1f}" for n in have]
        if "base" in have:
            b = r["base_us_per_layer"]
            cells += [f"{r[f'{n}_us_per_layer'] - b:.1f} (+{100 * (r[f'{n}_us_per_layer'] / b - 1):.1f}%)" for n in lora]
        cells.append(f"{r['floor_us_per_layer']:.1f}")
        cells.append(" / ".join(f"{r.get(f'{n}_err', float('nan')):.0e}" for n in lora))
        L.append("| " + " | ".join(cells) + " |")
    return "\n".join(L) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for lora_decode.json / .md")
    ap.add_argument("--layouts", default="fused", help="fused and/or separate (comma-separated)")
    ap.add_argument("--ranks", default=",".join(map(str, RANKS)))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--layers", type=int, default=32, help="layers (own weights each) in one captured step")
    ap.add_argument("--slots", type=int, default=SLOTS, help="GPU slots (max_loras)")
    ap.add_argument("--reps", type=int, default=20, help="timed replays per graph (median)")
    ap.add_argument("--no-base", dest="base", action="store_false", help="LoRA kernels only, no base GEMMs")
    ap.add_argument("--budget-s", type=float, default=150,
                    help="start no new (layout, rank) block after this many seconds (0: no limit); results are "
                         "written after every block")
    ap.add_argument("--paths", default=",".join(LORA_PATHS), help="LoRA paths to time (comma-separated; "
                    "base is timed unless --no-base)")
    ap.add_argument("--kernel-times", action="store_true",
                    help="also profile each graph's replays: device time per kernel name, into the JSON rows")
    ap.add_argument("--timeline", action="store_true",
                    help="also store one replay's kernels (name, stream, start, duration) for the first mix")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (1/64), 2 layers: a CPU check of the script")
    args = ap.parse_args(argv)
    args.layouts = args.layouts.split(",")
    args.ranks = [int(r) for r in args.ranks.split(",")]
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.mixes = args.mixes.split(",")
    args.paths = [p for p in args.paths.split(",") if p != "base"]
    bad = [x for x in args.layouts if x not in LAYOUTS] + [
        p for p in args.paths if p not in LORA_PATHS and not VARIANT.match(p)] + [
        m for m in args.mixes if not m.split("-")[0].isdigit() or int(m.split("-")[0]) < 1 or m.count("-") > 1
        or (m.count("-") == 1 and m.split("-")[1] not in ("half", "qv"))]
    if bad:
        sys.exit(f"unknown layout or mix {bad}; layouts: {', '.join(LAYOUTS)}; mixes like 1, 8, 32, 8-half, 32-qv")
    if args.smoke:
        args.layers, args.ranks, args.reps, args.slots = 1, [16], 1, 8
        args.tokens = [8]
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
    from loramux.kernels.tiles import pdl_available

    env["pdl_available"] = pdl_available(device)
    print(env, flush=True)
    if not env["pdl_available"]:
        print(f"note: {PDL_NOTE.format(device=env['device'])}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    started = time.time()

    def save(rows):
        md = markdown(rows, env, args.layers, args.slots, str(dtype).replace("torch.", ""))
        with open(os.path.join(args.out, "lora_decode.json"), "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "lora_decode.md"), "w") as f:
            f.write(md)
        return md

    rows = run(args, device, dtype, env, save)
    save(rows)
    env["elapsed_s"] = time.time() - started
    if device.type == "cuda":
        env["kernel_resources"] = kernel_resources()
        for k in env["kernel_resources"]:
            print({key: k.get(key) for key in ("kernel", "regs", "spills", "shared", "num_warps", "error")})
    print(save(rows))


if __name__ == "__main__":
    main()

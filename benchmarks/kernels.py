"""Multi-LoRA kernel benchmark (issue 4): Triton shrink/expand against the torch reference and a
dense torch.mm floor, on Llama-3-8B's layer shapes in bfloat16.

    PYTHONPATH=. python benchmarks/kernels.py --json results.json          # the full table
    PYTHONPATH=. python benchmarks/kernels.py --sweep --json sweep.json    # launch-shape sweep
    PYTHONPATH=. python benchmarks/kernels.py --smoke                      # tiny shapes, any device

Per case: median time (CUDA events, cold L2: a 256 MiB buffer is rewritten before every run),
the fewest bytes the op must move, achieved bandwidth as a fraction of the device-to-device copy
ceiling measured in the same run, speedup over the torch reference, and a dense torch.mm with
one adapter's weights (the floor). Decode cases also get the eager back-to-back time of a
shrink+expand pair (host launch cost included) and its CUDA-graph replay time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

LAYERS = {  # name: (hidden in, output slices)
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
    "h2048": (2048, (2048,)),
    "h8192": (8192, (8192,)),
}
RANKS = {"o": (16, 64, 128)}  # others: (16, 64)
TOKENS = (1, 16, 64, 128, 256, 1024, 4096, 8192)
DECODE_MAX = 256
MAPPINGS = ("1", "4", "32", "4-half")  # distinct adapters, random order; "4-half": half the tokens have none


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Median GPU time of one call, replayed from a CUDA graph (so the host's launch cost is left
    out) after a read of a 256 MiB buffer (so L2 is cold and holds no dirty lines). Falls back
    to eager calls if capture fails; wall clock on CPU."""

    def __init__(self, device, reps=25):
        self.device, self.reps = device, reps
        self.flush = torch.ones(64 * 2**20, dtype=torch.int32, device=device) if device.type == "cuda" else None
        self.eager_fallbacks = 0

    def graph(self, fn):
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g

    def __call__(self, fn, reps=None):
        reps = reps or self.reps
        fn()
        sync(self.device)
        if self.device.type != "cuda":
            ts = []
            for _ in range(min(reps, 3)):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(ts)
        try:
            g = self.graph(fn)
            run = g.replay
        except Exception as e:  # noqa: BLE001 - report and time eagerly
            self.eager_fallbacks += 1
            print(f"  graph capture failed ({type(e).__name__}: {str(e)[:80]}); timing eagerly", file=sys.stderr)
            sync(self.device)
            g, run = None, fn
        t0 = time.perf_counter()
        run()
        sync(self.device)
        if time.perf_counter() - t0 > 0.02:  # slow op (torch reference at prefill): fewer runs
            reps = max(5, reps // 4)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for st, en in ev:
            self.flush.sum()
            st.record()
            run()
            en.record()
        sync(self.device)
        del g
        return statistics.median(st.elapsed_time(en) * 1e3 for st, en in ev)  # us


def eager_us(fn, device, iters=50):
    """Back-to-back eager calls: what a step pays without CUDA graphs (host launch cost included)."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e6 / iters


def ceilings(device, timer):
    """Device-copy bandwidth (bytes read + written) and the launch floor of an empty kernel."""
    import triton
    import triton.language as tl

    @triton.jit
    def _noop(p):
        pass

    if device.type != "cuda":
        return {"copy_GBps": float("nan"), "empty_kernel_us": float("nan"), "eager_launch_us": float("nan")}
    # device copy, bytes read + written: the best of eager and graph-replayed copies of 1 GiB
    # (a graph may turn copy_ into a copy-engine memcpy, which is slower) and an elementwise kernel
    n = 512 * 2**20  # 1 GiB of bf16
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    nbytes = 2 * a.numel() * 2
    for _ in range(20):  # let the clocks settle
        b.copy_(a)
    sync(device)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]
    for st, en in ev:
        st.record()
        b.copy_(a)
        en.record()
    sync(device)
    t_eager = statistics.median(st.elapsed_time(en) * 1e3 for st, en in ev)
    t_graph = timer(lambda: b.copy_(a), reps=10)
    t_kernel = timer(lambda: torch.mul(a, 1.0, out=b), reps=10)
    t_read = timer(lambda: a.sum(), reps=10)
    copies = {"eager_copy": nbytes / t_eager / 1e3, "graph_copy": nbytes / t_graph / 1e3,
              "graph_mul": nbytes / t_kernel / 1e3}
    copy = max(copies.values())
    read = a.numel() * 2 / t_read / 1e3
    del a, b
    flag = torch.empty(1, device=device)
    empty = timer(lambda: _noop[(1,)](flag))
    eager = eager_us(lambda: _noop[(1,)](flag), device, iters=1000)
    props = torch.cuda.get_device_properties(device)
    return {"copy_GBps": copy, "copy_variants_GBps": copies, "read_GBps": read,
            "empty_kernel_us": empty, "eager_launch_us": eager, "device": props.name,
            "sms": props.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__}


def make_case(layer, R, T, mapping, device, dtype=torch.bfloat16, seed=0, scale=1):
    H, sizes = LAYERS[layer]
    H, sizes = H // scale, tuple(n // scale for n in sizes)
    n_ad = int(mapping.split("-")[0])
    g = torch.Generator(device="cpu").manual_seed(seed)
    slots = torch.randint(0, n_ad, (T,), generator=g)
    if mapping.endswith("half"):
        slots[torch.randperm(T, generator=g)[: T // 2]] = -1
    ns, N = len(sizes), sum(sizes)
    x = torch.randn(T, H, device=device, dtype=dtype)
    A = (torch.randn(n_ad, ns * R, H, device=device) / H ** 0.5).to(dtype)
    B = (torch.randn(n_ad, N, R, device=device) / R ** 0.5).to(dtype)
    scales = torch.full((n_ad, ns), 2.0, device=device)
    y = torch.randn(T, N, device=device, dtype=dtype)
    return dict(H=H, sizes=sizes, N=N, NR=ns * R, S=n_ad, x=x, A=A, B=B, scales=scales, y=y,
                slots=slots.to(torch.int32).to(device))


def bytes_moved(c, meta, es=2):
    T_act, n_act = meta.num_lora_tokens, meta.num_active
    H, N, NR, R = c["H"], c["N"], c["NR"], c["NR"] // len(c["sizes"])
    T = c["x"].shape[0]
    return {
        "shrink": T_act * H * es + n_act * NR * H * es + T_act * NR * 4,
        "expand": 2 * T_act * N * es + T_act * NR * 4 + n_act * N * R * es,
        "dense_shrink": T * H * es + NR * H * es + T * NR * es,
        "dense_expand": 2 * T * N * es + T * R * es + N * R * es,
    }


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run_case(layer, R, T, mapping, device, timer, ceil, scale=1, decode_extras=True):
    from loramux.kernels import build_lora_meta, reference
    from loramux.kernels.expand import expand_config, lora_expand_triton
    from loramux.kernels.shrink import lora_shrink_triton, shrink_config

    # the interpreter's bfloat16 is wrong: float16 there (smoke runs only)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    c = make_case(layer, R, T, mapping, device, dtype=dtype, scale=scale)
    x, A, B, scales, y, sizes = c["x"], c["A"], c["B"], c["scales"], c["y"], c["sizes"]
    meta = build_lora_meta(c["slots"], c["S"])
    row = dict(layer=layer, R=R, T=T, mapping=mapping, H=c["H"], N=c["N"], slices=len(sizes),
               lora_tokens=meta.num_lora_tokens, active=meta.num_active)
    row["shrink_cfg"] = shrink_config(meta, c["NR"], c["H"], x.dtype, device).__dict__
    row["expand_cfg"] = expand_config(meta, sizes, R, y.dtype, device).__dict__

    # correctness against the float32 reference (the timed reference below runs in bf16, like PEFT)
    buf = lora_shrink_triton(x, A, scales, meta)
    y1 = y.clone()
    lora_expand_triton(y1, buf, B, sizes, meta)
    buf_ref = reference.lora_shrink_ref(x.float(), A.float(), scales, meta)
    y_ref = y.float()
    reference.lora_expand_ref(y_ref, buf_ref, B.float(), sizes, meta)
    act = (c["slots"] >= 0)
    row["err_shrink"] = rel_err(buf[act], buf_ref[act]) if meta.num_lora_tokens else 0.0
    row["err_expand"] = rel_err((y1.float() - y.float())[act], (y_ref - y.float())[act]) if meta.num_lora_tokens else 0.0
    del y1, y_ref, buf_ref

    row["shrink_us"] = timer(lambda: lora_shrink_triton(x, A, scales, meta))
    row["expand_us"] = timer(lambda: lora_expand_triton(y, buf, B, sizes, meta))
    row["ref_shrink_us"] = timer(lambda: reference.lora_shrink_ref(x, A, scales, meta))
    row["ref_expand_us"] = timer(lambda: reference.lora_expand_ref(y, buf, B, sizes, meta))
    A0, B0 = A[0], B[0]
    h16 = buf[:, :R].to(x.dtype).contiguous()
    row["dense_shrink_us"] = timer(lambda: torch.mm(x, A0.t()))
    row["dense_expand_us"] = timer(lambda: y.addmm_(h16, B0.t()))
    nbytes = bytes_moved(c, meta)
    row.update({f"bytes_{k}": v for k, v in nbytes.items()})
    for op in ("shrink", "expand"):
        bw = nbytes[op] / (row[f"{op}_us"] * 1e-6) / 1e9
        row[f"{op}_GBps"] = bw
        row[f"{op}_bw_frac"] = bw / ceil["copy_GBps"]
        row[f"{op}_speedup"] = row[f"ref_{op}_us"] / row[f"{op}_us"]
        row[f"dense_{op}_bw_frac"] = nbytes[f"dense_{op}"] / (row[f"dense_{op}_us"] * 1e-6) / 1e9 / ceil["copy_GBps"]

    if decode_extras and T <= DECODE_MAX and device.type == "cuda":
        def pair():
            b = lora_shrink_triton(x, A, scales, meta)
            lora_expand_triton(y, b, B, sizes, meta)

        def ref_pair():
            b = reference.lora_shrink_ref(x, A, scales, meta)
            reference.lora_expand_ref(y, b, B, sizes, meta)

        row["pair_us"] = timer(pair)
        row["eager_pair_us"] = eager_us(pair, device)
        row["eager_ref_pair_us"] = eager_us(ref_pair, device, iters=10)
    return row


def cases(smoke=False):
    if smoke:
        for layer in ("qkv", "down"):
            for T in (1, 16, 64):
                for mapping in MAPPINGS:
                    yield layer, 16, T, mapping
        return
    for layer in LAYERS:
        for R in RANKS.get(layer, (16, 64)):
            for T in TOKENS:
                for mapping in MAPPINGS:
                    yield layer, R, T, mapping


def fmt_row(r):
    return (f"{r['layer']:>7} r{r['R']:<3} T{r['T']:<5} {r['mapping']:>6} | "
            f"shrink {r['shrink_us']:8.1f}us {100 * r['shrink_bw_frac']:5.1f}% x{r['shrink_speedup']:6.1f} "
            f"(mm {r['dense_shrink_us']:7.1f}) | "
            f"expand {r['expand_us']:8.1f}us {100 * r['expand_bw_frac']:5.1f}% x{r['expand_speedup']:6.1f} "
            f"(mm {r['dense_expand_us']:7.1f})"
            + (f" | pair {r['pair_us']:5.1f} eager {r['eager_pair_us']:6.1f} (ref {r['eager_ref_pair_us']:7.1f})"
               if "pair_us" in r else ""))


# --------------------------------------------------------------------------------------------
# launch-shape sweep (used to set the heuristics in shrink_config / expand_config)

SWEEP_CASES = [  # (layer, R, T, mapping): few-tile (decode) and many-tile (prefill) shapes
    ("qkv", 16, 1, "1"), ("down", 64, 1, "1"), ("qkv", 16, 64, "32"), ("qkv", 64, 256, "32"),
    ("gate_up", 16, 256, "4"), ("o", 16, 128, "1"), ("qkv", 16, 1024, "4"), ("qkv", 16, 8192, "1"),
    ("qkv", 64, 8192, "4"), ("gate_up", 64, 8192, "1"), ("down", 16, 8192, "32"), ("o", 128, 4096, "4"),
]


def sweep_configs(meta, NR, R, H, sizes, dtype, device):
    """Launch-shape variants for one case: the heuristic's choice first."""
    from loramux.kernels.expand import ExpandConfig, expand_config
    from loramux.kernels.shrink import ShrinkConfig, shrink_config
    from loramux.kernels.tiles import next_pow2

    big = meta.max_segment > 64
    s_cfgs = [shrink_config(meta, NR, H, dtype, device)]
    if big:
        for bm in (32, 64, 128):
            for bn in (64, 128, 256):
                if bn > max(64, next_pow2(NR)) or bn < next_pow2(NR) // 4:
                    continue
                for sk in (1, 2, 4):
                    for bk, w, st in ((64, 8, 3), (128, 4, 3), (64, 4, 4)):
                        if bm * bn >= 128 * 256 or (bm * bn >= 64 * 256 and (bk, w) != (64, 8)):
                            continue
                        s_cfgs.append(ShrinkConfig(bm, bn, bk, sk, w, st))
    else:
        for bm in ((16, 32) if meta.max_segment > 16 else (16,)):
            for bn in (16, 32, 64, 128):
                if bn > max(16, next_pow2(NR)):
                    continue
                for sk in (1, 2, 4, 8, 16, 32):
                    for bk, w, st in ((64, 4, 4), (128, 4, 4)):
                        s_cfgs.append(ShrinkConfig(bm, bn, bk, sk, w, st))
    e_cfgs = [expand_config(meta, sizes, R, dtype, device)]
    h = e_cfgs[0]
    e_cfgs.append(ExpandConfig(h.block_m, h.block_n, h.group, h.num_warps, h.num_stages, cast_buf=False))
    if big:
        for bm in (32, 64, 128):
            for bn in (64, 128):
                for w in (4, 8):
                    for st in (2, 3, 4):
                        for g in (4, 8, 16):
                            e_cfgs.append(ExpandConfig(bm, bn, g, w, st))
    else:
        for bm in ((16, 32) if meta.max_segment > 16 else (16,)):
            for bn in (32, 64, 128):
                for g in (1, 2):
                    for st in (2, 3):
                        e_cfgs.append(ExpandConfig(bm, bn, g, 4, st))
    dedup = lambda cs: list(dict.fromkeys(cs))  # noqa: E731
    return dedup(s_cfgs), dedup(e_cfgs)


def sweep(device, timer, out_rows, shard=None, scale=1, max_cfgs=None, kinds=("shrink", "expand"), case_ids=None):
    """Time every variant of every sweep case. shard=(k, n): compile-only worker k of n (fills
    Triton's on-disk cache in parallel so the timed pass does not wait on the compiler)."""
    from loramux.kernels import build_lora_meta
    from loramux.kernels.expand import lora_expand_triton
    from loramux.kernels.shrink import lora_shrink_triton

    idx = 0
    chosen = [SWEEP_CASES[i] for i in case_ids] if case_ids else SWEEP_CASES[: 2 if scale > 1 else None]
    for layer, R, T, mapping in chosen:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
        c = make_case(layer, R, T, mapping, device, dtype=dtype, scale=scale)
        meta = build_lora_meta(c["slots"], c["S"])
        x, A, B, scales, y, sizes = c["x"], c["A"], c["B"], c["scales"], c["y"], c["sizes"]
        s_cfgs, e_cfgs = sweep_configs(meta, c["NR"], R, c["H"], sizes, dtype, device)
        if max_cfgs:
            s_cfgs, e_cfgs = s_cfgs[:max_cfgs], e_cfgs[:max_cfgs]
        buf = lora_shrink_triton(x, A, scales, meta)
        t_case = time.perf_counter()
        for kind, cfgs in (("shrink", s_cfgs), ("expand", e_cfgs)):
            if kind not in kinds:
                continue
            res = []
            for cfg in cfgs:
                if kind == "shrink":
                    fn = lambda: lora_shrink_triton(x, A, scales, meta, config=cfg)  # noqa: E731
                else:
                    fn = lambda: lora_expand_triton(y, buf, B, sizes, meta, config=cfg)  # noqa: E731
                idx += 1
                if shard is not None:
                    if idx % shard[1] == shard[0]:
                        try:
                            fn()
                        except Exception:
                            pass
                    continue
                try:
                    t = timer(fn, reps=10)
                except Exception as e:  # out of resources etc.
                    t = float("inf")
                    print(f"  {kind} {cfg}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
                res.append((t, cfg))
            if shard is not None:
                continue
            heur_t, heur = res[0]
            res.sort(key=lambda p: p[0])
            out_rows.append(dict(kind=kind, layer=layer, R=R, T=T, mapping=mapping, heuristic_us=heur_t,
                                 heuristic=heur.__dict__, all=[dict(us=t, **cfg.__dict__) for t, cfg in res]))
            print(f"sweep {kind:6} {layer:>7} r{R:<3} T{T:<5} {mapping:>6}: heuristic {heur_t:8.1f}us, "
                  f"best {res[0][0]:8.1f}us {res[0][1]}, 2nd {res[1][0] if len(res) > 1 else 0:8.1f}us", flush=True)
        if shard is None:
            print(f"  ({time.perf_counter() - t_case:.0f}s, {len(s_cfgs)}+{len(e_cfgs)} configs)", file=sys.stderr, flush=True)


def _compile_worker(mode, k, n, scale, only):
    device = torch.device("cuda")
    if mode.startswith("sweep"):
        _, kinds, ids = mode.split(":")
        sweep(device, None, [], shard=(k, n), scale=scale, kinds=tuple(kinds.split(",")),
              case_ids=[int(i) for i in ids.split(",")] if ids else None)
        return
    from loramux.kernels import build_lora_meta
    from loramux.kernels.expand import lora_expand_triton
    from loramux.kernels.shrink import lora_shrink_triton

    for i, (layer, R, T, mapping) in enumerate(cases(scale > 1)):
        if i % n != k or (only and layer not in only.split(",")):
            continue
        c = make_case(layer, R, T, mapping, device, scale=scale)
        meta = build_lora_meta(c["slots"], c["S"])
        try:
            buf = lora_shrink_triton(c["x"], c["A"], c["scales"], meta)
            lora_expand_triton(c["y"], buf, c["B"], c["sizes"], meta)
        except Exception as e:
            print(f"compile worker: {layer} r{R} T{T} {mapping}: {e!r}"[:300], file=sys.stderr)
        del c


def parallel_compile(mode, n, scale, only=None):
    """Fill Triton's on-disk cache from n processes so the timed pass never waits on the compiler."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_compile_worker, args=(mode, k, n, scale, only)) for k in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=max(1.0, 300 - (time.perf_counter() - t0)))
        if p.is_alive():
            p.kill()
    print(f"# parallel compile ({mode}) with {n} workers: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--sweep", action="store_true", help="time launch-shape variants on a few cases")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (hidden / 16): checks the script")
    ap.add_argument("--only", help="comma-separated layers to run")
    ap.add_argument("--workers", type=int, default=12, help="parallel compile processes (CUDA only)")
    ap.add_argument("--sweep-kinds", default="shrink,expand", help="which ops --sweep varies")
    ap.add_argument("--sweep-cases", help="comma-separated indices into SWEEP_CASES")
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting new cases after this many seconds")
    ap.add_argument("--report", help="print tables (and --table-md / --png) from a --json result, then exit")
    ap.add_argument("--table-md", help="with --report: write the full table here")
    ap.add_argument("--png", help="with --report: write the plot here")
    args = ap.parse_args(argv)
    if args.report:
        report(args.report, args.table_md, args.png)
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    timer = Timer(device)
    ceil = ceilings(device, timer)
    print(json.dumps(ceil), flush=True)
    result = {"ceilings": ceil, "rows": [], "sweep": []}
    if args.sweep:
        kinds = tuple(args.sweep_kinds.split(","))
        ids = [int(i) for i in args.sweep_cases.split(",")] if args.sweep_cases else None
        if device.type == "cuda" and args.workers > 1:
            parallel_compile(f"sweep:{','.join(kinds)}:{args.sweep_cases or ''}", args.workers, 16 if args.smoke else 1)
        sweep(device, timer, result["sweep"], scale=16 if args.smoke else 1, max_cfgs=3 if args.smoke else None,
              kinds=kinds, case_ids=ids)
    else:
        if device.type == "cuda" and args.workers > 1:
            parallel_compile("bench", args.workers, 16 if args.smoke else 1, args.only)
        t_start = time.perf_counter()
        jsonl = open(args.json + "l", "w") if args.json else None
        for layer, R, T, mapping in cases(args.smoke):
            if args.only and layer not in args.only.split(","):
                continue
            if args.budget_s and time.perf_counter() - t_start > args.budget_s:
                print("# time budget spent: stopping early", file=sys.stderr)
                break
            row = run_case(layer, R, T, mapping, device, timer, ceil, scale=16 if args.smoke else 1)
            result["rows"].append(row)
            print(fmt_row(row), flush=True)
            if jsonl:
                jsonl.write(json.dumps(row) + "\n")
                jsonl.flush()
        print(f"# {len(result['rows'])} cases in {time.perf_counter() - t_start:.0f}s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    if result["rows"]:
        summarize(result)


def summarize(result):
    rows = result["rows"]
    ceil = result["ceilings"]
    print(f"\n# device {ceil.get('device')}: copy {ceil['copy_GBps']:.0f} GB/s, empty kernel "
          f"{ceil['empty_kernel_us']:.1f} us (events), eager launch {ceil['eager_launch_us']:.1f} us")
    pairs = [r for r in rows if "pair_us" in r]
    if pairs:
        one = [r["pair_us"] for r in pairs if r["mapping"] == "1"]
        print(f"decode shrink+expand pair (graph): 1 adapter median {statistics.median(one):.1f} us; "
              f"all median {statistics.median(r['pair_us'] for r in pairs):.1f} max {max(r['pair_us'] for r in pairs):.1f}; "
              f"eager pair median {statistics.median(r['eager_pair_us'] for r in pairs):.1f} us "
              f"(torch ref eager {statistics.median(r['eager_ref_pair_us'] for r in pairs):.1f} us)")
    for op in ("shrink", "expand"):
        pre = [r for r in rows if r["T"] > DECODE_MAX]
        dec = [r for r in rows if r["T"] <= DECODE_MAX]
        if pre:
            fr = sorted(r[f"{op}_bw_frac"] for r in pre)
            print(f"{op}: prefill bw frac min {fr[0]:.2f} median {statistics.median(fr):.2f} max {fr[-1]:.2f}; "
                  f">=0.70 in {sum(f >= 0.7 for f in fr)}/{len(fr)}")
        if dec:
            t1 = [r[f"{op}_us"] for r in dec if r["T"] == 1]
            td = [r[f"{op}_us"] for r in dec]
            print(f"{op}: decode T=1 time median {statistics.median(t1):.1f} us, max {max(t1):.1f} us; "
                  f"all decode median {statistics.median(td):.1f} max {max(td):.1f} us")
        sp = sorted(r[f"{op}_speedup"] for r in rows)
        print(f"{op}: speedup vs torch ref min {sp[0]:.2f} median {statistics.median(sp):.1f}; "
              f"slower in {sum(s < 1 for s in sp)}/{len(sp)}")
        worst = max(rows, key=lambda r: r[f"err_{op}"])
        print(f"{op}: worst rel err vs fp32 ref {worst[f'err_{op}']:.2e}")
        ratio = sorted(r[f"{op}_us"] / r[f"dense_{op}_us"] for r in rows if r["mapping"] == "1")
        print(f"{op}: time / dense mm (1 adapter) median {statistics.median(ratio):.2f} max {ratio[-1]:.2f}")


# --------------------------------------------------------------------------------------------
# report: tables and a plot from a --json result (run anywhere; needs matplotlib for the plot)


def _md_table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def report(path, table_md=None, png=None):
    with open(path) as f:
        result = json.load(f)
    rows, ceil = result["rows"], result["ceilings"]
    idx = {(r["layer"], r["R"], r["T"], r["mapping"]): r for r in rows}
    pct = lambda f: f"{100 * f:.0f}%"  # noqa: E731
    # decode: qkv r16, time per op against tokens and adapters
    dec = [[T] + [f"{idx['qkv', 16, T, m][op]:.1f}" for m in MAPPINGS for op in ("shrink_us", "expand_us")]
           + [f"{idx['qkv', 16, T, '1']['dense_shrink_us']:.1f} / {idx['qkv', 16, T, '1']['dense_expand_us']:.1f}",
              f"{idx['qkv', 16, T, '1']['pair_us']:.1f}"]
           for T in TOKENS if T <= DECODE_MAX]
    print(_md_table(["T"] + [f"{m} ad. {op}" for m in MAPPINGS for op in ("shrink", "expand")]
                    + ["dense mm / addmm", "pair (1 ad.)"], dec))
    print()
    pre = []
    for layer in LAYERS:
        for R in RANKS.get(layer, (16, 64)):
            for m in ("1", "32"):
                r = idx[layer, R, 8192, m]
                pre.append([layer, R, m, f"{r['shrink_us']:.1f}", pct(r["shrink_bw_frac"]), f"{r['dense_shrink_us']:.1f}",
                            f"{r['expand_us']:.1f}", pct(r["expand_bw_frac"]), f"{r['dense_expand_us']:.1f}",
                            f"{r['shrink_speedup']:.1f}x / {r['expand_speedup']:.1f}x"])
    print(_md_table(["layer", "R", "adapters", "shrink us", "of copy", "dense mm us", "expand us", "of copy",
                     "dense addmm us", "vs torch ref"], pre))
    if table_md:
        full = [[r["layer"], r["R"], r["T"], r["mapping"], f"{r['shrink_us']:.1f}", pct(r["shrink_bw_frac"]),
                 f"{r['shrink_speedup']:.1f}", f"{r['dense_shrink_us']:.1f}", f"{r['expand_us']:.1f}",
                 pct(r["expand_bw_frac"]), f"{r['expand_speedup']:.1f}", f"{r['dense_expand_us']:.1f}",
                 f"{r['err_shrink']:.0e} / {r['err_expand']:.0e}"] for r in rows]
        with open(table_md, "w") as f:
            f.write(f"# Kernel benchmark: every case ({ceil.get('device')}, torch {ceil.get('torch')}, "
                    f"triton {ceil.get('triton')})\n\nGenerated by `python benchmarks/kernels.py --report "
                    f"{os.path.basename(path)}`; see kernels.md for the method. Copy ceiling "
                    f"{ceil['copy_GBps']:.0f} GB/s. Times in microseconds (CUDA-graph replay, cold L2, median); "
                    "'x' columns are speedups over the torch reference; the last column is the relative error "
                    "against a float32 reference.\n\n")
            f.write(_md_table(["layer", "R", "T", "adapters", "shrink", "of copy", "x ref", "dense mm", "expand",
                               "of copy", "x ref", "dense addmm", "rel err"], full) + "\n")
    if png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(2, 2, figsize=(13, 9))
        dT = [T for T in TOKENS if T <= DECODE_MAX]
        a = ax[0, 0]
        for op, ls in (("shrink", "-"), ("expand", "--")):
            for m, c in zip(("1", "4", "32"), ("C0", "C1", "C2")):
                a.plot(dT, [idx["qkv", 16, T, m][f"{op}_us"] for T in dT], ls, color=c, marker="o", label=f"{op}, {m} ad.")
            a.plot(dT, [idx["qkv", 16, T, "1"][f"dense_{op}_us"] for T in dT], ls, color="k", alpha=0.5,
                   label=f"dense torch.mm ({op})")
        a.axhline(ceil["empty_kernel_us"], color="r", lw=0.8, label="empty kernel")
        a.set(xscale="log", xlabel="tokens", ylabel="us", title="decode, qkv r16 (3 slices)")
        a.legend(fontsize=7)
        a = ax[0, 1]
        names = [f"{layer}\nr{R}" for layer in LAYERS for R in RANKS.get(layer, (16, 64))]
        keys = [(layer, R) for layer in LAYERS for R in RANKS.get(layer, (16, 64))]
        x = range(len(keys))
        for i, (lab, f) in enumerate((("shrink", "shrink_bw_frac"), ("expand", "expand_bw_frac"),
                                      ("dense mm", "dense_shrink_bw_frac"), ("dense addmm", "dense_expand_bw_frac"))):
            a.bar([k + 0.2 * i - 0.3 for k in x], [idx[l, R, 8192, "1"][f] for l, R in keys], 0.2, label=lab)
        a.axhline(0.7, color="r", lw=0.8, label="target 70%")
        a.set_xticks(list(x), names, fontsize=7)
        a.set(ylabel="fraction of copy bandwidth", title="prefill T=8192, 1 adapter")
        a.legend(fontsize=7)
        a = ax[1, 0]
        for m, c in zip(MAPPINGS, ("C0", "C1", "C2", "C3")):
            sp = [(idx["qkv", 16, T, m]["ref_shrink_us"] + idx["qkv", 16, T, m]["ref_expand_us"])
                  / (idx["qkv", 16, T, m]["shrink_us"] + idx["qkv", 16, T, m]["expand_us"]) for T in TOKENS]
            a.plot(TOKENS, sp, marker="o", color=c, label=f"{m} adapters")
        a.set(xscale="log", yscale="log", xlabel="tokens", ylabel="x faster",
              title="shrink+expand vs torch reference (GPU time), qkv r16")
        a.legend(fontsize=7)
        a = ax[1, 1]
        for (layer, R), c in zip((("qkv", 16), ("qkv", 64), ("gate_up", 16), ("gate_up", 64), ("down", 64)),
                                 ("C0", "C1", "C2", "C3", "C4")):
            a.plot(TOKENS, [idx[layer, R, T, "4"]["expand_us"] / idx[layer, R, T, "4"]["dense_expand_us"] for T in TOKENS],
                   marker="o", color=c, label=f"{layer} r{R}")
        a.axhline(1.0, color="k", lw=0.8)
        a.set(xscale="log", xlabel="tokens", ylabel="expand / dense addmm",
              title="expand (all slices, 4 adapters) vs one dense addmm of the same size")
        a.legend(fontsize=7)
        fig.suptitle(f"loramux multi-LoRA kernels, {ceil.get('device')} (copy {ceil['copy_GBps']:.0f} GB/s), bf16")
        fig.tight_layout()
        fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()

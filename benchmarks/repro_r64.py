"""Repro for the rank-64 illegal memory access in benchmarks/throughput.py (temporary).

Replays every shrink/expand launch the engine makes for Llama-3.1-8B shapes (S=32 slots, bf16,
ranks tensor, all 7 projections) in the throughput scenarios (warm-up, then 1 / 8 / 32 adapters:
a 64 x 128-token prefill and a 64-token decode), prints each launch's config before it runs,
synchronises after it and compares with the reference.

    CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=. python benchmarks/repro_r64.py --ranks 16,64
    PYTHONPATH=. python benchmarks/repro_r64.py --cpu-scale 16    # interpreter, guarded buffers
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--cpu-scale" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from loramux.kernels import build_lora_meta, reference
from loramux.kernels import expand as expand_mod
from loramux.kernels import shrink as shrink_mod

S = 32
LLAMA = {  # name: (in, out)
    "q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096),
    "gate": (4096, 14336), "up": (4096, 14336), "down": (14336, 4096),
}


VARIANTS = {  # temporary source patches of the kernels, to bisect under compute-sanitizer
    "base": [],
    "noevenk": [("shrink.py", "EVEN_K=H % cfg.block_k == 0", "EVEN_K=False")],
    "expand_nopipe": [("expand.py", "for j in tl.range(0, n_blocks, num_stages=STAGES):", "for j in range(0, n_blocks):")],
    "shrink_stages1": [("shrink.py", "num_warps=cfg.num_warps, num_stages=cfg.num_stages,", "num_warps=cfg.num_warps, num_stages=1,")],
}


def load_variant(name: str):
    """Copies of loramux.kernels with VARIANTS[name] applied, imported as a separate package."""
    global shrink_mod, expand_mod, build_lora_meta, reference
    if name == "base":
        return
    import importlib
    import shutil
    import tempfile

    root = tempfile.mkdtemp()
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "loramux", "kernels")
    pkg = f"lmxk_{name}"
    shutil.copytree(src, os.path.join(root, pkg), ignore=shutil.ignore_patterns("__pycache__"))
    for fname, old, new in VARIANTS[name]:
        path = os.path.join(root, pkg, fname)
        text = open(path).read()
        assert old in text, (fname, old)
        open(path, "w").write(text.replace(old, new))
    sys.path.insert(0, root)
    shrink_mod = importlib.import_module(f"{pkg}.shrink")
    expand_mod = importlib.import_module(f"{pkg}.expand")
    build_lora_meta = importlib.import_module(f"{pkg}.metadata").build_lora_meta
    reference = importlib.import_module(f"{pkg}.reference")


def scenarios(last_slot: bool = False):
    """(name, token_slots list) in the order the throughput script runs them; last_slot maps
    adapter i to slot S-1-i (the slot at the end of the stacked weights)."""
    if last_slot:
        return [(f"{n}-last", [s if s < 0 else S - 1 - s for s in sl]) for n, sl in scenarios()]
    out = []
    # warm-up: 33 requests of 4 tokens (None, then one per adapter), then one decode step
    out.append(("warmup-prefill", [-1] * 4 + [s for s in range(S) for _ in range(4)]))
    out.append(("warmup-decode", [-1] + list(range(S))))
    for n in (1, 8, 32):
        slots = [i % n for i in range(64)]
        out.append((f"{n}ad-prefill", [s for s in slots for _ in range(128)]))
        out.append((f"{n}ad-decode", slots))
    return out


def guarded(t: torch.Tensor, pad: int = 4096) -> torch.Tensor:
    """A copy of t inside a NaN-poisoned buffer (CPU: out-of-bounds reads show up as NaN)."""
    flat = torch.full((t.numel() + 2 * pad,), float("nan"), dtype=t.dtype)
    flat[pad : pad + t.numel()] = t.reshape(-1)
    return flat[pad : pad + t.numel()].view(t.shape)


def engine_main(argv) -> None:
    """Run benchmarks/throughput.py with every LoRA launch logged and synchronised."""
    import loramux.engine.layers.base as base

    shrink0, expand0 = base.lora_shrink, base.lora_expand
    count = [0]

    def desc(t):
        return f"{tuple(t.shape)}/{t.stride()}/{t.dtype}/{t.data_ptr() % 256}"

    def shrink(x, a, scales, meta, ranks=None):
        count[0] += 1
        cfg = shrink_mod.shrink_config(meta, a.shape[1], x.shape[1], x.dtype, x.device)
        print(f"[{count[0]}] shrink x={desc(x)} a={desc(a)} T={meta.num_tokens} act={meta.num_active} "
              f"maxseg={meta.max_segment} {cfg}", flush=True)
        return shrink0(x, a, scales, meta, ranks)  # run with CUDA_LAUNCH_BLOCKING=1

    def expand(y, buf, b, sizes, meta, ranks=None):
        count[0] += 1
        cfg = expand_mod.expand_config(meta, tuple(sizes), b.shape[2], y.dtype, y.device)
        print(f"[{count[0]}] expand y={desc(y)} buf={desc(buf)} b={desc(b)} {cfg}", flush=True)
        expand0(y, buf, b, sizes, meta, ranks)

    base.lora_shrink, base.lora_expand = shrink, expand
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import throughput

    sys.argv = ["throughput.py", *argv]
    throughput.main()


def main() -> None:
    if sys.argv[1:2] == ["--engine"]:
        engine_main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--cpu-scale", type=int, default=0, help="divide H/out by this, interpreter")
    ap.add_argument("--only", default="", help="comma list of scenario names")
    ap.add_argument("--layers", default=",".join(LLAMA))
    ap.add_argument("--variant", default="base", choices=list(VARIANTS))
    ap.add_argument("--last-slot", action="store_true")
    ap.add_argument("--no-check", action="store_true", help="skip the reference (compute-sanitizer)")
    args = ap.parse_args()
    load_variant(args.variant)
    print(f"variant {args.variant}: {shrink_mod.__name__}, {expand_mod.__name__}", flush=True)
    cpu = args.cpu_scale > 0
    dev = "cpu" if cpu else "cuda"
    dtype = torch.float16 if cpu else torch.bfloat16
    if cpu:  # use the GPU's launch heuristics (132 SMs) under the interpreter
        shrink_mod.target_programs = expand_mod.target_programs = lambda device: 264
    gen = torch.Generator().manual_seed(0)
    failures = 0
    for R in [int(r) for r in args.ranks.split(",")]:
        weights = {}
        for name in args.layers.split(","):
            H, N = LLAMA[name]
            if cpu:
                H, N = H // args.cpu_scale, N // args.cpu_scale
            A = (torch.randn(S, R, H, generator=gen) / H**0.5).to(dtype)
            B = (torch.randn(S, N, R, generator=gen) / R**0.5).to(dtype)
            weights[name] = (A.to(dev), B.to(dev))
        scales = torch.full((S, 1), 2.0, device=dev)
        ranks = torch.full((S,), R, dtype=torch.int32, device=dev)
        for sc_name, slots in scenarios(args.last_slot):
            if args.only and sc_name not in args.only.split(","):
                continue
            token_slots = torch.tensor(slots, dtype=torch.int64, device=dev)
            T = len(slots)
            meta = build_lora_meta(token_slots, S)
            for name, (A, B) in weights.items():
                H, N = A.shape[2], B.shape[1]
                x = (torch.randn(T, H, generator=gen)).to(dtype).to(dev)
                y0 = torch.randn(T, N, generator=gen).to(dtype).to(dev)
                scfg = shrink_mod.shrink_config(meta, R, H, dtype, x.device)
                ecfg = expand_mod.expand_config(meta, (N,), R, dtype, x.device)
                tag = f"R{R} {sc_name} {name} T{T} H{H} N{N}"
                print(f"{tag}\n  shrink {scfg} tiles={meta.num_tiles(scfg.block_m)}\n  expand {ecfg} "
                      f"tiles={meta.num_tiles(ecfg.block_m)}", flush=True)
                if cpu:
                    x, A_, B_, y = guarded(x), guarded(A), guarded(B), guarded(y0.clone())
                else:
                    A_, B_, y = A, B, y0.clone()
                if os.environ.get("REPRO_LAST"):
                    with open(os.environ["REPRO_LAST"], "w") as f:
                        f.write(f"--ranks {R} --only {sc_name} --layers {name}\n")
                t0 = time.perf_counter()
                buf = shrink_mod.lora_shrink_triton(x, A_, scales, meta, ranks)
                if not cpu:
                    torch.cuda.synchronize()
                expand_mod.lora_expand_triton(y, buf, B_, (N,), meta, ranks)
                if not cpu:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                if args.no_check:
                    print(f"  ran ({dt * 1e3:.1f} ms)", flush=True)
                    continue
                # reference in float32 (float64 on the CPU) on the launch's device
                ref_dt = torch.float64 if cpu else torch.float32
                m_ref = build_lora_meta(token_slots.cpu(), S) if cpu else meta
                dv = "cpu" if cpu else dev
                bref = reference.lora_shrink_ref(x.to(dv, ref_dt), A.to(dv, ref_dt), scales.to(dv, ref_dt) if cpu else scales,
                                                 m_ref, ranks.to(dv))
                yref = y0.to(dv, ref_dt)
                reference.lora_expand_ref(yref, buf.to(dv, ref_dt), B.to(dv, ref_dt), (N,), m_ref, ranks.to(dv))
                act = (torch.tensor(slots) >= 0).to(dv)
                e1 = ((buf.to(dv, ref_dt) - bref)[act].norm() / bref[act].norm()).item()
                d, dref = (y.to(dv, ref_dt) - y0.to(dv, ref_dt))[act], (yref - y0.to(dv, ref_dt))[act]
                e2 = ((d - dref).norm() / dref.norm()).item()
                ok = e1 < 1e-2 and e2 < 2e-2 and torch.isfinite(y).all().item()
                failures += not ok
                print(f"  {'ok' if ok else 'FAIL'} shrink err {e1:.1e} expand err {e2:.1e} ({dt * 1e3:.1f} ms)", flush=True)
    print(f"done, {failures} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

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


def scenarios():
    """(name, token_slots list) in the order the throughput script runs them."""
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
        out = shrink0(x, a, scales, meta, ranks)
        torch.cuda.synchronize()
        return out

    def expand(y, buf, b, sizes, meta, ranks=None):
        count[0] += 1
        cfg = expand_mod.expand_config(meta, tuple(sizes), b.shape[2], y.dtype, y.device)
        print(f"[{count[0]}] expand y={desc(y)} buf={desc(buf)} b={desc(b)} {cfg}", flush=True)
        expand0(y, buf, b, sizes, meta, ranks)
        torch.cuda.synchronize()

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
    args = ap.parse_args()
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
        for sc_name, slots in scenarios():
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

"""Launch shapes of the decode graphs' LoRA kernels for a many-adapter batch against a one-adapter
batch (issues 10 and 13), kernel by kernel, at Llama-3.1-8B shapes.

A CUDA graph's shrink and expand have one launch shape per token count (`static_shrink_config`,
`static_expand_config`), chosen for the one-adapter batch; a batch of many adapters fills the
same grid with more tiles. This script times, for one module's pooled weights (max rank 64, 256
slots, bfloat16), the static-meta launches of a 64-token decode batch under each candidate shape,
for three batches: one rank-16 adapter on every slice, 4 adapters of the fleet, and 47 distinct
adapters of the fleet (ranks and targets drawn from `adapter_trace.DEFAULT_MIX`; q/v adapters
leave qkv's k slice and o untouched, scale 0 / rank 0, as the engine writes them). Each shape's
output is checked against the engine's shape. Times: CUDA-graph replay, cold L2, median (`kernels.Timer`),
on the whole GPU (the engine runs these beside a GEMM on part of it: a shape that wins here is a
candidate, to be confirmed in `profile_step.py --fleet 4,1000`).

    PYTHONPATH=. python benchmarks/sweep_decode_launch.py [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.adapter_trace import DEFAULT_MIX  # noqa: E402
from kernels import Timer, rel_err  # noqa: E402

from loramux.engine.layers.side_stream import lora_sms_beside  # noqa: E402
from loramux.kernels import build_lora_meta  # noqa: E402
from loramux.kernels.expand import ExpandConfig, lora_expand_triton, static_expand_config  # noqa: E402
from loramux.kernels.pool import pool_rows  # noqa: E402
from loramux.kernels.shrink import ShrinkConfig, lora_shrink_triton, static_shrink_config  # noqa: E402

MODULES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,))}
TARGETS = {"q/v": {"qkv": (0, 2)}, "q/k/v/o": {"qkv": (0, 1, 2), "o": (0,)},
           "all 7": {"qkv": (0, 1, 2), "o": (0,)}}
R, S, T = 64, 256, 64


def draw_fleet(n: int, rng: random.Random) -> list[tuple[int, str]]:
    kinds = [(k.rank, k.targets) for k in DEFAULT_MIX]
    return rng.choices(kinds, weights=[k.share for k in DEFAULT_MIX], k=n)


def batch(name: str, rng: random.Random) -> tuple[list[tuple[int, str]], torch.Tensor]:
    """(adapters (rank, targets) by slot, token slots [T])."""
    if name == "one":
        adapters, tokens = [(16, "all 7")], [0] * T
    else:
        n = 4 if name == "fleet4" else 47
        adapters = draw_fleet(n, rng)
        tokens = list(range(n)) + [rng.randrange(n) for _ in range(T - n)] if n < T else list(range(T))
        rng.shuffle(tokens)
    slots = torch.tensor([S - 1 - a for a in tokens], dtype=torch.int32)
    return adapters, slots


def module_weights(module: str, adapters, device, gen):
    """Pooled A [U, n, H], B [U, N], starts, ranks, scales for ``adapters`` in slots S-1, S-2, ..."""
    H, sizes = MODULES[module]
    n, N = len(sizes), sum(sizes)
    ranks = torch.zeros(S, dtype=torch.int32)
    scales = torch.zeros(S, n)
    for i, (rank, targets) in enumerate(adapters):
        on = TARGETS[targets].get(module, ())
        if on:
            ranks[S - 1 - i] = rank
            for j in on:
                scales[S - 1 - i, j] = 2.0
    widths = [pool_rows(int(r)) for r in ranks]
    U = sum(widths)
    pool_a = (torch.randn(U, n, H, generator=gen) * H ** -0.5).to(device, torch.bfloat16)
    pool_b = (torch.randn(U, N, generator=gen) * R ** -0.5).to(device, torch.bfloat16)
    starts = torch.tensor([sum(widths[:s]) for s in range(S)], dtype=torch.int32)
    for s in range(S):  # B's columns past the rank are zero (the layout's contract)
        block = pool_b.view(-1)[starts[s] * N : (starts[s] + widths[s]) * N].view(N, widths[s])
        block[:, int(ranks[s]):] = 0
    return (pool_a, pool_b, starts.to(device), ranks.to(device), scales.to(device), sizes)


def shrink_candidates(base: ShrinkConfig) -> list[ShrinkConfig]:
    out = [base]
    for bn, split, stages, warps in itertools.product((16, 32), (1, 2, 4, 8, 16), (2, 4), (2, 4)):
        out.append(ShrinkConfig(base.block_m, bn, base.block_k, split, warps, stages))
    for bk in (64, 256):
        out.append(ShrinkConfig(base.block_m, base.block_n, bk, base.split_k, base.num_warps, base.num_stages))
    return list(dict.fromkeys(out))


def expand_candidates(base: ExpandConfig) -> list[ExpandConfig]:
    out = [base]
    for bn, group, stages, warps in itertools.product((32, 64, 128), (1, 2, 4), (2, 3), (4,)):
        out.append(ExpandConfig(base.block_m, bn, group, warps, stages))
    return list(dict.fromkeys(out))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--modules", default="qkv,o")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    timer = Timer(device)
    rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    batches = {name: batch(name, rng) for name in ("one", "fleet4", "fleet47")}
    results = {"device": torch.cuda.get_device_name(device), "T": T, "S": S, "R": R, "modules": {}}
    for module in args.modules.split(","):
        H, sizes = MODULES[module]
        prepared = {}
        for name, (adapters, slots) in batches.items():
            w = module_weights(module, adapters, device, gen)
            x = torch.randn(T, H, generator=gen).to(device, torch.bfloat16)
            meta = build_lora_meta(slots.to(device), S, static=True)
            prepared[name] = (w, x, meta)
        sms = lora_sms_beside(T, device, H * sum(sizes))  # the engine's shapes: sized for the SMs its GEMM leaves
        s_base = static_shrink_config(T, len(sizes) * R, H, torch.bfloat16, device, sms, rank=R)
        e_base = static_expand_config(T, sizes, R, torch.bfloat16, device, sms)
        rows = []
        for kind, candidates in (("shrink", shrink_candidates(s_base)), ("expand", expand_candidates(e_base))):
            refs = {}
            for cfg in candidates:
                row = {"kernel": kind, "config": cfg.__dict__, "engine": cfg in (s_base, e_base)}
                try:
                    for name, (w, x, meta) in prepared.items():
                        pool_a, pool_b, starts, ranks, scales, _ = w
                        buf = torch.zeros(T, len(sizes) * R, device=device)
                        y = torch.zeros(T, sum(sizes), device=device, dtype=torch.bfloat16)
                        if kind == "shrink":
                            def fn(cfg=cfg):
                                lora_shrink_triton(x, pool_a, scales, meta, ranks, config=cfg, out=buf,
                                                   pool_starts=starts, max_rank=R)
                            out = buf
                        else:
                            lora_shrink_triton(x, pool_a, scales, meta, ranks, config=s_base, out=buf,
                                               pool_starts=starts, max_rank=R)

                            def fn(cfg=cfg):
                                lora_expand_triton(y, buf, pool_b, sizes, meta, ranks, config=cfg,
                                                   pool_starts=starts, store=True, scales=scales)
                            out = y
                        fn()
                        torch.cuda.synchronize()
                        got = out.float().clone()
                        if name not in refs:
                            refs[name] = got
                        err = rel_err(got, refs[name])
                        if not err < 1e-2:
                            raise AssertionError(f"{name}: rel err {err:.1e} against the engine's shape")
                        row[name] = timer(fn)
                except Exception as error:  # noqa: BLE001 - a shape that fails to build or launch: skipped
                    row["error"] = f"{type(error).__name__}: {str(error)[:120]}"
                rows.append(row)
                print(module, kind, cfg, {k: round(v, 1) for k, v in row.items() if isinstance(v, float)},
                      row.get("error", ""), flush=True)
        results["modules"][module] = rows
        for kind in ("shrink", "expand"):
            ok = [r for r in rows if r["kernel"] == kind and "error" not in r]
            base = next(r for r in ok if r["engine"])
            best = min(ok, key=lambda r: r["fleet47"] + r["fleet4"] + r["one"])
            print(f"== {module} {kind}: engine {base['config']} one {base['one']:.1f} fleet4 {base['fleet4']:.1f} "
                  f"fleet47 {base['fleet47']:.1f}; best sum {best['config']} one {best['one']:.1f} "
                  f"fleet4 {best['fleet4']:.1f} fleet47 {best['fleet47']:.1f}")
            safe = [r for r in ok if r["one"] <= base["one"] * 1.02 and r["fleet4"] <= base["fleet4"] * 1.02]
            best = min(safe, key=lambda r: r["fleet47"])
            print(f"   best fleet47 with one, fleet4 within 2%: {best['config']} one {best['one']:.1f} "
                  f"fleet4 {best['fleet4']:.1f} fleet47 {best['fleet47']:.1f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

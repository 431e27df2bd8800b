"""Paged-attention benchmark (issue 12): the Triton kernel against the torch reference and a dense
`F.scaled_dot_product_attention` on the same data, Llama-3.1-8B shapes (H=32, Hkv=8, D=128), bf16,
block size 16.

    PYTHONPATH=. python benchmarks/attention.py --out results/attention        # -> .json and .md
    PYTHONPATH=. python benchmarks/attention.py --sweep --out results/attn-sweep  # launch shapes
    PYTHONPATH=. python benchmarks/attention.py --device cpu --out /tmp/attn      # tiny, interpreter

Per case: median time (`triton.testing.do_bench`; wall clock on CPU), the KV bytes the step must
read (each sequence's keys and values once) over that time, as a fraction of the device-copy
bandwidth measured in the same run (bytes read + written by a 1 GiB copy), the speedup over the
torch reference and over dense SDPA, and the kernel's error against the reference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

H, HKV, D, BLOCK = 32, 8, 128, 16
DECODE_BATCHES = (1, 8, 64, 128)
DECODE_CONTEXTS = (256, 1024, 4096, 32768)  # 32768 for B <= 8 only
PREFILLS = ((1, 2048), (8, 512))  # (sequences, tokens each), no cached prefix
SMOKE = dict(H=4, HKV=2, D=32, BLOCK=8, batches=(1, 3), contexts=(16, 40), prefills=((1, 24), (2, 9)))


def bench(fn, device, reps=None) -> float:
    """Median time of fn in microseconds."""
    if device.type == "cuda":
        import triton.testing

        fn()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        slow = time.perf_counter() - t0 > 0.01  # the torch reference on big batches: fewer runs
        return 1e3 * triton.testing.do_bench(fn, warmup=10 if slow else 25, rep=200 if slow else 100,
                                             return_mode="median")
    fn()
    ts = []
    for _ in range(reps or 3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def copy_bandwidth(device) -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (GB/s)."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(512 * 2**20, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    us = bench(lambda: b.copy_(a), device)
    return 2 * a.numel() * a.element_size() / (us * 1e-6) / 1e9  # a and b are freed on return


def make_case(B, ctx, n_q, shapes, dtype, device, seed=0):
    """Sequences of ctx tokens (n_q of them queries this step) in a shuffled paged cache; also the
    same keys/values laid out densely for SDPA."""
    h, hkv, d, bs = shapes
    g = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = -(-ctx // bs)
    num_blocks = B * per_seq
    k_cache = torch.randn(num_blocks, bs, hkv, d, device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, generator=g).view(B, per_seq).to(torch.int32).to(device)
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=device) * n_q
    q = torch.randn(B * n_q, h, d, device=device, dtype=dtype)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, seq_lens=seq_lens,
                query_start_loc=qsl, B=B, ctx=ctx, n_q=n_q)


def dense_layout(c):
    """[B, Hkv, ctx, D] keys/values and [B, H, n_q, D] queries, for SDPA."""
    B, ctx, n_q = c["B"], c["ctx"], c["n_q"]
    idx = c["block_tables"].long()  # [B, blocks]
    k = c["k_cache"][idx].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    v = c["v_cache"][idx].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    q = c["q"].view(B, n_q, -1, k.shape[-1]).transpose(1, 2).contiguous()
    return q, k, v


def sdpa_variants(q, k, v, causal, scale):
    """Dense SDPA two ways: with enable_gqa (reads K/V once; not every backend takes it) and on
    K/V repeated to H heads beforehand (the flash backend). The table keeps the faster."""
    import torch.nn.functional as F

    G = q.shape[1] // k.shape[1]
    k_rep, v_rep = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    variants = {"repeated_kv": lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=causal, scale=scale)}
    try:
        F.scaled_dot_product_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], enable_gqa=True)
        variants["enable_gqa"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                                        enable_gqa=True)
    except TypeError:  # torch < 2.5
        pass
    return variants


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run_case(kind, B, ctx, n_q, shapes, dtype, device, copy_gbps, reference_too=True):
    from loramux.kernels.attention_reference import paged_attention_ref
    from loramux.kernels.attention import attention_config, paged_attention_triton

    c = make_case(B, ctx, n_q, shapes, dtype, device)
    h, hkv, d, bs = shapes
    scale = d**-0.5
    args = (c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["seq_lens"], c["query_start_loc"])
    T = B * n_q
    cfg = attention_config(T, B, h, hkv, d, c["block_tables"].shape[1], bs, dtype, device)
    row = dict(kind=kind, B=B, ctx=ctx, n_q=n_q, config=cfg.__dict__)
    out = torch.empty_like(c["q"])
    row["triton_us"] = bench(lambda: paged_attention_triton(*args, scale=scale, out=out), device)
    kv_bytes = 2 * B * ctx * hkv * d * c["k_cache"].element_size()
    row["kv_bytes"] = kv_bytes
    row["kv_GBps"] = kv_bytes / (row["triton_us"] * 1e-6) / 1e9
    row["bw_frac"] = row["kv_GBps"] / copy_gbps if copy_gbps == copy_gbps else float("nan")
    if reference_too:
        ref = paged_attention_ref(*[t.float() if t.is_floating_point() else t for t in args], scale=scale)
        row["err"] = rel_err(out, ref)
        del ref
        row["ref_us"] = bench(lambda: paged_attention_ref(*args, scale=scale), device)
        row["speedup_vs_ref"] = row["ref_us"] / row["triton_us"]
    qd, kd, vd = dense_layout(c)
    del c
    times = {}
    for name, fn in sdpa_variants(qd, kd, vd, n_q > 1, scale).items():
        try:
            times[name] = bench(fn, device)
        except RuntimeError as e:  # a backend that refuses the shape: the other variant stands
            print(f"  sdpa {name}: {str(e)[:100]}", file=sys.stderr)
    row["sdpa_variants_us"] = times
    row["sdpa_us"] = min(times.values())
    row["speedup_vs_sdpa"] = row["sdpa_us"] / row["triton_us"]
    return row


def cases(smoke):
    batches = SMOKE["batches"] if smoke else DECODE_BATCHES
    contexts = SMOKE["contexts"] if smoke else DECODE_CONTEXTS
    for B in batches:
        for ctx in contexts:
            if ctx == contexts[-1] and B > 8:
                continue
            yield "decode", B, ctx, 1
    for B, n in SMOKE["prefills"] if smoke else PREFILLS:
        yield "prefill", B, n, n


def sweep(shapes, dtype, device, copy_gbps, smoke, cases=None):
    """Time launch-shape variants on a few decode cases (to tune attention_config)."""
    from loramux.kernels.attention import AttentionConfig, attention_config, paged_attention_triton

    rows = []
    picks = [(3, 40)] if smoke else [(1, 32768), (8, 4096), (64, 1024), (64, 4096), (128, 1024)]
    if cases:
        picks = cases
    for B, ctx in picks:
        c = make_case(B, ctx, 1, shapes, dtype, device)
        args = (c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["seq_lens"], c["query_start_loc"])
        h, hkv, d, bs = shapes
        heur = attention_config(B, B, h, hkv, d, c["block_tables"].shape[1], bs, dtype, device)
        cfgs = [heur]
        for bn in (16, 32, 64, 128) if not cases else (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3, 4) if not cases else (2, 3, 4):
                    for splits in sorted({heur.num_splits, max(1, heur.num_splits // 2), heur.num_splits * 2}
                                         if not cases else {heur.num_splits}):
                        cfgs.append(AttentionConfig(heur.block_m, bn, splits, warps, stages))
        if smoke:
            cfgs = cfgs[:3]
        res = []
        out = torch.empty_like(c["q"])
        for cfg in dict.fromkeys(cfgs):
            try:
                us = bench(lambda: paged_attention_triton(*args, scale=0.1, out=out, config=cfg), device)
            except Exception as e:  # noqa: BLE001 - out of shared memory etc.: record and go on
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
                us = float("inf")
            res.append((us, cfg))
        heur_us = res[0][0]
        res.sort(key=lambda p: p[0])
        kv_bytes = 2 * B * ctx * hkv * d * c["k_cache"].element_size()
        rows.append(dict(B=B, ctx=ctx, heuristic_us=heur_us, heuristic=heur.__dict__, best_us=res[0][0],
                         best=res[0][1].__dict__, best_bw_frac=kv_bytes / (res[0][0] * 1e-6) / 1e9 / copy_gbps,
                         all=[dict(us=us, **cfg.__dict__) for us, cfg in res]))
        print(f"sweep B{B} ctx{ctx}: heuristic {heur_us:.1f}us, best {res[0][0]:.1f}us {res[0][1]}", flush=True)
        del c
    return rows


def markdown(meta, rows):
    lines = [f"# Paged attention on {meta['device']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['dtype']}, H={meta['H']} Hkv={meta['HKV']} "
             f"D={meta['D']} block {meta['BLOCK']}; copy bandwidth {meta['copy_GBps']:.0f} GB/s (read + write).", "",
             "| kind | B | ctx | tokens | triton us | KV GB/s | of copy bw | torch ref us | x ref | SDPA us | x SDPA "
             "| err | config |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kind']} | {r['B']} | {r['ctx']} | {r['B'] * r['n_q']} | error: {r['error']} |"
                         + " |" * 8)
            continue
        cfg = r["config"]
        lines.append(
            f"| {r['kind']} | {r['B']} | {r['ctx']} | {r['B'] * r['n_q']} | {r['triton_us']:.1f} | "
            f"{r['kv_GBps']:.0f} | {100 * r['bw_frac']:.0f}% | {r.get('ref_us', math.nan):.1f} | "
            f"{r.get('speedup_vs_ref', math.nan):.1f} | {r['sdpa_us']:.1f} | {r['speedup_vs_sdpa']:.2f} | "
            f"{r.get('err', math.nan):.1e} | m{cfg['block_m']} n{cfg['block_n']} s{cfg['num_splits']} "
            f"w{cfg['num_warps']} st{cfg['num_stages']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md (a .json/.md suffix is dropped)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sweep", action="store_true", help="time launch-shape variants instead of the table")
    p.add_argument("--no-reference", action="store_true", help="skip the (slow) torch reference")
    p.add_argument("--sweep-cases", default=None, help="decode cases for --sweep, e.g. 64x256,64x1024 (B x ctx)")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    smoke = device.type != "cuda"
    if smoke:  # the Triton interpreter (tiny shapes; its bfloat16 is wrong, so float16)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    shapes = (SMOKE["H"], SMOKE["HKV"], SMOKE["D"], SMOKE["BLOCK"]) if smoke else (H, HKV, D, BLOCK)
    copy_gbps = copy_bandwidth(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
                torch=torch.__version__, triton=triton.__version__, dtype=str(dtype), copy_GBps=copy_gbps,
                H=shapes[0], HKV=shapes[1], D=shapes[2], BLOCK=shapes[3])
    print(f"{meta['device']}: copy {copy_gbps:.0f} GB/s", flush=True)
    base = a.out[: -len(Path(a.out).suffix)] if Path(a.out).suffix in (".json", ".md") else a.out
    json_path, md_path = Path(base + ".json"), Path(base + ".md")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    if a.sweep:
        cases = [tuple(map(int, c.split("x"))) for c in a.sweep_cases.split(",")] if a.sweep_cases else None
        rows = sweep(shapes, dtype, device, copy_gbps, smoke, cases)
        json_path.write_text(json.dumps(dict(meta=meta, sweep=rows), indent=1))
        print(f"wrote {json_path}")
        return 0
    rows = []
    for kind, B, ctx, n_q in cases(smoke):
        try:
            row = run_case(kind, B, ctx, n_q, shapes, dtype, device, copy_gbps, reference_too=not a.no_reference)
        except Exception as e:  # noqa: BLE001 - one failing case (e.g. out of memory) must not lose the rest
            row = dict(kind=kind, B=B, ctx=ctx, n_q=n_q, error=f"{type(e).__name__}: {str(e)[:120]}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        if "error" in row:
            print(f"{kind} B{B} ctx{ctx}: {row['error']}", flush=True)
        else:
            print(f"{kind:7} B{B:<4} ctx{ctx:<6} {row['triton_us']:9.1f}us {row['kv_GBps']:7.0f} GB/s "
                  f"({100 * row['bw_frac']:.0f}% of copy)  ref x{row.get('speedup_vs_ref', math.nan):.1f}  "
                  f"sdpa x{row['speedup_vs_sdpa']:.2f}  err {row.get('err', math.nan):.1e}", flush=True)
    json_path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    md_path.write_text(markdown(meta, rows))
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

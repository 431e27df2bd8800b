"""Our multi-LoRA Triton kernels against vLLM's Triton LoRA ops (issue 4: "beat the best
open-source Triton LoRA kernels"), on Llama-3-8B's layer shapes in bfloat16.

    PYTHONPATH=. python benchmarks/compare_vllm.py --out results/            # GPU: the table
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/compare_vllm.py --check-cpu   # layouts, on CPU

vLLM's code is not part of this repository and never committed: copy its
`vllm/lora/ops/triton_ops/{lora_shrink_op,lora_expand_op,kernel_utils,lora_kernel_metadata,utils}.py`
into a folder (default `.thirdparty/vllm_lora`, git-ignored), with the `vllm.*` imports replaced by
local shims, and pass it with --vllm-ops. The script only loads it from there.

Timing as in benchmarks/kernels.py (its Timer): CUDA-graph replay, cold L2 (a 256 MiB buffer is
read before every run), median of 25. Each side gets its own layout: ours takes A [S, n*R, H] and
writes buf [T, n*R] float32; vLLM takes one [S, R, H] / [S, N_i, R] weight per slice and writes
[n, T, R] float32 (its shrink zeroes the output itself; ours needs no zeroing). vLLM runs its
default configs (no tuned-config folder) and its default metadata (`meta_args(T,
specialize_active_lora=False)`: a grid over max_loras + 1 adapters) and, as a second column, the
specialized metadata (grid over the active adapters only); the speedup is against the faster of
the two. Errors are relative (Frobenius) to a float32 reference over the tokens with an adapter.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from kernels import LAYERS, Timer, rel_err, sync  # noqa: E402  (benchmarks/kernels.py)

CMP_LAYERS = ("qkv", "o", "gate_up", "down")
RANKS = (16, 64)
TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)
ADAPTERS = (1, 32)
DECODE_MAX, PREFILL_MIN = 256, 1024
SCALE = 2.0  # vLLM's shrink takes one float scaling for all adapters; ours gets 2.0 per slot too


def load_vllm(path):
    """Import the copied vLLM ops as a package named `vllm_lora_ops` from `path`."""
    init = os.path.join(path, "__init__.py")
    need = ("lora_shrink_op.py", "lora_expand_op.py", "kernel_utils.py", "lora_kernel_metadata.py", "utils.py")
    missing = [f for f in need if not os.path.exists(os.path.join(path, f))]
    if not os.path.isdir(path) or missing:
        sys.exit(f"vLLM LoRA ops not found in {path!r} (missing: {', '.join(missing) or 'the folder'}).\n"
                 "Copy vllm/lora/ops/triton_ops/{" + ",".join(n[:-3] for n in need) + "}.py there "
                 "(with local shims for the vllm.* imports) or pass --vllm-ops DIR.")
    if not os.path.exists(init):
        open(init, "w").close()
    spec = importlib.util.spec_from_file_location("vllm_lora_ops", init, submodule_search_locations=[path])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["vllm_lora_ops"] = pkg
    spec.loader.exec_module(pkg)
    mods = {}
    for name in ("lora_shrink_op", "lora_expand_op", "lora_kernel_metadata", "utils"):
        mods[name] = importlib.import_module(f"vllm_lora_ops.{name}")
    return mods


class VLLMSide:
    """vLLM's ops on one case: per-slice weight lists, its metadata, its [n, T, R] intermediate."""

    def __init__(self, mods, x, A, B, sizes, slots, S, specialize):
        self.m = mods
        # its pointer caches are keyed by data_ptr: clear them, a freed case's address may be reused
        mods["utils"]._LORA_A_PTR_DICT.clear()
        mods["utils"]._LORA_B_PTR_DICT.clear()
        n, R, H = len(sizes), A.shape[1] // len(sizes), A.shape[2]
        self.a = [A.view(S, n, R, H)[:, i].contiguous() for i in range(n)]
        self.b = list(t.contiguous() for t in torch.split(B, list(sizes), dim=1))
        T = x.shape[0]
        meta = mods["lora_kernel_metadata"].LoRAKernelMeta.make(max_loras=S, max_num_tokens=T, device=x.device)
        meta.prepare_tensors(slots)
        self.meta, self.T = meta, T
        self.args = meta.meta_args(T, specialize_active_lora=specialize)
        self.out = torch.empty(n, T, R, dtype=torch.float32, device=x.device)

    def shrink(self, x):
        self.m["lora_shrink_op"].lora_shrink(x, self.a, self.out, *self.args, SCALE)
        return self.out

    def expand(self, y, buf):
        self.m["lora_expand_op"].lora_expand(buf, self.b, y, *self.args, offset_start=0, add_inputs=True)


def make_case(layer, R, T, S, device, dtype, seed=0, dims=None):
    H, sizes = dims or LAYERS[layer]
    g = torch.Generator(device="cpu").manual_seed(seed)
    slots = torch.randint(0, S, (T,), generator=g)
    n, N = len(sizes), sum(sizes)
    x = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
    A = (torch.randn(S, n * R, H, generator=g) / H ** 0.5).to(device=device, dtype=dtype)
    B = (torch.randn(S, N, R, generator=g) / R ** 0.5).to(device=device, dtype=dtype)
    y = torch.randn(T, N, generator=g).to(device=device, dtype=dtype)
    scales = torch.full((S, n), SCALE, device=device)
    return x, A, B, y, scales, sizes, slots.to(torch.int32).to(device)


def references(x, A, B, y, scales, sizes, meta):
    """float32 reference on x's device (the torch reference runs float32 products for float32 input)."""
    from loramux.kernels import reference

    buf_ref = reference.lora_shrink_ref(x.float(), A.float(), scales, meta)
    y_ref = y.float()
    reference.lora_expand_ref(y_ref, buf_ref, B.float(), sizes, meta)
    return buf_ref, y_ref


def errors(x, y, sizes, buf_ours, y_ours, buf_vllm, y_vllm, buf_ref, y_ref):
    n, T = len(sizes), x.shape[0]
    R = buf_ref.shape[1] // n
    y0 = y.float()
    d_ref = y_ref - y0
    return {
        "err_shrink_ours": rel_err(buf_ours.float(), buf_ref),
        "err_expand_ours": rel_err(y_ours.float() - y0, d_ref),
        "err_shrink_vllm": rel_err(buf_vllm.float().permute(1, 0, 2).reshape(T, n * R), buf_ref),
        "err_expand_vllm": rel_err(y_vllm.float() - y0, d_ref),
    }


def run_case(mods, layer, R, T, S, device, timer):
    from loramux.kernels import build_lora_meta
    from loramux.kernels.expand import lora_expand_triton
    from loramux.kernels.shrink import lora_shrink_triton

    x, A, B, y, scales, sizes, slots = make_case(layer, R, T, S, device, torch.bfloat16)
    meta = build_lora_meta(slots, S)
    row = dict(layer=layer, R=R, T=T, adapters=S, active=meta.num_active)

    # correctness: each side's own shrink -> expand pipeline against the float32 reference
    buf_o = lora_shrink_triton(x, A, scales, meta)
    y_o = y.clone()
    lora_expand_triton(y_o, buf_o, B, sizes, meta)
    v = VLLMSide(mods, x, A, B, sizes, slots, S, specialize=False)
    buf_v = v.shrink(x).clone()
    y_v = y.clone()
    v.expand(y_v, buf_v)
    sync(device)
    buf_ref, y_ref = references(x, A, B, y, scales, sizes, meta)
    row.update(errors(x, y, sizes, buf_o, y_o, buf_v, y_v, buf_ref, y_ref))
    del y_o, y_v, buf_ref, y_ref

    row["ours_shrink_us"] = timer(lambda: lora_shrink_triton(x, A, scales, meta))
    row["ours_expand_us"] = timer(lambda: lora_expand_triton(y, buf_o, B, sizes, meta))
    row["vllm_shrink_us"] = timer(lambda: v.shrink(x))
    row["vllm_expand_us"] = timer(lambda: v.expand(y, buf_v))
    vs = VLLMSide(mods, x, A, B, sizes, slots, S, specialize=True)
    row["vllm_spec_shrink_us"] = timer(lambda: vs.shrink(x))
    row["vllm_spec_expand_us"] = timer(lambda: vs.expand(y, buf_v))
    for op in ("shrink", "expand"):
        best = min(row[f"vllm_{op}_us"], row[f"vllm_spec_{op}_us"])
        row[f"vllm_best_{op}_us"] = best
        row[f"speedup_{op}"] = best / row[f"ours_{op}_us"]
    return row


def summarize(rows):
    out = {}
    for op in ("shrink", "expand"):
        for name, sel in (("decode", lambda r: r["T"] <= DECODE_MAX), ("prefill", lambda r: r["T"] >= PREFILL_MIN),
                          ("all", lambda r: True)):
            sp = [r[f"speedup_{op}"] for r in rows if sel(r)]
            if sp:
                out[f"{op}_{name}_geomean"] = math.exp(sum(math.log(s) for s in sp) / len(sp))
                out[f"{op}_{name}_wins"] = f"{sum(s > 1 for s in sp)}/{len(sp)}"
        worst = min(rows, key=lambda r: r[f"speedup_{op}"])
        best = max(rows, key=lambda r: r[f"speedup_{op}"])
        keys = ("layer", "R", "T", "adapters", f"ours_{op}_us", f"vllm_best_{op}_us", f"speedup_{op}")
        out[f"{op}_worst"] = {k: worst[k] for k in keys}
        out[f"{op}_best"] = {k: best[k] for k in keys}
        out[f"{op}_max_err_ours"] = max(r[f"err_{op}_ours"] for r in rows)
        out[f"{op}_max_err_vllm"] = max(r[f"err_{op}_vllm"] for r in rows)
    return out


def markdown(rows, summ, env):
    L = [f"Device: {env.get('device')}; torch {env.get('torch')}, triton {env.get('triton')}; "
         f"{len(rows)} cases; times in us (graph replay, cold L2, median).", "",
         "| layer | R | T | adapters | shrink ours | shrink vLLM (default / spec.) | speedup | "
         "expand ours | expand vLLM (default / spec.) | speedup |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['layer']} | {r['R']} | {r['T']} | {r['adapters']} | {r['ours_shrink_us']:.1f} | "
                 f"{r['vllm_shrink_us']:.1f} / {r['vllm_spec_shrink_us']:.1f} | {r['speedup_shrink']:.2f}x | "
                 f"{r['ours_expand_us']:.1f} | {r['vllm_expand_us']:.1f} / {r['vllm_spec_expand_us']:.1f} | "
                 f"{r['speedup_expand']:.2f}x |")
    L += ["", "| op | decode (T <= 256) geomean | wins | prefill (T >= 1024) geomean | wins | all | worst case |",
          "|---|---|---|---|---|---|---|"]
    for op in ("shrink", "expand"):
        w = summ[f"{op}_worst"]
        L.append(f"| {op} | {summ[f'{op}_decode_geomean']:.2f}x | {summ[f'{op}_decode_wins']} | "
                 f"{summ[f'{op}_prefill_geomean']:.2f}x | {summ[f'{op}_prefill_wins']} | "
                 f"{summ[f'{op}_all_geomean']:.2f}x | "
                 f"{w['layer']} r{w['R']} T={w['T']} a={w['adapters']}: {w[f'speedup_{op}']:.2f}x "
                 f"({w[f'ours_{op}_us']:.1f} vs {w[f'vllm_best_{op}_us']:.1f} us) |")
    L.append("")
    L.append(f"max relative error vs float32: shrink ours {summ['shrink_max_err_ours']:.1e}, vLLM "
             f"{summ['shrink_max_err_vllm']:.1e}; expand ours {summ['expand_max_err_ours']:.1e}, vLLM "
             f"{summ['expand_max_err_vllm']:.1e}")
    return "\n".join(L) + "\n"


def check_cpu(mods):
    """Layouts and agreement with our reference on a tiny mixed batch (TRITON_INTERPRET=1)."""
    from loramux.kernels import build_lora_meta, reference

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    ok = True
    # the interpreter's bfloat16 is wrong and vLLM's shrink takes only fp16/bf16: float16 here
    for H, sizes, R, S, T in ((64, (64, 16, 16), 16, 3, 13), (64, (32,), 16, 4, 9), (32, (48, 48), 16, 2, 130)):
        x, A, B, y, scales, sizes, slots = make_case("qkv", R, T, S, "cpu", torch.float16, dims=(H, sizes))
        slots[::5] = -1  # some tokens without an adapter
        meta = build_lora_meta(slots, S)
        buf_ref = reference.lora_shrink_ref(x.float(), A.float(), scales, meta)
        y_ref = y.float()
        reference.lora_expand_ref(y_ref, buf_ref, B.float(), sizes, meta)
        for spec in (False, True):
            v = VLLMSide(mods, x, A, B, sizes, slots, S, specialize=spec)
            buf_v = v.shrink(x).clone()
            y_v = y.clone()
            v.expand(y_v, buf_v)
            n = len(sizes)
            e_s = rel_err(buf_v.permute(1, 0, 2).reshape(T, n * R), buf_ref)
            e_e = rel_err(y_v.float() - y.float(), y_ref - y.float())
            good = e_s < 2e-3 and e_e < 2e-2
            ok &= good
            print(f"cpu check H={H} sizes={sizes} R={R} S={S} T={T} specialize={spec}: "
                  f"shrink err {e_s:.1e}, expand err {e_e:.1e} {'ok' if good else 'FAIL'}")
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-ops", default=".thirdparty/vllm_lora", help="folder with the copied vLLM ops")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for compare_vllm.json / .md")
    ap.add_argument("--check-cpu", action="store_true", help="tiny layout/agreement check (TRITON_INTERPRET=1)")
    ap.add_argument("--only", help="comma-separated layers")
    ap.add_argument("--tokens", help="comma-separated token counts")
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting new cases after this many seconds")
    args = ap.parse_args(argv)
    mods = load_vllm(args.vllm_ops)
    if args.check_cpu:
        sys.exit(0 if check_cpu(mods) else 1)
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: use --check-cpu for the layout check")
    import triton

    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    props = torch.cuda.get_device_properties(device)
    env = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
           "triton": triton.__version__, "vllm_ops": os.path.abspath(args.vllm_ops)}
    print(env, flush=True)
    timer = Timer(device)
    layers = args.only.split(",") if args.only else CMP_LAYERS
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else TOKENS
    rows, t0 = [], time.time()
    for layer in layers:
        for R in RANKS:
            for S in ADAPTERS:
                for T in tokens:
                    if args.budget_s and time.time() - t0 > args.budget_s:
                        print(f"budget reached: skipping {layer} r{R} a{S} T={T}", flush=True)
                        continue
                    r = run_case(mods, layer, R, T, S, device, timer)
                    rows.append(r)
                    print(f"{layer:8s} r{R:<3d} T={T:<5d} a={S:<2d} shrink {r['ours_shrink_us']:7.1f} vs "
                          f"{r['vllm_shrink_us']:7.1f}/{r['vllm_spec_shrink_us']:7.1f} ({r['speedup_shrink']:.2f}x) | "
                          f"expand {r['ours_expand_us']:7.1f} vs {r['vllm_expand_us']:7.1f}/"
                          f"{r['vllm_spec_expand_us']:7.1f} "
                          f"({r['speedup_expand']:.2f}x) | err o {r['err_shrink_ours']:.0e}/{r['err_expand_ours']:.0e} "
                          f"v {r['err_shrink_vllm']:.0e}/{r['err_expand_vllm']:.0e}", flush=True)
    summ = summarize(rows)
    env["eager_fallbacks"] = timer.eager_fallbacks
    env["elapsed_s"] = time.time() - t0
    md = markdown(rows, summ, env)
    print(md)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare_vllm.json"), "w") as f:
        json.dump({"env": env, "summary": summ, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "compare_vllm.md"), "w") as f:
        f.write(md)


if __name__ == "__main__":
    main()

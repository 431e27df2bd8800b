"""Our multi-LoRA Triton kernels against vLLM's Triton LoRA ops (issue 4: "beat the best
open-source Triton LoRA kernels"), on Llama-3-8B's layer shapes in bfloat16.

    python benchmarks/fetch_vllm_lora_ops.py                                  # once, needs PyPI
    PYTHONPATH=. python benchmarks/compare_vllm.py --out results/            # GPU: the table
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/compare_vllm.py --check-cpu   # layouts, on CPU

vLLM's code is not part of this repository and never committed: benchmarks/fetch_vllm_lora_ops.py
puts its unmodified `vllm/lora/ops/triton_ops/*.py` of a pinned release, with our shims for the
`vllm.*` modules they import, into `.thirdparty/vllm_lora` (git-ignored; --vllm-ops DIR elsewhere).

vLLM's kernel configs (--vllm-configs): "tuned" (the default) sets VLLM_TUNED_CONFIG_FOLDER to
--vllm-config-dir (default `<vllm-ops>/configs`), so vLLM uses `<GPU>_SHRINK.json` /
`<GPU>_EXPAND_TRUE.json` there when the folder has them for this device, and its built-in defaults
otherwise; "default" unsets it (the old table). Each run records vLLM's version and, per op, the
config source vLLM's own loader reported (the tuned file's name, or "default"); each row records
the launch config vLLM picked for that case (benchmarks/vllm_lora_ops.py says how it is keyed).

Timing as in benchmarks/kernels.py (its Timer): CUDA-graph replay, cold L2 (a 256 MiB buffer is
read before every run), median of 25. Each side gets its own layout: ours takes A [S, n*R, H] and
writes buf [T, n*R] float32; vLLM takes one [S, R, H] / [S, N_i, R] weight per slice and writes
[n, T, R] float32 (its shrink zeroes the output itself; ours needs no zeroing). vLLM runs its
configs as above and its default metadata (`meta_args(T,
specialize_active_lora=False)`: a grid over max_loras + 1 adapters) and, as a second column, the
specialized metadata (grid over the active adapters only); the speedup is against the faster of
the two. Errors are relative (Frobenius) to a float32 reference over the tokens with an adapter.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from loramux.engine.config import EngineConfig  # noqa: E402
from kernels import LAYERS, Timer, rel_err, sync  # noqa: E402  (benchmarks/kernels.py)
from vllm_lora_ops import (  # noqa: E402  (benchmarks/vllm_lora_ops.py)
    CONFIG_MODES, EXPAND_ADD_INPUTS, config_sources, device_named, kernel_configs, load_or_exit, reset_config_caches,
    tuned_config_name, use_configs, vllm_version)

CMP_LAYERS = ("qkv", "o", "gate_up", "down")
RANKS = (16, 64)
TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)
ADAPTERS = (1, 32)
DECODE_MAX, PREFILL_MIN = 256, 1024
GRAPH_MAX = EngineConfig.max_graph_tokens  # the default: steps up to it replay a graph (static meta)
SCALE = 2.0  # vLLM's shrink takes one float scaling for all adapters; ours gets 2.0 per slot too


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

    def config_keys(self) -> dict[str, dict]:
        """get_lora_op_configs' arguments for this case, taken from the tensors as vLLM's ops take them."""
        lora_ids = self.args[4]  # [max_loras + 1]: vLLM keys its tuned files by this length
        rank, hidden = self.a[0].shape[-2:]
        common = dict(max_loras=lora_ids.size(0), batch=self.T, rank=rank, num_slices=len(self.a))
        return {"shrink": dict(op_type="shrink", hidden_size=hidden, **common),
                "expand": dict(op_type="expand", hidden_size=max(b.size(1) for b in self.b),
                               add_inputs=EXPAND_ADD_INPUTS, **common)}

    def shrink(self, x):
        self.m["lora_shrink_op"].lora_shrink(x, self.a, self.out, *self.args, SCALE)
        return self.out

    def expand(self, y, buf):
        self.m["lora_expand_op"].lora_expand(buf, self.b, y, *self.args, offset_start=0,
                                             add_inputs=EXPAND_ADD_INPUTS)


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
    for op, cfg in kernel_configs(mods, v.config_keys()).items():
        row[f"vllm_{op}_config"] = cfg
    buf_v = v.shrink(x).clone()
    y_v = y.clone()
    v.expand(y_v, buf_v)
    sync(device)
    buf_ref, y_ref = references(x, A, B, y, scales, sizes, meta)
    row.update(errors(x, y, sizes, buf_o, y_o, buf_v, y_v, buf_ref, y_ref))
    del y_o, y_v, buf_ref, y_ref

    row["ours_shrink_us"] = timer(lambda: lora_shrink_triton(x, A, scales, meta))
    row["ours_expand_us"] = timer(lambda: lora_expand_triton(y, buf_o, B, sizes, meta))
    if T <= GRAPH_MAX:  # the engine's CUDA-graph steps launch with a static meta: time that launch too
        static = build_lora_meta(slots, S, static=True)
        row["ours_graph_shrink_us"] = timer(lambda: lora_shrink_triton(x, A, scales, static))
        row["ours_graph_expand_us"] = timer(lambda: lora_expand_triton(y, buf_o, B, sizes, static))
    row["vllm_shrink_us"] = timer(lambda: v.shrink(x))
    row["vllm_expand_us"] = timer(lambda: v.expand(y, buf_v))
    vs = VLLMSide(mods, x, A, B, sizes, slots, S, specialize=True)
    row["vllm_spec_shrink_us"] = timer(lambda: vs.shrink(x))
    row["vllm_spec_expand_us"] = timer(lambda: vs.expand(y, buf_v))
    for op in ("shrink", "expand"):
        best = min(row[f"vllm_{op}_us"], row[f"vllm_spec_{op}_us"])
        row[f"vllm_best_{op}_us"] = best
        row[f"speedup_{op}"] = best / row[f"ours_{op}_us"]
        if f"ours_graph_{op}_us" in row:
            row[f"speedup_graph_{op}"] = best / row[f"ours_graph_{op}_us"]
    return row


def summarize(rows):
    out = {}
    for op in ("shrink", "expand"):
        for name, sel in (("decode", lambda r: r["T"] <= DECODE_MAX), ("prefill", lambda r: r["T"] >= PREFILL_MIN),
                          ("all", lambda r: True)):
            sp = [r[f"speedup_{op}"] for r in rows if sel(r)]
            out[f"{op}_{name}_geomean"] = math.exp(sum(math.log(s) for s in sp) / len(sp)) if sp else float("nan")
            out[f"{op}_{name}_wins"] = f"{sum(s > 1 for s in sp)}/{len(sp)}"
        graph = [r[f"speedup_graph_{op}"] for r in rows if f"speedup_graph_{op}" in r]
        out[f"{op}_graph_wins"] = f"{sum(s > 1 for s in graph)}/{len(graph)}"
        worst = min(rows, key=lambda r: r[f"speedup_{op}"])
        best = max(rows, key=lambda r: r[f"speedup_{op}"])
        keys = ("layer", "R", "T", "adapters", f"ours_{op}_us", f"vllm_best_{op}_us", f"speedup_{op}")
        out[f"{op}_worst"] = {k: worst[k] for k in keys}
        out[f"{op}_best"] = {k: best[k] for k in keys}
        out[f"{op}_max_err_ours"] = max(r[f"err_{op}_ours"] for r in rows)
        out[f"{op}_max_err_vllm"] = max(r[f"err_{op}_vllm"] for r in rows)
    return out


def markdown(rows, summ, env):
    src = env.get("vllm_config_source", {})
    L = [f"Device: {env.get('device')}; torch {env.get('torch')}, triton {env.get('triton')}; "
         f"{len(rows)} cases; times in us (graph replay, cold L2, median).", "",
         f"vLLM {env.get('vllm_version')} (--vllm-configs {env.get('vllm_configs')}): kernel configs from "
         f"shrink: {src.get('shrink')}, expand: {src.get('expand')}.", "",
         f"'ours' launches with an exact meta (eager steps); 'graph' with the static meta the engine's "
         f"CUDA graphs use (T <= {GRAPH_MAX}); speedup = vLLM's better time / ours.", "",
         "| layer | R | T | adapters | shrink ours / graph | shrink vLLM (default / spec.) | speedup (graph) | "
         "expand ours / graph | expand vLLM (default / spec.) | speedup (graph) |",
         "|---|---|---|---|---|---|---|---|---|---|"]

    def cells(r, op):
        graph = f" / {r[f'ours_graph_{op}_us']:.1f}" if f"ours_graph_{op}_us" in r else ""
        graph_sp = f" ({r[f'speedup_graph_{op}']:.2f}x)" if f"speedup_graph_{op}" in r else ""
        return (f"{r[f'ours_{op}_us']:.1f}{graph} | {r[f'vllm_{op}_us']:.1f} / {r[f'vllm_spec_{op}_us']:.1f} | "
                f"{r[f'speedup_{op}']:.2f}x{graph_sp}")

    for r in rows:
        L.append(f"| {r['layer']} | {r['R']} | {r['T']} | {r['adapters']} | {cells(r, 'shrink')} | {cells(r, 'expand')} |")
    L += ["", "| op | decode (T <= 256) geomean | wins | prefill (T >= 1024) geomean | wins | all | graph launch wins | "
          "worst case |", "|---|---|---|---|---|---|---|---|"]
    for op in ("shrink", "expand"):
        w = summ[f"{op}_worst"]
        L.append(f"| {op} | {summ[f'{op}_decode_geomean']:.2f}x | {summ[f'{op}_decode_wins']} | "
                 f"{summ[f'{op}_prefill_geomean']:.2f}x | {summ[f'{op}_prefill_wins']} | "
                 f"{summ[f'{op}_all_geomean']:.2f}x | {summ[f'{op}_graph_wins']} | "
                 f"{w['layer']} r{w['R']} T={w['T']} a={w['adapters']}: {w[f'speedup_{op}']:.2f}x "
                 f"({w[f'ours_{op}_us']:.1f} vs {w[f'vllm_best_{op}_us']:.1f} us) |")
    L.append("")
    L.append(f"max relative error vs float32: shrink ours {summ['shrink_max_err_ours']:.1e}, vLLM "
             f"{summ['shrink_max_err_vllm']:.1e}; expand ours {summ['expand_max_err_ours']:.1e}, vLLM "
             f"{summ['expand_max_err_vllm']:.1e}")
    return "\n".join(L) + "\n"


CPU_CASES = ((64, (64, 16, 16), 16, 3, 13), (64, (32,), 16, 4, 9), (32, (48, 48), 16, 2, 130))  # H, sizes, R, S, T
FAKE_GPU = "NVIDIA H100 80GB HBM3"  # the tuned-lookup check answers torch.cuda.get_device_name() with this
# launch configs for the tuned-lookup check: unlike vLLM's defaults, so a launch with them shows
TUNED_PICK = {"shrink": dict(block_m=16, block_n=16, block_k=32, split_k=2, num_warps=4, num_ctas=1,
                             group_size_m=4, num_stages=2, max_nreg=None),
              "expand": dict(block_m=16, block_n=32, block_k=16, num_warps=4, num_ctas=1, num_stages=2,
                             max_nreg=None)}


def cpu_agreement(mods, H, sizes, R, S, T, specialize, spy=None):
    """vLLM's shrink -> expand on one tiny float16 case against our reference: (shrink err, expand err)."""
    from loramux.kernels import build_lora_meta, reference

    torch.manual_seed(0)
    x, A, B, y, scales, sizes, slots = make_case("qkv", R, T, S, "cpu", torch.float16, dims=(H, sizes))
    slots[::5] = -1  # some tokens without an adapter
    meta = build_lora_meta(slots, S)
    buf_ref = reference.lora_shrink_ref(x.float(), A.float(), scales, meta)
    y_ref = y.float()
    reference.lora_expand_ref(y_ref, buf_ref, B.float(), sizes, meta)
    v = VLLMSide(mods, x, A, B, sizes, slots, S, specialize=specialize)
    if spy is not None:
        spy(v)
    buf_v = v.shrink(x).clone()
    y_v = y.clone()
    v.expand(y_v, buf_v)
    e_s = rel_err(buf_v.permute(1, 0, 2).reshape(T, len(sizes) * R), buf_ref)
    return e_s, rel_err(y_v.float() - y.float(), y_ref - y.float())


def write_tuned_files(folder, device_name, keys):
    """vLLM-format tuned files for `device_name` whose exact keys lead to TUNED_PICK and whose
    neighbours (other max_loras, other token counts) lead elsewhere."""
    for op, k in keys.items():
        kn = (k["hidden_size"], k["rank"]) if op == "shrink" else (k["rank"], k["hidden_size"])
        decoy = dict(TUNED_PICK[op], block_m=64)

        def entry(m, leaf, kn=kn):
            return {str(m): {str(kn[0]): {str(kn[1]): leaf}}}

        table = {str(k["max_loras"]): {str(k["num_slices"]): {**entry(k["batch"], TUNED_PICK[op]),
                                                              **entry(k["batch"] + 4096, decoy)}},
                 str(k["max_loras"] + 40): {str(k["num_slices"]): entry(k["batch"], decoy)}}
        name = tuned_config_name(device_name, op, k.get("add_inputs"))
        with open(os.path.join(folder, name), "w") as f:
            json.dump(table, f)


def check_tuned_cpu(mods):
    """vLLM's own tuned-config lookup on a CPU: with VLLM_TUNED_CONFIG_FOLDER holding files for
    FAKE_GPU, vLLM reports them as its source, its ops are called with the keys VLLMSide records,
    pick the exact entry, launch with it and still agree with our reference; another GPU name and
    --vllm-configs default give "default"."""
    import inspect
    import tempfile

    H, sizes, R, S, T = CPU_CASES[0]
    ok, calls = True, []
    lookup = mods["utils"].get_lora_op_configs

    def spy_on(v):
        for op in ("lora_shrink_op", "lora_expand_op"):
            mods[op].get_lora_op_configs = lambda *a, **kw: calls.append((a, kw)) or lookup(*a, **kw)
        v.expected = v.config_keys()

    def bound(a, kw):
        b = inspect.signature(lookup.__wrapped__).bind(*a, **kw)
        b.apply_defaults()
        return dict(b.arguments)

    with tempfile.TemporaryDirectory() as folder, device_named(FAKE_GPU):
        x, A, B, *_ = make_case("qkv", R, T, S, "cpu", torch.float16, dims=(H, sizes))
        keys = VLLMSide(mods, x, A, B, sizes, torch.zeros(T, dtype=torch.int32), S, specialize=False).config_keys()
        write_tuned_files(folder, FAKE_GPU, keys)
        use_configs("tuned", folder)
        reset_config_caches(mods)
        src = config_sources(mods, FAKE_GPU)
        want = {op: tuned_config_name(FAKE_GPU, op, k.get("add_inputs")) for op, k in keys.items()}
        picked = kernel_configs(mods, keys)
        holder = []
        try:
            e_s, e_e = cpu_agreement(mods, H, sizes, R, S, T, False, spy=lambda v: holder.append(v) or spy_on(v))
        finally:
            for op in ("lora_shrink_op", "lora_expand_op"):
                mods[op].get_lora_op_configs = lookup
        passed = [bound(a, kw) for a, kw in calls]
        expected = [bound((), holder[0].expected[op]) for op in ("shrink", "expand")]
        checks = {"source": src == want, "pick": picked == TUNED_PICK, "keys": passed == expected,
                  "agreement": e_s < 2e-3 and e_e < 2e-2}
        reset_config_caches(mods)
        checks["other GPU"] = config_sources(mods, "NVIDIA H200") == {"shrink": "default", "expand": "default"}
        use_configs("default", None)
        reset_config_caches(mods)
        checks["default mode"] = config_sources(mods, FAKE_GPU) == {"shrink": "default", "expand": "default"}
    for name, good in checks.items():
        ok &= good
        print(f"cpu tuned-config check ({FAKE_GPU!r}) {name}: {'ok' if good else 'FAIL'}")
    print(f"  vLLM's source: {src}; keys passed: {passed}; picked: {picked}; "
          f"shrink err {e_s:.1e}, expand err {e_e:.1e}")
    return ok


def check_cpu(mods):
    """Layouts and agreement with our reference on tiny mixed batches, then the tuned-config
    lookup (TRITON_INTERPRET=1)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--check-cpu runs vLLM's Triton kernels on the CPU: set TRITON_INTERPRET=1 before running it")
    use_configs("default", None)  # vLLM's tuned lookup asks CUDA for the device name
    reset_config_caches(mods)
    ok = True
    # the interpreter's bfloat16 is wrong and vLLM's shrink takes only fp16/bf16: float16 here
    for H, sizes, R, S, T in CPU_CASES:
        for spec in (False, True):
            e_s, e_e = cpu_agreement(mods, H, sizes, R, S, T, spec)
            good = e_s < 2e-3 and e_e < 2e-2
            ok &= good
            print(f"cpu check H={H} sizes={sizes} R={R} S={S} T={T} specialize={spec}: "
                  f"shrink err {e_s:.1e}, expand err {e_e:.1e} {'ok' if good else 'FAIL'}")
    return check_tuned_cpu(mods) and ok


def add_case_options(ap: argparse.ArgumentParser) -> None:
    """The case selection this script and tune_vllm_lora.py share (`selected_cases` reads it)."""
    ap.add_argument("--only", help="comma-separated layers")
    ap.add_argument("--tokens", help="comma-separated token counts")
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting new cases after this many seconds")


def selected_cases(args) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(layers, token counts) named by --only / --tokens, all of them by default."""
    layers = tuple(args.only.split(",")) if args.only else CMP_LAYERS
    return layers, tuple(int(t) for t in args.tokens.split(",")) if args.tokens else TOKENS


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-ops", default=".thirdparty/vllm_lora",
                    help="folder written by benchmarks/fetch_vllm_lora_ops.py")
    ap.add_argument("--vllm-configs", choices=CONFIG_MODES, default="tuned",
                    help="tuned: vLLM's tuned configs for this GPU where the config folder has them (else its "
                         "defaults); default: vLLM's built-in defaults everywhere (the old table)")
    ap.add_argument("--vllm-config-dir",
                    help="folder of vLLM tuned LoRA configs (<GPU>_SHRINK.json, <GPU>_EXPAND_TRUE.json); "
                         "default: $VLLM_TUNED_CONFIG_FOLDER, else <vllm-ops>/configs")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for compare_vllm.json / .md")
    ap.add_argument("--check-cpu", action="store_true", help="tiny layout/agreement check (TRITON_INTERPRET=1)")
    add_case_options(ap)
    args = ap.parse_args(argv)
    mods = load_or_exit(args, check_cpu, "use --check-cpu for the layout check")
    import triton

    config_dir = (args.vllm_config_dir or os.environ.get("VLLM_TUNED_CONFIG_FOLDER")
                  or os.path.join(args.vllm_ops, "configs"))
    try:
        use_configs(args.vllm_configs, config_dir)
    except ValueError as e:
        sys.exit(str(e))
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    props = torch.cuda.get_device_properties(device)
    env = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
           "triton": triton.__version__, "vllm_ops": os.path.abspath(args.vllm_ops),
           "vllm_version": vllm_version(args.vllm_ops), "vllm_configs": args.vllm_configs,
           "vllm_config_dir": os.path.abspath(config_dir) if args.vllm_configs == "tuned" else None,
           # what vLLM's own loader found for this device (its name as vLLM spells it)
           "vllm_config_source": config_sources(mods, torch.cuda.get_device_name(device))}
    print(env, flush=True)
    if args.vllm_configs == "tuned" and "default" in env["vllm_config_source"].values():
        print(f"NOTE: no tuned vLLM config for {props.name!r} in {config_dir} for "
              f"{[op for op, src in env['vllm_config_source'].items() if src == 'default']}: vLLM runs its "
              "defaults there (vLLM ships none; make them with benchmarks/tune_vllm_lora.py)", flush=True)
    timer = Timer(device)
    layers, tokens = selected_cases(args)
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

"""Tune vLLM's LoRA shrink/expand launch configs on this GPU for the kernels benchmark's cases, and
write them where vLLM reads tuned configs, in its format. vLLM's wheels ship no tuned LoRA configs,
and its README_TUNING.md leaves tuning to the user: search the launch parameters per shape, keep
the fastest, store it as `<GPU>_SHRINK.json` / `<GPU>_EXPAND_TRUE.json` nested
`[max_loras][num_slices][m][k][n]`. This script does that for exactly the shapes the benchmark
times, so vLLM runs with the best configs we can find for it on this device.

    PYTHONPATH=. python scripts/tune_vllm_lora.py --out results/      # GPU, then benchmarks/kernels.py

Search: per case and op, a coordinate search from vLLM's own default config (one parameter at a
time over SHRINK_SPACE / EXPAND_SPACE, keeping a change only when it is faster; two rounds), each
candidate run through vLLM's unmodified op (its `get_lora_op_configs` answered with the
candidate), checked against the default config's output, and timed with the benchmark's timer
(CUDA-graph replay, cold L2, median) under vLLM's default metadata. A candidate that fails to
compile or launch (e.g. too much shared memory) is skipped. Results merge into the files already
in --config-dir (default `benchmarks/vllm_configs`, which the benchmark reads); a copy and a log of
every timing go to --out. `tests/test_kernels_vs_vllm.py` runs a tiny search on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.kernels import ADAPTERS, LAYERS, RANKS, TOKENS, Timer, make_case, rel_err, sync  # noqa: E402
from benchmarks.vllm_ops import (  # noqa: E402
    DEFAULT_OPS,
    TUNED_CONFIGS,
    VLLMSide,
    load_vllm,
    reset_config_caches,
    tuned_config_name,
    use_configs,
)

# README_TUNING.md's ranges, narrowed to what these shapes can use (rank 16/64: block_n <= 64)
SHRINK_SPACE = dict(block_m=(16, 32, 64), block_n=(16, 32, 64), block_k=(32, 64, 128, 256),
                    split_k=(1, 2, 4, 8, 16, 32, 64), num_warps=(4, 8), num_stages=(2, 3, 4))
EXPAND_SPACE = dict(block_m=(16, 32, 64, 128), block_n=(32, 64, 128, 256), block_k=(16, 32, 64),
                    num_warps=(4, 8), num_stages=(2, 3, 4))
SPACES = {"shrink": SHRINK_SPACE, "expand": EXPAND_SPACE}
OP_MODULES = {"shrink": "lora_shrink_op", "expand": "lora_expand_op"}
ROUNDS = 2
MAX_ERR = 5e-2  # a candidate further than this from the default config's output is broken (bf16 noise: ~4e-3)


def add_case_options(ap: argparse.ArgumentParser) -> None:
    """The case selection both tuners share (`selected_cases` reads it)."""
    ap.add_argument("--only", help="comma-separated layers")
    ap.add_argument("--tokens", help="comma-separated token counts")
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting new cases after this many seconds")


def selected_cases(args) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(layers, token counts) named by --only / --tokens, all of the benchmark's by default."""
    layers = tuple(args.only.split(",")) if args.only else tuple(LAYERS)
    return layers, tuple(int(t) for t in args.tokens.split(",")) if args.tokens else TOKENS


def coordinate_search(start: dict, space: dict, measure, rounds: int = ROUNDS) -> tuple[dict, float, dict]:
    """Minimize measure(config) -> us (None: the config does not run) one parameter at a time.

    :returns: the best config, its time, and every timing keyed by the config's sorted items.
    """
    timed: dict = {}

    def cost(cfg):
        key = tuple(sorted(cfg.items()))
        if key not in timed:
            timed[key] = measure(cfg)
        return timed[key]

    best = dict(start)
    best_us = cost(best)
    if best_us is None:
        raise RuntimeError(f"the starting config {start} does not run here; nothing to tune from")
    for _ in range(rounds):
        improved = False
        for param, values in space.items():
            for value in values:
                cand = dict(best, **{param: value})
                us = cost(cand)
                if us is not None and us < best_us:
                    best, best_us, improved = cand, us, True
        if not improved:
            break
    return best, best_us, timed


def insert_entry(table: dict, keys: dict, config: dict) -> None:
    """Put `config` at vLLM's path for `keys` (get_lora_op_configs' arguments):
    [max_loras][num_slices][m][k][n], (k, n) = (hidden, rank) for shrink, (rank, hidden) for expand."""
    k, n = ((keys["hidden_size"], keys["rank"]) if keys["op_type"] == "shrink"
            else (keys["rank"], keys["hidden_size"]))
    node = table
    for level in (keys["max_loras"], keys["num_slices"], keys["batch"], k):
        node = node.setdefault(str(level), {})
    node[str(n)] = config


def tune_case(mods, layer, R, T, S, device, timer, dtype=torch.bfloat16, dims=None, log=None,
              spaces=SPACES, rounds=ROUNDS) -> dict:
    """Best vLLM config per op for one case: {op: (keys, config, us, default_us, n_timed)}."""
    x, A, B, y, _, sizes, slots = make_case(layer, R, T, S, device, dtype, dims=dims)
    v = VLLMSide(mods, x, A, B, sizes, slots, S, specialize=False)
    keys = v.config_keys()
    buf = v.shrink(x).clone()  # vLLM's default config: the reference each candidate must match
    y_ref = y.clone()
    v.expand(y_ref, buf)
    sync(device)
    y_work = y.clone()  # expand adds into it; timed replays keep adding, as in the benchmark
    calls = {"shrink": lambda: v.shrink(x), "expand": lambda: v.expand(y_work, buf)}
    result = {}
    for op in ("shrink", "expand"):
        module = mods[OP_MODULES[op]]
        lookup = module.get_lora_op_configs
        default = dict(lookup(**keys[op]))

        def measure(cfg, op=op, module=module):
            module.get_lora_op_configs = lambda *a, **kw: cfg
            try:
                if op == "shrink":
                    out = v.shrink(x)
                    err = rel_err(out.float(), buf.float())
                else:
                    y_work.copy_(y)
                    v.expand(y_work, buf)
                    err = rel_err((y_work.float() - y.float()), (y_ref.float() - y.float()))
                sync(device)
                if not err < MAX_ERR:
                    raise ValueError(f"error {err:.1e} against the default config")
                us = timer(calls[op])
            except Exception as e:  # noqa: BLE001 - a config that cannot run is just not a candidate
                if log is not None:
                    log.append({"layer": layer, "R": R, "T": T, "adapters": S, "op": op, "config": cfg,
                                "skipped": f"{type(e).__name__}: {str(e)[:120]}"})
                return None
            finally:
                module.get_lora_op_configs = lookup
            if log is not None:
                log.append({"layer": layer, "R": R, "T": T, "adapters": S, "op": op, "config": cfg, "us": us})
            return us

        best, best_us, timed = coordinate_search(default, spaces[op], measure, rounds)
        result[op] = (keys[op], best, best_us, timed[tuple(sorted(default.items()))], len(timed))
    return result


def save_tables(tables: dict, folder: str, device_name: str) -> list[str]:
    """Merge `tables` {op: nested entries} into vLLM's files for `device_name` in `folder`."""
    os.makedirs(folder, exist_ok=True)
    written = []
    for op, table in tables.items():
        name = tuned_config_name(device_name, op, True if op == "expand" else None)
        path = os.path.join(folder, name)
        merged = {}
        if os.path.exists(path):
            with open(path) as f:
                merged = json.load(f)
        _merge(merged, table)
        with open(path + ".tmp", "w") as f:
            json.dump(merged, f, separators=(",", ":"), sort_keys=True)
            f.write("\n")
        os.replace(path + ".tmp", path)
        written.append(path)
    return written


def _merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict) and "block_m" not in value:
            _merge(into[key], value)
        else:
            into[key] = value


def check_cpu(mods) -> bool:
    """Tiny search under the interpreter: the files written are the ones vLLM's own lookup reads,
    and each case's keys lead it to that case's tuned entry."""
    import tempfile

    from benchmarks.vllm_ops import config_sources, device_named, kernel_configs

    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--check-cpu runs vLLM's Triton kernels on the CPU: set TRITON_INTERPRET=1 before running it")
    tiny = {"shrink": dict(split_k=(2, 8), block_k=(32,)), "expand": dict(block_n=(32, 64))}
    use_configs("default", None)
    reset_config_caches(mods)
    device, gpu = torch.device("cpu"), "NVIDIA H100 80GB HBM3"

    def timer(fn):  # one interpreted call: the check is about the files, not the times
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    cases = [((32, (32, 16, 16)), 16, 5, 3), ((32, (32,)), 16, 3, 2)]
    tables, picks = {"shrink": {}, "expand": {}}, []
    for dims, R, T, S in cases:
        res = tune_case(mods, "qkv", R, T, S, device, timer, dtype=torch.float16, dims=dims, spaces=tiny, rounds=1)
        for op, (keys, best, us, default_us, n) in res.items():
            insert_entry(tables[op], keys, best)
            picks.append((keys, op, best))
            print(f"cpu tune H={dims[0]} sizes={dims[1]} R={R} T={T} S={S} {op}: {n} configs, best {best}")
    ok = True
    with tempfile.TemporaryDirectory() as folder, device_named(gpu):
        save_tables(tables, folder, gpu)
        use_configs("tuned", folder)
        reset_config_caches(mods)
        src = config_sources(mods, gpu)
        ok &= "default" not in src.values()
        print(f"cpu tune: vLLM's source {src}")
        for keys, op, best in picks:
            got = kernel_configs(mods, {op: keys})[op]
            ok &= got == best
            print(f"cpu tune: vLLM reads back the {op} entry for {keys}: {'ok' if got == best else 'FAIL'}")
    use_configs("default", None)
    reset_config_caches(mods)
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-ops", default=DEFAULT_OPS, help="folder written by benchmarks/vllm_ops.py")
    ap.add_argument("--config-dir", default=TUNED_CONFIGS, help="where vLLM's tuned files go")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for a copy of the files and the log")
    ap.add_argument("--check-cpu", action="store_true", help="tiny search and read-back (TRITON_INTERPRET=1)")
    ap.add_argument("--reps", type=int, default=10, help="timed replays per candidate (median)")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="coordinate-search rounds (1 compiles fewer kernels)")
    add_case_options(ap)
    args = ap.parse_args(argv)
    mods = load_vllm(args.vllm_ops)
    if args.check_cpu:
        sys.exit(0 if check_cpu(mods) else 1)
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: tuning needs the GPU the benchmark runs on (--check-cpu checks the format)")
    use_configs("default", None)  # start every search from vLLM's built-in default
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    timer = Timer(device, reps=args.reps)
    layers, tokens = selected_cases(args)
    tables, log, t0 = {"shrink": {}, "expand": {}}, [], time.time()
    for layer in layers:
        for R in RANKS:
            for S in ADAPTERS:
                for T in tokens:
                    if args.budget_s and time.time() - t0 > args.budget_s:
                        print(f"budget reached: not tuned {layer} r{R} a{S} T={T} (vLLM takes the nearest "
                              "tuned entry there: tune it in a later run with --only)", flush=True)
                        continue
                    res = tune_case(mods, layer, R, T, S, device, timer, log=log, rounds=args.rounds)
                    for op, (keys, best, us, default_us, n) in res.items():
                        insert_entry(tables[op], keys, best)
                        print(f"{layer:8s} r{R:<3d} T={T:<5d} a={S:<2d} {op:6s} {default_us:7.1f} -> {us:7.1f} us "
                              f"({n} configs) {best}", flush=True)
    written = save_tables(tables, args.config_dir, gpu)
    os.makedirs(args.out, exist_ok=True)
    for path in written:
        with open(path) as src, open(os.path.join(args.out, os.path.basename(path)), "w") as dst:
            dst.write(src.read())
    with open(os.path.join(args.out, "tune_vllm_lora_log.json"), "w") as f:
        json.dump({"device": gpu, "elapsed_s": time.time() - t0, "timings": log}, f)
    print(f"wrote {', '.join(written)} (copies in {args.out}); {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()

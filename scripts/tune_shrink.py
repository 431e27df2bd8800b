"""Tune our shrink's eager launch shapes on this GPU for the kernels benchmark's cases, and write
them where loramux reads tuned configs (`loramux/kernels/tuned.py`): the same search
scripts/tune_vllm_lora.py gives vLLM's shrink, so both sides of the comparison run tuned.

    PYTHONPATH=. python scripts/tune_shrink.py --out results/    # GPU, then benchmarks/kernels.py

Search: per case, a coordinate search from our heuristic launch shape (`shrink_config` with no
tuned file), one parameter at a time over SPACE, a change kept only when it is faster, two rounds;
each candidate checked against the heuristic shape's output and timed with the benchmark's timer
(CUDA-graph replay, cold L2, median). A candidate that fails to compile or launch is skipped. An
entry is written only where the search beat the heuristic. Cases: one adapter at every token
count, and 32 adapters at decode sizes (T <= 256, where an eager launch's shape depends on its
adapter segments); a prefill-sized launch takes the one-adapter entry whatever its mix, so the
32-adapter prefill cases have no entry of their own. Results merge into the device's file in
--config-dir (default: the package's `loramux/data/kernel_configs`); a log of every timing goes
to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from tune_vllm_lora import add_case_options, coordinate_search, selected_cases  # noqa: E402

from benchmarks.kernels import ADAPTERS, RANKS, Timer, make_case, rel_err, sync  # noqa: E402

from loramux.kernels import build_lora_meta  # noqa: E402
from loramux.kernels import tuned  # noqa: E402
from loramux.kernels.shrink import ShrinkConfig, lora_shrink_triton, shrink_config  # noqa: E402
from loramux.kernels.tiles import DECODE_MAX_TOKENS  # noqa: E402

SPACE = dict(block_m=(16, 32, 64), block_n=(16, 32, 64), block_k=(32, 64, 128, 256),
             split_k=(1, 2, 4, 8, 16, 32, 64), num_warps=(4, 8), num_stages=(2, 3, 4))
ROUNDS = 2
MAX_ERR = 1e-3  # float32 accumulation in another order: ~1e-6 from the heuristic's output


def entry_key(entry: dict) -> tuple:
    """What an entry is for: `tuned.KEY_FIELDS`, then its token count."""
    return tuple(entry[f] for f in tuned.KEY_FIELDS) + (entry["tokens"],)


def tune_case(layer, R, T, S, device, timer, dtype=torch.bfloat16, dims=None, log=None, space=SPACE,
              rounds=ROUNDS) -> tuple[dict, float, float, int]:
    """(entry, best us, heuristic us, configs timed) for one case; the entry as `tuned` reads it."""
    x, A, _, _, scales, sizes, slots = make_case(layer, R, T, S, device, dtype, dims=dims)
    meta = build_lora_meta(slots, S)
    n, H = len(sizes), x.shape[1]
    start = shrink_config(meta, n * R, H, dtype, device, rank=R)  # no tuned file is read here (main)
    ref = lora_shrink_triton(x, A, scales, meta, config=start).clone()
    sync(device)

    def measure(cfg):
        config = ShrinkConfig(**cfg)
        try:
            err = rel_err(lora_shrink_triton(x, A, scales, meta, config=config).float(), ref)
            sync(device)
            if not err < MAX_ERR:
                raise ValueError(f"error {err:.1e} against the heuristic shape")
            us = timer(lambda: lora_shrink_triton(x, A, scales, meta, config=config))
        except Exception as e:  # noqa: BLE001 - a config that cannot run is just not a candidate
            if log is not None:
                log.append({"layer": layer, "R": R, "T": T, "adapters": S, "config": cfg,
                            "skipped": f"{type(e).__name__}: {str(e)[:120]}"})
            return None
        if log is not None:
            log.append({"layer": layer, "R": R, "T": T, "adapters": S, "config": cfg, "us": us})
        return us

    start_cfg = {f: getattr(start, f) for f in tuned.CONFIG_FIELDS}
    best, best_us, timed = coordinate_search(start_cfg, space, measure, rounds)
    entry = dict(dtype=str(dtype).removeprefix("torch."), n_slices=n, rank=R, hidden=H, tokens=T,
                 many_adapters=tuned.many_adapters(meta), config=best)
    return entry, best_us, timed[tuple(sorted(start_cfg.items()))], len(timed)


def merge_entries(path: str, device_name: str, entries: list[dict]) -> int:
    """Merge ``entries`` into the file at ``path`` (an entry replaces the one with its key);
    returns the entries the file then holds."""
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)["entries"]
    merged = {entry_key(e): e for e in old}
    merged.update((entry_key(e), e) for e in entries)
    entries = sorted(merged.values(), key=entry_key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:  # an entry a line: the file diffs and reads by case
        f.write(f'{{"device": {json.dumps(device_name)}, "entries": [\n')
        f.write(",\n".join(json.dumps(e) for e in entries))
        f.write("\n]}\n")
    os.replace(path + ".tmp", path)
    return len(merged)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config-dir", default=str(tuned.DEFAULT_DIR), help="folder of the tuned files to merge into")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for tune_shrink_log.json")
    add_case_options(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("tune_shrink.py times launches on a CUDA GPU; none is visible")
    os.environ[tuned.CONFIG_DIR_ENV_VAR] = tempfile.mkdtemp()  # the search starts from the heuristics
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    timer, log, entries, seen = Timer(device), [], [], set()
    layers, tokens = selected_cases(args)
    t0 = time.time()
    for S in ADAPTERS:
        for layer in layers:
            for R in RANKS:
                for T in tokens:
                    if S > 1 and T > DECODE_MAX_TOKENS:
                        continue  # a prefill-sized launch takes the one-adapter entry
                    if args.budget_s and time.time() - t0 > args.budget_s:
                        print(f"budget reached: skipping {layer} r{R} a{S} T={T}", flush=True)
                        continue
                    entry, best_us, start_us, n = tune_case(layer, R, T, S, device, timer, log=log)
                    if entry_key(entry) in seen:
                        continue  # 32 adapters at T = 1: one active, the one-adapter case's key
                    seen.add(entry_key(entry))
                    kept = best_us < start_us
                    if kept:
                        entries.append(entry)
                    print(f"{layer:8s} r{R:<3d} T={T:<5d} a={S:<2d} heuristic {start_us:6.1f} -> {best_us:6.1f} us "
                          f"({n} configs){' ' + str(entry['config']) if kept else ', kept the heuristic'}", flush=True)
    path = os.path.join(args.config_dir, tuned.config_file_name(name))
    total = merge_entries(path, name, entries)
    print(f"{len(entries)} entries merged into {path} ({total} in all); {time.time() - t0:.0f} s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_shrink_log.json"), "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "entries": entries, "timings": log}, f)


if __name__ == "__main__":
    main()

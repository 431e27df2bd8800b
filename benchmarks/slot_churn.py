"""Host time of placing an adapter into the GPU tier under churn: every slot full, each new
adapter evicting the least recently used one (issue 10: thousands of adapters).

The model manager's own work per placement (evict, pool rows for every wrapped layer, the batched
slot write) runs on the engine's thread, in the step loop, once per adapter that enters a slot.
It depends on the number of wrapped layers and resident adapters, not on the layers' sizes, so
the default model is Llama-3.1-8B's layout (32 layers; fused q/k/v and gate/up, 129 wrapped
layers with the LM head) at tiny widths, on the CPU; ``--model llama-3.1-8b`` on CUDA takes
the real shapes (dummy weights) and times the device copies as well.

Both GPU memory layouts are timed: one region of ``max_lora_rank`` rows per slot (the default)
and rows shared by rank (``--max-gpu-lora-bytes``: by default about 7 rows per slot, as the
many-adapters benchmark's 10 GiB gave 256 slots at 8B). The fleet is the many-adapters mix
(`DEFAULT_MIX`: ranks 8-64 on q/v, q/k/v/o or all seven projections).

    python benchmarks/slot_churn.py [--slots 256] [--placements 200] [--tag cpu]

Writes ``docs/benchmarks/slot_churn_<tag>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import device_name, random_adapter, save_report, sync  # noqa: E402
from benchmarks.adapter_trace import DEFAULT_MIX, TARGET_SETS  # noqa: E402

# Llama-3.1-8B's layer count and head layout at widths where host work dominates
TINY_8B_LAYOUT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=32,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256)
MAX_RANK = 64


def build_model(args):
    from loramux.engine.siblings import fuse_siblings

    if args.model == "tiny-8b-layout":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(LlamaConfig(**TINY_8B_LAYOUT)).eval().to(args.device)
    else:
        from loramux.engine.model_loader import load_model

        model = load_model(args.model, dtype=torch.bfloat16, device=args.device, load_format="dummy")[0]
    fuse_siblings(model)  # as the engine does: one qkv and one gate_up layer
    return model


def make_fleet(config, count: int, device: torch.device, dtype: torch.dtype, seed: int):
    """``count`` adapters of the mix, each packed into one host buffer as the loader gives them."""
    from loramux.registry.handle import memory_handle

    rng = random.Random(seed)
    kinds = rng.choices(DEFAULT_MIX, weights=[k.share for k in DEFAULT_MIX], k=count)
    fleet = []
    for i, kind in enumerate(kinds):
        adapter = random_adapter(config, f"a{i}", kind.rank, TARGET_SETS[kind.targets], seed + i, "cpu", dtype)
        adapter = adapter.pack(pin_memory=device.type == "cuda")
        fleet.append(replace(adapter, handle=memory_handle(adapter, adapter.name)))
    return fleet


def manager_for(args, gpu_bytes: int | None, slots: int):
    from loramux.engine.lora_model import LoRAModelManager
    from loramux.registry import LoRAConfig

    return LoRAModelManager(build_model(args), LoRAConfig(max_loras=slots, max_lora_rank=MAX_RANK,
                                                          max_gpu_lora_bytes=gpu_bytes))


def churn(fleet, args, gpu_bytes: int | None) -> dict:
    """Fill every slot, then place adapters cyclically over more of them than slots (every
    placement misses and evicts); host milliseconds per placement, and with the device synced."""
    manager = manager_for(args, gpu_bytes, args.slots)
    for adapter in fleet[: args.slots]:
        manager.activate(adapter)
    sync(args.device)
    host, synced = [], []
    for k in range(args.placements):
        adapter = fleet[(args.slots + k) % len(fleet)]
        started = time.perf_counter()
        manager.activate(adapter)
        host.append(time.perf_counter() - started)
        sync(args.device)
        synced.append(time.perf_counter() - started)
    assert manager.stats.evictions >= args.placements, "every placement must evict"
    profile = profiled_placements(manager, fleet, args) if args.profile else None
    result = {"layers": len(manager.layers), "pool_rank_rows": manager.pool_units,
              "gpu_lora_bytes": manager.capacity_bytes, "host_ms_p50": 1e3 * statistics.median(host),
              "host_ms_mean": 1e3 * statistics.mean(host), "synced_ms_p50": 1e3 * statistics.median(synced)}
    if profile is not None:
        result["profile"] = profile
    del manager
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def profiled_placements(manager, fleet, args) -> list[dict]:
    """Where a placement's host time goes: ``args.placements`` more placements under cProfile
    (after the timed ones, whose times it would inflate), the ``args.profile`` functions with the
    most time of their own, in ms per placement."""
    profiler = cProfile.Profile()
    profiler.enable()
    for k in range(args.placements):
        manager.activate(fleet[(args.slots + args.placements + k) % len(fleet)])
    profiler.disable()
    stats = pstats.Stats(profiler).sort_stats("tottime")
    rows = []
    for (path, line, name) in stats.fcn_list[: args.profile]:
        calls, _, own, cumulative, _ = stats.stats[(path, line, name)]
        rows.append({"function": f"{Path(path).name}:{line}({name})", "calls_per_placement": calls / args.placements,
                     "own_ms": 1e3 * own / args.placements, "cumulative_ms": 1e3 * cumulative / args.placements})
    return rows


def markdown(report: dict) -> str:
    lines = [f"**{report['device']}**, {report['model']}: {report['slots']} slots, all full; "
             f"{report['placements']} placements, each evicting the least recently used adapter; "
             f"a fleet of {report['fleet']} adapters of the many-adapters mix.", "",
             "| GPU memory layout | wrapped layers | rank rows a layer | host ms (p50) | host ms (mean) | "
             "with the device synced (p50) |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in report["layouts"].items():
        lines.append(f"| {name} | {r['layers']} | {r['pool_rank_rows']} | {r['host_ms_p50']:.2f} | "
                     f"{r['host_ms_mean']:.2f} | {r['synced_ms_p50']:.2f} |")
    for name, r in report["layouts"].items():
        if "profile" in r:
            lines += ["", f"Where the host time of a placement goes ({name}; cProfile, ms per placement):", "",
                      "| function | calls | own ms | cumulative ms |", "| --- | ---: | ---: | ---: |"]
            lines += [f"| `{row['function']}` | {row['calls_per_placement']:.1f} | {row['own_ms']:.3f} | "
                      f"{row['cumulative_ms']:.3f} |" for row in r["profile"]]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-8b-layout",
                        help="tiny-8b-layout (default: 8B's layers at tiny widths) or a shipped dummy config name")
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--fleet", type=int, default=300, help="adapters placed in turn (more than --slots)")
    parser.add_argument("--placements", type=int, default=200)
    parser.add_argument("--rows-per-slot", type=float, default=7.3,
                        help="the shared layout's pool, in rank rows per slot (7.3: 10 GiB over 256 slots at 8B)")
    parser.add_argument("--layouts", default="regions,shared",
                        help="which GPU memory layouts to time (regions: one max-rank region per slot, the "
                        "default; shared: rows shared by rank). At 8B shapes 256 regions need 86 GB: "
                        "time 'shared' alone there")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="then profile as many placements again and report the TOP functions by own time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--tag", default="gpu" if cuda else "cpu")
    args = parser.parse_args(argv)
    args.layouts = args.layouts.split(",")
    if not args.layouts or not set(args.layouts) <= {"regions", "shared"}:
        parser.error(f"--layouts {','.join(args.layouts)}: give regions, shared or both, comma-separated")
    if args.slots < 1 or args.placements < 1 or args.fleet <= args.slots:
        parser.error(f"need --slots >= 1, --placements >= 1 and --fleet > --slots (got {args.slots}, "
                     f"{args.placements}, {args.fleet})")
    args.device = torch.device("cuda" if cuda and args.model != "tiny-8b-layout" else "cpu")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    probe = manager_for(args, None, 1)  # bytes of one rank row over every wrapped layer
    row_bytes = probe.capacity_bytes // probe.pool_units
    model = probe.model
    fleet = make_fleet(model.config, args.fleet, args.device, next(model.parameters()).dtype, args.seed)
    del probe, model
    shared = max(int(args.rows_per_slot * args.slots), MAX_RANK) * row_bytes  # at least one max-rank adapter
    report = {"device": device_name(args.device), "model": args.model, "slots": args.slots,
              "placements": args.placements, "fleet": args.fleet, "torch": torch.__version__, "layouts": {}}
    layouts = {"regions": ("one max-rank region per slot (default)", None),
               "shared": (f"rows shared by rank ({args.rows_per_slot} a slot)", shared)}
    for name, gpu_bytes in (layouts[key] for key in args.layouts):
        report["layouts"][name] = result = churn(fleet, args, gpu_bytes)
        print(f"{name}: {result['host_ms_p50']:.2f} ms host per placement (p50)", flush=True)
    save_report(args.out, f"slot_churn_{args.tag}", report, markdown(report))
    return report


if __name__ == "__main__":
    main()

"""The cold path of one adapter, stage by stage: resolve, read, check, validate, copy to the GPU,
each timed on its own (best of N) and then the whole load through the registry, against the floor
of reading the same file.

    PYTHONPATH=. python benchmarks/cold_load.py                                   # CUDA or CPU
    PYTHONPATH=. python benchmarks/cold_load.py --repeats 1 --disk-probe-mb 16 --out /tmp   # CPU smoke

The adapter is synthetic, with Llama-3.1-8B shapes (rank 16 on q_proj [4096 -> 4096] and v_proj
[4096 -> 1024] of 32 layers, bfloat16), saved as PEFT saves one; the base model for the engine's
validation is built on the ``meta`` device (shapes only), so no weights are needed. Two regimes:
"disk" drops the adapter's pages from the page cache before every repetition
(``posix_fadvise(DONTNEED)``, no root needed), "page cache" reads it while cached. The same run
measures the disk's sequential read bandwidth, so that "cold TTFT <= warm TTFT + 1.5 x adapter
bytes / disk bandwidth" can be judged on any host. With CUDA the weights are read straight into a
piece of a page-locked arena made beforehand, as the engine's loads are, and copied to the GPU;
without it there is no copy. Each 1 MiB chunk is hashed and scanned for NaN and infinity on a
pool while the file is read, so "loader_checks" holds the wait for the last chunks' scan and
"digest_wait" what is left of the digest after it. The read, check and digest stages are the
loader's own timings (``load_adapter_with_digest(..., stages=)``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    default_out,
    disk_bandwidth,
    drop_from_page_cache,
    read_seconds,
    write_peft_config,
    write_result,
)

TITLE = "Cold adapter loads"
LAYERS, HIDDEN, KV_OUT, RANK = 32, 4096, 1024, 16


def make_adapter(directory: Path, *, seed: int = 0) -> Path:
    """A PEFT-layout LoRA for Llama-3.1-8B: q_proj and v_proj of every layer, rank 16, bf16."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for module, out in (("q_proj", HIDDEN), ("v_proj", KV_OUT)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=generator).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, RANK, generator=generator).bfloat16()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    write_peft_config(directory, RANK, ("q_proj", "v_proj"))
    return directory


def meta_llama_8b():
    """Llama-3.1-8B's module tree on the meta device: real shapes, no memory."""
    from transformers import AutoModelForCausalLM

    from loramux.engine.worker.model_loader import dummy_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(dummy_config("llama-3.1-8b")).to(torch.bfloat16)


def best(times: list[float]) -> float:
    """Milliseconds of the fastest repetition: the stage's own cost, without other work's noise."""
    return min(times) * 1e3


class Stages:
    """The stages of the loader, timed one by one on the same adapter, then the whole path."""

    def __init__(self, root: Path, name: str, manager) -> None:
        from loramux.registry import LoRAConfig, Registry
        from loramux.resolvers import FilesystemResolver

        from loramux.registry.host_memory import PAGEABLE
        from loramux.registry.page_locked_arena import PageLockedArena

        self.root, self.name, self.manager = root, name, manager
        self.config = LoRAConfig(max_loras=1, max_lora_rank=RANK, max_cpu_loras=1)
        self.cuda = torch.cuda.is_available()
        self.memory = PageLockedArena(256 << 20) if self.cuda else PAGEABLE  # as the engine's loads
        self.make_registry = lambda: Registry(
            self.config, resolvers=[FilesystemResolver(root)], validate=manager.validate, host_memory=self.memory
        )

    def run_once(self, drop: bool) -> dict[str, float]:
        from loramux.registry import load_adapter_with_digest

        directory = self.root / self.name
        files = [directory / "adapter_config.json", directory / "adapter_model.safetensors"]
        times: dict[str, float] = {}
        if drop:
            drop_from_page_cache(*files)
        # the floor for this very file: read whole into a buffer allocated beforehand, no hash
        times["raw_read"] = read_seconds(files[1])
        registry = self.make_registry()
        if drop:
            drop_from_page_cache(*files)
        t0 = time.perf_counter()
        location = registry.locate(self.name)
        t1 = time.perf_counter()
        stages: dict[str, float] = {}  # the loader's own stage timings
        # read straight into the arena's page-locked memory on CUDA: pinning is part of the read
        adapter, _ = load_adapter_with_digest(location.path, self.config, name=self.name, host_memory=self.memory,
                                              stages=stages)
        t2 = time.perf_counter()
        self.manager.validate(adapter)
        t4 = time.perf_counter()
        times.update(resolve=t1 - t0, read=stages["read"], loader_checks=stages["checks"],
                     digest_wait=stages["digest_wait"], engine_validate=t4 - t2)
        if self.cuda:
            times["pin"] = 0.0  # the read buffer is page-locked already
            adapter.map_tensors(lambda t: t.to("cuda", non_blocking=True))
            torch.cuda.synchronize()
            times["copy"] = time.perf_counter() - t4
        # the whole registry path, as the engine's loader thread runs it; the stages' copy is
        # freed first, so both paths meet the allocator in the same state
        del adapter
        registry = self.make_registry()
        if drop:
            drop_from_page_cache(*files)
        t7 = time.perf_counter()
        registry.get(self.name)
        times["registry_get"] = time.perf_counter() - t7
        return times


def sha256_seconds(path: Path) -> float:
    """One thread hashing the whole file from memory: what the digest would cost unoverlapped."""
    import hashlib

    data = path.read_bytes()
    start = time.perf_counter()
    hashlib.sha256(data).digest()
    return time.perf_counter() - start


def main(argv=None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dir", default=None, help="where to write the adapter (default: a temp dir)")
    parser.add_argument("--disk-probe-mb", type=int, default=256, help="the sequential-read probe file's size")
    parser.add_argument("--out", type=Path, default=default_out(), help="folder for cold_load.json")
    args = parser.parse_args(argv)
    from loramux.engine.adapters.lora_model import LoRAModelManager
    from loramux.registry import LoRAConfig

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        directory = make_adapter(root / "llama8b-r16")
        nbytes = (directory / "adapter_model.safetensors").stat().st_size
        manager = LoRAModelManager(meta_llama_8b(), LoRAConfig(max_loras=1, max_lora_rank=RANK),
                                   target_modules=["q_proj", "v_proj"])
        stages = Stages(root, directory.name, manager)
        bandwidth = disk_bandwidth(root, nbytes=args.disk_probe_mb << 20)
        results = {}
        for regime, drop in (("disk", True), ("page_cache", False)):
            stages.run_once(drop)  # warm-up: imports, allocator
            runs = [stages.run_once(drop) for _ in range(args.repeats)]
            results[regime] = {stage: round(best([r[stage] for r in runs]), 3) for stage in runs[0]}
        hash_ms = best([sha256_seconds(directory / "adapter_model.safetensors") for _ in range(5)])
    host = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    device = f"{torch.cuda.get_device_name()} (host: {host})" if torch.cuda.is_available() else f"CPU ({host})"
    report = {"adapter_bytes": nbytes, "repeats": args.repeats,
              **{key: round(value / 1e9, 3) for key, value in bandwidth.items()},  # GB/s
              "ms_best_of_n": results, "ms_sha256_single_thread": round(hash_ms, 3),
              "load_average_1m": round(os.getloadavg()[0], 2),
              "ms_floor_disk": round(nbytes / bandwidth["disk_bytes_per_s"] * 1e3, 3),
              "ms_floor_page_cache": round(nbytes / bandwidth["page_cache_bytes_per_s"] * 1e3, 3)}
    print(markdown(report))
    return write_result(args.out / "cold_load.json", "cold_load", device, report, argv)


STAGES = {"raw_read": "the file read whole into a buffer (the floor)", "resolve": "resolve the name to a dir",
          "read": "read, hashed and scanned chunk by chunk on a pool",
          "loader_checks": "check the tensors (the scan's tail)",
          "engine_validate": "the engine's validation", "digest_wait": "the digest's tail",
          "pin": "page-lock (0: read into the arena)", "copy": "copy to the GPU",
          "registry_get": "the whole load through the registry"}


def markdown(report: dict) -> str:
    disk, cached = report["ms_best_of_n"]["disk"], report["ms_best_of_n"]["page_cache"]
    lines = [f"One adapter of {report['adapter_bytes'] / 1e6:.1f} MB (Llama-3.1-8B, rank 16, q/v, bfloat16); best of "
             f"{report['repeats']}; disk read at {report['disk_bytes_per_s']:.2f} GB/s, page cache at "
             f"{report['page_cache_bytes_per_s']:.2f} GB/s; host load average {report['load_average_1m']}", "",
             "| stage | ms, from disk | ms, from the page cache |", "| --- | ---: | ---: |"]
    lines += [f"| {stage}: {what} | {disk[stage]:.2f} | {cached[stage]:.2f} |" for stage, what in STAGES.items()
              if stage in disk]
    lines += ["", f"- the file's bytes over the bandwidth: {report['ms_floor_disk']:.2f} ms from disk, "
              f"{report['ms_floor_page_cache']:.2f} ms from the page cache",
              f"- SHA-256 of the whole file on one thread: {report['ms_sha256_single_thread']:.2f} ms"]
    return "\n".join(lines) + "\n"


#: JSON stem -> (heading, renderer, the command that measures it), for benchmarks/report.py
SECTIONS = {"cold_load": ("", markdown, "PYTHONPATH=. python benchmarks/cold_load.py")}

if __name__ == "__main__":
    main()

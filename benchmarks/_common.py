"""What several benchmarks share: naming the device, its copy ceiling, the disk's read bandwidth,
Llama-style projection shapes, and random LoRA adapters in memory or saved as PEFT saves them.

Imported as ``benchmarks._common`` (the scripts put the repository root on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

__all__ = [
    "ALL_SEVEN", "QV", "QKVO", "copy_bandwidth", "device_name", "disk_bandwidth", "drop_from_page_cache",
    "filesystem_of", "kernel_device_times", "projection_shapes", "random_adapter", "read_seconds",
    "save_peft_files", "sync",
]

ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
QV = ("q_proj", "v_proj")
ATTENTION = frozenset(QKVO)

BANDWIDTH_FILE_BYTES = 256 << 20


# -- the device ----------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read + write), the HBM ceiling."""
    if device.type != "cuda":
        return None
    src = torch.empty(2**30 // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.nbytes / min(times)


def save_report(out: Path, stem: str, report: dict, text: str) -> Path:
    """Write ``report`` as ``out/<stem>.json`` and ``text`` (its markdown) beside it; print the
    markdown; return the JSON's path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    path.with_suffix(".md").write_text(text)
    print(text)
    return path


def kernel_device_times(prof, steps: int) -> dict[str, tuple[float, int]]:
    """Device time per kernel name in a ``torch.profiler`` run of ``steps`` steps (graph replays
    included): {name (90 chars): (us per step, launches per step)}, largest first."""
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(event.name[:90], [0.0, 0])
            entry[0] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
            entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return {name: (us / steps, n // steps) for name, (us, n) in ranked}


# -- the disk ------------------------------------------------------------------------------------


def drop_from_page_cache(*paths: Path) -> None:
    """Evict the files' pages, so the next read comes from the disk (clean pages only; no root)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_seconds(path: Path) -> float:
    """Seconds to read ``path`` whole into a preallocated buffer (no allocation in the timing)."""
    buffer = bytearray(path.stat().st_size)
    view = memoryview(buffer)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as file:
        done = 0
        while done < len(view):
            done += file.readinto(view[done:])
    return time.perf_counter() - start


def disk_bandwidth(directory: Path, repeats: int = 3, nbytes: int = BANDWIDTH_FILE_BYTES) -> dict:
    """Sequential read bandwidth of the disk under ``directory`` and of the page cache, bytes/s,
    reading a file of ``nbytes`` (rounded up to 16 MiB)."""
    path = directory / "bandwidth.bin"
    chunk = os.urandom(16 << 20)
    chunks = max(1, -(-nbytes // len(chunk)))
    with open(path, "wb") as file:
        for _ in range(chunks):
            file.write(chunk)
        file.flush()
        os.fsync(file.fileno())
    disk = []
    for _ in range(repeats):
        drop_from_page_cache(path)
        disk.append(read_seconds(path))
    cached = [read_seconds(path) for _ in range(repeats)]
    path.unlink()
    size = chunks * len(chunk)
    return {"disk_bytes_per_s": size / min(disk), "page_cache_bytes_per_s": size / min(cached)}


def filesystem_of(path: Path) -> str:
    """The type of the filesystem holding ``path`` (from /proc/mounts; "tmpfs" means no disk at all),
    or "unknown" where the system does not say."""
    path = Path(path).resolve()
    best, kind = -1, "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = Path(fields[1])
        if (path == mount or mount in path.parents) and len(mount.parts) > best:
            best, kind = len(mount.parts), fields[2]
    return kind


# -- adapters ------------------------------------------------------------------------------------


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a Llama-style config."""
    c = config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv, h, i = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim, c.hidden_size, c.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def module_name(layer: int, proj: str) -> str:
    """The module path of projection ``proj`` of decoder layer ``layer`` in a Llama-style model."""
    parent = "self_attn" if proj in ATTENTION else "mlp"
    return f"model.layers.{layer}.{parent}.{proj}"


def random_adapter(config, name: str, rank: int, targets, seed: int, device, dtype):
    """A random LoRA of ``rank`` on ``targets`` of every layer (a ``LoRAAdapter`` in memory)."""
    from loramux.registry import LoRAAdapter, LoRAModuleWeights

    generator = torch.Generator(device=device).manual_seed(seed)
    shapes = projection_shapes(config)
    modules = {}
    for layer in range(config.get_text_config().num_hidden_layers):
        for proj in targets:
            fan_in, fan_out = shapes[proj]
            like = dict(device=device, dtype=dtype, generator=generator)
            a = torch.randn(rank, fan_in, **like) / fan_in**0.5
            b = torch.randn(fan_out, rank, **like) * 0.01
            modules[module_name(layer, proj)] = LoRAModuleWeights(a, b, 2.0)
    return LoRAAdapter(name=name, path=Path("."), modules=modules, lora_alpha=2 * rank, target_modules=list(targets))


def write_peft_config(directory: Path, rank: int, targets) -> None:
    """The adapter_config.json PEFT writes, with what a loader reads of it (alpha = 2 x rank)."""
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
              "task_type": "CAUSAL_LM"}
    (directory / "adapter_config.json").write_text(json.dumps(config))


def save_peft_files(adapter, rank: int, directory: Path) -> Path:
    """Write ``adapter`` as PEFT saves one (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, w in adapter.modules.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = w.lora_a.cpu().contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = w.lora_b.cpu().contiguous()
    save_file(tensors, directory / "adapter_model.safetensors")
    write_peft_config(directory, rank, adapter.target_modules)
    return directory

"""What several benchmarks share: the results file (with the device, command, commit and date),
the model to measure, the device and its copy ceiling, the engine's start-up stages and what
compiled while serving, the disk's read bandwidth, Llama-style projection shapes, and random LoRA
adapters in memory or saved as PEFT saves them. Statistics live in ``benchmarks.stats``.

Imported as ``benchmarks._common`` (the scripts put the repository root on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shlex
import subprocess
import time
from pathlib import Path

import torch

__all__ = [
    "ALL_SEVEN", "QV", "QKVO", "RESULTS_DIR", "TINY_CONFIG", "cell", "compiles_watched", "copy_bandwidth", "default_out", "device_name",
    "disk_bandwidth", "drop_from_page_cache", "engine_stages", "filesystem_of", "forward_weight_bytes", "load_bench_model",
    "matmul_flops", "projection_shapes", "random_adapter", "read_seconds", "save_peft_files", "sync", "write_result",
]

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "docs" / "benchmarks"  # where results pages and their JSON live


def default_out(gpu: bool = True) -> Path:
    """Where a benchmark writes its JSON by default: the results pages' folder, except for a GPU
    benchmark run without CUDA (a smoke run must not replace the GPU's results)."""
    return RESULTS_DIR if torch.cuda.is_available() or not gpu else Path("benchmark-results")

ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
QV = ("q_proj", "v_proj")
ATTENTION = frozenset(QKVO)

BANDWIDTH_FILE_BYTES = 256 << 20
# "tiny": a 2-layer Llama with random weights, small enough that 2 CPU cores run a benchmark's
# smallest mode in seconds (the CPU smoke runs)
TINY_CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512)


# -- results -------------------------------------------------------------------------------------


def git_commit() -> str:
    """The commit measured: $LORAMUX_COMMIT where set (a copy of the tree without .git), else git's
    HEAD, with "-dirty" when the tree has changes; "unknown" without either."""
    if os.environ.get("LORAMUX_COMMIT"):
        return os.environ["LORAMUX_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def write_result(path: Path, benchmark: str, device: str, result: dict, argv: list[str]) -> Path:
    """Write ``result`` as the benchmark's JSON at ``path``, with what its results page states:
    the device, the exact command, the commit and the date (``benchmarks/report.py`` renders it)."""
    document = {"benchmark": benchmark, "device": device,
                "command": " ".join(["PYTHONPATH=. python", f"benchmarks/{benchmark}.py", *map(shlex.quote, argv)]),
                "commit": git_commit(), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
                "result": result}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def cell(value, spec: str = "{:.2f}") -> str:
    """A table cell: ``value`` formatted, or empty where it was not measured."""
    return "" if value is None else spec.format(value)


# -- the model -----------------------------------------------------------------------------------


def load_bench_model(name: str | None, dtype: str, device: torch.device, load_format: str = "auto"):
    """The model a benchmark measures: "tiny" (`TINY_CONFIG`, random), or what ``load_model`` loads
    (None: the embedded model; a shipped config name with ``load_format="dummy"``: random weights)."""
    if name == "tiny":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)).to(device, getattr(torch, dtype)).eval()
    from loramux.engine.worker.model_loader import load_model

    return load_model(name, dtype=dtype, device=device, load_format=load_format)[0]


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


def matmul_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float | None:
    """Dense matmul throughput in FLOP/s (``n`` x ``n`` by ``n`` x ``n`` in ``dtype``, the best of
    10), the compute ceiling; None off CUDA."""
    if device.type != "cuda":
        return None
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times)


def forward_weight_bytes(model) -> int:
    """Bytes of weights one forward reads: every parameter, but an input embedding table that the
    output layer does not share, of which a lookup reads only its tokens' rows (a few KB)."""
    embedding = model.get_input_embeddings()
    table = getattr(embedding, "base_layer", embedding).weight
    output = model.get_output_embeddings()
    output_weight = getattr(output, "base_layer", output).weight if output is not None else None
    return sum(p.nbytes for p in model.parameters()) - (0 if output_weight is table else table.nbytes)


def engine_stages(engine, engine_seconds: float) -> dict:
    """Where an engine's start went: compile, capture, kernel warm-up, waiting for the page-locked
    arena, the rest (profile run, KV cache); and the arena's own page-locking, on its thread."""
    from loramux.registry.page_locked_arena import PageLockedArena

    runner = engine.runner
    arena = engine.registry.host_memory if engine.registry is not None else None
    arena = arena if isinstance(arena, PageLockedArena) else None
    parts = {"compile_s": runner.regions.compile_seconds if runner.regions else 0.0,
             "capture_s": runner.startup_seconds.get("capture", 0.0),
             "warmup_s": runner.startup_seconds.get("warmup", 0.0),
             "pinned_arena_wait_s": arena.waited_seconds if arena else 0.0}
    return {"engine_s": engine_seconds, **parts, "other_s": engine_seconds - sum(parts.values()),
            "pinned_arena_s": arena.reserve_seconds if arena else 0.0}


@contextlib.contextmanager
def compiles_watched():
    """What compiled inside the block: dynamo frames and Triton kernels (built, or read from the
    disk cache), each a stall of the step that needed it. Yields a dict filled on exit."""
    import triton

    from loramux.engine.worker.compilation import compiled_frames

    knobs = getattr(triton, "knobs", None)
    built: list[str] = []
    frames = compiled_frames()
    watched: dict = {}
    if knobs is not None:
        knobs.runtime.jit_post_compile_hook = lambda **kw: built.append(kw["repr"][:300])
    try:
        yield watched
    finally:
        if knobs is not None:
            knobs.runtime.jit_post_compile_hook = None
        watched.update(dynamo_frames=compiled_frames() - frames,
                       triton_kernels=len(built) if knobs is not None else None, kernels=built)


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
    try:
        mounts = [fields for fields in map(str.split, Path("/proc/mounts").read_text().splitlines()) if len(fields) > 2]
    except OSError:
        return "unknown"
    holding = [(len(Path(m[1]).parts), m[2]) for m in mounts if path == Path(m[1]) or Path(m[1]) in path.parents]
    return max(holding)[1] if holding else "unknown"


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

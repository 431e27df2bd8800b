"""Every environment variable loramux reads, in one place, read once (vLLM's ``envs.py``).

    from loramux import envs
    envs.current().kernels          # "triton", "torch" or None (Triton on CUDA, torch elsewhere)

`current` reads the environment the first time something asks (the start of a command, an
engine or a kernel launch) and keeps the answer: nothing else in loramux reads ``os.environ``,
and nothing reads it per call. A process that changes its environment afterwards calls `refresh`.
A value loramux does not understand is a `ValueError` naming the variable and what it takes.

Flags and arguments win over these: the environment gives defaults only.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Envs", "current", "env_name", "export_default", "refresh"]


@dataclass(frozen=True)
class Envs:
    """The environment as loramux reads it; each field's doc names its variable."""

    kernels: str | None = None
    """``LORAMUX_KERNELS``: ``triton`` or ``torch`` forces those LoRA and attention kernels; unset:
    Triton on CUDA tensors, the torch reference elsewhere."""
    meta_kernel: bool = True
    """``LORAMUX_META_KERNEL``: ``0`` builds a static LoRA meta with torch ops instead of one
    Triton launch (CUDA)."""
    pdl: bool = False
    """``LORAMUX_PDL``: ``1`` turns programmatic dependent launch on for the LoRA kernels where
    the device and Triton have it."""
    kernel_config_dir: Path | None = None
    """``LORAMUX_KERNEL_CONFIG_DIR``: where tuned kernel launch shapes are read (default: the
    package's ``data/kernel_configs``)."""
    symm_mem_all_reduce: bool = False
    """``LORAMUX_SYMM_MEM_ALL_REDUCE``: ``1`` sends a tensor-parallel step's small all-reduces on
    CUDA through a symmetric-memory buffer instead of NCCL (`loramux.engine.tensor_parallel.group`)."""
    kernel_warmup: bool = True
    """``LORAMUX_KERNEL_WARMUP``: ``0`` skips compiling every kernel configuration at start."""
    kernel_warmup_threads: int = 8
    """``LORAMUX_KERNEL_WARMUP_THREADS``: threads compiling the warm-up's kernels (1: as the steps
    come)."""
    cache_dir: Path | None = None
    """``LORAMUX_CACHE_DIR``: downloaded adapters, the embedded model and compile caches (default
    ``~/.cache/loramux``)."""
    lora_resolvers: str | None = None
    """``LORAMUX_LORA_RESOLVERS``: the resolvers asked for a name, in order (``a,b``)."""
    lora_resolver_dir: str | None = None
    """``LORAMUX_LORA_RESOLVER_DIR``: the filesystem resolver's root."""
    lora_resolver_hf_repo_list: str = ""
    """``LORAMUX_LORA_RESOLVER_HF_REPO_LIST``: Hub repos the Hugging Face resolver may resolve."""
    lora_fetch_timeout: float | None = None
    """``LORAMUX_LORA_FETCH_TIMEOUT``: seconds a resolver may take for one adapter."""
    plugins: str | None = None
    """``LORAMUX_PLUGINS``: an allow-list of third-party plugins, ``a,b`` (unset: all installed
    ones; empty: none)."""
    trace_hooks: bool = False
    """``LORAMUX_TRACE_HOOKS``: print every hook call to stderr."""
    api_key: str | None = None
    """``LORAMUX_API_KEY``: ``loramux serve --api-key``'s default."""
    allow_runtime_lora_updating: bool = False
    """``LORAMUX_ALLOW_RUNTIME_LORA_UPDATING``: ``loramux serve --allow-runtime-lora-updating``'s
    default."""
    hf_endpoint: str | None = None
    """``HF_ENDPOINT``: the Hugging Face Hub the hub resolver asks."""
    hf_hub_offline: bool = False
    """``HF_HUB_OFFLINE``: the hub resolver reads its cache only."""
    triton_interpret: bool = False
    """``TRITON_INTERPRET``: Triton runs kernels in its interpreter (CPU tests)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Envs:
        """Read ``environ`` (default ``os.environ``); unset and empty variables take the defaults
        (but an empty ``LORAMUX_PLUGINS`` is an empty allow-list).

        :raises ValueError: a value that is not understood, naming the variable and its forms.
        """
        environ = os.environ if environ is None else environ
        values = {}
        for field, (name, parse) in _VARIABLES.items():
            text = environ.get(name)
            if text is not None and (text.strip() or parse is _allow_list):
                values[field] = parse(name, text.strip())
        return cls(**values)


def _kernels(name: str, text: str) -> str | None:
    choice = text.lower()
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"{name}={text!r} is not understood; use 'triton', 'torch' or leave it unset")
    return None if choice == "auto" else choice


def _zero_or_one(name: str, text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(f"{name}={text!r} is not understood; use 1 (on), 0 (off) or leave it unset")
    return text == "1"


def _on_unless_false(name: str, text: str) -> bool:
    return text.lower() not in ("0", "false", "no", "off")


def _off_unless_true(name: str, text: str) -> bool:
    return text.lower() in ("1", "true", "yes", "on")


def _threads(name: str, text: str) -> int:
    try:
        return max(1, int(text))
    except ValueError:
        raise ValueError(f"{name}={text!r}: not a whole number of threads") from None


def _seconds(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: not a number of seconds") from None


def _path(name: str, text: str) -> Path:
    return Path(text).expanduser()


def _text(name: str, text: str) -> str:
    return text


def _allow_list(name: str, text: str) -> str:
    return text


#: each field's variable (the name users know) and how its text is read
_VARIABLES: dict[str, tuple[str, Callable[[str, str], object]]] = {
    "kernels": ("LORAMUX_KERNELS", _kernels),
    "meta_kernel": ("LORAMUX_META_KERNEL", _zero_or_one),
    "pdl": ("LORAMUX_PDL", _zero_or_one),
    "kernel_config_dir": ("LORAMUX_KERNEL_CONFIG_DIR", _path),
    "symm_mem_all_reduce": ("LORAMUX_SYMM_MEM_ALL_REDUCE", _zero_or_one),
    "kernel_warmup": ("LORAMUX_KERNEL_WARMUP", _on_unless_false),
    "kernel_warmup_threads": ("LORAMUX_KERNEL_WARMUP_THREADS", _threads),
    "cache_dir": ("LORAMUX_CACHE_DIR", _path),
    "lora_resolvers": ("LORAMUX_LORA_RESOLVERS", _text),
    "lora_resolver_dir": ("LORAMUX_LORA_RESOLVER_DIR", _text),
    "lora_resolver_hf_repo_list": ("LORAMUX_LORA_RESOLVER_HF_REPO_LIST", _text),
    "lora_fetch_timeout": ("LORAMUX_LORA_FETCH_TIMEOUT", _seconds),
    "plugins": ("LORAMUX_PLUGINS", _allow_list),
    "trace_hooks": ("LORAMUX_TRACE_HOOKS", _on_unless_false),
    "api_key": ("LORAMUX_API_KEY", _text),
    "allow_runtime_lora_updating": ("LORAMUX_ALLOW_RUNTIME_LORA_UPDATING", _off_unless_true),
    "hf_endpoint": ("HF_ENDPOINT", _text),
    "hf_hub_offline": ("HF_HUB_OFFLINE", _off_unless_true),
    "triton_interpret": ("TRITON_INTERPRET", _on_unless_false),
}


def env_name(field: str) -> str:
    """The variable behind `Envs` field ``field`` (for messages: "LORAMUX_KERNEL_WARMUP=0")."""
    return _VARIABLES[field][0]


_lock = threading.Lock()
_current: Envs | None = None


def current() -> Envs:
    """The environment as read the first time this was called (or at the last `refresh`)."""
    global _current
    envs = _current
    if envs is None:
        with _lock:
            if _current is None:
                _current = Envs.from_env()
            envs = _current
    return envs


def refresh() -> Envs:
    """Read the environment again (a process that changed it after loramux read it)."""
    global _current
    envs = Envs.from_env()
    with _lock:
        _current = envs
    return envs


def export_default(name: str, value: str) -> str:
    """Set ``name`` for the libraries below loramux that read it themselves (torch's inductor,
    Triton), unless the user set it; returns the value in effect."""
    return os.environ.setdefault(name, value)

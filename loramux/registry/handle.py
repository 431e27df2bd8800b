"""`AdapterHandle`: an adapter's one identity below the registry, and its content digest.

The registry issues a handle once per adapter it resolves, loads and validates. Everything
below it (the CPU tier, GPU slots, sequences, prefix-cache hashes) keys by ``handle.id``, an
integer that is unique in the process and never reused, as vLLM's ``lora_int_id`` is used end to
end. The name a request gave is bound to a handle in the registry only; a reload binds the name
to a new handle, and the old one lives on for as long as something holds it.

The digest is a SHA-256 over the adapter's weights and the configuration that changes what they
compute (rank, alpha, rsLoRA, rank/alpha patterns, targets) and the dtype they are kept in. It
names the content, not the place: two copies of an adapter under other names or paths have the
same digest, and a change of any one weight or of the alpha changes it. SHA-256 rather than a
faster non-cryptographic hash because the digest keys shared caches (prefix KV blocks): a
collision crafted by whoever uploads an adapter must not be able to serve another tenant's
cached state.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from dataclasses import dataclass

import torch

__all__ = ["AdapterHandle", "config_digest", "combine_digest", "memory_handle", "next_handle_id", "tensors_digest"]

# The PEFT config fields that change what an adapter's weights compute (or where they apply).
SCALING_FIELDS = ("peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern",
                  "target_modules", "fan_in_fan_out")
_DIGEST_VERSION = b"loramux-adapter-digest-v1\0"

_ids = itertools.count(1)
_ids_lock = threading.Lock()


def next_handle_id() -> int:
    """A new adapter handle id: unique in this process, never reused, never 0 ("no adapter")."""
    with _ids_lock:  # itertools.count is atomic under the GIL only; say so explicitly
        return next(_ids)


@dataclass(frozen=True, eq=False)
class AdapterHandle:
    """One loaded, validated adapter, as everything below the registry refers to it.

    Equal (and hashed) by ``id`` alone: two handles are the same adapter exactly when their ids
    are. Issued only by :class:`~loramux.registry.Registry`.

    :ivar id: unique in the process, never reused; > 0.
    :ivar name: the name it was bound to when it was issued (a reload issues a new handle).
    :ivar digest: hex SHA-256 of its weights and scaling-relevant config (see the module doc).
    :ivar path: the local directory it was read from; None for an adapter bound from memory.
    :ivar rank: its largest rank over all modules.
    :ivar nbytes: bytes of its weights in host memory (what it costs the CPU tier).
    :ivar source: where it came from: the name of the resolver that found or fetched it,
        ``"path"`` for a local path, ``"memory"`` for one bound with :meth:`Registry.bind`.
    :ivar load_seconds: resolve + read + validate time when it was issued (metrics by source).
    """

    id: int
    name: str
    digest: str
    path: str | None
    rank: int
    nbytes: int
    source: str = "path"
    load_seconds: float = 0.0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AdapterHandle) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"AdapterHandle(id={self.id}, name={self.name!r}, digest={self.digest[:12]}…)"


def config_digest(peft_config: dict, dtype: torch.dtype | None) -> bytes:
    """SHA-256 of the scaling-relevant fields of ``adapter_config.json`` and the kept dtype.

    Fields PEFT leaves at their defaults may be absent or explicit (``rank_pattern: {}``); both
    hash the same, so re-saving an adapter with another PEFT version keeps its digest.
    """
    defaults = {"use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False}
    fields = {key: peft_config.get(key) for key in SCALING_FIELDS}
    for key, default in defaults.items():
        if fields[key] is None:
            fields[key] = default
    if isinstance(fields["target_modules"], list):
        fields["target_modules"] = sorted(fields["target_modules"])
    fields["dtype"] = str(dtype) if dtype is not None else "as-saved"
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).digest()


def combine_digest(config: bytes, weights: bytes) -> str:
    """The adapter digest (hex) from :func:`config_digest` and a digest of the weights."""
    return hashlib.sha256(_DIGEST_VERSION + config + weights).hexdigest()


def tensors_digest(modules: dict) -> bytes:
    """SHA-256 of in-memory weights (an adapter bound without files): each module's name,
    scaling, kind, and its A and B (dtype, shape, bytes), in name order."""
    digest = hashlib.sha256()
    for name in sorted(modules):
        weights = modules[name]
        digest.update(f"{name}\0{weights.scaling!r}\0{weights.is_embedding}\0".encode())
        for tensor in (weights.lora_a, weights.lora_b):
            tensor = tensor.detach().to("cpu").contiguous()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}\0".encode())
            digest.update(memoryview(tensor.view(torch.uint8).reshape(-1).numpy()))
    return digest.digest()


def memory_handle(adapter, name: str, *, load_seconds: float = 0.0) -> AdapterHandle:
    """A new handle for an adapter built in memory (no files): digested from its tensors.

    :meth:`Registry.bind <loramux.registry.Registry.bind>` issues these; so does a
    ``LoRAModelManager`` used on its own, without a registry, for the adapters it is handed.
    """
    digest = combine_digest(b"memory", tensors_digest(adapter.modules))
    return AdapterHandle(next_handle_id(), name, digest, None, adapter.rank, adapter.nbytes,
                         source="memory", load_seconds=load_seconds)

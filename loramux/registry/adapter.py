"""What a loaded adapter is: per-module A, B and scaling, in host memory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loramux.registry.handle import AdapterHandle

__all__ = ["LoRAModuleWeights", "LoRAAdapter"]


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One module's LoRA: ``delta(x) = (x @ lora_a.T) @ lora_b.T * scaling``.

    For an embedding, ``lora_a`` is PEFT's ``lora_embedding_A`` ([r, num_embeddings]), so the
    same formula holds with ``x`` one-hot.
    """

    lora_a: torch.Tensor  # [r, in]
    lora_b: torch.Tensor  # [out, r]
    scaling: float
    is_embedding: bool = False

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]

    @property
    def in_features(self) -> int:
        return self.lora_a.shape[1]

    @property
    def out_features(self) -> int:
        return self.lora_b.shape[0]

    @property
    def nbytes(self) -> int:
        return self.lora_a.nbytes + self.lora_b.nbytes


@dataclass(frozen=True)
class LoRAAdapter:
    """A validated PEFT LoRA adapter, loaded into host memory.

    :ivar name: the adapter's name (what requests call it).
    :ivar path: the local directory it was loaded from.
    :ivar modules: module name (as in the base model, e.g. ``model.layers.0.self_attn.q_proj``)
        to its weights.
    :ivar lora_alpha: the config's ``lora_alpha`` (``alpha_pattern`` may override it per module).
    :ivar target_modules: the config's ``target_modules``: a list of names or one regex.
    :ivar base_model_name: ``base_model_name_or_path`` from the adapter's config, if any.
    :ivar peft_config: the raw ``adapter_config.json``.
    :ivar handle: its identity, set by the :class:`~loramux.registry.Registry` that issued it;
        None for an adapter loaded directly with :func:`~loramux.registry.load_adapter`.
    """

    name: str
    path: Path
    modules: dict[str, LoRAModuleWeights]
    lora_alpha: float
    target_modules: list[str] | str
    base_model_name: str | None = None
    peft_config: dict = field(default_factory=dict, repr=False)
    handle: AdapterHandle | None = field(default=None, compare=False)

    @property
    def rank(self) -> int:
        """The largest rank over all modules (``rank_pattern`` can make modules differ)."""
        return max(weights.rank for weights in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(weights.nbytes for weights in self.modules.values())

    @property
    def num_parameters(self) -> int:
        return sum(w.lora_a.numel() + w.lora_b.numel() for w in self.modules.values())

    def map_tensors(self, fn) -> "LoRAAdapter":
        """A copy whose tensors are ``fn(tensor)`` (a dtype cast, pinning, a device move)."""
        modules = {
            name: replace(weights, lora_a=fn(weights.lora_a), lora_b=fn(weights.lora_b))
            for name, weights in self.modules.items()
        }
        return replace(self, modules=modules)

    def pin_memory(self) -> "LoRAAdapter":
        """A copy in page-locked host memory, so copies into GPU slots can run asynchronously."""
        return self.pack(pin_memory=True)

    @property
    def is_pinned(self) -> bool:
        """Whether its weights are in page-locked host memory."""
        first = next(iter(self.modules.values()), None)
        return first is not None and first.lora_a.is_pinned() and first.lora_b.is_pinned()

    def pack(self, dtype: torch.dtype | None = None, *, pin_memory: bool = False,
             allocate: Callable[[int], torch.Tensor] | None = None) -> "LoRAAdapter":
        """A copy whose tensors all live in one new host buffer (cast to ``dtype`` if given).

        One allocation instead of two per module: page-locked memory is costly to allocate
        (``cudaHostAlloc``), and PyTorch's host allocator caches whole blocks, so adapters of
        one size reuse each other's buffers. Cast and copy are one pass.

        :param pin_memory: allocate the buffer page-locked.
        :param allocate: allocate it with this instead (``allocate(nbytes)`` -> uint8 tensor; a
            :class:`~loramux.registry.page_locked_arena.PageLockedArena`'s ``allocate``, say).
        """
        tensors = [t for w in self.modules.values() for t in (w.lora_a, w.lora_b)]
        sizes = [_aligned(t.numel() * (dtype or t.dtype).itemsize) for t in tensors]
        if allocate is not None:
            buffer = allocate(sum(sizes))
        else:
            buffer = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pin_memory)
        packed, offset = [], 0
        for tensor, size in zip(tensors, sizes):
            target = dtype or tensor.dtype
            nbytes = tensor.numel() * target.itemsize
            view = buffer[offset : offset + nbytes].view(target).view(tensor.shape)
            packed.append(view.copy_(tensor))
            offset += size
        weights = iter(packed)
        modules = {
            name: replace(w, lora_a=next(weights), lora_b=next(weights))
            for name, w in self.modules.items()
        }
        return replace(self, modules=modules)


def _aligned(nbytes: int, alignment: int = 64) -> int:
    """Round up so every tensor in a packed buffer starts on a cache line (and any dtype)."""
    return -(-nbytes // alignment) * alignment

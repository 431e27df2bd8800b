"""What a loaded adapter is: per-module A, B and scaling, in host memory."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

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
    """

    name: str
    path: Path
    modules: dict[str, LoRAModuleWeights]
    lora_alpha: float
    target_modules: list[str] | str
    base_model_name: str | None = None
    peft_config: dict = field(default_factory=dict, repr=False)

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
        return self.map_tensors(torch.Tensor.pin_memory)

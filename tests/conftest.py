"""Shared fixtures: tiny random-config models and PEFT adapters saved to disk.

Adapters are made with PEFT itself (``init_lora_weights=False`` so B is not zero), which makes
PEFT the oracle for everything loramux computes from them.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def tiny_llama(seed: int = 0):
    """A 2-layer Llama with random weights (deterministic for a seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()


def save_peft_adapter(model, directory: Path, *, seed: int = 0, **lora_kwargs) -> Path:
    """Wrap ``model`` with a fresh PEFT LoRA built from ``lora_kwargs`` and save it."""
    from peft import LoraConfig, get_peft_model

    lora_kwargs.setdefault("r", 8)
    lora_kwargs.setdefault("lora_alpha", 16)
    lora_kwargs.setdefault("target_modules", ["q_proj", "v_proj"])
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kwargs))
    peft_model.save_pretrained(directory)
    peft_model.unload()  # give the caller its model back unwrapped
    return directory


@pytest.fixture(scope="session")
def make_adapter(tmp_path_factory):
    """Factory: ``make_adapter(name=None, *, model=None, seed=0, **LoraConfig kwargs) -> Path``.

    Defaults: a fresh tiny Llama, r=8, alpha=16, targets q_proj and v_proj.
    """
    counter = itertools.count()

    def make(name: str | None = None, *, model=None, seed: int = 0, **lora_kwargs) -> Path:
        directory = tmp_path_factory.mktemp("adapters") / (name or f"adapter{next(counter)}")
        return save_peft_adapter(model or tiny_llama(), directory, seed=seed, **lora_kwargs)

    return make

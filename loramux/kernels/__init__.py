"""Multi-LoRA kernels: one launch applies each token's own adapter (Punica's SGMV layout).

    meta = build_lora_meta(token_slots, num_slots)           # once per forward, shared by layers
    buf = lora_shrink(x, lora_a, scales, meta, ranks)         # [T, n_slices*R] float32
    lora_expand(y, buf, lora_b, slice_sizes, meta, ranks)     # y += B(buf), in place
    lora_apply(y, x, lora_a, lora_b, scales, ranks, slice_sizes, meta)   # both in one call

For CUDA graphs: ``build_lora_meta(token_slots, num_slots, static=True)`` (no host sync; launch
grids from T and num_slots only, so one captured graph replays for any mix of adapters).

Paged attention: `write_kv(key, value, k_cache, v_cache, slot_mapping)` stores a step's
keys/values, then `paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
scale=...)` serves decode tokens and prefill chunks of many sequences in one launch.

Triton on CUDA tensors, the torch reference elsewhere; LORAMUX_KERNELS=triton|torch forces one.
"""

from . import attention_reference, reference
from .dispatch import lora_apply, lora_expand, lora_shrink, paged_attention, write_kv
from .metadata import LoRABatchMeta, build_lora_meta

__all__ = [
    "LoRABatchMeta",
    "build_lora_meta",
    "lora_shrink",
    "lora_expand",
    "lora_apply",
    "reference",
    "paged_attention",
    "write_kv",
    "attention_reference",
]

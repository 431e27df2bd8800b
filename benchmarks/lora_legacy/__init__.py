"""A frozen copy of loramux/kernels at e25c560 (before issue 13): the static meta built with
``max_active=A`` (launch grid sized by A), split-K through float32 atomics into a buffer zeroed
by its own ``zero_()`` before every shrink. Only benchmarks/lora_decode.py imports it, to time the
old graph path against the new one in the same run; delete it once those numbers are recorded.
"""

from .expand import lora_expand_triton
from .metadata import LoRABatchMeta, build_lora_meta
from .shrink import lora_shrink_triton

__all__ = ["LoRABatchMeta", "build_lora_meta", "lora_expand_triton", "lora_shrink_triton"]

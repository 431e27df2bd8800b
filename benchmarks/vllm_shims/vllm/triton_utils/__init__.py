"""Plain `triton` and `triton.language` (vLLM's module adds placeholders for triton-less installs)."""

import triton
import triton.language as tl

HAS_TRITON = True

__all__ = ["HAS_TRITON", "tl", "triton"]

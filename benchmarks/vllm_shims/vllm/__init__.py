"""Stand-in for the `vllm` package: only what vLLM's LoRA Triton ops import (see ../README.md)."""

"""loramux.engine: LoRA layers, the GPU slot tier, and the generation engine (LLM, LLMEngine).

The generation side is imported lazily, so that ``loramux.engine.layers`` and friends stay light.
"""

from __future__ import annotations

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput"]

_LAZY = {
    "LLM": "loramux.engine.llm",
    "LLMEngine": "loramux.engine.llm_engine",
    "EngineConfig": "loramux.engine.config",
    "SamplingParams": "loramux.engine.sampling_params",
    "StructuredOutputsParams": "loramux.engine.sampling_params",
    "RequestOutput": "loramux.engine.core.outputs",
    "CompletionOutput": "loramux.engine.core.outputs",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'loramux.engine' has no attribute {name!r}")

"""loramux: serve many LoRA adapters on one shared base model.

The public API lives here. The engine (``LLM``, ``SamplingParams``) is imported on first use so
that ``import loramux`` stays light for plugins and the CLI.
"""

from __future__ import annotations

from loramux.errors import (
    AdapterDownloadError,
    AdapterNotFoundError,
    CacheFullError,
    EngineClosedError,
    IncompatibleAdapterError,
    InvalidAdapterError,
    LoRAError,
    PluginError,
    QuantizationError,
)
from loramux.registry import LoRAConfig, LoRARequest
from loramux.version import __version__

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "StructuredOutputsParams",
    "LoRARequest",
    "LoRAConfig",
    "hookimpl",
    "LoRAError",
    "AdapterNotFoundError",
    "InvalidAdapterError",
    "IncompatibleAdapterError",
    "AdapterDownloadError",
    "CacheFullError",
    "EngineClosedError",
    "PluginError",
    "QuantizationError",
]

_LAZY = {
    "LLM": "loramux.engine.llm",
    "LLMEngine": "loramux.engine.llm_engine",
    "SamplingParams": "loramux.engine.sampling_params",
    "StructuredOutputsParams": "loramux.engine.sampling_params",
    "hookimpl": "loramux.plugins.hookspecs",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'loramux' has no attribute {name!r}")

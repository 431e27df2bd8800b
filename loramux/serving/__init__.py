"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): ``loramux serve``.

``build_app(engine, ServerConfig(...))`` gives the ASGI app for any engine with the ``LLMEngine``
contract; :func:`loramux.serving.server.serve` builds the engine from the CLI's flags and runs
uvicorn. Imported lazily, so that ``loramux --help`` does not import FastAPI.
"""

from __future__ import annotations

__all__ = ["ServerConfig", "build_app"]

_LAZY = {"ServerConfig": "loramux.serving.config", "build_app": "loramux.serving.app"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'loramux.serving' has no attribute {name!r}")

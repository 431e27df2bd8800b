"""One small error hierarchy for everything a user can get wrong.

Every message names the adapter (or plugin), the file where one is involved, and what to do about
it, so the CLI and the HTTP server can show it to a user as it is.
"""

from __future__ import annotations

from os import PathLike

__all__ = [
    "LoRAError",
    "AdapterNotFoundError",
    "InvalidAdapterError",
    "IncompatibleAdapterError",
    "AdapterDownloadError",
    "CacheFullError",
    "CacheBusyError",
    "PluginError",
    "EngineClosedError",
    "QuantizationError",
]


class LoRAError(Exception):
    """Base of every loramux error.

    :param problem: what is wrong, in one sentence.
    :param adapter: the adapter's name, when one is involved.
    :param path: the file or directory involved.
    :param fix: what the user can do about it.
    """

    def __init__(
        self,
        problem: str,
        *,
        adapter: str | None = None,
        path: str | PathLike[str] | None = None,
        fix: str | None = None,
    ) -> None:
        self.problem = problem
        self.adapter = adapter
        self.path = None if path is None else str(path)
        self.fix = fix
        where = []
        if adapter is not None:
            where.append(f"adapter {adapter!r}")
        if self.path is not None:
            where.append(f"({self.path})")
        message = f"{' '.join(where)}: {problem}" if where else problem
        if fix:
            message = f"{message} {fix}"
        super().__init__(message)

    def __reduce__(self):  # keeps keyword-only fields across pickling (threads, processes)
        return (_rebuild, (type(self), self.problem, self.adapter, self.path, self.fix))


def _rebuild(cls, problem, adapter, path, fix):
    return cls(problem, adapter=adapter, path=path, fix=fix)


class AdapterNotFoundError(LoRAError, LookupError):
    """No adapter of that name or path exists in any configured source."""


class InvalidAdapterError(LoRAError, ValueError):
    """The adapter's files are missing, corrupt, unsafe or use a feature loramux does not support."""


class IncompatibleAdapterError(LoRAError, ValueError):
    """The adapter is well-formed but does not fit this model or this LoRA configuration."""


class AdapterDownloadError(LoRAError):
    """A remote source failed while fetching an adapter; nothing partial was kept."""


class CacheFullError(LoRAError):
    """Every entry of a bounded cache tier is in use, so there is no room for another adapter now."""


class CacheBusyError(CacheFullError):
    """The tier has room in principle, but what it holds is in use now; room comes back as the
    requests using it finish (the engine waits for that instead of failing the request)."""


class PluginError(LoRAError):
    """A plugin failed to import or broke a hook's contract; loramux carries on without it."""


class EngineClosedError(LoRAError, RuntimeError):
    """The engine was closed (``close()``, a ``with`` block's end, or garbage collection)."""


class QuantizationError(LoRAError, ValueError):
    """The base model's quantization (the ``quantization`` option, or a checkpoint's
    ``quantization_config``) is one loramux cannot run, or not on this device."""

"""The adapters loaded or unloaded at runtime, shared by every replica of one deployment.

``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` must apply to all replicas, including
the ones Ray starts later (scale-up, a replacement for a dead one). One replica runs the change
first, so the client gets that replica's answer (the single server's errors, unchanged); on
success the change is recorded here under a new version. Every replica compares its version
with this one before it serves a request and replays what it missed, so once a load has
answered, no replica serves a request without it.

It is a one-replica Serve deployment so it lives and dies with the application. Its state is
in memory: if its process dies, Ray restarts it empty, and replicas keep the adapters they had.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AdapterChange", "AdapterDirectory"]


@dataclass(frozen=True)
class AdapterChange:
    """One name's latest runtime change: loaded from ``path`` (None: unloaded)."""

    name: str
    version: int
    path: str | None
    base_model_name: str | None = None


class AdapterDirectory:
    """Latest runtime change per adapter name, and a version that grows with every change."""

    def __init__(self) -> None:
        self._changes: dict[str, AdapterChange] = {}
        self._version = 0

    def version(self) -> int:
        return self._version

    def record(self, name: str, path: str | None, base_model_name: str | None = None) -> int:
        """Record that ``name`` now serves ``path`` (None: it was unloaded); returns the version."""
        self._version += 1
        self._changes[name] = AdapterChange(name, self._version, path, base_model_name)
        return self._version

    def changes_since(self, version: int) -> tuple[int, list[AdapterChange]]:
        """The current version and the changes newer than ``version``, oldest first."""
        newer = sorted((c for c in self._changes.values() if c.version > version), key=lambda c: c.version)
        return self._version, newer

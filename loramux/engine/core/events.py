"""What the engine tells its listeners about adapters, as it happens (no polling).

- ``"ready"``: the adapter of these requests was resolved and loaded (or found in the CPU tier);
  ``handle`` says which one, ``seconds`` how long resolve + load took for them.
- ``"failed"``: it could not be resolved or loaded; ``error`` says why. Sent from the loading
  thread the moment the load fails, so a server answers 404/400 without waiting for a step.
- ``"retired"``: ``handle`` lost its name (a reload rebound the name, or an unload unbound it)
  and its last request ended: its GPU slot and CPU-tier entry are free. Sent exactly once per
  handle that loses its name, right then (possibly inside ``remove_lora`` when nothing used it).

Listeners run in the thread where the event happens (the step loop, a loading thread, or the
caller of ``add_lora`` / ``remove_lora``): they must be quick and thread-safe; an asyncio server
hands the event to its loop with ``loop.call_soon_threadsafe``. A listener that raises is logged
and does not stop the others.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from loramux.errors import LoRAError
from loramux.registry import AdapterHandle

__all__ = ["AdapterEvent", "AdapterEventKind", "EventListeners"]

logger = logging.getLogger(__name__)

AdapterEventKind = Literal["ready", "failed", "retired"]


@dataclass(frozen=True)
class AdapterEvent:
    """One thing that happened to an adapter.

    :ivar kind: ``"ready"``, ``"failed"`` or ``"retired"`` (see the module doc).
    :ivar name: the adapter's name as the requests (or the handle) gave it.
    :ivar request_ids: the requests it is about (ready, failed); empty for retired.
    :ivar handle: the handle (ready, retired); None for failed.
    :ivar error: why it failed (failed only).
    :ivar seconds: resolve + load time for these requests (ready, failed).
    """

    kind: AdapterEventKind
    name: str
    request_ids: tuple[str, ...] = ()
    handle: AdapterHandle | None = None
    error: LoRAError | None = None
    seconds: float | None = None

    @property
    def source(self) -> str | None:
        """The resolver that found the adapter (``"path"`` for a local path), when known."""
        return self.handle.source if self.handle is not None else None


class EventListeners:
    """A thread-safe list of listeners, called in order for each event."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[Callable[[AdapterEvent], None]] = []

    def add(self, listener: Callable[[AdapterEvent], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove(self, listener: Callable[[AdapterEvent], None]) -> None:
        with self._lock:
            self._listeners.remove(listener)

    def emit(self, event: AdapterEvent) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # a broken listener must not break the step loop or a load
                logger.exception("An adapter event listener raised on %s", event)

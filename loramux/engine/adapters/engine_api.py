"""`EngineAdapterAPI`: the adapter-facing methods of `LLMEngine` (``add_lora``, ``remove_lora``,
``pin_lora``, ``lora_handle``, ``list_loras``, the adapter event listeners and the tiers' stats).

Each one checks LoRA is enabled, turns a ``lora_int_id`` into the name it is bound to, and hands
the call to the engine's `AdapterLifecycle` or registry; the lifecycle owns the adapter's life and
its locking, so these are safe from any thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from loramux.engine.core.events import AdapterEvent
from loramux.engine.core.stats import TierStats, read_tiers
from loramux.errors import LoRAError
from loramux.registry import AdapterHandle, LoRARequest, Registry

if TYPE_CHECKING:
    from loramux.engine.adapters.lifecycle import AdapterLifecycle
    from loramux.engine.config import EngineConfig

__all__ = ["EngineAdapterAPI"]


class EngineAdapterAPI:
    """What `LLMEngine` offers about adapters; the engine sets the attributes below (all None
    without LoRA, except ``config``)."""

    config: EngineConfig
    registry: Registry | None
    lora_manager: object | None  # the GPU tier (`LoRAModelManager`)
    adapters: AdapterLifecycle | None

    @property
    def lora_enabled(self) -> bool:
        return self.lora_manager is not None

    @property
    def max_loading_workers(self) -> int:
        """Adapter loads that run at once beside the step loop."""
        return self.config.max_loading_workers

    def tier_stats(self) -> dict[str, TierStats]:
        """Each adapter tier's counters and residents (``{"cpu": ..., "gpu": ...}``; none without LoRA)."""
        return read_tiers(self.registry, self.lora_manager)

    def add_event_listener(self, listener: Callable[[AdapterEvent], None]) -> None:
        """Call ``listener(event)`` for every adapter event: "ready" and "failed" per request as
        its adapter's load ends, "retired" when a handle that lost its name has no request left
        (see :mod:`loramux.engine.core.events`). It runs in the thread where the event happens: keep
        it quick and thread-safe."""
        self._require_lora()
        self.adapters.events.add(listener)

    def remove_event_listener(self, listener: Callable[[AdapterEvent], None]) -> None:
        self._require_lora()
        self.adapters.events.remove(listener)

    def _name_of(self, name_or_id: str | int) -> str:
        if isinstance(name_or_id, int):
            name = self.registry.name_of_id(name_or_id)
            if name is None:
                raise LoRAError(f"no adapter with lora_int_id={name_or_id} is bound in this engine.",
                                fix="Name it by its lora_name, or add it with add_lora first.")
            return name
        return name_or_id

    def _require_lora(self) -> None:
        if self.lora_manager is None:
            raise ValueError("LoRA is disabled; build the engine with enable_lora=True")

    def add_lora(self, lora_request: LoRARequest, *, wait_s: float = 0.0) -> bool:
        """Load an adapter now (blocking) and bind its name to it, so requests naming it start at
        once. An adapter already bound is reloaded: the name gets the new weights (a new handle)
        for new requests, running ones finish on the old weights, and the old handle retires
        (a "retired" event) when its last request ends.

        :param wait_s: if the CPU tier is full of adapters that requests hold, wait up to this
            many seconds for one to be released (while another thread steps the engine); 0 raises
            `~loramux.errors.CacheBusyError` at once.
        """
        self._require_lora()
        self.adapters.add(lora_request, wait_s=wait_s)
        return True

    def remove_lora(self, name_or_id: str | int) -> bool:
        """Unload: unbind the name and return at once (whether it was bound). Requests running
        with it finish; its handle retires, freeing its GPU slot and CPU entry, when the last one
        ends, and a "retired" event says so (see :meth:`add_event_listener`)."""
        self._require_lora()
        try:
            name = self._name_of(name_or_id)
        except LoRAError:
            return False
        return self.adapters.remove(name)

    def pin_lora(self, name_or_id: str | int) -> bool:
        """Keep an adapter in a GPU slot until ``remove_lora``; its rows stay taken in the GPU
        pool (and it counts against ``max_loras`` when set): a reference the engine holds; a
        reload moves it to the new weights."""
        self._require_lora()
        return self.adapters.pin_name(self._name_of(name_or_id))

    def lora_handle(self, name: str) -> AdapterHandle | None:
        """The handle ``name`` is bound to now (None: not loaded, or unknown)."""
        self._require_lora()
        return self.registry.handle(name)

    def list_loras(self) -> list[str]:
        """Adapter names this engine serves: registered, or found by a resolver and loaded."""
        self._require_lora()
        return self.registry.list()

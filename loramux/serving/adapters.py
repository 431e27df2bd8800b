"""Which names the server answers to: the base model's, and adapters with stable int ids.

A request's ``model`` field is either one of the base model's served names or an adapter name.
Adapters come from ``--lora-modules`` and ``/v1/load_lora_adapter`` (with a path), or are named
by a client and found on demand through the resolvers (an empty path). Each name keeps one
``LoRARequest`` (one ``lora_int_id``) for as long as it is known, so concurrent requests for a
new name share one resolution in the engine (single-flight).

What a name *means* (which weights) lives in the engine's registry, its one name -> handle
binding: a reload rebinds the name there and an unload unbinds it, while requests already running
finish on the handle they started with. Which names are served is the engine's too
(`EngineClient.list_loras`): /v1/models lists a name only while the engine serves it, and a name
found on demand that the engine has forgotten (its adapter left the CPU tier) is forgotten here
as well, so the book never outgrows the engine's name map. Used on the event loop only.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from loramux.errors import AdapterNotFoundError
from loramux.registry import LoRARequest, validate_adapter_name
from loramux.serving.errors import APIError

__all__ = ["AdapterBook", "AdapterEntry"]

_MIN_PRUNE_AT = 1024


@dataclass
class AdapterEntry:
    request: LoRARequest  # what the engine gets (its lora_name is the public name)
    source: str  # "static" (--lora-modules), "runtime" (load_lora_adapter), "resolved" (on demand)
    confirmed: bool = True  # a resolved name is listed in /v1/models once a request with it ran
    path: str | None = None  # where it was loaded from, when known


class AdapterBook:
    """Maps a request's ``model`` to ``None`` (the base model) or a ``LoRARequest``.

    :param served_names: the base model's names; the first is the one responses carry.
    :param engine_names: the adapter names the engine serves now (its registry's name map).
    """

    def __init__(self, served_names: list[str], engine_names: Callable[[], Iterable[str]]) -> None:
        if not served_names:
            raise ValueError("the base model needs at least one served name")
        self.served_names = list(served_names)
        self._engine_names = engine_names
        self._entries: dict[str, AdapterEntry] = {}  # public name -> entry
        self._ids = itertools.count(1)
        self._prune_at = _MIN_PRUNE_AT  # entries past which a new on-demand name prunes the book

    @property
    def base_name(self) -> str:
        return self.served_names[0]

    # -- serving requests ------------------------------------------------------------------------

    def lookup(self, model: str) -> LoRARequest | None:
        """The adapter ``model`` names (None for the base model), creating an on-demand entry.

        :raises APIError: 400 when ``model`` is not a valid adapter name.
        """
        if model in self.served_names:
            return None
        entry = self._entries.get(model)
        if entry is not None:
            return entry.request
        request = self._new_request(model, "", param="model")
        if len(self._entries) >= self._prune_at:  # amortized: the book doubles between prunes
            self._forget_unserved(set(self._engine_names()))
            self._prune_at = max(_MIN_PRUNE_AT, 2 * len(self._entries))
        self._entries[model] = AdapterEntry(request, "resolved", confirmed=False)
        return request

    def settle(self, model: str, request: LoRARequest, error: BaseException | None) -> bool:
        """Record how a request for ``model`` started: its adapter was found, or ``error``.

        A name found on demand is listed from its first success on; one that fails is dropped,
        so the next request asks the resolvers again. Returns True for the call that settled a
        pending on-demand lookup (so it is counted once however many requests waited on it).
        """
        entry = self._entries.get(model)
        if entry is None or entry.request != request:
            return False
        pending = not entry.confirmed
        if error is None:
            entry.confirmed = True
        elif entry.source == "resolved" and (pending or isinstance(error, AdapterNotFoundError)):
            del self._entries[model]
        return pending

    def is_known(self, model: str, request: LoRARequest) -> bool:
        """Whether ``request`` is what ``model`` names now, registered or found on demand and run."""
        entry = self._entries.get(model)
        return entry is not None and entry.request == request and entry.confirmed

    # -- loading and unloading -------------------------------------------------------------------

    def prepare(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """A new ``LoRARequest`` for ``name`` at ``path``, not yet served (see ``commit``).

        :raises APIError: 400 when the name is invalid or the base model's.
        """
        return self._new_request(name, path, base_model_name, param="lora_name")

    def commit(self, name: str, request: LoRARequest, *, source: str, path: str) -> AdapterEntry | None:
        """Make ``name`` serve ``request`` from now on; returns the entry it replaced."""
        previous = self._entries.get(name)
        self._entries[name] = AdapterEntry(request, source, confirmed=True, path=path)
        return previous

    def remove(self, name: str) -> AdapterEntry | None:
        """Stop serving ``name`` (the caller unloads it from the engine)."""
        return self._entries.pop(name, None)

    def get(self, name: str) -> AdapterEntry | None:
        return self._entries.get(name)

    def listed(self) -> list[tuple[str, AdapterEntry]]:
        """The adapters /v1/models shows: those the engine serves now, registered here or found
        on demand and run."""
        serving = set(self._engine_names())
        self._forget_unserved(serving)
        return [(name, entry) for name, entry in self._entries.items() if entry.confirmed and name in serving]

    def _forget_unserved(self, serving: set[str]) -> None:
        """Drop the names found on demand, and run, that the engine no longer serves (a request
        for one finds it again through the resolvers). Pending lookups stay: they are running."""
        for name in [name for name, entry in self._entries.items()
                     if entry.source == "resolved" and entry.confirmed and name not in serving]:
            del self._entries[name]

    # -- helpers ---------------------------------------------------------------------------------

    def _new_request(self, name: str, path: str, base_model_name: str | None = None,
                     *, param: str) -> LoRARequest:
        if name in self.served_names:
            raise APIError(400, f"{name!r} is the base model's name; pick another name for the adapter",
                           param=param, code="invalid_adapter_name")
        try:
            validate_adapter_name(name)
            return LoRARequest(name, next(self._ids), path, base_model_name)
        except ValueError as error:
            raise APIError(400, f"invalid adapter name: {error}", param=param,
                           code="invalid_adapter_name") from error

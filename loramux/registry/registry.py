"""`Registry`: the one place a name means an adapter. Name -> handle, backed by the CPU tier.

An adapter is named once, at the border. The registry finds it (a path or URI registered for
the name, else the resolvers), loads and validates it once, issues an
:class:`~loramux.registry.AdapterHandle` and binds the name to it. Below the registry everything
keys by ``handle.id``; the CPU tier holds the weights by it.

- Loading happens once per name however many threads ask at once (single-flight: this is the one
  place concurrent loads of an adapter merge); a failure reaches every waiter and leaves the
  registry and the tier as they were. `Registry.load` runs it on a few loading threads (beside
  an engine's steps); `Registry.get` waits for it.
- Reload (:meth:`Registry.rebind`) binds the name to a new handle; unload
  (:meth:`Registry.unregister`) unbinds it. Either way the old handle *retires*: it stays in the
  CPU tier while pinned (requests already running finish on it) and leaves at its last unpin.
- An adapter evicted from the CPU tier and asked for again is read again from its source; if its
  content is unchanged it keeps its handle, so GPU slots and caches keyed by it stay valid.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from os import PathLike
from typing import TYPE_CHECKING

import torch

from loramux.errors import CacheBusyError, IncompatibleAdapterError
from loramux.registry.adapter import LoRAAdapter
from loramux.registry.config import LoRAConfig
from loramux.registry.cpu_cache import CPUAdapterCache
from loramux.registry.handle import AdapterHandle, memory_handle, next_handle_id
from loramux.registry.host_memory import PAGEABLE, PINNED_EACH_LOAD, HostMemory, release_frames
from loramux.registry.loader import load_adapter_with_digest
from loramux.registry.loading_threads import LoadingThreads
from loramux.registry.request import LoRARequest
from loramux.registry.sources import (
    AdapterLocation,
    AdapterSource,
    AdapterSources,
    check_name,
    normalize_location,
)

if TYPE_CHECKING:
    from loramux.resolvers.base import Resolver
    from loramux.resolvers.settings import ResolverSettings

__all__ = ["AdapterLocation", "Registry"]


@dataclass
class _Binding:
    """What a name means: where to (re)load it from, and the handle it is bound to now."""

    source: AdapterSource | None = None  # None: the resolvers find it by name
    handle: AdapterHandle | None = None  # None: not loaded yet
    held: bool = False  # bound from memory: the registry pins it, as nothing could reload it
    lora_int_id: int | None = None  # the border's id for the name (LoRARequest), for remove_lora(id)


class Registry:
    """Adapters by name: loaded on demand, validated once, bound to handles, kept in the CPU tier.

    :param lora_config: bounds checked at load (``max_lora_rank``), the dtype, and the CPU
        tier's size (``max_cpu_loras``, ``max_cpu_lora_bytes``).
    :param base_model_name: the served model; passed to resolvers, which may group adapters by it.
    :param resolvers: the resolvers to use; default: those the plugins register, given
        ``resolver_settings``.
    :param resolver_settings: the built-in resolvers' settings (order, filesystem root, Hub
        allow-list); default :meth:`ResolverSettings.from_env`, the environment read once here.
    :param resolver_order: names of the resolvers to ask by name, in order (a list or ``"a,b"``);
        overrides ``resolver_settings.order``.
    :param cache: the CPU tier; default one sized by ``lora_config``.
    :param validate: called once with each adapter after it loads, before it gets a handle, on the
        loading thread (the engine passes ``LoRAModelManager.validate_and_prepare``); its
        exception fails the load and caches nothing.
    :param pin_memory: keep weights in page-locked memory allocated for each load (read straight
        into it), so copies into GPU slots run asynchronously; default: when CUDA is available.
        Allocating it while serving stalls the engine's CUDA calls: the engine gives its registry
        an arena instead (``host_memory``).
    :param host_memory: where loads put weights (a :class:`~loramux.registry.page_locked_arena.PageLockedArena`,
        made once, carved per adapter); overrides ``pin_memory``.
    :param on_unbind: called with a handle when its name is rebound (reload) or unbound
        (unload): nothing new will use it (outside the registry's lock).
    """

    def __init__(
        self,
        lora_config: LoRAConfig | None = None,
        *,
        base_model_name: str | None = None,
        resolvers: Sequence[Resolver] | None = None,
        resolver_settings: ResolverSettings | None = None,
        resolver_order: Sequence[str] | str | None = None,
        cache: CPUAdapterCache | None = None,
        validate: Callable[[LoRAAdapter], None] | None = None,
        pin_memory: bool | None = None,
        host_memory: HostMemory | None = None,
        on_unbind: Callable[[AdapterHandle], None] | None = None,
    ) -> None:
        from loramux.resolvers.collect import collect_resolvers
        from loramux.resolvers.settings import ResolverSettings

        self.lora_config = lora_config or LoRAConfig()
        self.base_model_name = base_model_name
        settings = resolver_settings or ResolverSettings.from_env()
        if resolver_order is not None:
            settings = replace(settings, order=resolver_order)
        self.resolver_settings = settings
        self.sources = AdapterSources(
            collect_resolvers(settings) if resolvers is None else resolvers,
            settings.order,
            base_model_name=base_model_name,
            fetch_timeout=settings.fetch_timeout,
        )
        self.cache = cache or CPUAdapterCache(
            self.lora_config.max_cpu_loras, self.lora_config.max_cpu_lora_bytes
        )
        if host_memory is None:
            pinned = torch.cuda.is_available() if pin_memory is None else pin_memory
            host_memory = PINNED_EACH_LOAD if pinned else PAGEABLE
        self.host_memory: HostMemory = host_memory
        self._validate = validate
        self._unbind_listeners: list[Callable[[AdapterHandle], None]] = [on_unbind] if on_unbind else []
        self._bindings: dict[str, _Binding] = {}
        self._loading: dict[str, Future[LoRAAdapter]] = {}  # name -> its load in flight
        self._threads = LoadingThreads(self.lora_config.max_loading_workers)
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stop the loading threads (waiting a moment for loads in flight); a later `load` starts
        them again. An engine closes the registry it built."""
        self._threads.shutdown()

    @property
    def pin_memory(self) -> bool:
        """Whether loads put weights in page-locked memory."""
        return self.host_memory.pinned

    @property
    def resolvers(self) -> list[Resolver]:
        return self.sources.resolvers

    @property
    def name_resolvers(self) -> list[Resolver]:
        """The resolvers asked for a name, in order."""
        return self.sources.name_resolvers

    # -- names ---------------------------------------------------------------------------------

    def register(
        self,
        name: str,
        path: str | PathLike[str],
        base_model_name: str | None = None,
        *,
        replace: bool = False,
    ) -> None:
        """Serve the adapter at ``path`` (a local directory or a URI) as ``name``; loads lazily.

        :param base_model_name: when given, the adapter must have been trained for this model.
        :param replace: allow ``name`` to point somewhere else than before. The handle it was
            bound to retires, so the next ``get`` loads from the new place.
        :raises InvalidAdapterError: the name is unsafe.
        :raises AdapterNotFoundError: a local ``path`` is not a directory, or no resolver
            fetches its URI scheme.
        :raises IncompatibleAdapterError: ``name`` is registered for another path (and not
            ``replace``).
        """
        check_name(name)
        source = AdapterSource(normalize_location(path), base_model_name)
        self.sources.check(name, source)
        with self._lock:
            binding = self._bindings.setdefault(name, _Binding())
            previous = binding.source
            if previous is not None and previous.location != source.location and not replace:
                raise IncompatibleAdapterError(
                    f"the name is already registered for {previous.location!r}, not "
                    f"{source.location!r}.",
                    adapter=name,
                    fix="Use another name, or unregister (unload) this one first.",
                )
            binding.source = source
            # a copy loaded from elsewhere (or found by a resolver, or from memory) is stale
            stale = self._unbind_handle(binding) if previous != source else None
        self._retire(stale)

    def unregister(self, name: str) -> bool:
        """Unload: unbind ``name``. Its handle retires (it leaves the CPU tier at its last unpin).

        :returns: whether the name was bound or registered.
        """
        with self._lock:
            binding = self._bindings.pop(name, None)
            stale = self._unbind_handle(binding) if binding is not None else None
        self._retire(stale)
        return binding is not None

    def add_unbind_listener(self, listener: Callable[[AdapterHandle], None]) -> None:
        """Also call ``listener(handle)`` whenever a handle loses its name (as ``on_unbind``).

        The engine subscribes here: a handle that lost its name *retires* once no request uses it.
        Called in the thread that rebound or unbound the name, outside the registry's lock.
        """
        with self._lock:
            self._unbind_listeners.append(listener)

    def remove_unbind_listener(self, listener: Callable[[AdapterHandle], None]) -> None:
        """Stop calling ``listener`` (an engine closing: the registry may outlive it)."""
        with self._lock:
            if listener in self._unbind_listeners:
                self._unbind_listeners.remove(listener)

    def name_of_id(self, lora_int_id: int) -> str | None:
        """The name a ``LoRARequest`` with this ``lora_int_id`` last asked for, if still bound."""
        with self._lock:
            return next((name for name, b in self._bindings.items() if b.lora_int_id == lora_int_id), None)

    def handle(self, name: str) -> AdapterHandle | None:
        """The handle ``name`` is bound to now, or None (unknown, or not loaded yet)."""
        with self._lock:
            binding = self._bindings.get(name)
            return binding.handle if binding is not None else None

    def list(self) -> list[str]:
        """Names served now, sorted: registered ones (loaded or not), and those found by the
        resolvers whose adapter is in the CPU tier."""
        with self._lock:
            bindings = list(self._bindings.items())
        return sorted(name for name, binding in bindings if self._listed(binding))

    def __contains__(self, name: object) -> bool:
        with self._lock:
            binding = self._bindings.get(name)
        return binding is not None and self._listed(binding)

    def _listed(self, binding: _Binding) -> bool:
        if binding.source is not None or binding.held:
            return True
        return binding.handle is not None and binding.handle.id in self.cache

    # -- adapters ------------------------------------------------------------------------------

    def get(self, name_or_request: str | LoRARequest, *, pin: bool = False) -> LoRAAdapter:
        """The adapter ``name`` is bound to, loaded (resolved, read, validated) on first use, then
        from the CPU tier. Its ``.handle`` is set. Loads in this thread (see `load`).

        Concurrent calls for the same missing adapter load it once; all get its result or error.

        :param name_or_request: a name, or a ``LoRARequest`` (its ``lora_path``, if set, is
            registered for its name).
        :param pin: also pin its handle in the CPU tier, atomically (release with
            ``registry.cache.unpin(adapter.handle.id)``).
        :raises AdapterNotFoundError: no path is registered and no resolver finds it; the
            message lists the resolvers tried.
        :raises LoRAError: it cannot be fetched, is invalid or does not fit; nothing is cached.
        """
        name = self._name_of(name_or_request)
        while True:
            adapter = self._resident(name, pin)
            if adapter is not None:
                return adapter
            future, started = self._join(name)
            if started:
                return self._run_load(name, future, pin=pin, force=False)
            future.result()  # another thread's load: its error is ours too; then a hit (or a new load)

    def load(self, request: str | LoRARequest, *, pin: bool = False) -> Future[LoRAAdapter]:
        """`get`, without waiting: the adapter at once from the CPU tier, else its load on the
        loading threads (``LoRAConfig.max_loading_workers`` at most), or the load of its name
        already in flight. The future's adapter is pinned once for this call when ``pin``; its
        error is the load's, or the request's own (an unsafe name, a path that is not there)."""
        result: Future[LoRAAdapter] = Future()
        try:
            name = self._name_of(request)
        except BaseException as error:  # this request's failure, told like a load's
            result.set_exception(error)
            return result
        self._deliver(name, pin, result)
        return result

    def _deliver(self, name: str, pin: bool, result: Future) -> None:
        adapter = self._resident(name, pin)
        if adapter is not None:
            result.set_result(adapter)
            return
        future, started = self._join(name)
        if started:  # its load pins for this call
            self._threads.submit(self._run_load, name, future, pin, False).add_done_callback(
                lambda done: _copy_outcome(done, result))
        else:  # once the load in flight ends: a hit (pinned now), or its error
            future.add_done_callback(lambda done: _copy_outcome(done, result) if done.exception() is not None
                                     else self._deliver(name, pin, result))

    def _resident(self, name: str, pin: bool) -> LoRAAdapter | None:
        """The adapter ``name`` is bound to if it is in the CPU tier (a hit), else None (a miss)."""
        handle = self.handle(name)
        if handle is None:
            self.cache.record_miss()
            return None
        return self.cache.get(handle.id, pin=pin)

    def rebind(self, name_or_request: str | LoRARequest, *, pin: bool = False) -> LoRAAdapter:
        """Reload: read the adapter again from its source and bind its name to the result (in this
        thread, after any load of the name in flight).

        New content gets a new handle; the old handle retires (requests running on it finish on
        it). The same content again (same digest and path) keeps its handle.
        """
        name = self._name_of(name_or_request)
        while True:
            future, started = self._join(name)
            if started:
                return self._run_load(name, future, pin=pin, force=True)
            try:
                future.result()  # a load started before this call: a reload must read the source itself
            except BaseException:
                pass

    def bind(self, adapter: LoRAAdapter, *, name: str | None = None) -> LoRAAdapter:
        """Serve an adapter built in memory as ``name`` (default ``adapter.name``).

        It is validated, digested from its tensors and given a handle; the registry holds a pin
        on it (nothing could reload it) until the name is unregistered or bound again.

        :returns: the adapter as served (in ``host_memory`` when that is page-locked and the
            adapter is not), its handle set.
        """
        name = check_name(name or adapter.name)
        started = time.perf_counter()
        if self._validate is not None:
            self._validate(adapter)
        first = next(iter(adapter.modules.values()), None)
        if self.pin_memory and first is not None and first.lora_a.device.type == "cpu" and not adapter.is_pinned:
            adapter = adapter.pack(allocate=self.host_memory.allocate)
        handle = memory_handle(adapter, name, load_seconds=time.perf_counter() - started)
        adapter = replace(adapter, name=name, handle=handle)
        self.cache.put(adapter, pin=True)
        with self._lock:
            binding = self._bindings.setdefault(name, _Binding())
            stale = self._unbind_handle(binding)
            binding.source, binding.handle, binding.held = None, handle, True
        self._retire(stale)
        return adapter

    def locate(self, name_or_request: str | LoRARequest) -> AdapterLocation:
        """Find (and fetch, if remote) the adapter's directory without loading it."""
        name = self._name_of(name_or_request)
        with self._lock:
            binding = self._bindings.get(name)
        return self.sources.locate(name, binding.source if binding is not None else None)

    # -- loading -------------------------------------------------------------------------------

    def _join(self, name: str) -> tuple[Future, bool]:
        """The load of ``name`` in flight (False), or a new one that the caller runs (True)."""
        with self._lock:
            future = self._loading.get(name)
            if future is None:
                future = self._loading[name] = Future()
                return future, True
            return future, False

    def _run_load(self, name: str, future: Future, pin: bool, force: bool) -> LoRAAdapter:
        """Run the load `_join` started; its waiters get its result or error."""
        try:
            adapter = self._load(name, pin=pin, force=force)
        except BaseException as error:
            release_frames(error)  # its buffer (an arena piece) must not live on in the error's frames
            with self._lock:
                del self._loading[name]
            if not isinstance(error, CacheBusyError):  # waiting for room is no failure: it is retried
                self.cache.record_load_failure()
            future.set_exception(error)
            raise
        with self._lock:
            del self._loading[name]
        future.set_result(adapter)
        return adapter

    def _load(self, name: str, *, pin: bool, force: bool) -> LoRAAdapter:
        started = time.perf_counter()
        with self._lock:
            binding = self._bindings.get(name)
            source = binding.source if binding is not None else None
            old = binding.handle if binding is not None else None
        if old is not None and force and binding.held:
            return self.cache.get(old.id, pin=pin)  # from memory: nothing to read again
        location = self.sources.locate(name, source)
        adapter, digest = load_adapter_with_digest(
            location.path,
            self.lora_config,
            name=name,
            base_model_name=source.base_model_name if source is not None else None,
            host_memory=self.host_memory,
        )
        if self._validate is not None:
            self._validate(adapter)  # the one validation of this load, before any state changes
        path = str(location.path)
        if old is not None and old.digest == digest and old.path == path:
            handle = old  # the same content again: the same identity
            resident = self.cache.get(handle.id, pin=pin)
            if resident is not None:
                return resident
        else:
            handle = AdapterHandle(
                next_handle_id(), name, digest, path, adapter.rank, adapter.nbytes,
                source=location.resolver or "path", load_seconds=time.perf_counter() - started,
            )
        adapter = replace(adapter, handle=handle)
        self.cache.put(adapter, pin=pin)  # raises CacheFullError with nothing changed
        with self._lock:
            current = self._bindings.get(name)
            if current is not binding or (current is not None and current.source != source):
                # unregistered or registered elsewhere meanwhile: serve this load's waiters,
                # bind nothing
                stale, current = handle, None
            elif current is None:
                current = self._bindings[name] = _Binding()
                stale = None
            else:
                stale = self._unbind_handle(current) if current.handle != handle else None
            if current is not None:
                current.handle = handle
            self._forget_evicted()
        self._retire(stale)
        return adapter

    def _forget_evicted(self) -> None:
        """Bound the name map under churn (under the lock): past a few times the CPU tier's size,
        drop names that only a resolver found and whose adapter left the tier. Kept until then,
        such a name read again keeps its handle when its content is unchanged."""
        if len(self._bindings) <= 4 * (self.cache.max_loras or len(self.cache)) + 1024:
            return
        resident = set(self.cache.handle_ids())
        for name in [
            name
            for name, b in self._bindings.items()
            if b.source is None and not b.held and (b.handle is None or b.handle.id not in resident)
        ]:
            del self._bindings[name]

    def _unbind_handle(self, binding: _Binding) -> AdapterHandle | None:
        """Detach ``binding``'s handle (under the lock); the caller retires it after."""
        handle, binding.handle = binding.handle, None
        if handle is not None and binding.held:
            binding.held = False
            self.cache.unpin(handle.id)
        return handle

    def _retire(self, handle: AdapterHandle | None) -> None:
        if handle is None:
            return
        self.cache.retire(handle.id)
        with self._lock:
            listeners = list(self._unbind_listeners)
        for listener in listeners:
            listener(handle)

    def _name_of(self, name_or_request: str | LoRARequest) -> str:
        if isinstance(name_or_request, LoRARequest):
            request = name_or_request
            if request.lora_path:
                with self._lock:
                    binding = self._bindings.get(request.lora_name)
                    known = binding.source if binding is not None else None
                # the path as registered needs no resolving: half of a burst's add_request time
                if known is None or (request.lora_path != known.location
                                     and known.location != normalize_location(request.lora_path)):
                    self.register(request.lora_name, request.lora_path, request.base_model_name)
            with self._lock:
                binding = self._bindings.setdefault(check_name(request.lora_name), _Binding())
                binding.lora_int_id = request.lora_int_id
            return request.lora_name
        return check_name(name_or_request)


def _copy_outcome(done: Future, result: Future) -> None:
    error = done.exception()
    if error is not None:
        result.set_exception(error)
    else:
        result.set_result(done.result())

"""`AdapterLifecycle`: the one owner of an adapter's life inside the engine, name -> handle -> slot.

    border (LoRARequest) --AdapterLoader--> Registry.load: handle (validated once), CPU-tier pin
        --> collect: a reference per queued sequence (`AdapterUses`; the first pins the CPU tier)
        --> prefetch: copied into a GPU slot beside a step (`Fit.READY` from then on)
        --> admission: the handle's GPU slot, held while it runs (seq.lora_slot, no name lookup)
        --> last reference gone: slot released (stays as cache), CPU pin released
        --> name rebound or unbound meanwhile: the handle *retires* (slot and CPU entry freed),
            and a "retired" event says so, exactly then.

It owns the registry (names, handles, the CPU tier), the `LoRAModelManager` (GPU slots), the
loads in flight and the event listeners, and keeps the reference counts (`AdapterUses`) the
scheduler updates and asks. It reads nothing of the scheduler's: the engine hands it the queue
in admission order when it copies adapters (`prefetch`), and takes back the requests whose load
ended (`collect`). Its state changes run under the engine's step lock, so the step loop, API
threads (``add_lora``, ``remove_lora``, ``pin_lora``) and the registry's unbind callback never
interleave.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from loramux.engine.adapters.loading import AdapterLoader
from loramux.engine.adapters.uses import AdapterUses
from loramux.engine.core.events import AdapterEvent, EventListeners
from loramux.engine.core.instrumentation import StepClock
from loramux.engine.core.sequence import Sequence
from loramux.errors import CacheBusyError, LoRAError
from loramux.registry import AdapterHandle, LoRAAdapter, LoRARequest, Registry

__all__ = ["AdapterLifecycle", "Collected", "PREFETCH_PER_STEP"]

# adapters a step copies into GPU slots ahead of admission: requests arrive a few per step even
# at saturation, so this keeps ahead of them without one step doing the work of hundreds
PREFETCH_PER_STEP = 8


@dataclass
class Collected:
    """What `AdapterLifecycle.collect` found: requests whose adapter loaded (a handle each, to
    queue) and requests whose load failed (finished with the error)."""

    ready: list[Sequence]
    failed: list[Sequence]


class AdapterLifecycle(AdapterUses):
    """Loads, references, slots, reloads, unloads and events of the engine's adapters.

    :param registry: names, handles and the CPU tier (it runs the loads).
    :param manager: the ``LoRAModelManager`` (GPU slots, keyed by handle id).
    :param lock: the engine's step lock (reentrant): held for every state change here.
    :param validate: whether to validate what the registry returns (a registry the engine did
        not build, which does not run the engine's ``validate`` callback itself).
    :param clock: the engine's timing points (``lora.can_place``, ``lora.place``).
    """

    def __init__(self, registry: Registry, manager, *, lock: threading.RLock, validate: bool = False,
                 clock: StepClock | None = None) -> None:
        super().__init__(manager.lora_config.max_loras)
        self.registry = registry
        self.manager = manager
        self.clock = clock or StepClock()
        self.events = EventListeners()
        self.loader = AdapterLoader(registry, check=self._checked, on_settled=self._settled)
        self._lock = lock
        self._validate = validate
        self._unbound: set[int] = set()  # handle ids that lost their name while still referenced
        # requests whose adapter found the CPU tier full of adapters in use: they wait (status
        # LOADING_ADAPTER) and load again as references are released, oldest first
        self._deferred: list[Sequence] = []
        self._room_freed = False
        self._room = threading.Condition(lock)  # notified as requests and adds release CPU-tier pins
        self._released_count = 0  # bumped each time they do
        # add() calls not waiting for room: each holds, or is loading towards, a CPU-tier pin that
        # it releases as it ends (another add may wait for it, as for a request's)
        self._adding = 0
        self.prefetches = 0  # adapters copied into a GPU slot before their request was admitted
        registry.add_unbind_listener(self._on_unbind)

    # -- loading beside the loop ----------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        """Start resolving and loading ``seq``'s adapter (any thread)."""
        self.loader.submit(seq)

    def _checked(self, adapter: LoRAAdapter) -> None:
        """Whether ``adapter`` (pinned in the CPU tier) has a handle and fits here; else unpinned, raised."""
        try:
            if adapter.handle is None:
                raise LoRAError("the registry returned it without a handle.", adapter=adapter.name,
                                fix="Pass a loramux.registry.Registry (it issues handles).")
            if self._validate:  # a registry we did not build: check it fits here
                self.manager.validate_and_prepare(adapter)
        except BaseException:
            self._unpin_cpu(adapter)
            raise

    def _settled(self, waiters: list[Sequence], adapter: LoRAAdapter | None, error: BaseException | None,
                 seconds: float) -> None:
        """A load ended (its thread): tell the listeners now, before any step."""
        ids = tuple(seq.request_id for seq in waiters if not seq.is_finished)
        if not ids or isinstance(error, CacheBusyError):  # it waits for room; collect decides
            return
        name = waiters[0].lora_name
        if error is None:
            self.events.emit(AdapterEvent("ready", name, ids, handle=adapter.handle, seconds=seconds))
        else:
            self.events.emit(AdapterEvent("failed", name, ids, error=error, seconds=seconds))

    def collect(self, timeout: float, queue: Callable[[Sequence], None]) -> list[Sequence]:
        """Hand the requests whose adapter loaded to ``queue`` (the scheduler's ``add``: each
        references its handle); return those whose load failed (finished now)."""
        failed = []
        self._retry_deferred()
        # loads that succeeded first: their requests' references are what a load that found the
        # CPU tier busy waits on
        for result in sorted(self.loader.poll(timeout=timeout), key=lambda r: r.error is not None):
            waiters = [seq for seq in result.waiters if not seq.is_finished]
            if isinstance(result.error, CacheBusyError) and self._room_will_free():
                self._deferred.extend(waiters)  # no room in the CPU tier until requests end
                continue
            if result.error is not None:
                for seq in waiters:
                    seq.fail(result.error)
                failed.extend(waiters)
                if isinstance(result.error, CacheBusyError) and waiters:  # not told by _settled
                    self.events.emit(AdapterEvent("failed", waiters[0].lora_name,
                                                  tuple(seq.request_id for seq in waiters),
                                                  error=result.error, seconds=result.seconds))
                continue
            handle = result.adapter.handle
            with self._lock:
                for seq in waiters:
                    seq.handle = handle
                    seq.salt_with(handle.digest)  # prefix-cache blocks key on content, not name
                    queue(seq)  # its reference; the first one pins the CPU tier
                self._unpin_cpu(result.adapter)  # the load's own pin: the references hold it now
        return failed

    def _room_will_free(self) -> bool:
        """Whether some queued or running request, a load not collected yet, or an add() call not
        waiting for room holds the CPU tier: room comes back when it ends. (Only user pins left:
        nothing will free; the request fails with the error.)"""
        return (any(use.sequences for use in self._uses.values()) or self.loader.in_flight() > 0
                or self._adding > 0)

    def _retry_deferred(self) -> None:
        """Load again, oldest first, as many deferred adapters as the CPU tier has unpinned room."""
        self._deferred = [seq for seq in self._deferred if not seq.is_finished]
        if not self._deferred:
            return
        if not self._room_freed and self._room_will_free():
            return
        self._room_freed = False
        cache = self.registry.cache
        # without a count bound, every deferred adapter tries (the bytes decide, in the tier)
        room = len(self._deferred) if cache.max_loras is None else max(1, cache.max_loras - cache.num_pinned())
        retry, kept, names = [], [], set()
        for seq in sorted(self._deferred, key=lambda q: q.arrival):
            if seq.lora_name in names or len(names) < room:
                names.add(seq.lora_name)
                retry.append(seq)
            else:
                kept.append(seq)
        self._deferred = kept
        for seq in retry:
            self.loader.submit(seq)

    def discard(self, seq: Sequence) -> None:
        """Forget an aborted request that waits for its adapter."""
        if seq in self._deferred:
            self._deferred.remove(seq)
        self.loader.discard(seq)

    def __len__(self) -> int:
        """Requests waiting for their adapter (loading, or deferred for room)."""
        return len(self.loader) + len(self._deferred)

    # -- placement beside the step ---------------------------------------------------------------

    def prefetch(self, queue: Iterable[Sequence], busy: Callable[[], bool] | None = None, *, idle: bool = False,
                 ) -> list[tuple[AdapterHandle, LoRAError]]:
        """Copy the adapters of the oldest requests in ``queue`` (the scheduler's, in admission
        order) into GPU slots, the only place where they get one: admission starts a request only
        once its adapter is there (`Fit.READY`). Returns the adapters that could not be placed,
        with why (the scheduler fails their queued requests).

        In queue order, as many handles as fit beside the adapters in use and those ahead of
        them (and at most ``max_loras`` less the slots in use, when set): exactly the ones it
        admits next, so no cached adapter is evicted for a request that could not run anyway. A
        held slot is never written, nor is the slot of an adapter ahead in the queue (adapters
        share the pool rows by rank: a prefetch with no room beside those stops); the copy runs
        on the manager's side stream (CUDA) and the step waits on it only at admission.

        Each copy costs the engine's thread milliseconds of host work, hidden while the GPU
        computes the step this runs beside. So a step copies one adapter, then more only while
        ``busy()`` says the GPU still computes (the runner's `computing`; None where there is no
        GPU work to hide behind: the CPU, a step with nothing to run), and never more than
        `PREFETCH_PER_STEP`: with hundreds of slots free (a fresh engine, a burst after a quiet
        spell) one step would otherwise place every queued adapter at once and last as long as
        all those copies; placed at admission instead, before the step's forward, each copy
        would lengthen the step (docs/benchmarks/many_adapters.md). With ``idle`` (no step runs:
        there is none to keep short) every adapter that fits is copied at once, so a burst of
        distinct adapters on an idle engine starts in one step, as a burst on one adapter does.
        """
        failed: list[tuple[AdapterHandle, LoRAError]] = []
        in_slots = self.in_slots()
        room = math.inf if self.max_loras is None else self.max_loras - len(in_slots)  # pool rows decide
        most = math.inf if idle else PREFETCH_PER_STEP
        copies = 0
        seen: set[int] = set()
        for seq in queue:
            if room <= 0 or copies >= most or (copies and busy is not None and not busy()):
                break
            handle = seq.handle
            if handle is None or handle.id in in_slots or handle.id in seen:
                continue
            seen.add(handle.id)
            room -= 1
            if self.manager.slot_of(handle.id) is not None:
                continue  # still resident from an earlier use
            adapter = self.registry.cache.get(handle.id)  # referenced, so pinned in the CPU tier
            try:
                with self.clock["lora.place"]:
                    slot = None if adapter is None else self.manager.prefetch(adapter, keep=seen)
                if slot is None:
                    break
            except LoRAError as error:  # only this adapter's requests fail (the next step reports them)
                failed.append((handle, error))
                continue
            self.prefetches += 1
            copies += 1
        return failed

    # -- the reference counts' transitions, on the tiers (under the step lock) -----------------

    def _referenced(self, handle: AdapterHandle) -> None:
        self.registry.cache.pin(handle.id)

    def _has_room(self, handle: AdapterHandle) -> bool:
        # referenced, so pinned in the CPU tier; if not, admission tries and `_place` says why
        adapter = self.registry.cache.peek(handle.id)
        with self.clock["lora.can_place"]:
            return adapter is None or self.manager.can_place(adapter)

    def _fits_beside(self, handle: AdapterHandle, pinned: set[int]) -> bool:
        adapter = self.registry.cache.peek(handle.id)
        with self.clock["lora.can_place"]:
            return adapter is None or self.manager.fits_beside(adapter, pinned)

    def _is_placed(self, handle: AdapterHandle) -> bool:
        return self.manager.slot_of(handle.id) is not None

    def _place(self, handle: AdapterHandle) -> int:
        adapter = self.registry.cache.get(handle.id)  # pinned while referenced, so resident
        if adapter is None:
            raise LoRAError("its weights left the CPU tier while a request referenced them.",
                            adapter=handle.name, fix="This is a bug in loramux; please report it.")
        with self.clock["lora.place"]:
            self.manager.activate(adapter)
        return self.manager.hold(handle.id)

    def _ended(self, handle: AdapterHandle) -> None:
        self.manager.release(handle.id)

    def _released(self, handle: AdapterHandle) -> None:
        self.registry.cache.unpin(handle.id)  # a retired handle leaves the CPU tier here
        self._room_freed = True
        self._released_count += 1
        self._room.notify_all()
        if handle.id in self._unbound:
            self._retire(handle)
        elif self.registry.handle(handle.name) != handle:  # unbound before it was referenced
            self.manager.deactivate(handle.id)

    # -- reload and unload: rebinding; retirement ---------------------------------------------

    def _on_unbind(self, handle: AdapterHandle) -> None:
        """The registry unbound ``handle`` from its name (any thread): retire it when unused."""
        with self._lock:
            self._unbound.add(handle.id)
            use = self._uses.get(handle.id)
            for _ in range(use.user_pins if use is not None else 0):  # a pin is by name: it goes too
                self.unpin(handle)
            if handle.id in self._unbound and self.references(handle.id) == 0:
                self._retire(handle)

    def _retire(self, handle: AdapterHandle) -> None:
        self._unbound.discard(handle.id)
        self.manager.deactivate(handle.id)
        self.events.emit(AdapterEvent("retired", handle.name, handle=handle))

    def add(self, request: LoRARequest, *, wait_s: float = 0.0) -> AdapterHandle:
        """Load ``request``'s adapter now and bind its name to it (a reload if already bound).

        Requests running on the old handle finish on it; new requests get the new one; the old
        handle retires when its last request ends. A pin (``pin``) moves to the new handle.

        :param wait_s: when the CPU tier is full of adapters that queued or running requests
            hold, wait up to this long for them to release one (another thread must be stepping
            the engine), then load; 0 raises `CacheBusyError` at once.
        """
        name = request.lora_name
        old = self.registry.handle(name)
        with self._lock:  # before the name moves: registering another path unbinds it already
            was_pinned = old is not None and old.id in self.pinned()
            self._adding += 1
        try:
            if request.lora_path:
                self.registry.register(name, request.lora_path, request.base_model_name, replace=True)
            adapter = self._rebind_when_room(request, time.monotonic() + wait_s)
            try:
                if self._validate:
                    self.manager.validate_and_prepare(adapter)
                if was_pinned and adapter.handle != old:
                    self.pin_adapter(adapter)
            finally:
                self._unpin_cpu(adapter)
        finally:
            with self._room:  # its pin is released (or it never got one): room may be back
                self._adding -= 1
                self._room_freed = True
                self._released_count += 1
                self._room.notify_all()
        return adapter.handle

    def _rebind_when_room(self, request: LoRARequest, deadline: float) -> LoRAAdapter:
        """``registry.rebind(request, pin=True)``, again each time a request or another add
        releases the CPU tier, while it is full of adapters in use that will be released, until
        ``deadline``. Called by an add in progress (counted in ``_adding``): while it waits it
        holds no pin, so it does not count, and two adds waiting for each other both fail."""
        while True:
            with self._lock:
                released = self._released_count
            try:
                return self.registry.rebind(request, pin=True)
            except CacheBusyError:
                with self._room:
                    while released == self._released_count:
                        remaining = deadline - time.monotonic()
                        self._adding -= 1  # this add holds no pin while it waits
                        try:
                            if remaining <= 0 or not self._room_will_free():
                                raise
                            self._room.wait(remaining)
                        finally:
                            self._adding += 1

    def remove(self, name: str) -> bool:
        """Unload: unbind ``name`` and return at once; its handle retires when unused (event)."""
        return self.registry.unregister(name)

    def pin_name(self, name: str) -> bool:
        """Keep the adapter ``name`` means in a GPU slot (a reference the engine holds) until it
        is removed; loads it first if needed.

        :raises LoRAError: every slot is in use by running or pinned adapters.
        """
        adapter = self.registry.get(name, pin=True)
        self._checked(adapter)
        try:
            return self.pin_adapter(adapter)
        finally:
            self._unpin_cpu(adapter)

    def pin_adapter(self, adapter: LoRAAdapter) -> bool:
        """`pin_name`, for an adapter in hand (with its handle)."""
        handle = adapter.handle
        with self._lock:
            if handle.id in self.pinned():
                return True
            in_slots = self.in_slots()
            if self.max_loras is not None and handle.id not in in_slots and len(in_slots) >= self.max_loras:
                raise LoRAError(
                    f"all {self.max_loras} GPU slots are in use by running or pinned adapters.",
                    adapter=handle.name,
                    fix="Raise max_loras, or remove a pinned adapter.",
                )
            self.pin(handle)
            return True

    def close(self) -> None:
        """Stop loading and leave the registry (which may outlive the engine)."""
        self.loader.shutdown()
        self.registry.remove_unbind_listener(self._on_unbind)

    def _unpin_cpu(self, adapter: LoRAAdapter) -> None:
        if adapter.handle is not None and self.registry.cache.is_pinned(adapter.handle.id):
            self.registry.cache.unpin(adapter.handle.id)

"""Turn a transformers model into a multi-LoRA model, and manage its GPU adapter slots.

    manager = LoRAModelManager(model, LoRAConfig(max_loras=4, max_lora_rank=16))
    slot = manager.activate(adapter)               # copy into a free or least recently used slot
                                                   # (keyed by adapter.handle.id)
    manager.set_mapping(token_slots)               # [T] slot per token, -1 = base model; per forward
    logits = model(input_ids).logits

Patching (`loramux.engine.layers.lora_patch`) replaces each eligible layer in place by the wrapper the
``create_lora_layer`` hook returns (plugins first, loramux's built-ins last). Every wrapper reads the same `LoRAContext`,
so the per-forward kernel metadata is built once. The adapter weight pool
(`loramux.engine.layers.weight_pool`) owns the layers' adapter memory and writes it; this manager
decides which adapter sits in which slot, evicts, and orders the copies against the compute stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

import torch
from torch import nn

from loramux.engine.layers import LoRAContext
from loramux.engine.layers.weight_pool import AdapterWeightPool, Footprint
from loramux.engine.layers.lora_patch import patch_model, wrap_layer
from loramux.engine.adapters.lora_validation import AdapterValidator
from loramux.engine.adapters.slots import SlotTable
from loramux.errors import CacheFullError, LoRAError
from loramux.registry import AdapterHandle, CacheStats, LoRAAdapter, LoRAConfig
from loramux.registry.handle import memory_handle

__all__ = ["LoRAModelManager", "patch_model", "wrap_layer"]  # the latter two: lora_patch.py

#: Footprints `LoRAModelManager` keeps before it starts over (a few KB each at 8B).
MAX_FOOTPRINTS = 4096


class LoRAModelManager:
    """Patches ``model`` in place for multi-LoRA and keeps its ``max_loras`` GPU slots.

    :param model: a transformers model (or any ``nn.Module``), already on its device and dtype.
    :param lora_config: ``max_loras`` slots of rank up to ``max_lora_rank``. Slot tensors take
        each layer's own dtype (adapter weights are cast on copy); ``max_gpu_lora_bytes`` sizes
        the pools.
    :param target_modules: wrap only these modules (PEFT's rule: a list of names matched as
        dotted suffixes, or one regex matched against the full name); None wraps every
        supported layer. Narrowing saves slot memory.
    :param workers: with tensor parallelism, the `WorkerGroup` of the other ranks: each slot
        write sends every rank its shard.
    :param on_host_copies: told, after every slot write on CUDA, of an event that completes when
        the write's asynchronous copies from host memory have run (the engine passes its
        `PageLockedArena`'s ``fence``, so no arena piece is reused while a copy may still read it).

    Thread-safe: the step loop and API threads may call it concurrently.
    """

    def __init__(
        self,
        model: nn.Module,
        lora_config: LoRAConfig,
        *,
        target_modules: Sequence[str] | str | None = None,
        workers=None,
        on_host_copies: Callable[[torch.cuda.Event], None] | None = None,
    ) -> None:
        self.model = model
        self.lora_config = lora_config
        self.target_modules = target_modules
        self.context = LoRAContext(lora_config.max_loras)
        module_types = {name: type(module) for name, module in model.named_modules() if name}  # before patching
        self.layers = patch_model(model, lora_config, self.context, target_modules=target_modules)
        self.validator = AdapterValidator(type(model).__name__, module_types, self.layers, target_modules)
        self.workers = workers
        self.pool = AdapterWeightPool(self.layers, lora_config)
        self._touches_big: dict[int, bool] = {}  # slot -> whether its adapter touches a big-GEMM layer
        self._footprints: dict[int, Footprint] = {}  # handle id -> _footprint
        self._fit_answers: tuple[int, dict] = (-1, {})  # (the slot table's version, its answers)
        self._slots = SlotTable(lora_config.max_loras)
        # resident handles by id: not the adapters, so a slot keeps no host memory alive (the CPU
        # tier owns the weights, and an arena piece comes back once the tier lets it go)
        self._handles: dict[int, AdapterHandle] = {}
        self._lock = threading.RLock()
        self.stats = CacheStats()  # the GPU tier's counters, as the CPU tier keeps them
        if self.layers:
            self.device = self.pool.device
        else:
            self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        # prefetch copies run on a side stream (created here, at engine start, never while a
        # graph is captured); the compute stream waits on a copy's event when its slot is held
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._copies: dict[int, torch.cuda.Event] = {}  # handle id -> its side-stream copy
        self.on_host_copies = on_host_copies

    @property
    def capacity_bytes(self) -> int:
        """Bytes of GPU memory the wrapped layers keep for adapter weights: the GPU tier's budget."""
        return self.pool.capacity_bytes

    @property
    def pool_units(self) -> int:
        """Rank rows in each wrapped layer's pool (0 without wrapped layers)."""
        return self.pool.units

    # -- validation ----------------------------------------------------------------------------

    def supported_layer_types(self) -> list[str]:
        """Layer types this model can take LoRA on: loramux's own and those plugins wrapped."""
        return self.validator.supported_layer_types()

    def validate(self, adapter: LoRAAdapter) -> None:
        """Check that every module of ``adapter`` fits a wrapped layer of this model.

        :raises IncompatibleAdapterError: a module is absent from the model, not wrapped (left
            out by ``target_modules``, or of a layer type no wrapper supports), of another
            shape, or above ``max_lora_rank``. Nothing changes either way.
        """
        self.validator.validate(adapter)

    # -- slots (keyed by handle id) ---------------------------------------------------------------

    def prefetch(self, adapter: LoRAAdapter, keep: Collection[int] = ()) -> int | None:
        """Copy ``adapter`` into a free (or least recently used, not held) slot ahead of its use,
        on the side stream on CUDA, so the step that admits its request does not wait for the
        host-to-device copy; synchronous on CPU. The compute stream waits for the copy when the
        slot is held (:meth:`hold`). A held slot (in use by the running batch) is never written,
        nor is one of the handle ids in ``keep`` (adapters prefetched for requests ahead of it).

        :returns: its slot, or None when there is no room for it beside the adapters held or
            kept (nothing changes).
        """
        with self._lock:
            if adapter.handle is not None and adapter.handle.id in self._slots:
                return self._slots.slot_of(adapter.handle.id)
            if not self.can_place(adapter, keep=keep):
                return None
            return self._activate(adapter, side_stream=self._copy_stream is not None, keep=keep)

    def activate(self, adapter: LoRAAdapter) -> int:
        """Make ``adapter`` usable in the next forward and return its slot.

        Slots are keyed by ``adapter.handle.id``: an adapter already resident keeps its slot (it
        becomes the most recently used); a reload is a new handle, so it gets a slot of its own
        while the old one finishes its requests. Otherwise a free slot, or the least recently
        used one nobody holds, receives a copy (asynchronous from pinned host memory).

        An adapter with a handle was validated by the registry, once, at the border; one without
        (this manager used on its own) is validated here and given a handle, and an adapter
        without a handle whose name is resident already is a hit on it.

        A slot takes pool rows by rank in every pooled layer (`loramux.engine.adapters.rank_pool`): the
        least recently used adapters not in use are evicted until a slot is free and the new
        adapter's rows fit.

        :raises IncompatibleAdapterError: ``adapter`` does not fit this model (nothing changes).
        :raises CacheFullError: every slot is held, or the adapters in use leave no room for its
            rows (nothing is evicted then).
        """
        with self._lock:
            return self._activate(adapter, side_stream=False)

    def _activate(self, adapter: LoRAAdapter, *, side_stream: bool, keep: Collection[int] = ()) -> int:
        with self._lock:
            handle = adapter.handle or self._standalone_handle(adapter)
            slot = self._slots.slot_of(handle.id)
            if slot is not None:
                self._slots.touch(handle.id)
                self.stats.hits += 1
                return slot
            self.stats.misses += 1
            if adapter.handle is None:
                self.validate(adapter)
                adapter = replace(adapter, handle=handle)
            footprint = self._footprint(adapter)
            self._make_room(footprint, adapter.name, keep)
            slot, evicted = self._slots.allocate(handle.id, label=adapter.name)
            assert evicted is None, "_make_room leaves a free slot"
            try:
                if side_stream:
                    self._write_slot_aside(handle.id, slot, adapter)
                else:
                    self._write_slot(slot, adapter)
                    if self.device.type == "cuda" and self.on_host_copies is not None:
                        self._fence_host_copies(torch.cuda.current_stream(self.device))
            except BaseException:
                self._clear_slot(slot)
                self._slots.drop(handle.id)  # a half-written slot is never used
                self.stats.load_failures += 1
                raise
            self._handles[handle.id] = handle
            self._touches_big[slot] = any(layer.big_gemm for layer, _ in footprint)
            self.stats.loads += 1
            return slot

    def _footprint(self, adapter: LoRAAdapter) -> Footprint:
        """The pool rows ``adapter`` takes in each layer it touches. Kept per handle (a handle's
        weights never change): the scheduler asks `can_place` every step an adapter waits."""
        key = adapter.handle.id if adapter.handle is not None else None
        footprint = self._footprints.get(key) if key is not None else None
        if footprint is None:
            footprint = self.pool.footprint(adapter.modules)
            if key is not None:
                if len(self._footprints) >= MAX_FOOTPRINTS:
                    self._footprints.clear()  # handles come and go; this only bounds the table
                self._footprints[key] = footprint
        return footprint

    def _make_room(self, footprint: Footprint, label: str,
                   keep: Collection[int] = ()) -> None:
        """Evict the least recently used adapters not in use (nor in ``keep``) until a slot is
        free and every layer of ``footprint`` has its rows free.

        :raises CacheFullError: the adapters in use leave no room (checked first: nothing is evicted).
        """
        if len(self._slots.held()) >= self._slots.num_slots:
            raise self._slots.full_error(label)
        if not self._rows_fit_once_evicted(footprint, keep):
            held = [self._handles[i].name for i in self._slots.held()]
            raise CacheFullError(
                f"the adapters in use ({', '.join(held)}) leave no room for its weights in the GPU "
                f"LoRA memory ({self.pool_units} rank rows per layer).",
                adapter=label,
                fix="Retry when a request finishes, or raise max_gpu_lora_bytes (--max-gpu-lora-bytes).",
            )
        while True:
            short = [layer for layer, units in footprint if not layer.slots.rows.fits(units)]
            if self._slots.free_slots and not short:
                return
            # least recently used first; for rows, only an adapter that owns some where they are short
            self._evict(next(i for i in self._slots.ids() if not self._slots.is_held(i) and i not in keep
                             and (not self._slots.free_slots
                                  or any(self._slots.slot_of(i) in layer.slots.rows for layer in short))))

    def _kept(self, keep: Collection[int]) -> set[int]:
        """Resident handle ids that may not be evicted: the held ones and those in ``keep``."""
        return set(self._slots.held()) | {i for i in keep if i in self._slots}

    def _rows_fit_once_evicted(self, footprint: Footprint,
                               keep: Collection[int] = (), handle_id: int | None = None) -> bool:
        """Whether ``footprint`` fits every layer's rows left by the held adapters and ``keep``.
        The answer stands until the slot table changes, so it is kept per handle: the scheduler
        asks it for a waiting adapter every step, and at 8B with 64 adapters in use one answer
        walks 225 layers' blocks."""
        kept_ids = self._kept(keep)
        key = (handle_id, frozenset(kept_ids))
        if self._fit_answers[0] != self._slots.version:
            self._fit_answers = (self._slots.version, {})
        answer = self._fit_answers[1].get(key) if handle_id is not None else None
        if answer is None:
            kept = {self._slots.slot_of(i) for i in kept_ids}
            answer = self.pool.fits_keeping(footprint, kept)
            if handle_id is not None:
                self._fit_answers[1][key] = answer
        return answer

    def can_place(self, adapter: LoRAAdapter, keep: Collection[int] = ()) -> bool:
        """Whether `activate` would find ``adapter`` a slot and its pool rows now, evicting only
        adapters not in use, nor in ``keep`` (handle ids) (True when it is resident)."""
        with self._lock:
            if adapter.handle is not None and adapter.handle.id in self._slots:
                return True
            if len(self._kept(keep)) >= self._slots.num_slots:
                return False
            footprint = self._footprint(adapter)
            if self._slots.free_slots and self.pool.fits(footprint):
                return True  # room now: the common case, without walking what is resident
            return self._rows_fit_once_evicted(footprint, keep, adapter.handle and adapter.handle.id)

    def fits_beside(self, adapter: LoRAAdapter, handle_ids: Collection[int]) -> bool:
        """Whether ``adapter`` would find a slot and its rows if only ``handle_ids`` stayed
        resident (the scheduler asks it of the user-pinned ones: if not, it can never run)."""
        with self._lock:
            kept = {i for i in handle_ids if i in self._slots}
            if len(kept) >= self._slots.num_slots:
                return False
            slots = {self._slots.slot_of(i) for i in kept}
            return self.pool.fits_keeping(self._footprint(adapter), slots)

    def _evict(self, handle_id: int) -> None:
        """Free the slot and pool rows of a resident adapter nobody holds."""
        self._await_copy(handle_id)  # its own prefetch must land before its rows are written again
        self._clear_slot(self._slots.deallocate(handle_id))
        del self._handles[handle_id]
        self.stats.evictions += 1

    def _standalone_handle(self, adapter: LoRAAdapter) -> AdapterHandle:
        """The handle of a resident handle-less adapter of this name, or a new one (no registry)."""
        resident = self._resident_named(adapter.name)
        if resident is not None and resident.source == "memory":
            return resident
        return memory_handle(adapter, adapter.name)

    def _write_slot_aside(self, handle_id: int, slot: int, adapter: LoRAAdapter) -> None:
        """The copy on the side stream, after everything the compute stream has queued so far
        (the slot's last readers: the batch of the step that released it)."""
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._write_slot(slot, adapter)
        self._copies[handle_id] = self._fence_host_copies(stream)

    def _fence_host_copies(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """An event after the copies queued on ``stream``, told to `on_host_copies` while the
        caller still holds the adapter copied from (its host memory is not released before)."""
        event = torch.cuda.Event()
        event.record(stream)
        if self.on_host_copies is not None:
            self.on_host_copies(event)
        return event

    def _await_copy(self, handle_id: int) -> None:
        """Make the compute stream wait for ``handle_id``'s side-stream copy, if one is pending."""
        event = self._copies.pop(handle_id, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write ``adapter`` into ``slot`` of every layer (`AdapterWeightPool.write`); with tensor
        parallelism this rank writes its part and each worker receives only its own."""
        if self.pool.tp_rank is None:
            self.pool.write(slot, adapter.modules)
            return
        self.pool.write(slot, self.pool.shard(adapter.modules, self.pool.tp_rank))
        if self.workers is not None:
            parts = [self.pool.shard(adapter.modules, rank) for rank in range(1, self.workers.size)]
            self.workers.write_slot(slot, parts)

    def _clear_slot(self, slot: int) -> None:
        self._touches_big.pop(slot, None)
        self.pool.clear(slot)
        if self.workers is not None:
            self.workers.clear_slot(slot)

    def _resident_named(self, name: str) -> AdapterHandle | None:
        """The handle of the most recently used resident adapter called ``name`` (standalone use by name)."""
        return next((self._handles[i] for i in reversed(self._slots.ids()) if self._handles[i].name == name), None)

    def _id(self, key: int | str) -> int | None:
        """A handle id, or a name meaning the most recently used resident adapter of that name."""
        if isinstance(key, str):
            handle = self._resident_named(key)
            return handle.id if handle is not None else None
        return key

    def can_activate(self, key: int | str) -> bool:
        """Whether this handle id or name is resident, or a slot is free or evictable. An adapter
        not resident also needs pool rows: `can_place` answers for it."""
        with self._lock:
            return self._id(key) in self._slots or self._slots.can_allocate()

    def deactivate(self, key: int | str) -> bool:
        """Free the slot of a handle id (or a name); returns whether it was resident.

        :raises LoRAError: it is held (running requests or a user pin use it).
        """
        with self._lock:
            handle_id = self._id(key)
            if handle_id not in self._slots:
                return False
            if self._slots.is_held(handle_id):
                raise LoRAError(
                    "it is in use by running requests, so its GPU slot cannot be freed now.",
                    adapter=self._handles[handle_id].name,
                    fix="Free it when the scheduler releases it (its last request ends).",
                )
            self._await_copy(handle_id)
            self._clear_slot(self._slots.deallocate(handle_id))
            del self._handles[handle_id]
            return True

    def hold(self, key: int | str) -> int:
        """Keep a resident handle (or name) in its slot until :meth:`release`; returns the slot.

        Not counted: the scheduler counts the requests and pins that use a handle, and calls
        this on the first and :meth:`release` after the last.
        """
        with self._lock:
            handle_id = self._id(key)
            if handle_id not in self._slots:
                raise ValueError(f"adapter {key!r} holds no GPU slot; activate it before holding it")
            self._slots.hold(handle_id)
            self._await_copy(handle_id)  # before the first forward that reads this slot
            return self._slots.slot_of(handle_id)

    def release(self, key: int | str) -> None:
        """The slot of this handle (or name) may be evicted again; it stays resident until then."""
        with self._lock:
            handle_id = self._id(key)
            if handle_id is None or not self._slots.is_held(handle_id):
                raise ValueError(f"adapter {key!r} is not held")
            self._slots.release(handle_id)

    def is_held(self, key: int | str) -> bool:
        with self._lock:
            handle_id = self._id(key)
            return handle_id is not None and self._slots.is_held(handle_id)

    def slot_of(self, key: int | str) -> int | None:
        """The slot of a handle id (or of the resident adapter of a name), or None."""
        with self._lock:
            handle_id = self._id(key)
            return None if handle_id is None else self._slots.slot_of(handle_id)

    def resident(self) -> list[str]:
        """Names of the adapters in GPU slots, least recently used first (a name shows twice
        while an old handle of it finishes its requests beside the new one)."""
        with self._lock:
            return [self._handles[i].name for i in self._slots.ids()]

    def resident_handles(self) -> list[AdapterHandle]:
        """Handles in GPU slots, least recently used first."""
        with self._lock:
            return [self._handles[i] for i in self._slots.ids()]

    @property
    def nbytes(self) -> int:
        """Bytes of the weights of the adapters resident in slots (for the tier's metrics)."""
        with self._lock:
            return sum(handle.nbytes for handle in self._handles.values())

    def handle(self, key: int | str) -> AdapterHandle | None:
        """The handle of a resident adapter, by handle id or name, or None."""
        with self._lock:
            handle_id = self._id(key)
            return None if handle_id is None else self._handles.get(handle_id)

    # -- per-forward mapping ---------------------------------------------------------------------

    def token_slots(self, adapter_names: Sequence[str | None], seq_len: int = 1) -> torch.Tensor:
        """``[len(adapter_names) * seq_len]`` slots for a ``[B, seq_len]`` batch, row by row.

        ``None`` (or ``""``) is the base model. Every named adapter must be resident.
        """
        with self._lock:
            slots = []
            for name in adapter_names:
                slot = -1 if not name else self.slot_of(name)
                if slot is None:
                    raise ValueError(f"adapter {name!r} holds no GPU slot; activate it first")
                slots.append(slot)
        rows = torch.tensor(slots, dtype=torch.int32)
        return rows.repeat_interleave(seq_len).to(self.device)

    @property
    def has_big_gemms(self) -> bool:
        """Whether some layer's GEMM is big (`BaseLayerWithLoRA.big_gemm`): step graphs then have a
        variant for adapters that leave those layers alone (`leaves_big_gemms`)."""
        return any(layer.big_gemm for layer in self.layers.values())

    def leaves_big_gemms(self, slots) -> bool:
        """Whether the adapters in ``slots`` all leave every big-GEMM layer alone (q/v adapters
        on Llama-3.1-8B leave gate_up and down), so a step of theirs may run those layers' base
        GEMMs only. A slot holding no adapter counts as touching them."""
        with self._lock:
            return not any(self._touches_big.get(slot, True) for slot in slots)

    @property
    def has_logits_layer(self) -> bool:
        """Whether the model's LM head carries LoRA (its rows then need their own slots)."""
        return any(layer.computes_logits for layer in self.layers.values())

    def set_mapping(
        self,
        token_slots: torch.Tensor | None,
        logits_slots: torch.Tensor | None = None,
        *,
        static: bool = False,
        skip_big: bool = False,
    ) -> None:
        """State the slot of every token of the next forward (``[T]``, -1 = base model).

        ``T`` is the flattened batch (``B * S`` for a ``[B, S]`` batch). ``logits_slots`` gives
        the slot of each row of the logits when the model computes them on other rows than all
        ``T`` tokens (not needed for Hugging Face's ``logits_to_keep`` on a ``[B, S]`` batch).
        ``None`` runs the base model for every token. Builds the kernel metadata once.

        ``static`` (CUDA-graph capture): build a static meta, without a host sync, whose launch
        grids hold any mapping of this many tokens (any mix of adapters and base rows). The slots
        are then not checked here; the caller states the slots each replay uses with
        :meth:`mark_used`. ``skip_big`` (with ``static``): a graph for adapters that leave every
        big-GEMM layer alone (:meth:`leaves_big_gemms`), whose base GEMMs then run alone.
        """
        if token_slots is None:
            self.context.set(None)
            return
        token_slots = torch.as_tensor(token_slots).to(self.device, non_blocking=True)
        if logits_slots is not None:
            logits_slots = torch.as_tensor(logits_slots).to(self.device, non_blocking=True)
        self.context.set(token_slots, logits_slots, static=static, skip_big=skip_big)
        if static:
            return
        try:
            self.mark_used(self.context.meta.active_slots_host)
        except ValueError:
            self.context.set(None)
            raise

    def mark_used(self, slots) -> None:
        """Check that every slot in ``slots`` holds an adapter and move those adapters to the end
        of the eviction order (``set_mapping`` does it for the slots it finds)."""
        with self._lock:
            by_slot = {self._slots.slot_of(i): i for i in self._slots.ids()}
            empty = [slot for slot in slots if slot not in by_slot]
            if empty:
                raise ValueError(f"token_slots names slot(s) {empty}, which hold no adapter")
            for slot in slots:  # used now: last in the eviction order
                self._slots.touch(by_slot[slot])

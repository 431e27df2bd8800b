"""Turn a transformers model into a multi-LoRA model, and manage its GPU adapter slots.

    manager = LoRAModelManager(model, LoRAConfig(max_lora_rank=16))
    slot = manager.activate(adapter)               # copy into a free slot, evicting the least
                                                   # recently used ones not in use for its rows
                                                   # (keyed by adapter.handle.id)
    manager.set_mapping(token_slots)               # [T] slot per token, -1 = base model; per forward
    logits = model(input_ids).logits

Patching (`loramux.engine.layers.lora_patch`) replaces each eligible layer in place by the wrapper the
``create_lora_layer`` hook returns (plugins first, loramux's built-ins last). Every wrapper reads the same `LoRAContext`,
so the per-forward kernel metadata is built once. The adapter weight pool
(`loramux.engine.layers.weight_pool`) owns the layers' adapter memory and writes it; placement
(`loramux.engine.adapters.placement`) decides where an adapter goes and what it evicts;
`loramux.engine.adapters.slot_copies` orders the copies against the compute stream; this manager
keeps the resident handles and the slot table, and writes and clears slots.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

import torch
from torch import nn

from loramux.engine.layers import LoRAContext
from loramux.engine.layers.weight_pool import AdapterWeightPool
from loramux.engine.layers.lora_patch import patch_model, wrap_layer
from loramux.engine.adapters.lora_validation import AdapterValidator
from loramux.engine.adapters.placement import AdapterPlacement
from loramux.engine.adapters.slot_copies import SlotCopies
from loramux.engine.adapters.slots import SlotTable
from loramux.errors import LoRAError
from loramux.registry import AdapterHandle, CacheStats, LoRAAdapter, LoRAConfig
from loramux.registry.handle import memory_handle

__all__ = ["LoRAModelManager", "patch_model", "wrap_layer"]  # the latter two: lora_patch.py


class LoRAModelManager:
    """Patches ``model`` in place for multi-LoRA and keeps its GPU adapter slots.

    :param model: a transformers model (or any ``nn.Module``), already on its device and dtype.
    :param lora_config: adapters of rank up to ``max_lora_rank``; ``max_gpu_lora_bytes`` sizes
        the pools and ``max_loras``, if set, caps the slots (`AdapterWeightPool`). Slot tensors
        take each layer's own dtype (adapter weights are cast on copy).
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
        self.context = LoRAContext()
        module_types = {name: type(module) for name, module in model.named_modules() if name}  # before patching
        self.layers = patch_model(model, lora_config, self.context, target_modules=target_modules)
        self.validator = AdapterValidator(type(model).__name__, module_types, self.layers, target_modules)
        self.workers = workers
        self.pool = AdapterWeightPool(self.layers, lora_config)
        self.context.num_slots = self.pool.num_slots
        self._touches_big: dict[int, bool] = {}  # slot -> whether its adapter touches a big-GEMM layer
        self._slots = SlotTable(self.pool.num_slots)
        self.placement = AdapterPlacement(self.pool, self._slots)
        # resident handles by id: not the adapters, so a slot keeps no host memory alive (the CPU
        # tier owns the weights, and an arena piece comes back once the tier lets it go)
        self._handles: dict[int, AdapterHandle] = {}
        self._lock = threading.RLock()
        self.stats = CacheStats()  # the GPU tier's counters, as the CPU tier keeps them
        self.device = self.pool.device if self.layers else next((p.device for p in model.parameters()),
                                                                 torch.device("cpu"))
        self.copies = SlotCopies(self.device, on_host_copies)  # prefetches on a side stream (CUDA)

    @property
    def on_host_copies(self) -> Callable[[torch.cuda.Event], None] | None:
        return self.copies.on_host_copies

    @property
    def capacity_bytes(self) -> int:
        """Bytes of GPU memory the wrapped layers keep for adapter weights: the GPU tier's budget."""
        return self.pool.capacity_bytes

    @property
    def pool_units(self) -> int:
        """Rank rows in each wrapped layer's pool (0 without wrapped layers)."""
        return self.pool.units

    @property
    def num_slots(self) -> int:
        """Adapters that may be resident at once (`AdapterWeightPool.num_slots`)."""
        return self.pool.num_slots

    @property
    def usage(self) -> float:
        """The GPU tier's pressure, 0 to 1 (`AdapterPlacement.usage`)."""
        with self._lock:
            return self.placement.usage

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

    def validate_and_prepare(self, adapter: LoRAAdapter) -> None:
        """`validate`, then work out ``adapter``'s slot write ahead (`AdapterWeightPool.prepare`),
        so that placing it later costs the engine's thread only its rows and its launch. Any
        thread may call it: the registry does as it loads an adapter, on its loading thread.

        :raises IncompatibleAdapterError: as `validate` (nothing changes).
        """
        self.validate(adapter)
        self.pool.prepare(adapter.modules)

    # -- slots (keyed by handle id) ---------------------------------------------------------------

    def prefetch(self, adapter: LoRAAdapter, keep: Collection[int] = ()) -> int | None:
        """Copy ``adapter`` into a slot ahead of its use, on the side stream on CUDA
        (`SlotCopies`), synchronously on CPU. Evicts as `activate` does, but never the handle
        ids in ``keep`` (adapters prefetched for requests ahead of it).

        :returns: its slot, or None when there is no room for it beside the adapters held or
            kept (nothing changes).
        """
        with self._lock:
            if adapter.handle is not None and adapter.handle.id in self._slots:
                return self._slots.slot_of(adapter.handle.id)
            if not self.can_place(adapter, keep=keep):
                return None
            return self._activate(adapter, side_stream=self.copies.stream is not None, keep=keep)

    def activate(self, adapter: LoRAAdapter) -> int:
        """Make ``adapter`` usable in the next forward and return its slot.

        Slots are keyed by ``adapter.handle.id``: a resident adapter keeps its slot (and becomes
        the most recently used); a reload is a new handle, with a slot of its own while the old
        one finishes its requests. Otherwise a free slot and pool rows by rank receive a copy
        (asynchronous from pinned host memory), once `AdapterPlacement` made room. An adapter
        without a handle (this manager used on its own) is validated here and given one, or is a
        hit on a resident one of its name.

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
            footprint = self.placement.footprint(adapter)
            self.placement.make_room(footprint, adapter.name, keep, self._evict, lambda i: self._handles[i].name)
            slot, evicted = self._slots.allocate(handle.id, label=adapter.name)
            assert evicted is None, "make_room leaves a free slot"
            try:
                if side_stream:
                    self.copies.write_aside(handle.id, lambda: self._write_slot(slot, adapter))
                else:
                    self._write_slot(slot, adapter)
                    self.copies.written_in_line()
            except BaseException:
                self._clear_slot(slot)
                self._slots.drop(handle.id)  # a half-written slot is never used
                self.stats.load_failures += 1
                raise
            self._handles[handle.id] = handle
            self._touches_big[slot] = footprint.big_gemm
            self.stats.loads += 1
            return slot

    def can_place(self, adapter: LoRAAdapter, keep: Collection[int] = ()) -> bool:
        """Whether `activate` would find ``adapter`` a slot and its pool rows now, evicting only
        adapters not in use, nor in ``keep`` (handle ids) (True when it is resident)."""
        with self._lock:
            if adapter.handle is not None and adapter.handle.id in self._slots:
                return True
            return self.placement.can_place(adapter, keep)

    def fits_beside(self, adapter: LoRAAdapter, handle_ids: Collection[int]) -> bool:
        """Whether ``adapter`` would find a slot and its rows if only ``handle_ids`` stayed
        resident (the scheduler asks it of the user-pinned ones: if not, it can never run)."""
        with self._lock:
            return self.placement.fits_beside(adapter, handle_ids)

    def _evict(self, handle_id: int) -> None:
        self._free(handle_id)
        self.stats.evictions += 1

    def _free(self, handle_id: int) -> None:
        """Free the slot and pool rows of a resident adapter nobody holds."""
        self.copies.wait(handle_id)  # its own prefetch must land before its rows are written again
        self._clear_slot(self._slots.deallocate(handle_id))
        del self._handles[handle_id]

    def _standalone_handle(self, adapter: LoRAAdapter) -> AdapterHandle:
        """The handle of a resident handle-less adapter of this name, or a new one (no registry)."""
        resident = self._resident_named(adapter.name)
        if resident is not None and resident.source == "memory":
            return resident
        return memory_handle(adapter, adapter.name)

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
            self._free(handle_id)
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
            self.copies.wait(handle_id)  # before the first forward that reads this slot
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
            return self._slots.is_held(self._id(key))

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
        max_distinct: int | None = None,
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
        ``max_distinct`` (with ``static``): the most distinct slots a replay's mapping holds (the
        step's sequences), which bounds the static grids (`build_lora_meta`).
        """
        if token_slots is None:
            self.context.set(None)
            return
        token_slots = torch.as_tensor(token_slots).to(self.device, non_blocking=True)
        if logits_slots is not None:
            logits_slots = torch.as_tensor(logits_slots).to(self.device, non_blocking=True)
        self.context.set(token_slots, logits_slots, static=static, skip_big=skip_big, max_distinct=max_distinct)
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

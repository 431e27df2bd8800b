"""Turn a transformers model into a multi-LoRA model, and manage its GPU adapter slots.

    manager = LoRAModelManager(model, LoRAConfig(max_loras=4, max_lora_rank=16))
    slot = manager.activate(adapter)               # copy into a free or least recently used slot
    manager.set_mapping(token_slots)               # [T] slot per token, -1 = base model; per forward
    logits = model(input_ids).logits

Patching replaces each eligible layer in place by the wrapper the ``create_lora_layer`` hook
returns (plugins first, loramux's built-ins last). Every wrapper reads the same `LoRAContext`,
so the per-forward kernel metadata is built once.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Callable

import torch
from torch import nn

from loramux.engine.layers import BaseLayerWithLoRA, LoRAContext
from loramux.engine.slots import SlotTable
from loramux.errors import IncompatibleAdapterError, LoRAError, PluginError
from loramux.registry import CacheStats, LoRAAdapter, LoRAConfig, LoRAModuleWeights

__all__ = ["LoRAModelManager", "create_lora_layer", "patch_model"]

LayerFactory = Callable[[nn.Module, str, LoRAConfig], "BaseLayerWithLoRA | None"]


def create_lora_layer(
    base_layer: nn.Module, module_name: str, lora_config: LoRAConfig
) -> BaseLayerWithLoRA | None:
    """The wrapper for one layer, from the ``create_lora_layer`` hook (built-ins answer last).

    A plugin's wrapper that is not a `BaseLayerWithLoRA` cannot hold slots: it is reported as a
    broken plugin and loramux's own wrapper (if any) is used for that layer instead.
    """
    from loramux.engine.layers.plugin import builtin_lora_layer
    from loramux.plugins.layers import create_lora_layer as ask_plugins
    from loramux.plugins.manager import report_plugin_error

    layer = ask_plugins(base_layer, module_name, lora_config)
    if layer is None or isinstance(layer, BaseLayerWithLoRA):
        return layer
    report_plugin_error(
        PluginError(
            f"a plugin's create_lora_layer returned {type(layer).__name__} for {module_name!r}, "
            "which is not a loramux.engine.layers.BaseLayerWithLoRA.",
            fix="Skipped it for this layer; subclass BaseLayerWithLoRA in the plugin.",
        )
    )
    return builtin_lora_layer(base_layer, module_name, lora_config)


def _matches(name: str, target_modules: Sequence[str] | str | None) -> bool:
    """PEFT's rule: a regex must match the whole name; a list entry matches a dotted suffix."""
    if target_modules is None:
        return True
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == key or name.endswith("." + key) for key in target_modules)


def patch_model(
    model: nn.Module,
    lora_config: LoRAConfig,
    context: LoRAContext,
    *,
    target_modules: Sequence[str] | str | None = None,
    create: LayerFactory = create_lora_layer,
) -> dict[str, BaseLayerWithLoRA]:
    """Replace, in place, every layer of ``model`` that ``create`` wraps; return them by name.

    Modules are offered parents first; the children of a wrapped module are not offered. The
    model is changed only once every wrapper was built, so a failing plugin leaves it as it was.
    """
    modules = list(model.named_modules())
    for name, module in modules:
        if isinstance(module, BaseLayerWithLoRA):
            raise ValueError(f"{name!r} is already a LoRA layer: this model was patched before")
    wrapped: dict[str, BaseLayerWithLoRA] = {}
    for name, module in modules:
        # a fused layer stands for the modules it declares (``loramux_slices``)
        names = [n for n, _ in getattr(module, "loramux_slices", ())] or [name]
        if not name or not any(_matches(n, target_modules) for n in names):
            continue
        if any(parent in wrapped for parent in _ancestors(name)):
            continue  # inside a layer a plugin wrapped whole
        wrapper = create(module, name, lora_config)
        if wrapper is None:
            continue
        if not isinstance(wrapper, BaseLayerWithLoRA) or wrapper.get_base_layer() is not module:
            raise PluginError(
                f"create_lora_layer returned {type(wrapper).__name__} for {name!r}, which is not "
                "a BaseLayerWithLoRA (loramux.engine.layers) wrapping that layer.",
                fix="Fix the plugin's create_lora_layer, or uninstall it.",
            )
        wrapped[name] = wrapper
    for name, wrapper in wrapped.items():
        wrapper.lora_context = context
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, wrapper)
    return wrapped


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


class LoRAModelManager:
    """Patches ``model`` in place for multi-LoRA and keeps its ``max_loras`` GPU slots.

    :param model: a transformers model (or any ``nn.Module``), already on its device and dtype.
    :param lora_config: ``max_loras`` slots of rank up to ``max_lora_rank``. Slot tensors take
        each layer's own dtype (adapter weights are cast on copy).
    :param target_modules: wrap only these modules (PEFT's rule: a list of names matched as
        dotted suffixes, or one regex matched against the full name); None wraps every
        supported layer. Narrowing saves slot memory.

    Thread-safe: the step loop and API threads may call it concurrently.
    """

    def __init__(
        self,
        model: nn.Module,
        lora_config: LoRAConfig,
        *,
        target_modules: Sequence[str] | str | None = None,
    ) -> None:
        self.model = model
        self.lora_config = lora_config
        self.target_modules = target_modules
        self.context = LoRAContext(lora_config.max_loras)
        self._module_types = {name: type(module) for name, module in model.named_modules() if name}
        self.layers = patch_model(model, lora_config, self.context, target_modules=target_modules)
        # adapter module name -> (layer, slice index); packed layers take several names
        self._targets: dict[str, tuple[BaseLayerWithLoRA, int]] = {
            slice_name: (layer, index)
            for layer in self.layers.values()
            for index, slice_name in enumerate(layer.slice_names)
        }
        self.workers = None  # the tensor-parallel workers (a WorkerGroup), set by the engine
        self._slots = SlotTable(lora_config.max_loras)
        self._adapters: dict[str, LoRAAdapter] = {}  # resident adapters, by name
        self._lock = threading.RLock()
        self.stats = CacheStats()  # the GPU tier's counters, as the CPU tier keeps them
        first = next(iter(self.layers.values()), None)
        if first is not None:
            self.device = first.lora_scales.device
        else:
            self.device = next((p.device for p in model.parameters()), torch.device("cpu"))

    # -- validation ----------------------------------------------------------------------------

    def supported_layer_types(self) -> list[str]:
        """Layer types this model can take LoRA on: loramux's own and those plugins wrapped."""
        from loramux.engine.layers.plugin import SUPPORTED_LAYER_TYPES

        from_plugins = {
            f"{type(layer.base_layer).__module__}.{type(layer.base_layer).__qualname__}"
            for layer in self.layers.values()
            if not type(layer).__module__.startswith("loramux.engine.layers")
        }
        return [*SUPPORTED_LAYER_TYPES, *sorted(from_plugins)]

    def validate(self, adapter: LoRAAdapter) -> None:
        """Check that every module of ``adapter`` fits a wrapped layer of this model.

        :raises IncompatibleAdapterError: a module is absent from the model, not wrapped (left
            out by ``target_modules``, or of a layer type no wrapper supports), of another
            shape, or above ``max_lora_rank``. Nothing changes either way.
        """
        for module_name, weights in adapter.modules.items():
            target = self._targets.get(module_name)
            if target is None or not _matches(module_name, self.target_modules):
                raise self._not_wrapped_error(adapter, module_name)
            layer, index = target
            if weights.rank > layer.max_lora_rank:
                raise IncompatibleAdapterError(
                    f"module {module_name!r} has rank {weights.rank}, above max_lora_rank="
                    f"{layer.max_lora_rank}.",
                    adapter=adapter.name,
                    path=adapter.path,
                    fix=f"Raise max_lora_rank (--max-lora-rank) to at least {adapter.rank}.",
                )
            by_slice: list[LoRAModuleWeights | None] = [None] * layer.n_slices
            by_slice[index] = weights
            problem = layer.describe_mismatch(by_slice)
            if problem is not None:
                raise IncompatibleAdapterError(
                    f"{problem}.",
                    adapter=adapter.name,
                    path=adapter.path,
                    fix="Serve it with the base model it was trained for.",
                )

    def _not_wrapped_error(self, adapter: LoRAAdapter, module_name: str) -> IncompatibleAdapterError:
        module_type = self._module_types.get(module_name)
        if module_type is None:
            return IncompatibleAdapterError(
                f"it targets module {module_name!r}, which this {type(self.model).__name__} "
                "does not have.",
                adapter=adapter.name,
                path=adapter.path,
                fix="Serve it with the base model it was trained for.",
            )
        if not _matches(module_name, self.target_modules):
            return IncompatibleAdapterError(
                f"it targets module {module_name!r}, which lora_target_modules="
                f"{self.target_modules!r} leaves without LoRA.",
                adapter=adapter.name,
                path=adapter.path,
                fix="Add it to lora_target_modules, or leave that option unset.",
            )
        return IncompatibleAdapterError(
            f"it targets module {module_name!r}, a {module_type.__module__}."
            f"{module_type.__qualname__}, which loramux cannot apply LoRA to; supported layer "
            f"types: {', '.join(self.supported_layer_types())}.",
            adapter=adapter.name,
            path=adapter.path,
            fix="Install a plugin that adds LoRA support for that layer type "
            "(hook create_lora_layer), or use an adapter that does not target it.",
        )

    # -- slots ---------------------------------------------------------------------------------

    def activate(self, adapter: LoRAAdapter, *, replace: bool = False) -> int:
        """Make ``adapter`` usable in the next forward and return its slot.

        An adapter already resident keeps its slot (it becomes the most recently used), unless
        ``replace=True``: then its new weights are copied into that same slot (an in-place
        reload under the same name). Otherwise a free slot, or the least recently used one that
        no running request pins, receives a copy (asynchronous from pinned host memory).

        :raises IncompatibleAdapterError: ``adapter`` does not fit this model (nothing changes).
        :raises CacheFullError: every slot holds a pinned adapter.
        """
        with self._lock:
            name = adapter.name
            slot = self._slots.slot_of(name)
            if slot is not None and not replace:
                self._slots.touch(name)
                self.stats.hits += 1
                return slot
            self.stats.misses += 1
            if adapter.handle is None:  # a handle means the registry validated it, once, at the border
                self.validate(adapter)
            if slot is None:
                slot, evicted = self._slots.allocate(name)
                if evicted is not None:
                    del self._adapters[evicted]
                    self.stats.evictions += 1
            else:
                self._slots.touch(name)
            try:
                self._write_slot(slot, adapter)
            except BaseException:
                self._clear_slot(slot)
                self._adapters.pop(name, None)
                self._slots.drop(name)  # a half-written slot is never used
                self.stats.load_failures += 1
                raise
            self._adapters[name] = adapter
            self.stats.loads += 1
            return slot

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        # with tensor parallelism this rank writes its part and each worker receives only its own
        size = self.workers.size if self.workers is not None else 1
        shards: list[dict[str, list[LoRAModuleWeights | None]]] = [{} for _ in range(size)]
        for name, layer in self.layers.items():
            weights = [adapter.modules.get(module) for module in layer.slice_names]
            if any(w is not None for w in weights):
                layer.set_lora(slot, layer.shard_lora(weights))  # this rank's part
                for rank in range(1, size):
                    shards[rank][name] = layer.shard_lora(weights, rank)
            else:
                layer.reset_lora(slot)
        if self.workers is not None:
            self.workers.write_slot(slot, shards)

    def _clear_slot(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.reset_lora(slot)
        if self.workers is not None:
            self.workers.clear_slot(slot)

    def can_activate(self, name: str) -> bool:
        """Whether `activate` would succeed for an adapter called ``name`` (if it validates)."""
        with self._lock:
            return name in self._slots or self._slots.can_allocate()

    def deactivate(self, name: str) -> bool:
        """Free ``name``'s slot; returns whether it was resident.

        :raises LoRAError: a running request pins it.
        """
        with self._lock:
            if name not in self._slots:
                return False
            if self._slots.is_pinned(name):
                raise LoRAError(
                    "it is in use by running requests, so its GPU slot cannot be freed now.",
                    adapter=name,
                    fix="Retry when those requests finish.",
                )
            self._clear_slot(self._slots.deallocate(name))
            del self._adapters[name]
            return True

    def pin(self, name: str) -> None:
        """Keep ``name`` in its slot until as many `unpin` calls (the batch in flight uses it)."""
        with self._lock:
            if name not in self._slots:
                raise ValueError(f"adapter {name!r} holds no GPU slot; activate it before pinning")
            self._slots.pin(name)

    def unpin(self, name: str) -> None:
        with self._lock:
            if not self._slots.is_pinned(name):
                raise ValueError(f"adapter {name!r} is not pinned")
            self._slots.unpin(name)

    def is_pinned(self, name: str) -> bool:
        with self._lock:
            return self._slots.is_pinned(name)

    def slot_of(self, name: str) -> int | None:
        with self._lock:
            return self._slots.slot_of(name)

    def resident(self) -> list[str]:
        """Adapters in GPU slots, least recently used first."""
        with self._lock:
            return self._slots.names()

    @property
    def nbytes(self) -> int:
        """Bytes of the weights of the adapters resident in slots (for the tier's metrics)."""
        with self._lock:
            return sum(adapter.nbytes for adapter in self._adapters.values())

    def adapter(self, name: str) -> LoRAAdapter | None:
        """The resident adapter called ``name``, or None."""
        with self._lock:
            return self._adapters.get(name)

    # -- per-forward mapping ---------------------------------------------------------------------

    def token_slots(self, adapter_names: Sequence[str | None], seq_len: int = 1) -> torch.Tensor:
        """``[len(adapter_names) * seq_len]`` slots for a ``[B, seq_len]`` batch, row by row.

        ``None`` (or ``""``) is the base model. Every named adapter must be resident.
        """
        with self._lock:
            slots = []
            for name in adapter_names:
                slot = -1 if not name else self._slots.slot_of(name)
                if slot is None:
                    raise ValueError(f"adapter {name!r} holds no GPU slot; activate it first")
                slots.append(slot)
        rows = torch.tensor(slots, dtype=torch.int32)
        return rows.repeat_interleave(seq_len).to(self.device)

    def set_mapping(
        self,
        token_slots: torch.Tensor | None,
        logits_slots: torch.Tensor | None = None,
        *,
        static: bool = False,
    ) -> None:
        """State the slot of every token of the next forward (``[T]``, -1 = base model).

        ``T`` is the flattened batch (``B * S`` for a ``[B, S]`` batch). ``logits_slots`` gives
        the slot of each row of the logits when the model computes them on other rows than all
        ``T`` tokens (not needed for Hugging Face's ``logits_to_keep`` on a ``[B, S]`` batch).
        ``None`` runs the base model for every token. Builds the kernel metadata once.

        ``static`` (CUDA-graph capture): build a static meta, without a host sync, whose launch
        grids hold any mapping of this many tokens (any mix of adapters and base rows). The slots
        are then not checked here; the caller states the slots each replay uses with
        :meth:`mark_used`.
        """
        if token_slots is None:
            self.context.set(None)
            return
        token_slots = torch.as_tensor(token_slots).to(self.device, non_blocking=True)
        if logits_slots is not None:
            logits_slots = torch.as_tensor(logits_slots).to(self.device, non_blocking=True)
        self.context.set(token_slots, logits_slots, static=static)
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
            by_slot = {self._slots.slot_of(name): name for name in self._slots.names()}
            empty = [slot for slot in slots if slot not in by_slot]
            if empty:
                raise ValueError(f"token_slots names slot(s) {empty}, which hold no adapter")
            for slot in slots:  # used now: last in the eviction order
                self._slots.touch(by_slot[slot])

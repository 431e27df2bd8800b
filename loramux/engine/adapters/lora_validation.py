"""Whether an adapter fits a patched model: every module it names is a wrapped layer of the
right shape, at a rank the layer holds (`AdapterValidator`, the model manager's ``validate``).
Each error names the module, what is wrong and the fix."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from loramux.engine.layers import BaseLayerWithLoRA
from loramux.engine.layers.lora_patch import matches_target
from loramux.errors import IncompatibleAdapterError
from loramux.registry import LoRAAdapter, LoRAModuleWeights

__all__ = ["AdapterValidator", "adapter_sizes", "describe_mismatch"]

#: Adapter layouts `AdapterValidator` remembers as valid before it starts over.
MAX_LAYOUTS_KEPT = 256


class AdapterValidator:
    """Checks adapters against ``layers``, the wrappers `patch_model` put in a model.

    :param model_type: the model's class name (for messages).
    :param module_types: every module's type by name, as it was before patching (what a module
        that could not be wrapped is).
    :param layers: the wrapped layers by module name.
    :param target_modules: the manager's ``target_modules`` rule (None: every supported layer).
    """

    def __init__(self, model_type: str, module_types: dict[str, type[nn.Module]],
                 layers: dict[str, BaseLayerWithLoRA], target_modules: Sequence[str] | str | None) -> None:
        self._model_type = model_type
        self._module_types = module_types
        self.layers = layers
        self.target_modules = target_modules
        # adapter module name -> (layer, slice index); packed layers take several names
        self._targets: dict[str, tuple[BaseLayerWithLoRA, int]] = {
            slice_name: (layer, index)
            for layer in layers.values()
            for index, slice_name in enumerate(layer.slice_names)
        }
        # the layouts (module names, shapes, kinds) that passed: a fleet has a few kinds of adapter,
        # and checking one against every wrapped layer holds the GIL in a loader thread that long
        self._passed: set[tuple] = set()

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
        # what the checks below read, and nothing else (names, shapes, kinds)
        layout = tuple((name, w.lora_a.shape, w.lora_b.shape, w.is_embedding) for name, w in adapter.modules.items())
        if layout in self._passed:
            return
        self._check(adapter)
        if len(self._passed) >= MAX_LAYOUTS_KEPT:
            self._passed.clear()  # kinds come and go; this only bounds the set
        self._passed.add(layout)

    def _check(self, adapter: LoRAAdapter) -> None:
        for module_name, weights in adapter.modules.items():
            target = self._targets.get(module_name)
            if target is None or not matches_target(module_name, self.target_modules):
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
            problem = describe_mismatch(layer, by_slice)
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
                f"it targets module {module_name!r}, which this {self._model_type} "
                "does not have.",
                adapter=adapter.name,
                path=adapter.path,
                fix="Serve it with the base model it was trained for.",
            )
        if not matches_target(module_name, self.target_modules):
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



def describe_mismatch(layer: BaseLayerWithLoRA, weights_by_slice: Sequence[LoRAModuleWeights | None]) -> str | None:
    """Why these weights (one entry per output slice, None: left out; a whole adapter's, even for
    a tensor-parallel shard of the layer) cannot go into a slot of ``layer``, or None when they
    fit. Weights that are not matrices are read through the layer's ``adapter_matrices``."""
    in_features, output_sizes = adapter_sizes(layer)
    for name, out, weights in zip(layer.slice_names, output_sizes, weights_by_slice):
        if weights is None:
            continue
        kind = "embedding LoRA (lora_embedding_A/B)" if weights.is_embedding else "LoRA (lora_A/B)"
        if weights.is_embedding != layer.is_embedding:
            return f"module {name!r} holds a {kind} but the model's layer there is a {type(layer.base_layer).__name__}"
        if weights.rank > layer.max_lora_rank:
            return f"module {name!r} has rank {weights.rank}, above max_lora_rank={layer.max_lora_rank}"
        got_a, got_b = tuple(weights.lora_a.shape), tuple(weights.lora_b.shape)
        if weights.lora_a.dim() != 2 or weights.lora_b.dim() != 2:
            try:
                weights = layer.adapter_matrices(weights)
            except ValueError as error:
                return f"module {name!r}: {error}"
        expected_a, expected_b = (weights.rank, in_features), (out, weights.rank)
        if tuple(weights.lora_a.shape) != expected_a or tuple(weights.lora_b.shape) != expected_b:
            return (
                f"module {name!r}: the adapter's A is {list(got_a)} and B is {list(got_b)}, but "
                f"the model's {type(layer.base_layer).__name__} needs A {list(expected_a)} and "
                f"B {list(expected_b)} ([r, in] and [out, r])"
            )
    return None


def adapter_sizes(layer: BaseLayerWithLoRA) -> tuple[int, tuple[int, ...]]:
    """``(in_features, output_sizes)`` of the whole layer, which adapters are trained for."""
    shard = layer.tp_shard
    if shard is None:
        return layer.in_features, layer.output_sizes
    if shard.style == "row":
        return layer.in_features * shard.size, layer.output_sizes
    return layer.in_features, tuple(size * shard.size for size in layer.output_sizes)

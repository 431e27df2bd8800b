"""Patching a transformers model for multi-LoRA: each eligible layer replaced, in place, by the
wrapper the ``create_lora_layer`` hook returns (plugins first, loramux's built-ins last)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Callable

from torch import nn

from loramux.engine.layers import BaseLayerWithLoRA, LoRAContext
from loramux.errors import PluginError
from loramux.registry import LoRAConfig

__all__ = ["matches_target", "patch_model", "wrap_layer"]

LayerFactory = Callable[[nn.Module, str, LoRAConfig], "BaseLayerWithLoRA | None"]


def wrap_layer(
    base_layer: nn.Module, module_name: str, lora_config: LoRAConfig
) -> BaseLayerWithLoRA | None:
    """The wrapper for one layer, from the ``create_lora_layer`` hook (built-ins answer last).

    A third-party plugin's wrapper is checked before it is used (`check_wrapper`: a
    `BaseLayerWithLoRA`, and a dry run on a tiny input); one that fails is reported as a broken
    plugin naming the fix, and the next plugin (loramux's own wrapper, if any) is asked instead.
    """
    from loramux.engine.layers.wrap_check import check_wrapper
    from loramux.plugins.layers import layer_from_plugins as ask_plugins

    return ask_plugins(base_layer, module_name, lora_config, check=check_wrapper)


def matches_target(name: str, target_modules: Sequence[str] | str | None) -> bool:
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
    create: LayerFactory = wrap_layer,
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
        if not name or not any(matches_target(n, target_modules) for n in names):
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
    get_output = getattr(model, "get_output_embeddings", None)
    lm_head = get_output() if callable(get_output) else None
    for name, wrapper in wrapped.items():
        wrapper.lora_context = context
        # its rows are the logits rows, whose slots the context holds apart from the tokens'
        wrapper.computes_logits = lm_head is not None and wrapper.get_base_layer() is lm_head
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, wrapper)
    return wrapped


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]

"""Asking the plugins for a layer's LoRA wrapper (the ``create_lora_layer`` hook), checked."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from loramux.errors import LoRAError
from loramux.plugins.manager import DEFAULT_PLUGINS, each_plugin_hook, plugin_error, report_plugin_error

if TYPE_CHECKING:
    import torch

    from loramux.registry.config import LoRAConfig

__all__ = ["layer_from_plugins"]


def layer_from_plugins(
    base_layer: torch.nn.Module, module_name: str, lora_config: LoRAConfig,
    check: Callable[[torch.nn.Module], None] | None = None,
) -> torch.nn.Module | None:
    """The first plugin's LoRA wrapper for ``base_layer``, or None when no plugin supports it.

    Implementations are asked in pluggy's order (third-party first, loramux's own ``trylast``).
    One that raises anything but a :class:`~loramux.errors.LoRAError`, returns something other
    than a module wrapping ``base_layer``, or whose wrapper fails ``check`` (the engine's checks
    of the layer contract, run on third-party plugins' wrappers), is reported as a broken plugin
    and skipped: the next one is asked. A ``LoRAError`` is a deliberate refusal and reaches the
    caller.
    """
    import torch

    for plugin_name, hook in each_plugin_hook("create_lora_layer"):
        try:
            layer = hook(base_layer=base_layer, module_name=module_name, lora_config=lora_config)
        except LoRAError:
            raise
        except Exception as error:
            report_plugin_error(
                plugin_error(
                    plugin_name,
                    f"raised {type(error).__name__} in create_lora_layer for {module_name!r} "
                    f"({type(base_layer).__name__}): {error}.",
                    fix="Skipped it for this layer; fix or uninstall the plugin.",
                )
            )
            continue
        if layer is None:
            continue
        if isinstance(layer, torch.nn.Module) and _wraps(layer, base_layer):
            if check is None or plugin_name in DEFAULT_PLUGINS:
                return layer
            try:
                check(layer)
                return layer
            except Exception as error:
                report_plugin_error(plugin_error(
                    plugin_name, f"returned a {type(layer).__name__} for {module_name!r} "
                    f"({type(base_layer).__name__}) that breaks the LoRA layer contract: {error}.",
                    fix=f"{getattr(error, 'fix', None) or 'Fix the plugin'}. The layer is left to the next plugin "
                    "(loramux's own wrapper, if any); see docs/plugins.md, section 'The LoRA layer contract'."))
                continue
        report_plugin_error(
            plugin_error(
                plugin_name,
                f"returned {type(layer).__name__} from create_lora_layer for {module_name!r} "
                f"({type(base_layer).__name__}), not a torch.nn.Module whose get_base_layer() "
                "is the layer it was given.",
                fix="Skipped it for this layer; return a BaseLayerWithLoRA wrapping base_layer, "
                "or None for layers the plugin does not support.",
            )
        )
    return None


def _wraps(layer: torch.nn.Module, base_layer: torch.nn.Module) -> bool:
    try:
        return layer.get_base_layer() is base_layer
    except Exception:  # no get_base_layer(), or a broken one
        return False

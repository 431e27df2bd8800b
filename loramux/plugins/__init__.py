"""The plugin spine: hook specs (``hookspecs``), loading policy (``manager``), checked calls."""

from loramux.plugins.hookspecs import hookimpl, hookspec
from loramux.plugins.layers import create_lora_layer
from loramux.plugins.manager import (
    DEFAULT_PLUGINS,
    PluginInfo,
    get_plugin_manager,
    list_plugins,
    plugin_errors,
    register_plugin,
    reset_plugin_manager,
)

__all__ = [
    "DEFAULT_PLUGINS",
    "PluginInfo",
    "create_lora_layer",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    "list_plugins",
    "plugin_errors",
    "register_plugin",
    "reset_plugin_manager",
]

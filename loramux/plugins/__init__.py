"""The plugin spine: hook specs (``hookspecs``), loading policy (``manager``), checked calls."""

from loramux.plugins.hookspecs import hookimpl, hookspec
from loramux.plugins.layers import layer_from_plugins
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
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    "layer_from_plugins",
    "list_plugins",
    "plugin_errors",
    "register_plugin",
    "reset_plugin_manager",
]

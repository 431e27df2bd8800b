"""The plugin manager: which plugins load, in what order, and what happens when one is broken.

Built-ins are ordinary plugins listed by dotted path in :data:`DEFAULT_PLUGINS`; third-party
plugins are modules named by an entry point of group ``loramux``. Everything loads on the first
call of :func:`get_plugin_manager` (lazily, once). A plugin that fails to import or breaks a hook's
contract is left out with a :class:`~loramux.errors.PluginError` naming it (logged, and listed by
:func:`plugin_errors` and ``loramux plugins``); loramux carries on without it.

Environment:

- ``LORAMUX_PLUGINS``: a comma-separated allow-list of third-party plugins (entry-point or
  distribution names). Unset: every installed plugin loads. Set but empty: none does. Built-ins
  always load: they are loramux's own parts (choose built-in resolvers with
  ``LORAMUX_LORA_RESOLVERS``).
- ``LORAMUX_TRACE_HOOKS=1``: print every hook call, with its plugins and result, to stderr.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
import threading
from dataclasses import dataclass, field

import pluggy

from loramux import envs
from loramux.errors import PluginError
from loramux.plugins import hookspecs
from loramux.version import __version__

__all__ = [
    "DEFAULT_PLUGINS",
    "ENTRY_POINT_GROUP",
    "PLUGINS_ENV",
    "TRACE_ENV",
    "PluginInfo",
    "each_plugin_hook",
    "plugin_error",
    "get_plugin_manager",
    "list_plugins",
    "plugin_errors",
    "register_plugin",
    "report_plugin_error",
    "reset_plugin_manager",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "loramux"
PLUGINS_ENV = envs.env_name("plugins")
TRACE_ENV = envs.env_name("trace_hooks")

# Built-in plugins by dotted path, each living next to its domain code. A module listed here that
# cannot be imported is reported like any broken plugin, so adding a line is all it takes.
DEFAULT_PLUGINS: tuple[str, ...] = (
    "loramux.resolvers.filesystem",
    "loramux.resolvers.huggingface",
    "loramux.engine.layers.plugin",
)


@dataclass
class PluginInfo:
    """One plugin as ``loramux plugins`` shows it.

    :ivar status: ``"loaded"``, ``"blocked"`` (left out by ``LORAMUX_PLUGINS``) or ``"failed"``.
    """

    name: str
    version: str | None = None
    distribution: str | None = None
    hooks: list[str] = field(default_factory=list)
    builtin: bool = False
    status: str = "loaded"
    error: str | None = None


_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_errors: list[PluginError] = []
_not_loaded: dict[str, PluginInfo] = {}  # entry points blocked or failed, by name


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with every allowed plugin loaded (on the first call)."""
    global _manager
    if _manager is None:
        with _lock:
            if _manager is None:
                _manager = _build_manager()
    return _manager


def reset_plugin_manager() -> None:
    """Forget the loaded plugins and their errors; the next call loads them again (for tests)."""
    global _manager
    with _lock:
        _manager = None
        _errors.clear()
        _not_loaded.clear()


def plugin_errors() -> list[PluginError]:
    """The problems met so far: plugins that failed to load or broke a hook contract."""
    get_plugin_manager()
    with _lock:
        return list(_errors)


def report_plugin_error(error: PluginError) -> None:
    """Log ``error`` as a warning and remember it for :func:`plugin_errors` (once per message)."""
    with _lock:
        if any(str(seen) == str(error) for seen in _errors):
            return
        _errors.append(error)
    logger.warning("%s", error)


def plugin_error(plugin: str, problem: str, *, fix: str | None = None) -> PluginError:
    """A :class:`PluginError` whose message starts with the plugin's name (kept as ``.plugin``)."""
    error = PluginError(f"plugin {plugin!r} {problem}", fix=fix)
    error.plugin = plugin
    return error


def register_plugin(plugin: object, name: str | None = None) -> str:
    """Register ``plugin`` (a module or object with hookimpls) in-process, checking its contract.

    :returns: the name it was registered under.
    :raises PluginError: it breaks a hook contract; nothing is left registered.
    """
    manager = get_plugin_manager()
    name = name or manager.get_canonical_name(plugin)
    _register_checked(manager, plugin, name)
    return name


def each_plugin_hook(hook_name: str) -> list[tuple[str, pluggy.HookCaller]]:
    """For each plugin implementing ``hook_name``, in call order: its name and a caller of only
    its implementation (plus wrappers), so a result or an error can be traced to one plugin.
    Calls still go through pluggy, so ``LORAMUX_TRACE_HOOKS`` sees them."""
    manager = get_plugin_manager()
    impls = getattr(manager.hook, hook_name).get_hookimpls()
    answering = [impl for impl in reversed(impls) if not (impl.wrapper or impl.hookwrapper)]
    return [
        (
            impl.plugin_name,
            manager.subset_hook_caller(
                hook_name, [other.plugin for other in answering if other.plugin is not impl.plugin]
            ),
        )
        for impl in answering
    ]


def list_plugins(*, include_builtins: bool = False) -> list[PluginInfo]:
    """Every plugin loaded, blocked or failed, with its version and the hooks it implements."""
    manager = get_plugin_manager()
    distributions = {id(plugin): dist for plugin, dist in manager.list_plugin_distinfo()}
    infos = []
    for name, plugin in manager.list_name_plugin():
        if plugin is None:  # a blocked name
            continue
        builtin = name in DEFAULT_PLUGINS
        if builtin and not include_builtins:
            continue
        dist = distributions.get(id(plugin))
        hooks = sorted(caller.name for caller in manager.get_hookcallers(plugin) or [])
        infos.append(
            PluginInfo(
                name=name,
                version=dist.version if dist else (__version__ if builtin else None),
                distribution=dist.project_name if dist else ("loramux" if builtin else None),
                hooks=hooks,
                builtin=builtin,
            )
        )
    with _lock:
        infos.extend(info for info in _not_loaded.values() if include_builtins or not info.builtin)
    return sorted(infos, key=lambda info: (not info.builtin, info.name))


# -------------------------------------------------------------------------------------------------
# Loading
# -------------------------------------------------------------------------------------------------


def _build_manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    if envs.current().trace_hooks:
        _add_tracing(manager)
    for dotted_path in DEFAULT_PLUGINS:
        _load_builtin(manager, dotted_path)
    _load_entry_points(manager)
    return manager


def _load_builtin(manager: pluggy.PluginManager, dotted_path: str) -> None:
    try:
        module = importlib.import_module(dotted_path)
        _register_checked(manager, module, dotted_path)
    except PluginError as error:
        _not_loaded[dotted_path] = PluginInfo(
            dotted_path, builtin=True, status="failed", error=str(error)
        )
        report_plugin_error(error)
    except Exception as error:
        _not_loaded[dotted_path] = PluginInfo(
            dotted_path, builtin=True, status="failed", error=str(error)
        )
        report_plugin_error(
            plugin_error(
                dotted_path,
                f"(built in) failed to import: {type(error).__name__}: {error}.",
                fix="loramux carries on without it; reinstall loramux if this persists.",
            )
        )


def _allowed_plugins() -> set[str] | None:
    value = envs.current().plugins
    if value is None:
        return None
    return {_normalize(name) for name in value.split(",") if name.strip()}


def _normalize(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _load_entry_points(manager: pluggy.PluginManager) -> None:
    allowed = _allowed_plugins()
    seen: set[str] = set()
    for dist in importlib.metadata.distributions():
        for entry_point in dist.entry_points:
            if entry_point.group != ENTRY_POINT_GROUP or entry_point.name in seen:
                continue
            seen.add(entry_point.name)
            names = {_normalize(entry_point.name), _normalize(dist.metadata["Name"] or "")}
            info = PluginInfo(entry_point.name, dist.version, dist.metadata["Name"])
            if allowed is not None and not names & allowed:
                manager.set_blocked(entry_point.name)
                info.status = "blocked"
                _not_loaded[entry_point.name] = info
                continue
            if allowed is not None:
                allowed -= names
            _load_entry_point(manager, entry_point.name, info)
    for name in sorted(allowed or ()):
        report_plugin_error(
            plugin_error(
                name,
                f"is named in {PLUGINS_ENV} but no installed plugin has that name.",
                fix=f"Install it (pip install ...), or fix {PLUGINS_ENV}; `loramux plugins` lists "
                "what is installed.",
            )
        )


def _load_entry_point(manager: pluggy.PluginManager, name: str, info: PluginInfo) -> None:
    try:
        # pluggy imports the module, registers it and remembers its distribution for listings.
        manager.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
        plugin = manager.get_plugin(name)
        if plugin is not None:
            _check_contract(manager, plugin, name)
    except Exception as error:
        if manager.get_plugin(name) is not None:
            manager.unregister(name=name)
        if not isinstance(error, PluginError):
            error = plugin_error(
                name,
                f"({info.distribution} {info.version}) failed to load: "
                f"{type(error).__name__}: {error}.",
                fix=f"loramux carries on without it. Fix or upgrade the plugin, or leave it out "
                f"with {PLUGINS_ENV}.",
            )
        info.status, info.error = "failed", str(error)
        _not_loaded[name] = info
        report_plugin_error(error)


def _register_checked(manager: pluggy.PluginManager, plugin: object, name: str) -> None:
    try:
        manager.register(plugin, name=name)
    except (pluggy.PluginValidationError, ValueError) as error:
        raise plugin_error(
            name,
            f"cannot be registered: {error}",
            fix="Make each hookimpl take only arguments its hook spec names (see docs/plugins.md).",
        ) from error
    _check_contract(manager, plugin, name)


def _check_contract(manager: pluggy.PluginManager, plugin: object, name: str) -> None:
    """Refuse what pluggy accepts silently: unknown hook names and arguments with defaults."""
    problems = []
    known = sorted(name for name, hook in vars(manager.hook).items() if hook.has_spec())
    for caller in manager.get_hookcallers(plugin) or []:
        for impl in caller.get_hookimpls():
            if impl.plugin is not plugin:
                continue
            if not caller.has_spec():
                if not impl.optionalhook:
                    problems.append(
                        f"implements {caller.name!r}, which is not a loramux hook "
                        f"(known hooks: {', '.join(known)})"
                    )
            elif defaulted := set(impl.kwargnames) & set(caller.spec.argnames):
                problems.append(
                    f"gives {caller.name}'s argument(s) {', '.join(sorted(defaulted))} a default "
                    "value, so pluggy would never pass them"
                )
    if problems:
        manager.unregister(plugin)
        raise plugin_error(
            name,
            "breaks the hook contract: " + "; ".join(problems) + ".",
            fix="Fix the hookimpl (names have no prefix; never give arguments defaults), or "
            "mark a hook from a newer loramux @hookimpl(optionalhook=True).",
        )


def _add_tracing(manager: pluggy.PluginManager) -> None:
    def before(hook_name, hook_impls, kwargs):
        plugins = ", ".join(impl.plugin_name for impl in reversed(hook_impls))
        arguments = ", ".join(f"{key}={_short(value)}" for key, value in kwargs.items())
        print(f"loramux hook: {hook_name}({arguments}) -> [{plugins}]", file=sys.stderr)

    def after(outcome, hook_name, hook_impls, kwargs):
        if outcome.exception is not None:
            result = f"raised {type(outcome.exception).__name__}: {outcome.exception}"
        else:
            result = f"returned {_short(outcome.get_result())}"
        print(f"loramux hook: {hook_name} {result}", file=sys.stderr)

    manager.add_hookcall_monitoring(before, after)


def _short(value: object, limit: int = 80) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


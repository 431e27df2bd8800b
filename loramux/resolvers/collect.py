"""Collecting the resolvers that plugins register, and the user's choice of order."""

from __future__ import annotations

import re
from collections.abc import Sequence

from loramux.plugins.manager import each_plugin_hook, plugin_error, report_plugin_error
from loramux.resolvers.base import Resolver
from loramux.resolvers.settings import RESOLVERS_ENV, ResolverSettings

__all__ = ["RESOLVERS_ENV", "collect_resolvers", "order_resolvers"]
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*$")
_NAME = re.compile(r"^[^\s,]+$")
_LOCAL_SCHEMES = ("file",)


def collect_resolvers(settings: ResolverSettings | None = None) -> list[Resolver]:
    """Every resolver registered through ``register_resolvers``, in registration order.

    :param settings: handed to every ``register_resolvers`` hook; default
        :meth:`ResolverSettings.from_env` (the environment, read here once).

    A plugin whose hook raises or registers something that is not a valid :class:`Resolver` is
    reported (see :func:`~loramux.plugins.plugin_errors`) and its resolvers are left out.

    :raises PluginError: two plugins register resolvers with the same name or URI scheme; the
        message names both.
    """
    settings = ResolverSettings.from_env() if settings is None else settings
    resolvers: list[Resolver] = []
    owner: dict[str, str] = {}  # resolver name -> plugin
    scheme_owner: dict[str, Resolver] = {}
    for plugin_name, hook in each_plugin_hook("register_resolvers"):
        registered: list[Resolver] = []
        try:
            hook(register=registered.append, settings=settings)
            for resolver in registered:
                _check(resolver, plugin_name)
        except Exception as error:
            report_plugin_error(
                plugin_error(
                    plugin_name,
                    f"failed in register_resolvers: {type(error).__name__}: {error}",
                    fix="Its resolvers are left out; fix its configuration or the plugin.",
                )
            )
            continue
        for resolver in registered:
            if resolver.name in owner:
                raise plugin_error(
                    plugin_name,
                    f"registers a resolver named {resolver.name!r}, a name plugin "
                    f"{owner[resolver.name]!r} registered first.",
                    fix="Uninstall one of them, or leave one out with LORAMUX_PLUGINS.",
                )
            for scheme in resolver.schemes:
                if scheme in scheme_owner:
                    first = scheme_owner[scheme]
                    raise plugin_error(
                        plugin_name,
                        f"registers resolver {resolver.name!r} for '{scheme}://' URIs, which "
                        f"resolver {first.name!r} of plugin {owner[first.name]!r} claims already.",
                        fix="Uninstall one of them, or leave one out with LORAMUX_PLUGINS.",
                    )
                scheme_owner[scheme] = resolver
            owner[resolver.name] = plugin_name
            resolvers.append(resolver)
    return resolvers


def _check(resolver: object, plugin_name: str) -> None:
    if not isinstance(resolver, Resolver):
        raise TypeError(f"register() got {type(resolver).__name__}, not a loramux Resolver")
    if not isinstance(resolver.name, str) or not _NAME.match(resolver.name):
        raise ValueError(
            f"{type(resolver).__name__}.name is {resolver.name!r}; it must be a non-empty "
            "string without spaces or commas"
        )
    schemes = resolver.schemes
    if isinstance(schemes, str) or not all(
        isinstance(s, str) and _SCHEME.match(s) and s not in _LOCAL_SCHEMES for s in schemes
    ):
        raise ValueError(
            f"resolver {resolver.name!r} has schemes={schemes!r}; it must be a tuple of lower-case "
            "URI schemes like ('s3',), never 'file'"
        )


def order_resolvers(
    resolvers: Sequence[Resolver], order: Sequence[str] | str | None = None
) -> list[Resolver]:
    """The resolvers to ask by name, in the user's order.

    :param order: resolver names (or a comma-separated string); only those are asked, in that
        order. None: every resolver, in registration order (:class:`ResolverSettings` reads
        ``$LORAMUX_LORA_RESOLVERS`` into ``order``; this function reads no environment).
    :raises ValueError: the order names a resolver that is not registered.
    """
    if order is None:
        return list(resolvers)
    if isinstance(order, str):
        order = [name.strip() for name in order.split(",") if name.strip()]
    by_name = {resolver.name: resolver for resolver in resolvers}
    unknown = [name for name in order if name not in by_name]
    if unknown:
        raise ValueError(
            f"resolver order names {', '.join(map(repr, unknown))}, which no plugin registered; "
            f"registered resolvers: {', '.join(by_name) or 'none'} (check --lora-resolvers or {RESOLVERS_ENV})"
        )
    return [by_name[name] for name in dict.fromkeys(order)]

"""`Registry`: adapter name -> loaded adapter, backed by the CPU tier and the resolvers.

An adapter comes from, in this order: a path or URI given for its name (``register``, or a
``LoRARequest`` with ``lora_path``); else the resolvers, asked in order. A local path is read as
it is; a URI is fetched by the resolver that claims its scheme. Loading happens once per name
however many threads ask at once (the CPU tier's single-flight), and a failure leaves the
registry as it was.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING

from loramux.errors import (
    AdapterNotFoundError,
    IncompatibleAdapterError,
    InvalidAdapterError,
    LoRAError,
    PluginError,
)
from loramux.registry.adapter import LoRAAdapter
from loramux.registry.config import LoRAConfig
from loramux.registry.cpu_cache import CPUAdapterCache
from loramux.registry.loader import load_adapter
from loramux.registry.request import LoRARequest, validate_adapter_name

if TYPE_CHECKING:
    from loramux.resolvers.base import Resolver

__all__ = ["AdapterLocation", "Registry"]

_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_NAME_FIX = (
    "Adapter names are relative, like 'my-adapter' or 'org/repo/sub': no '..', no leading '/'."
)


@dataclass(frozen=True)
class AdapterLocation:
    """Where an adapter was found.

    :ivar path: the local directory holding it.
    :ivar source: the path or URI it was registered with, or None when a resolver found it by name.
    :ivar resolver: the resolver that found or fetched it; None for a local path.
    """

    name: str
    path: Path
    source: str | None = None
    resolver: str | None = None


@dataclass(frozen=True)
class _Source:
    location: str  # an absolute local path or a URI
    base_model_name: str | None = None


def _scheme(location: str) -> str | None:
    """The URI scheme of ``location``, or None for a local path (``file://`` included)."""
    match = _URI.match(location)
    if match is None or match[1].lower() == "file":
        return None
    return match[1].lower()


def _normalize(location: str | PathLike[str]) -> str:
    location = str(location)
    if _scheme(location) is not None:
        return location
    if location.lower().startswith("file://"):
        location = location[len("file://") :]
    return str(Path(location).expanduser().resolve())


def _check_name(name: object) -> str:
    try:
        return validate_adapter_name(name)
    except ValueError as error:
        raise InvalidAdapterError(
            str(error), adapter=name if isinstance(name, str) else None, fix=_NAME_FIX
        ) from None


class Registry:
    """Adapters by name: loaded on demand, kept in the CPU tier.

    :param lora_config: bounds checked at load (``max_lora_rank``), the dtype, and the CPU tier's
        size (``max_cpu_loras``, ``max_cpu_bytes``).
    :param base_model_name: the served model; passed to resolvers, which may group adapters by it.
    :param resolvers: the resolvers to use; default: those the plugins register.
    :param resolver_order: names of the resolvers to ask by name, in order (a list or
        ``"a,b"``); default ``$LORAMUX_LORA_RESOLVERS``, else all in registration order.
    :param cache: the CPU tier; default one sized by ``lora_config``.
    :param validate: called with each adapter after it loads, before it is cached (the engine
        checks it fits the model); its exception fails the load and caches nothing.
    """

    def __init__(
        self,
        lora_config: LoRAConfig | None = None,
        *,
        base_model_name: str | None = None,
        resolvers: Sequence[Resolver] | None = None,
        resolver_order: Sequence[str] | str | None = None,
        cache: CPUAdapterCache | None = None,
        validate: Callable[[LoRAAdapter], None] | None = None,
    ) -> None:
        from loramux.resolvers.collect import collect_resolvers, order_resolvers

        self.lora_config = lora_config or LoRAConfig()
        self.base_model_name = base_model_name
        self.resolvers = collect_resolvers() if resolvers is None else list(resolvers)
        self.name_resolvers = order_resolvers(self.resolvers, resolver_order)
        self.cache = cache or CPUAdapterCache(
            self.lora_config.max_cpu_loras, self.lora_config.max_cpu_bytes
        )
        self._validate = validate
        self._sources: dict[str, _Source] = {}
        self._lock = threading.Lock()

    # -- the name -> source map ----------------------------------------------------------------

    def register(
        self,
        name: str,
        path: str | PathLike[str],
        base_model_name: str | None = None,
        *,
        replace: bool = False,
    ) -> None:
        """Serve the adapter at ``path`` (a local directory or a URI) as ``name``; loads lazily.

        :param base_model_name: when given, the adapter must have been trained for this model.
        :param replace: allow ``name`` to point somewhere else than before. A copy of ``name``
            loaded from anywhere else is dropped, so the next ``get`` loads this one.
        :raises InvalidAdapterError: the name is unsafe.
        :raises AdapterNotFoundError: a local ``path`` is not a directory, or no resolver
            fetches its URI scheme.
        :raises IncompatibleAdapterError: ``name`` is registered for another path (and not
            ``replace``).
        """
        _check_name(name)
        source = _Source(_normalize(path), base_model_name)
        scheme = _scheme(source.location)
        if scheme is None and not Path(source.location).is_dir():
            raise AdapterNotFoundError(
                "no adapter directory at this path.",
                adapter=name,
                path=source.location,
                fix="Check the path; it must be a directory saved by PEFT's save_pretrained().",
            )
        if scheme is not None:
            self._scheme_resolver(scheme, name)
        with self._lock:
            previous = self._sources.get(name)
            if previous is not None and previous.location != source.location and not replace:
                raise IncompatibleAdapterError(
                    f"the name is already registered for {previous.location!r}, not "
                    f"{source.location!r}.",
                    adapter=name,
                    fix="Use another name, or unregister (unload) this one first.",
                )
            self._sources[name] = source
        if previous != source:  # a copy loaded from elsewhere (or found by a resolver) is stale
            self.cache.remove(name)

    def unregister(self, name: str) -> bool:
        """Forget ``name``: its registration and its loaded copy (pins included).

        :returns: whether there was anything to forget.
        """
        with self._lock:
            registered = self._sources.pop(name, None) is not None
        loaded = self.cache.remove(name)
        return registered or loaded

    def list(self) -> list[str]:
        """Names registered or loaded, sorted."""
        with self._lock:
            names = set(self._sources)
        return sorted(names | set(self.cache.names()))

    def __contains__(self, name: object) -> bool:
        with self._lock:
            if name in self._sources:
                return True
        return isinstance(name, str) and name in self.cache

    # -- finding and loading -------------------------------------------------------------------

    def get(self, name_or_request: str | LoRARequest, *, pin: bool = False) -> LoRAAdapter:
        """The adapter, loaded (and resolved or downloaded) on first use, then from the CPU tier.

        Concurrent calls for the same missing adapter load it once; all get its result or error.

        :param name_or_request: a name, or a ``LoRARequest`` (its ``lora_path``, if set, is
            registered for its name).
        :param pin: also pin it in the CPU tier (see :meth:`CPUAdapterCache.pin`).
        :raises AdapterNotFoundError: no path is registered and no resolver finds it; the
            message lists the resolvers tried.
        :raises LoRAError: it cannot be fetched, is invalid or does not fit; nothing is cached.
        """
        name = self._name_of(name_or_request)
        return self.cache.get_or_load(name, lambda: self._load(name), pin=pin)

    def locate(self, name_or_request: str | LoRARequest) -> AdapterLocation:
        """Find (and fetch, if remote) the adapter's directory without loading it."""
        name = self._name_of(name_or_request)
        with self._lock:
            source = self._sources.get(name)
        if source is None:
            return self._resolve(name)
        scheme = _scheme(source.location)
        if scheme is None:
            return AdapterLocation(name, Path(source.location), source.location)
        resolver = self._scheme_resolver(scheme, name)
        path = self._call(resolver, "fetch", name, source.location)
        return AdapterLocation(name, path, source.location, resolver.name)

    def _load(self, name: str) -> LoRAAdapter:
        location = self.locate(name)
        with self._lock:
            source = self._sources.get(name)
        adapter = load_adapter(
            location.path,
            self.lora_config,
            name=name,
            base_model_name=source.base_model_name if source else None,
        )
        if self._validate is not None:
            self._validate(adapter)
        return adapter

    def _name_of(self, name_or_request: str | LoRARequest) -> str:
        if isinstance(name_or_request, LoRARequest):
            request = name_or_request
            if request.lora_path:
                with self._lock:
                    known = self._sources.get(request.lora_name)
                if known is None or known.location != _normalize(request.lora_path):
                    self.register(request.lora_name, request.lora_path, request.base_model_name)
            return request.lora_name
        return _check_name(name_or_request)

    def _resolve(self, name: str) -> AdapterLocation:
        for resolver in self.name_resolvers:
            path = self._call(resolver, "resolve", name, self.base_model_name, name)
            if path is not None:
                return AdapterLocation(name, path, None, resolver.name)
        tried = "; ".join(resolver.describe() for resolver in self.name_resolvers)
        raise AdapterNotFoundError(
            f"no resolver found it (tried: {tried})."
            if tried
            else "it is not registered, and no resolver is configured to look for it.",
            adapter=name,
            fix="Check the name; give its path (LoRARequest lora_path, --lora-modules NAME=PATH), "
            "or point a resolver at it (LORAMUX_LORA_RESOLVER_DIR, "
            "LORAMUX_LORA_RESOLVER_HF_REPO_LIST, or a resolver plugin).",
        )

    def _scheme_resolver(self, scheme: str, name: str) -> Resolver:
        for resolver in self.resolvers:
            if scheme in resolver.schemes:
                return resolver
        claimed = sorted(s for resolver in self.resolvers for s in resolver.schemes)
        raise AdapterNotFoundError(
            f"no resolver fetches '{scheme}://' URIs (installed: "
            f"{', '.join(s + '://' for s in claimed) or 'none'}).",
            adapter=name,
            fix="Install the plugin for it (e.g. pip install loramux-s3 for s3://); "
            "`loramux plugins` lists what is installed.",
        )

    def _call(self, resolver: Resolver, method: str, name: str, *args) -> Path | None:
        """Run a resolver's method, holding it to its contract: a LoRAError is the answer; any
        other exception, or a result that is not a path, is the resolver's fault."""
        try:
            result = getattr(resolver, method)(*args)
        except LoRAError as error:
            if error.adapter == name:
                raise
            try:  # a resolver fetching a URI knows the URI, not the name the request gave it
                renamed = type(error)(error.problem, adapter=name, path=error.path, fix=error.fix)
            except Exception:
                raise error from None
            raise renamed from error
        except Exception as error:
            raise PluginError(
                f"resolver {resolver.name!r} failed in {method}(): {type(error).__name__}: {error}",
                adapter=name,
                fix="Fix its configuration, or leave it out with LORAMUX_LORA_RESOLVERS.",
            ) from error
        if result is None and method == "resolve":
            return None
        if not isinstance(result, (str, PathLike)):
            raise PluginError(
                f"resolver {resolver.name!r} returned {type(result).__name__} from {method}(), "
                "not a path.",
                adapter=name,
                fix="It must return the adapter's local directory (resolve() may return None).",
            )
        return Path(result)

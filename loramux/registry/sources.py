"""Where an adapter comes from: a registered path or URI, or the resolvers asked by name.

A local path is read as it is; a URI is fetched by the resolver that claims its scheme; a name
with neither goes to the resolvers in the user's order. Every resolver call is held to the
resolver contract here, so a plugin's bug fails only the request that reached it, and to a
deadline (``fetch_timeout``), so a slow or dead source fails only the loads that asked it, in
bounded time: the call runs in a thread of its own, which the load stops waiting for at the
deadline (a resolver cannot be interrupted; the thread ends when its own client gives up, and
what it downloads meanwhile lands in the cache for the next try).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from concurrent.futures import Future, TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING

from loramux.errors import AdapterDownloadError, AdapterNotFoundError, InvalidAdapterError, LoRAError, PluginError
from loramux.registry.request import validate_adapter_name

if TYPE_CHECKING:
    from loramux.resolvers.base import Resolver

__all__ = ["AdapterLocation", "AdapterSource", "AdapterSources", "check_name", "normalize_location"]

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
class AdapterSource:
    """A registered location: an absolute local path or a URI, and the base model it is for."""

    location: str
    base_model_name: str | None = None


def scheme_of(location: str) -> str | None:
    """The URI scheme of ``location``, or None for a local path (``file://`` included)."""
    match = _URI.match(location)
    if match is None or match[1].lower() == "file":
        return None
    return match[1].lower()


def normalize_location(location: str | PathLike[str]) -> str:
    """A URI as it is; a local path (or ``file://`` URI) made absolute, symlinks resolved."""
    location = str(location)
    if scheme_of(location) is not None:
        return location
    if location.lower().startswith("file://"):
        location = location[len("file://") :]
    return str(Path(location).expanduser().resolve())


def check_name(name: object) -> str:
    """``name`` if it is a safe adapter name, else an :class:`InvalidAdapterError` naming it."""
    try:
        return validate_adapter_name(name)
    except ValueError as error:
        raise InvalidAdapterError(
            str(error), adapter=name if isinstance(name, str) else None, fix=_NAME_FIX
        ) from None


class AdapterSources:
    """The resolvers, and the way from a name (and its registered source) to a local directory.

    :param resolvers: every resolver; URIs go to the one claiming their scheme.
    :param order: the names of the resolvers to ask by name, in order; None: all of them.
    :param base_model_name: passed to ``resolve``; resolvers may group adapters by model.
    :raises ValueError: ``order`` names a resolver that is not among ``resolvers``.
    """

    def __init__(
        self,
        resolvers: Sequence[Resolver],
        order: Sequence[str] | str | None = None,
        *,
        base_model_name: str | None = None,
        fetch_timeout: float | None = None,
    ) -> None:
        from loramux.resolvers.collect import order_resolvers

        self.resolvers = list(resolvers)
        self.name_resolvers = order_resolvers(self.resolvers, order)
        self.base_model_name = base_model_name
        self.fetch_timeout = fetch_timeout

    def check(self, name: str, source: AdapterSource) -> None:
        """Refuse at registration what can never load: a missing local directory, or a URI
        whose scheme no resolver claims."""
        scheme = scheme_of(source.location)
        if scheme is None and not Path(source.location).is_dir():
            raise AdapterNotFoundError(
                "no adapter directory at this path.",
                adapter=name,
                path=source.location,
                fix="Check the path; it must be a directory saved by PEFT's save_pretrained().",
            )
        if scheme is not None:
            self._scheme_resolver(scheme, name)

    def locate(self, name: str, source: AdapterSource | None) -> AdapterLocation:
        """The local directory of ``name``: its registered ``source`` (fetched if a URI), or
        what the resolvers find by name when it has none."""
        if source is None:
            return self._resolve(name)
        scheme = scheme_of(source.location)
        if scheme is None:
            return AdapterLocation(name, Path(source.location), source.location)
        resolver = self._scheme_resolver(scheme, name)
        path = self._call(resolver, "fetch", name, source.location)
        return AdapterLocation(name, path, source.location, resolver.name)

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
            "or point a resolver at it (--lora-resolver-dir / LORAMUX_LORA_RESOLVER_DIR, "
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
        other exception, or a result that is not a path, is the resolver's fault; no answer
        within ``fetch_timeout`` seconds is an `AdapterDownloadError`."""
        call = Future()

        def run() -> None:
            try:
                call.set_result(getattr(resolver, method)(*args))
            except BaseException as error:  # noqa: BLE001 - handed to the caller below
                call.set_exception(error)

        threading.Thread(target=run, name=f"loramux-resolve-{name}", daemon=True).start()
        try:
            result = call.result(timeout=self.fetch_timeout)
        except FutureTimeoutError:
            raise AdapterDownloadError(
                f"resolver {resolver.name!r} did not answer within {self.fetch_timeout:g} s.",
                adapter=name,
                fix="Check the source (its network, endpoint and credentials) and retry; raise "
                "--lora-fetch-timeout (LORAMUX_LORA_FETCH_TIMEOUT) for large downloads.",
            ) from None
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
                fix="Fix its configuration, or leave it out of --lora-resolvers "
                "(LORAMUX_LORA_RESOLVERS).",
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

"""`ResolverSettings`: where the built-in resolvers look and in which order, passed as arguments.

Settings travel from the border (the CLI's flags, ``Registry(...)``, ``LLM(...)``) down to the
resolvers as this one value: the ``register_resolvers`` hook receives it, so nothing writes
``os.environ`` for a resolver to read back. The environment variables stay the user-facing
defaults (:mod:`loramux.envs`), taken by :meth:`ResolverSettings.from_env`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loramux import envs

__all__ = ["DEFAULT_FETCH_TIMEOUT", "FETCH_TIMEOUT_ENV", "RESOLVERS_ENV", "REPO_LIST_ENV", "ROOT_ENV",
           "ResolverSettings", "add_resolver_arguments", "resolver_settings"]

RESOLVERS_ENV = envs.env_name("lora_resolvers")
ROOT_ENV = envs.env_name("lora_resolver_dir")
REPO_LIST_ENV = envs.env_name("lora_resolver_hf_repo_list")
FETCH_TIMEOUT_ENV = envs.env_name("lora_fetch_timeout")
# Seconds a resolver may take to find or fetch one adapter: room for a download of a few hundred
# MB, while a dead source (the Hub's client retries a refused connection for 23 s) fails in bounded time.
DEFAULT_FETCH_TIMEOUT = 60.0


def _names(value: Sequence[str] | str) -> tuple[str, ...]:
    """``"a, b"`` or ``["a", "b"]`` -> ``("a", "b")`` (blanks dropped)."""
    items = value.split(",") if isinstance(value, str) else value
    return tuple(item.strip() for item in items if item and item.strip())


@dataclass(frozen=True)
class ResolverSettings:
    """What the built-in resolvers need to know; a plugin's hook may read it too.

    :ivar order: resolver names to ask for an adapter by name, in this order (only those); None
        asks every resolver in registration order. Env ``LORAMUX_LORA_RESOLVERS``.
    :ivar directory: the filesystem resolver's root (``DIR/NAME`` or ``DIR/MODEL/NAME``); None
        registers no filesystem resolver. Env ``LORAMUX_LORA_RESOLVER_DIR``.
    :ivar hf_repos: Hub repos the Hugging Face resolver may resolve by name (``org/repo``).
        Env ``LORAMUX_LORA_RESOLVER_HF_REPO_LIST``.
    :ivar fetch_timeout: seconds a resolver may take to find or fetch one adapter; past it the
        load fails (only that adapter's requests) while the fetch ends on its own. Remote resolvers
        also give it to their client as its network timeout. Env ``LORAMUX_LORA_FETCH_TIMEOUT``.
    """

    order: tuple[str, ...] | None = None
    directory: Path | None = None
    hf_repos: tuple[str, ...] = field(default=())
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT

    def __post_init__(self) -> None:
        timeout = self.fetch_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"fetch_timeout: got {timeout!r}; allowed: seconds, a number > 0 "
                             f"(--lora-fetch-timeout, {FETCH_TIMEOUT_ENV})")
        # accept the forms a user writes (a comma list, a str path) and keep one form
        if self.order is not None:
            object.__setattr__(self, "order", _names(self.order))
        if self.directory is not None:
            object.__setattr__(self, "directory", Path(self.directory).expanduser())
        object.__setattr__(self, "hf_repos", _names(self.hf_repos))

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        order: Sequence[str] | str | None = None,
        directory: str | os.PathLike[str] | None = None,
        hf_repos: Sequence[str] | str | None = None,
        fetch_timeout: float | None = None,
    ) -> "ResolverSettings":
        """The settings given, and for each one not given (None) its environment variable.

        :param environ: the variables to take the defaults from; default: the environment as
            :mod:`loramux.envs` read it.
        """
        env = envs.current() if environ is None else envs.Envs.from_env(environ)
        return cls(
            order=env.lora_resolvers if order is None else order,
            directory=env.lora_resolver_dir if directory is None else directory,
            hf_repos=env.lora_resolver_hf_repo_list if hf_repos is None else hf_repos,
            fetch_timeout=next((t for t in (fetch_timeout, env.lora_fetch_timeout) if t is not None),
                               DEFAULT_FETCH_TIMEOUT),
        )


def add_resolver_arguments(parser: argparse.ArgumentParser) -> None:
    """The resolver settings as flags (each not given defaults to its environment variable)."""
    group = parser.add_argument_group("adapter sources")
    group.add_argument("--lora-resolver-dir", metavar="DIR",
                       help=f"find adapters by name under DIR: DIR/NAME or DIR/MODEL/NAME (env {ROOT_ENV})")
    group.add_argument("--lora-resolvers", metavar="A,B",
                       help=f"the resolvers to ask by name, in order (env {RESOLVERS_ENV}; default: all, in "
                       "registration order)")
    group.add_argument("--lora-fetch-timeout", type=float, metavar="SECONDS",
                       help="seconds a resolver may take to find or fetch one adapter; past it the load fails "
                       f"(env {FETCH_TIMEOUT_ENV}; default {DEFAULT_FETCH_TIMEOUT:g})")


def resolver_settings(args: argparse.Namespace) -> ResolverSettings:
    """The resolver flags in ``args`` as `ResolverSettings`, each one not given defaulting to its
    environment variable (nothing is written back). ``serve``'s vLLM-style ``--lora-resolver A B``
    is the same as ``--lora-resolvers A,B``."""
    order = getattr(args, "lora_resolvers", None) or getattr(args, "lora_resolver", None) or None
    return ResolverSettings.from_env(order=order, directory=getattr(args, "lora_resolver_dir", None),
                                     fetch_timeout=getattr(args, "lora_fetch_timeout", None))

"""`ResolverSettings`: where the built-in resolvers look and in which order, passed as arguments.

Settings travel from the border (the CLI's flags, ``Registry(...)``, ``LLM(...)``) down to the
resolvers as this one value: the ``register_resolvers`` hook receives it, so nothing writes
``os.environ`` for a resolver to read back. The environment variables stay the user-facing
defaults, read once by :meth:`ResolverSettings.from_env`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DEFAULT_FETCH_TIMEOUT", "FETCH_TIMEOUT_ENV", "RESOLVERS_ENV", "REPO_LIST_ENV", "ROOT_ENV",
           "ResolverSettings"]

RESOLVERS_ENV = "LORAMUX_LORA_RESOLVERS"
ROOT_ENV = "LORAMUX_LORA_RESOLVER_DIR"
REPO_LIST_ENV = "LORAMUX_LORA_RESOLVER_HF_REPO_LIST"
FETCH_TIMEOUT_ENV = "LORAMUX_LORA_FETCH_TIMEOUT"
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

        :param environ: where to read the defaults; default ``os.environ``. Read once, here.
        """
        environ = os.environ if environ is None else environ
        if order is None:
            order = environ.get(RESOLVERS_ENV) or None
        if directory is None:
            directory = environ.get(ROOT_ENV) or None
        if hf_repos is None:
            hf_repos = environ.get(REPO_LIST_ENV, "")
        if fetch_timeout is None:
            text = environ.get(FETCH_TIMEOUT_ENV, "").strip()
            try:
                fetch_timeout = float(text) if text else DEFAULT_FETCH_TIMEOUT
            except ValueError:
                raise ValueError(f"{FETCH_TIMEOUT_ENV}={text!r}: not a number of seconds") from None
        return cls(order=order, directory=directory, hf_repos=hf_repos, fetch_timeout=fetch_timeout)

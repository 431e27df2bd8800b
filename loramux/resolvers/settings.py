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

__all__ = ["RESOLVERS_ENV", "REPO_LIST_ENV", "ROOT_ENV", "ResolverSettings"]

RESOLVERS_ENV = "LORAMUX_LORA_RESOLVERS"
ROOT_ENV = "LORAMUX_LORA_RESOLVER_DIR"
REPO_LIST_ENV = "LORAMUX_LORA_RESOLVER_HF_REPO_LIST"


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
    """

    order: tuple[str, ...] | None = None
    directory: Path | None = None
    hf_repos: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
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
        return cls(order=order, directory=directory, hf_repos=hf_repos)

"""The filesystem resolver: adapters saved under one root directory.

The root is ``ResolverSettings.directory`` (``--lora-resolver-dir``, default
``$LORAMUX_LORA_RESOLVER_DIR``). An adapter called ``name``
is ``<root>/<base-model-name>/<name>`` (when the served model is known) or ``<root>/<name>``.
The name is validated and the real path (symlinks followed) must stay inside the root.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from loramux.errors import InvalidAdapterError
from loramux.plugins.hookspecs import hookimpl
from loramux.registry.request import validate_adapter_name
from loramux.resolvers.base import Resolver
from loramux.resolvers.settings import ROOT_ENV, ResolverSettings

__all__ = ["ROOT_ENV", "FilesystemResolver"]


class FilesystemResolver(Resolver):
    """Adapters in ``root``, optionally grouped in one sub-directory per base model.

    :param root: an existing directory.
    :raises NotADirectoryError: ``root`` is not a directory.
    """

    name = "filesystem"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise NotADirectoryError(f"the adapter root {str(root)!r} is not a directory")

    def describe(self) -> str:
        return f"filesystem (root {self.root})"

    def resolve(self, base_model_name: str | None, lora_name: str) -> Path | None:
        try:
            validate_adapter_name(lora_name)
        except ValueError as error:
            raise InvalidAdapterError(str(error), adapter=lora_name) from None
        for candidate in self._candidates(base_model_name, lora_name):
            if candidate.is_dir():
                return self._inside_root(candidate, lora_name)
        return None

    def _candidates(self, base_model_name: str | None, lora_name: str) -> list[Path]:
        candidates = []
        if base_model_name:
            # "org/Model", "/models/Model" and "Model" all group adapters under <root>/Model too.
            for group in dict.fromkeys([base_model_name, PurePosixPath(base_model_name).name]):
                try:
                    candidates.append(self.root / validate_adapter_name(group) / lora_name)
                except ValueError:
                    continue  # an absolute or odd model name names no group dir
        candidates.append(self.root / lora_name)
        return candidates

    def _inside_root(self, candidate: Path, lora_name: str) -> Path:
        real = candidate.resolve()
        if not real.is_relative_to(self.root):
            raise InvalidAdapterError(
                f"its directory leads outside the adapter root {str(self.root)!r} "
                f"(through a symlink, to {str(real)!r}); refused.",
                adapter=lora_name,
                path=candidate,
                fix="Copy the adapter into the root instead of linking to it from outside.",
            )
        return real


@hookimpl(tryfirst=True)
def register_resolvers(register, settings: ResolverSettings):
    """The local root goes first: the cheapest source, and the one the operator set up."""
    if settings.directory is not None:
        register(FilesystemResolver(settings.directory))

"""The resolver contract: where an adapter named by a request comes from.

A resolver is registered by a plugin through the ``register_resolvers(register)`` hook. The
registry asks resolvers in order, by name (``resolve``); a ``LoRARequest.lora_path`` that is a URI
goes to the resolver that claims its scheme (``fetch``). Both return a local adapter directory:
a remote resolver downloads into loramux's cache dir first (see :mod:`loramux.resolvers.cache`,
whose ``atomic_directory`` makes a half-downloaded adapter impossible to see).
"""

from __future__ import annotations

from pathlib import Path

from loramux.errors import AdapterNotFoundError

__all__ = ["Resolver"]


class Resolver:
    """Base class of every adapter source. Subclass it, set ``name`` (and ``schemes``), and
    override ``resolve`` and/or ``fetch``.

    :cvar name: unique among registered resolvers; users order and pick resolvers by it
        (``LORAMUX_LORA_RESOLVERS=s3,filesystem``). No commas or spaces.
    :cvar schemes: URI schemes this resolver fetches, lower case (``("s3",)`` for ``s3://…``).
        Plain local paths (and ``file://``) never reach a resolver: the registry reads them itself.
    """

    name: str = ""
    schemes: tuple[str, ...] = ()

    def resolve(self, base_model_name: str | None, lora_name: str) -> Path | None:
        """Find the adapter called ``lora_name`` and return its local directory, or None.

        :param base_model_name: the served base model, when known; a resolver may keep adapters
            per base model.
        :param lora_name: the adapter's name, already checked by
            :func:`~loramux.registry.validate_adapter_name` (no ``..``, not absolute). A resolver
            that joins it to a path or URL must still keep the result inside its root.
        :returns: a directory holding ``adapter_config.json`` and the weights, downloaded into
            the cache first if remote; None for "not mine / not here", so the next resolver is
            asked.
        :raises LoRAError: the adapter is here but cannot be had (download failed, unsafe, too
            large); the request fails with this error and no other resolver is asked.
        """
        return None

    def fetch(self, uri: str) -> Path:
        """Fetch the adapter at ``uri`` (one of ``schemes``) and return its local directory.

        :raises AdapterNotFoundError: nothing is there.
        :raises AdapterDownloadError: the download failed; nothing partial was kept.
        """
        raise AdapterNotFoundError(
            f"resolver {self.name!r} does not fetch URIs.",
            path=uri,
            fix="Give the adapter's local path, or a URI whose scheme a resolver claims.",
        )

    def describe(self) -> str:
        """One line saying where this resolver looks, for error messages and the CLI."""
        return self.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"

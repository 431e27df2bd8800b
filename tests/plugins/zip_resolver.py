"""Example resolver plugin: adapters shipped as zip archives.

By name, ``$LORAMUX_ZIP_DIR/<name>.zip``; as a URI, ``zip:///path/to/adapter.zip``. Archives are
extracted into loramux's cache with ``atomic_directory`` (a failed extraction leaves nothing), and
members that would land outside the target (``../x``, ``/etc/x``) are refused.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path, PurePosixPath

import loramux
from loramux.errors import AdapterNotFoundError, InvalidAdapterError
from loramux.resolvers import Resolver, adapters_cache_dir, atomic_directory


class ZipResolver(Resolver):
    name = "zip"
    schemes = ("zip",)

    def __init__(self, directory: str | None) -> None:
        self.directory = Path(directory) if directory else None

    def describe(self) -> str:
        return f"zip ({self.directory or 'LORAMUX_ZIP_DIR not set'})"

    def resolve(self, base_model_name, lora_name):
        if self.directory is None:
            return None
        archive = self.directory / f"{lora_name}.zip"
        return self._extract(archive, lora_name) if archive.is_file() else None

    def fetch(self, uri):
        archive = Path(uri.split("://", 1)[1])
        if not archive.is_file():
            raise AdapterNotFoundError("no such archive.", path=archive)
        return self._extract(archive, archive.stem)

    def _extract(self, archive: Path, name: str) -> Path:
        stat = archive.stat()
        target = adapters_cache_dir("zip", f"{archive.stem}-{stat.st_size}-{stat.st_mtime_ns}")
        if target.is_dir():
            return target  # extracted before; the key changes when the archive does
        with zipfile.ZipFile(archive) as bundle, atomic_directory(target) as staging:
            for member in bundle.namelist():
                parts = PurePosixPath(member).parts
                if member.startswith("/") or ".." in parts:
                    raise InvalidAdapterError(
                        f"archive member {member!r} would land outside the adapter directory.",
                        adapter=name,
                        path=archive,
                    )
            bundle.extractall(staging)
        return target


@loramux.hookimpl
def register_resolvers(register):
    register(ZipResolver(os.environ.get("LORAMUX_ZIP_DIR")))

"""loramux's cache dir, and installing a downloaded adapter into it atomically.

Remote resolvers download into ``<cache>/adapters/<source>/...``, where ``<cache>`` is
``$LORAMUX_CACHE_DIR`` or ``~/.cache/loramux``. :func:`atomic_directory` gives them a temp dir
beside the target and renames it into place only when everything is written, so a download that
fails midway (or a process killed during one) never leaves a partial adapter where a reader
would find it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loramux import envs

__all__ = ["CACHE_DIR_ENV", "adapters_cache_dir", "atomic_directory", "cache_dir"]

CACHE_DIR_ENV = envs.env_name("cache_dir")


def cache_dir() -> Path:
    """The loramux cache dir: ``$LORAMUX_CACHE_DIR``, else ``~/.cache/loramux``."""
    return envs.current().cache_dir or Path.home() / ".cache" / "loramux"


def adapters_cache_dir(*parts: str) -> Path:
    """``<cache>/adapters/<parts...>``: where downloaded adapters live."""
    return cache_dir().joinpath("adapters", *parts)


@contextmanager
def atomic_directory(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temp dir beside ``target``; on success it replaces ``target`` by renaming.

    If the block raises, the temp dir is removed and ``target`` is left as it was. An existing
    ``target`` (a stale copy) is swapped out and deleted only after the new one is in place.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield staging
        _replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _replace(staging: Path, target: Path) -> None:
    try:
        os.rename(staging, target)  # atomic; fails when target exists and is not empty
        return
    except OSError:
        if not target.exists():
            raise
    retired = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(target, retired)
    try:
        os.rename(staging, target)
    except OSError:
        os.rename(retired, target)  # put the old copy back rather than leave nothing
        raise
    shutil.rmtree(retired, ignore_errors=True)

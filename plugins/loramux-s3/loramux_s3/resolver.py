"""`S3Resolver`: adapters under an S3 prefix, downloaded atomically into loramux's cache."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from pathlib import Path, PurePosixPath

from loramux.errors import (
    AdapterDownloadError,
    AdapterNotFoundError,
    InvalidAdapterError,
    LoRAError,
)
from loramux.registry import validate_adapter_name
from loramux.registry.loader import ADAPTER_CONFIG_FILE, PICKLE_FILE, SAFETENSORS_FILE
from loramux.resolvers.base import Resolver
from loramux.resolvers.cache import adapters_cache_dir, atomic_directory

__all__ = ["DEFAULT_MAX_BYTES", "MAX_BYTES_ENV", "URI_ENV", "S3Resolver"]

URI_ENV = "LORAMUX_S3_URI"
MAX_BYTES_ENV = "LORAMUX_S3_MAX_BYTES"
DEFAULT_MAX_BYTES = 4 * 1024**3
MANIFEST_FILE = ".loramux-s3.json"  # written last: what was downloaded, with ETags and sizes
ADAPTER_FILES = (ADAPTER_CONFIG_FILE, SAFETENSORS_FILE)
_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")  # single-part uploads: the ETag is the content's MD5


def _split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> (``bucket``, ``a/b``), with every part checked like a name."""
    if not uri.startswith("s3://"):
        raise ValueError(f"{uri!r} is not an s3:// URI")
    path = uri[len("s3://") :].strip("/")
    validate_adapter_name(path)  # no '..', '.', empty or absolute parts: it becomes a cache path
    bucket, _, key = path.partition("/")
    if not key or any(not part for part in key.split("/")):
        raise ValueError(f"{uri!r} must name a prefix inside the bucket: s3://bucket/prefix")
    return bucket, key


class S3Resolver(Resolver):
    """Adapters in S3: by name under ``base_uri``, or any ``s3://`` URI.

    :param base_uri: ``s3://bucket/prefix``; the adapter ``name`` is ``<base_uri>/<name>/``.
        None: nothing is resolved by name, but ``s3://`` URIs are still fetched.
    :param max_bytes: adapters larger than this are refused before downloading.
    :param cache_dir: where downloads go; default ``<cache>/adapters/s3``.
    :param storage_options: extra ``s3fs.S3FileSystem`` arguments; credentials, region and
        endpoint otherwise come from the standard AWS settings (``AWS_ENDPOINT_URL`` included).
    :param timeout: seconds botocore waits to connect and for each read (loramux's registry
        bounds the whole fetch); None: botocore's defaults.
    """

    name = "s3"
    schemes = ("s3",)

    def __init__(
        self,
        base_uri: str | None = None,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        cache_dir: str | os.PathLike | None = None,
        storage_options: dict | None = None,
        timeout: float | None = None,
    ) -> None:
        if base_uri is not None:
            _split_uri(base_uri.rstrip("/") + "/x")  # raises ValueError for a malformed URI
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.base_uri = base_uri.rstrip("/") if base_uri else None
        self.max_bytes = max_bytes
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.storage_options = dict(storage_options or {})
        if timeout is not None:
            config = {"connect_timeout": timeout, "read_timeout": timeout}
            self.storage_options["config_kwargs"] = {**config, **self.storage_options.get("config_kwargs", {})}
        self._fs = None
        self._lock = threading.Lock()
        self._target_locks: dict[Path, threading.Lock] = {}

    def describe(self) -> str:
        return f"s3 ({self.base_uri})" if self.base_uri else f"s3 ({URI_ENV} not set)"

    @property
    def fs(self):
        """The ``s3fs.S3FileSystem``, made on first use (importing s3fs takes a while)."""
        with self._lock:
            if self._fs is None:
                import s3fs

                # No listing cache: an adapter updated on S3 must be seen as changed.
                self._fs = s3fs.S3FileSystem(
                    skip_instance_cache=True, use_listings_cache=False, **self.storage_options
                )
            return self._fs

    def resolve(self, base_model_name: str | None, lora_name: str) -> Path | None:
        if self.base_uri is None:
            return None
        validate_adapter_name(lora_name)
        try:
            return self._fetch(f"{self.base_uri}/{lora_name}", lora_name)
        except AdapterNotFoundError:
            return None

    def fetch(self, uri: str) -> Path:
        return self._fetch(uri, uri.rstrip("/").rsplit("/", 1)[-1] or uri)

    # -- downloading ---------------------------------------------------------------------------

    def _fetch(self, uri: str, name: str) -> Path:
        try:
            bucket, key = _split_uri(uri)
        except ValueError as error:
            raise InvalidAdapterError(
                str(error), adapter=name, path=uri, fix="Write s3://bucket/prefix/to/adapter."
            ) from None
        uri = f"s3://{bucket}/{key}"
        files = self._list(bucket, key, name, uri)
        target = (self.cache_dir or adapters_cache_dir("s3")).joinpath(bucket, *key.split("/"))
        manifest = {"uri": uri, "files": files}
        with self._target_lock(target):
            if self._is_current(target, manifest):
                return target
            try:
                with atomic_directory(target) as staging:
                    for filename, meta in files.items():
                        self._download_file(f"{bucket}/{key}/{filename}", staging / filename)
                        _check_download(staging / filename, meta, name, uri)
                    (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
            except LoRAError:
                raise
            except Exception as error:
                raise AdapterDownloadError(
                    f"the download failed: {type(error).__name__}: {error}",
                    adapter=name,
                    path=uri,
                    fix="Retry later; check AWS_ENDPOINT_URL, the credentials and the network. "
                    "Nothing partial was kept.",
                ) from error
        return target

    def _download_file(self, remote: str, local: Path) -> None:
        self.fs.get_file(remote, str(local))

    def _list(self, bucket: str, key: str, name: str, uri: str) -> dict[str, dict]:
        """The adapter's files on S3 with their ETags and sizes; refuses before any download."""
        try:
            entries = self.fs.ls(f"{bucket}/{key}", detail=True)
        except FileNotFoundError:
            entries = []
        except PermissionError as error:
            raise AdapterDownloadError(
                f"S3 refused access ({error}).",
                adapter=name,
                path=uri,
                fix="Check the AWS credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE) and the bucket "
                "policy.",
            ) from error
        except Exception as error:
            raise AdapterDownloadError(
                f"listing the adapter failed: {type(error).__name__}: {error}",
                adapter=name,
                path=uri,
                fix="Check AWS_ENDPOINT_URL, the credentials and the network, then retry.",
            ) from error
        found = {
            PurePosixPath(entry["name"]).name: entry
            for entry in entries
            if entry.get("type") == "file"
        }
        if ADAPTER_CONFIG_FILE not in found:
            raise AdapterNotFoundError(
                f"no {ADAPTER_CONFIG_FILE} under this S3 prefix.",
                adapter=name,
                path=uri,
                fix="Upload the folder PEFT's save_pretrained() wrote, or check the name.",
            )
        if SAFETENSORS_FILE not in found:
            pickled = (
                f" (it has {PICKLE_FILE}, which is never downloaded)"
                if PICKLE_FILE in found
                else ""
            )
            raise InvalidAdapterError(
                f"no {SAFETENSORS_FILE} under this S3 prefix{pickled}; loramux downloads "
                "safetensors only.",
                adapter=name,
                path=uri,
                fix="Re-save the adapter with PEFT's save_pretrained() (safetensors is its "
                "default) and upload it.",
            )
        files = {
            filename: {"size": int(found[filename]["size"]), "etag": _etag(found[filename])}
            for filename in ADAPTER_FILES
        }
        total = sum(meta["size"] for meta in files.values())
        if total > self.max_bytes:
            raise AdapterDownloadError(
                f"it is {total} bytes, above the limit of {self.max_bytes} bytes; not downloaded.",
                adapter=name,
                path=uri,
                fix=f"Raise {MAX_BYTES_ENV} if the adapter is meant to be this large.",
            )
        return files

    def _is_current(self, target: Path, manifest: dict) -> bool:
        """A cached copy counts only if it was finished, is intact, and S3 still holds it."""
        try:
            if json.loads((target / MANIFEST_FILE).read_text()) != manifest:
                return False
            return all(
                (target / filename).stat().st_size == meta["size"]
                for filename, meta in manifest["files"].items()
            )
        except (OSError, ValueError):
            return False

    def _target_lock(self, target: Path) -> threading.Lock:
        with self._lock:
            return self._target_locks.setdefault(target, threading.Lock())


def _etag(entry: dict) -> str:
    return str(entry.get("ETag") or entry.get("etag") or "").strip('"')


def _check_download(path: Path, meta: dict, name: str, uri: str) -> None:
    size = path.stat().st_size
    if size != meta["size"]:
        raise AdapterDownloadError(
            f"{path.name} arrived with {size} of {meta['size']} bytes.",
            adapter=name,
            path=uri,
            fix="Retry; nothing partial was kept.",
        )
    if _MD5_ETAG.match(meta["etag"]):
        digest = hashlib.md5(usedforsecurity=False)
        with open(path, "rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != meta["etag"]:
            raise AdapterDownloadError(
                f"{path.name} does not match its ETag: it changed on S3 during the download, "
                "or was corrupted.",
                adapter=name,
                path=uri,
                fix="Retry; nothing partial was kept.",
            )

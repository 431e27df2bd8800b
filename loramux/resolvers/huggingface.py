"""The Hugging Face Hub resolver: adapters in allow-listed repos, downloaded with huggingface_hub.

By name, only repos listed in ``ResolverSettings.hf_repos`` (default
``$LORAMUX_LORA_RESOLVER_HF_REPO_LIST``, ``org/a,org/b``) are looked at: ``org/a`` is the adapter at the repo's root, ``org/a/sub/dir`` one in a sub-folder.
A ``hf://org/repo[@revision][/sub/dir]`` URI given as ``lora_path`` is fetched from any repo.

Only ``adapter_config.json`` and ``adapter_model.safetensors`` are downloaded (never a pickle),
both from the same commit, into huggingface_hub's cache layout under
``<cache>/adapters/hf``: each file lands in a temp file renamed into place, and the adapter
directory is handed out only when both are there. ``HF_ENDPOINT``, ``HF_TOKEN`` and
``HF_HUB_OFFLINE`` (served from the cache only) are read at each download.

A Hub that cannot be reached at all (no such host, connection refused) is found out with one
request, no retries: huggingface_hub's client retries such a failure for 23 s before it falls
back to the cache, so the adapter is then taken from the cache alone, or refused at once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from loramux import envs
from loramux.errors import AdapterDownloadError, AdapterNotFoundError, InvalidAdapterError
from loramux.plugins.hookspecs import hookimpl
from loramux.registry.loader import ADAPTER_CONFIG_FILE, SAFETENSORS_FILE
from loramux.registry.request import validate_adapter_name
from loramux.resolvers.base import Resolver
from loramux.resolvers.cache import adapters_cache_dir
from loramux.resolvers.settings import DEFAULT_FETCH_TIMEOUT, REPO_LIST_ENV, ResolverSettings

__all__ = ["REPO_LIST_ENV", "HuggingFaceResolver"]


def _split_repo(path: str) -> tuple[str, str]:
    """``org/repo/sub/dir`` -> (``org/repo``, ``sub/dir``)."""
    parts = PurePosixPath(path).parts
    if len(parts) < 2:
        raise ValueError(f"{path!r} does not name a Hub repo as 'org/repo[/sub/dir]'")
    return "/".join(parts[:2]), "/".join(parts[2:])


class HuggingFaceResolver(Resolver):
    """Adapters on the Hugging Face Hub.

    :param repos: repos that may be resolved by name (``org/repo``); URIs are not limited.
    :param cache_dir: where downloads go; default ``<cache>/adapters/hf``.
    :param timeout: seconds huggingface_hub waits for the Hub's answer to each metadata request
        (its ``etag_timeout``; the registry bounds the whole fetch, retries included).
    """

    name = "huggingface"
    schemes = ("hf",)

    def __init__(self, repos: Sequence[str] = (), *, cache_dir: str | os.PathLike | None = None,
                 timeout: float = DEFAULT_FETCH_TIMEOUT):
        self.repos = tuple(dict.fromkeys(repo.strip().strip("/") for repo in repos if repo.strip()))
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.timeout = timeout

    def describe(self) -> str:
        if not self.repos:
            return f"huggingface (no repo allow-listed in {REPO_LIST_ENV})"
        return f"huggingface (repos {', '.join(self.repos)})"

    def resolve(self, base_model_name: str | None, lora_name: str) -> Path | None:
        try:
            repo_id, subfolder = _split_repo(validate_adapter_name(lora_name))
        except ValueError:
            return None
        if repo_id not in self.repos:
            return None
        try:
            return self.download(repo_id, subfolder, name=lora_name)
        except AdapterNotFoundError:
            return None  # the repo is allowed but holds no such adapter: ask the next resolver

    def fetch(self, uri: str) -> Path:
        path = uri.split("://", 1)[1].strip("/")
        revision = None
        head, _, rest = path.partition("/")
        repo_name, _, rest = rest.partition("/")
        if "@" in repo_name:
            repo_name, revision = repo_name.split("@", 1)
        try:
            repo_id, _ = _split_repo(validate_adapter_name(f"{head}/{repo_name}"))
            subfolder = validate_adapter_name(rest) if rest else ""
        except ValueError as error:
            raise InvalidAdapterError(
                f"{uri!r} is not a Hub adapter URI ({error}).",
                fix="Write hf://org/repo, hf://org/repo@revision or hf://org/repo/sub/dir.",
            ) from None
        return self.download(repo_id, subfolder, revision=revision, name=path)

    def download(
        self, repo_id: str, subfolder: str = "", *, revision: str | None = None, name: str
    ) -> Path:
        """Download the adapter in ``repo_id`` (at ``subfolder``) and return its local directory.

        :raises AdapterNotFoundError: no such repo, revision or adapter.
        :raises InvalidAdapterError: the adapter has no ``adapter_model.safetensors``.
        :raises AdapterDownloadError: the Hub failed, refused access, or is offline with nothing
            cached.
        """
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RemoteEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        offline, endpoint = envs.current().hf_hub_offline, envs.current().hf_endpoint
        unreachable = None if offline else self._unreachable(endpoint)
        where = (
            f"hf://{repo_id}"
            + (f"@{revision}" if revision else "")
            + (f"/{subfolder}" if subfolder else "")
        )
        prefix = f"{subfolder}/" if subfolder else ""
        options = dict(
            repo_id=repo_id,
            cache_dir=str(self.cache_dir or adapters_cache_dir("hf")),
            endpoint=endpoint,
            local_files_only=offline or unreachable is not None,
            etag_timeout=self.timeout,
        )
        try:
            config = Path(
                hf_hub_download(filename=prefix + ADAPTER_CONFIG_FILE, revision=revision, **options)
            )
            # .../snapshots/<commit>/<subfolder>/adapter_config.json: take the weights from the
            # same commit, even if the branch moves meanwhile.
            commit = config.parents[len(PurePosixPath(subfolder).parts)].name
            weights_file = prefix + SAFETENSORS_FILE
            try:
                weights = Path(hf_hub_download(filename=weights_file, revision=commit, **options))
            except RemoteEntryNotFoundError:
                raise InvalidAdapterError(
                    f"the repo has no {weights_file}; loramux downloads adapters in safetensors "
                    "format only, never pickled adapter_model.bin files.",
                    adapter=name,
                    path=where,
                    fix="Re-save the adapter with PEFT's save_pretrained() (safetensors is its "
                    "default) and upload it.",
                ) from None
        except GatedRepoError as error:
            raise AdapterDownloadError(
                f"the repo {repo_id!r} is gated ({error.__class__.__name__}).",
                adapter=name,
                path=where,
                fix="Accept its terms on the Hub and set HF_TOKEN to a token that may read it.",
            ) from error
        except RepositoryNotFoundError:
            raise AdapterNotFoundError(
                f"the Hub has no repo {repo_id!r} (or it is private).",
                adapter=name,
                path=where,
                fix="Check the name; for a private repo set HF_TOKEN.",
            ) from None
        except RevisionNotFoundError:
            raise AdapterNotFoundError(
                f"the repo {repo_id!r} has no revision {revision!r}.",
                adapter=name,
                path=where,
            ) from None
        except RemoteEntryNotFoundError:
            raise AdapterNotFoundError(
                f"the repo {repo_id!r} has no {prefix + ADAPTER_CONFIG_FILE}.",
                adapter=name,
                path=where,
                fix="Check the sub-folder: an adapter is a folder holding adapter_config.json.",
            ) from None
        except LocalEntryNotFoundError as error:
            reason = "HF_HUB_OFFLINE is set" if offline else (
                f"the Hub could not be reached ({unreachable})" if unreachable else "the Hub could not be reached")
            raise AdapterDownloadError(
                f"{reason} and the adapter is not in the cache.",
                adapter=name,
                path=where,
                fix="Unset HF_HUB_OFFLINE or check HF_ENDPOINT and the network, then retry.",
            ) from error
        except (InvalidAdapterError, AdapterNotFoundError):
            raise
        except Exception as error:  # HTTP errors, broken connections, a full disk
            raise AdapterDownloadError(
                f"the download failed: {type(error).__name__}: {error}",
                adapter=name,
                path=where,
                fix="Retry later; check HF_ENDPOINT, HF_TOKEN and the network. Nothing partial "
                "is used.",
            ) from error
        if weights.parent != config.parent:
            raise AdapterDownloadError(
                "the config and weights came from different commits.", adapter=name, path=where
            )
        return config.parent


    def _unreachable(self, endpoint: str | None) -> str | None:
        """Why the Hub at ``endpoint`` cannot be reached at all (one try, within half the
        timeout: the rest is the download's), or None if it answers (any status)."""
        from huggingface_hub import constants
        from huggingface_hub.utils import get_session

        url = endpoint or constants.ENDPOINT
        try:
            get_session().head(url, timeout=self.timeout / 2)
        except Exception as error:  # no such host, refused, no answer in time
            return f"{url}: {type(error).__name__}: {error}"
        return None


@hookimpl(trylast=True)
def register_resolvers(register, settings: ResolverSettings):
    """The Hub goes last: it is remote, and only allow-listed repos are looked at by name."""
    register(HuggingFaceResolver(settings.hf_repos, timeout=settings.fetch_timeout))

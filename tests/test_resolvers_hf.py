"""The Hugging Face Hub resolver against a real HTTP server on 127.0.0.1 speaking the Hub's file
API (``HF_ENDPOINT``), driven by the installed huggingface_hub.

``hf_hub_download`` asks ``HEAD /{repo}/resolve/{revision}/{file}`` for the commit
(``X-Repo-Commit``), the ETag and the size, then ``GET``s the same URL; errors are told apart by
``X-Error-Code``.
"""

from __future__ import annotations

import hashlib
import shutil
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest

from loramux.errors import AdapterDownloadError, AdapterNotFoundError, InvalidAdapterError
from loramux.registry import LoRARequest, Registry, load_adapter
from loramux.resolvers import HuggingFaceResolver, collect_resolvers
from conftest import setenv

TOKEN = "hf_test_token"


class Hub:
    """A small Hub: repos of files at one commit, access rules, failure switches, a request log."""

    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}
        self.requests: list[tuple[str, str, dict]] = []
        self.cut_midway: set[str] = set()  # GET sends half the body and closes the connection
        self.lock = threading.Lock()

    def add(self, repo_id: str, files: dict[str, bytes], *, private=False, gated=False) -> str:
        commit = hashlib.sha1(
            repo_id.encode() + str(sorted(files)).encode() + str(len(self.repos)).encode()
        ).hexdigest()
        self.repos[repo_id] = dict(commit=commit, files=files, private=private, gated=gated)
        return commit

    def add_adapter_dir(self, repo_id: str, directory: Path, subfolder: str = "", **access) -> str:
        files = dict(self.repos.get(repo_id, {}).get("files", {}))
        for path in directory.iterdir():
            files[f"{subfolder}/{path.name}" if subfolder else path.name] = path.read_bytes()
        return self.add(repo_id, files, **access)

    def paths_requested(self, method: str = "GET") -> list[str]:
        return [path for m, path, _ in self.requests if m == method]


def make_handler(hub: Hub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep pytest output clean
            pass

        def do_HEAD(self):
            self.serve(send_body=False)

        def do_GET(self):
            self.serve(send_body=True)

        def fail(self, status: int, code: str, commit: str | None = None):
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def serve(self, send_body: bool):
            path = unquote(self.path.split("?")[0]).lstrip("/")
            with hub.lock:
                hub.requests.append(
                    (self.command, path, {k.lower(): v for k, v in self.headers.items()})
                )
            parts = path.split("/")
            if len(parts) < 5 or parts[2] != "resolve":
                return self.fail(404, "NotFound")
            repo_id, revision, filename = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            repo = hub.repos.get(repo_id)
            authorized = self.headers.get("Authorization") == f"Bearer {TOKEN}"
            if repo is None or (repo["private"] and not authorized):
                return self.fail(401, "RepoNotFound")
            if repo["gated"] and not authorized:
                return self.fail(403, "GatedRepo")
            if revision not in ("main", repo["commit"]):
                return self.fail(404, "RevisionNotFound")
            body = repo["files"].get(filename)
            if body is None:
                return self.fail(404, "EntryNotFound", repo["commit"])
            self.send_response(200)
            self.send_header("X-Repo-Commit", repo["commit"])
            self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            if not send_body:
                return
            if filename in hub.cut_midway:
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


@pytest.fixture
def hub(monkeypatch, clean_plugin_env):
    state = Hub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    for var in ("HF_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    setenv(monkeypatch, "HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "5")
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def no_retry_waits(monkeypatch):
    """huggingface_hub waits 1, 2, 4... seconds between retries; the failures here are final."""
    import huggingface_hub.file_download
    import huggingface_hub.utils._http

    fast = types.SimpleNamespace(
        **{k: getattr(time, k) for k in dir(time) if not k.startswith("_")}
    )
    fast.sleep = lambda seconds: None
    monkeypatch.setattr(huggingface_hub.utils._http, "time", fast)
    monkeypatch.setattr(huggingface_hub.file_download, "time", fast)


@pytest.fixture(scope="module")
def adapter_dir(make_adapter):
    return make_adapter("hub-adapter")


def hub_cache(tmp_path) -> Path:
    return tmp_path / "cache" / "adapters" / "hf"


# -------------------------------------------------------------------------------------------------
# Finding and downloading
# -------------------------------------------------------------------------------------------------


def test_resolves_an_allow_listed_repo_by_name(hub, adapter_dir, tmp_path, monkeypatch):
    hub.add_adapter_dir("org/adapter", adapter_dir)
    hub.repos["org/adapter"]["files"]["README.md"] = b"docs"
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVER_HF_REPO_LIST", "org/adapter,org/other")
    registry = Registry()
    adapter = registry.get("org/adapter")
    reference = load_adapter(adapter_dir)
    assert adapter.rank == reference.rank and adapter.modules.keys() == reference.modules.keys()
    assert adapter.path.is_relative_to(hub_cache(tmp_path))
    assert registry.locate("org/adapter").resolver == "huggingface"
    # Only the two adapter files travel: never README.md, never a pickle.
    assert hub.paths_requested("GET") == [
        "org/adapter/resolve/main/adapter_config.json",
        f"org/adapter/resolve/{hub.repos['org/adapter']['commit']}/adapter_model.safetensors",
    ]


def test_resolves_an_adapter_in_a_sub_folder(hub, adapter_dir, monkeypatch):
    hub.add_adapter_dir("org/many", adapter_dir, subfolder="task/one")
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVER_HF_REPO_LIST", "org/many")
    location = Registry().locate("org/many/task/one")
    assert location.path.parts[-2:] == ("task", "one")
    assert load_adapter(location.path).rank == 8


def test_names_outside_the_allow_list_never_reach_the_network(hub, adapter_dir, monkeypatch):
    hub.add_adapter_dir("org/adapter", adapter_dir)
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVER_HF_REPO_LIST", "org/other")
    with pytest.raises(AdapterNotFoundError) as caught:
        Registry().get("org/adapter")
    assert "huggingface (repos org/other)" in str(caught.value)
    assert hub.requests == []


def test_allow_listed_repo_without_the_adapter_lets_the_registry_say_not_found(hub, monkeypatch):
    hub.add("org/empty", {"README.md": b"nothing here"})
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVER_HF_REPO_LIST", "org/empty,org/missing")
    registry = Registry()
    for name in ("org/empty", "org/empty/sub", "org/missing"):
        with pytest.raises(AdapterNotFoundError, match="no resolver found it"):
            registry.get(name)
    assert registry.list() == []


def test_a_cached_adapter_is_reused_and_served_offline(hub, adapter_dir, monkeypatch, tmp_path):
    hub.add_adapter_dir("org/adapter", adapter_dir)
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVER_HF_REPO_LIST", "org/adapter")
    first = Registry().locate("org/adapter").path
    gets = len(hub.paths_requested("GET"))
    assert Registry().locate("org/adapter").path == first
    assert len(hub.paths_requested("GET")) == gets  # nothing downloaded again
    before = len(hub.requests)
    setenv(monkeypatch, "HF_HUB_OFFLINE", "1")
    assert Registry().get("org/adapter").path == first
    assert len(hub.requests) == before  # offline: no request at all


def test_offline_without_a_cached_copy_is_a_clear_error(hub, adapter_dir, monkeypatch):
    hub.add_adapter_dir("org/adapter", adapter_dir)
    setenv(monkeypatch, "HF_HUB_OFFLINE", "1")
    registry = Registry()
    with pytest.raises(AdapterDownloadError) as caught:
        registry.get(LoRARequest("a", 1, "hf://org/adapter"))
    assert "HF_HUB_OFFLINE is set and the adapter is not in the cache" in str(caught.value)
    assert hub.requests == [] and registry.cache.names() == []


def test_hf_uri_is_fetched_from_any_repo_at_a_revision(hub, adapter_dir):
    commit = hub.add_adapter_dir("someone/adapter", adapter_dir, subfolder="v2")
    registry = Registry()  # no allow-list: URIs given by the operator are not limited
    adapter = registry.get(LoRARequest("pinned", 1, f"hf://someone/adapter@{commit}/v2"))
    assert adapter.rank == 8
    assert registry.locate("pinned").resolver == "huggingface"
    with pytest.raises(AdapterNotFoundError, match="no revision 'v9'"):
        registry.get(LoRARequest("other", 2, "hf://someone/adapter@v9/v2"))


@pytest.mark.parametrize("uri", ["hf://org", "hf://org/../x", "hf://org/repo/sub/../../x", "hf://"])
def test_malformed_hf_uris_are_refused(hub, uri):
    with pytest.raises(InvalidAdapterError, match="not a Hub adapter URI"):
        HuggingFaceResolver().fetch(uri)
    assert hub.requests == []


def test_hf_token_is_sent_for_a_private_repo(hub, adapter_dir, monkeypatch):
    hub.add_adapter_dir("org/private", adapter_dir, private=True)
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVER_HF_REPO_LIST", "org/private")
    with pytest.raises(AdapterNotFoundError, match="set HF_TOKEN"):
        HuggingFaceResolver(["org/private"]).fetch("hf://org/private")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert Registry().get("org/private").rank == 8
    assert hub.requests[0][2].get("authorization") is None
    assert all(
        headers.get("authorization") == f"Bearer {TOKEN}" for _, _, headers in hub.requests[-4:]
    )


def test_a_gated_repo_asks_for_a_token(hub, adapter_dir):
    hub.add_adapter_dir("org/gated", adapter_dir, gated=True)
    with pytest.raises(AdapterDownloadError, match="is gated") as caught:
        HuggingFaceResolver().fetch("hf://org/gated")
    assert "HF_TOKEN" in str(caught.value)


def test_pickled_weights_are_never_downloaded(hub, adapter_dir, monkeypatch, tmp_path):
    pickled = {
        "adapter_config.json": (adapter_dir / "adapter_config.json").read_bytes(),
        "adapter_model.bin": b"\x80\x04 pretend pickle",
    }
    hub.add("org/pickled", pickled)
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVER_HF_REPO_LIST", "org/pickled")
    registry = Registry()
    with pytest.raises(InvalidAdapterError, match="safetensors format only") as caught:
        registry.get("org/pickled")
    assert caught.value.adapter == "org/pickled"
    assert not any(path.endswith(".bin") for _, path, _ in hub.requests)
    assert registry.list() == []


def test_a_download_failing_midway_leaves_no_adapter_and_a_retry_works(
    hub, adapter_dir, monkeypatch, tmp_path, no_retry_waits
):
    hub.add_adapter_dir("org/flaky", adapter_dir)
    hub.cut_midway.add("adapter_model.safetensors")
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVER_HF_REPO_LIST", "org/flaky")
    registry = Registry()
    with pytest.raises(AdapterDownloadError) as caught:
        registry.get("org/flaky")
    assert caught.value.adapter == "org/flaky" and "Nothing partial is used" in str(caught.value)
    tries = [p for m, p, _ in hub.requests if m == "GET" and p.endswith(".safetensors")]
    assert len(tries) > 1  # huggingface_hub retried each broken transfer before giving up
    assert registry.list() == []
    weights = list(hub_cache(tmp_path).rglob("adapter_model.safetensors"))
    assert weights == []  # no weights file is visible in any snapshot
    hub.cut_midway.clear()
    assert registry.get("org/flaky").rank == 8


def test_an_unreachable_hub_is_a_download_error_at_once(hub, monkeypatch):
    setenv(monkeypatch, "HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on port 9
    started = time.monotonic()
    with pytest.raises(AdapterDownloadError, match=r"could not be reached \(http://127.0.0.1:9: ConnectError"):
        HuggingFaceResolver().fetch("hf://org/adapter")
    assert time.monotonic() - started < 3  # one try: huggingface_hub's own retries take 23 s


def test_an_unreachable_hub_still_serves_what_is_in_the_cache(hub, adapter_dir, monkeypatch):
    hub.add_adapter_dir("org/adapter", adapter_dir)
    path = HuggingFaceResolver().fetch("hf://org/adapter")
    setenv(monkeypatch, "HF_ENDPOINT", "http://127.0.0.1:9")
    assert HuggingFaceResolver().fetch("hf://org/adapter") == path


def test_describe_names_the_allow_list():
    assert HuggingFaceResolver(["a/b", " c/d ", ""]).describe() == "huggingface (repos a/b, c/d)"
    assert "LORAMUX_LORA_RESOLVER_HF_REPO_LIST" in HuggingFaceResolver().describe()


def test_the_plugin_reads_the_allow_list(hub, monkeypatch):
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVER_HF_REPO_LIST", "org/a, org/b")
    (resolver,) = [r for r in collect_resolvers() if r.name == "huggingface"]
    assert resolver.repos == ("org/a", "org/b")


def test_cache_layout_is_inside_the_loramux_cache(hub, adapter_dir, tmp_path):
    hub.add_adapter_dir("org/adapter", adapter_dir)
    path = HuggingFaceResolver().fetch("hf://org/adapter")
    assert path.is_relative_to(hub_cache(tmp_path))
    assert shutil.disk_usage(path)  # a real directory
    assert {p.name for p in path.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}

"""The S3 plugin (plugins/loramux-s3, installed with pip) against moto's S3 server on 127.0.0.1.

The plugin is found through its entry point, like any third-party plugin; the bucket is filled
with boto3, so the code under test only ever reads.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from loramux.errors import AdapterDownloadError, AdapterNotFoundError, InvalidAdapterError
from loramux.plugins import list_plugins, plugin_errors
from loramux.registry import LoRARequest, Registry, load_adapter
from loramux.resolvers import collect_resolvers

REPO_ROOT = Path(__file__).resolve().parents[1]
loramux_s3 = pytest.importorskip(
    "loramux_s3", reason="run `make setup`: it pip-installs ./plugins/loramux-s3"
)
from loramux_s3.resolver import MANIFEST_FILE, S3Resolver  # noqa: E402


def start_moto():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


@pytest.fixture(scope="module")
def moto_endpoint():
    server, endpoint = start_moto()
    yield endpoint
    server.stop()


@pytest.fixture
def s3(moto_endpoint, monkeypatch, clean_plugin_env):
    """A fresh bucket on the moto server, and the environment pointing at it."""
    import boto3

    for var in (
        "AWS_PROFILE",
        "AWS_SESSION_TOKEN",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # failures here are final; don't wait on retries
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    bucket = f"adapters-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    yield Bucket(client, bucket, clean_plugin_env / "adapters" / "s3" / bucket)


class Bucket:
    def __init__(self, client, name: str, cache: Path) -> None:
        self.client, self.name, self.cache = client, name, cache

    def upload_dir(self, directory: Path, prefix: str) -> str:
        for path in directory.iterdir():
            self.put(f"{prefix}/{path.name}", path.read_bytes())
        return f"s3://{self.name}/{prefix}"

    def put(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.name, Key=key, Body=body)


@pytest.fixture(scope="module")
def adapter_dir(make_adapter):
    return make_adapter("s3-adapter")


def counting_downloads(monkeypatch) -> list[str]:
    calls: list[str] = []
    original = S3Resolver._download_file

    def download(self, remote, local):
        calls.append(remote.rsplit("/", 1)[-1])
        return original(self, remote, local)

    monkeypatch.setattr(S3Resolver, "_download_file", download)
    return calls


# -------------------------------------------------------------------------------------------------
# Installed as a plugin
# -------------------------------------------------------------------------------------------------


def test_the_plugin_is_a_pip_installed_distribution_with_an_entry_point(s3):
    dist = importlib.metadata.distribution("loramux-s3")
    (entry_point,) = [ep for ep in dist.entry_points if ep.group == "loramux"]
    assert (entry_point.name, entry_point.value) == ("loramux-s3", "loramux_s3")
    assert any(req.startswith("s3fs") for req in dist.requires)
    (info,) = [info for info in list_plugins() if info.name == "loramux-s3"]
    assert info.status == "loaded" and info.hooks == ["register_resolvers"]
    (resolver,) = [r for r in collect_resolvers() if r.name == "s3"]
    assert resolver.schemes == ("s3",) and resolver.base_uri is None


def test_a_bad_base_uri_is_reported_and_loramux_carries_on(s3, monkeypatch):
    monkeypatch.setenv("LORAMUX_S3_URI", "https://not-s3/bucket")
    assert "s3" not in [r.name for r in collect_resolvers()]
    (error,) = plugin_errors()
    assert "plugin 'loramux-s3'" in str(error) and "is not an s3:// URI" in str(error)


# -------------------------------------------------------------------------------------------------
# Finding and downloading
# -------------------------------------------------------------------------------------------------


def test_resolves_a_name_under_the_base_uri(s3, adapter_dir, monkeypatch):
    s3.upload_dir(adapter_dir, "team/prod/my-adapter")
    s3.put("team/prod/my-adapter/README.md", b"not downloaded")
    monkeypatch.setenv("LORAMUX_S3_URI", f"s3://{s3.name}/team/prod/")
    registry = Registry()
    adapter = registry.get("my-adapter")
    assert adapter.rank == load_adapter(adapter_dir).rank
    target = s3.cache / "team" / "prod" / "my-adapter"
    assert adapter.path == target and registry.locate("my-adapter").resolver == "s3"
    assert sorted(p.name for p in target.iterdir()) == [
        MANIFEST_FILE,
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    manifest = json.loads((target / MANIFEST_FILE).read_text())
    assert manifest["uri"] == f"s3://{s3.name}/team/prod/my-adapter"
    assert set(manifest["files"]) == {"adapter_config.json", "adapter_model.safetensors"}


def test_an_s3_uri_is_fetched_without_a_base_uri(s3, adapter_dir):
    uri = s3.upload_dir(adapter_dir, "anywhere/x")
    registry = Registry()
    assert registry.get(LoRARequest("x", 1, uri + "/")).rank == 8
    assert registry.locate("x").resolver == "s3"


def test_a_cached_copy_is_reused_only_while_complete_and_unchanged(s3, adapter_dir, monkeypatch):
    uri = s3.upload_dir(adapter_dir, "p/a")
    downloads = counting_downloads(monkeypatch)
    path = S3Resolver().fetch(uri)
    assert downloads == ["adapter_config.json", "adapter_model.safetensors"]
    assert S3Resolver().fetch(uri) == path and len(downloads) == 2  # unchanged: reused

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    s3.put("p/a/adapter_config.json", json.dumps({**config, "lora_alpha": 32}).encode())
    assert S3Resolver().fetch(uri) == path and len(downloads) == 4  # new ETag: downloaded again
    assert load_adapter(path).lora_alpha == 32

    weights = path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a damaged cached copy
    S3Resolver().fetch(uri)
    assert len(downloads) == 6 and load_adapter(path).lora_alpha == 32
    assert os.listdir(path.parent) == ["a"]  # no temp or retired copies left


def test_a_download_failing_midway_leaves_no_partial_adapter(s3, adapter_dir, monkeypatch):
    uri = s3.upload_dir(adapter_dir, "p/flaky")
    server, endpoint = start_moto()
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    original = S3Resolver._download_file
    done = []

    def dies_after_the_first_file(self, remote, local):
        if done:
            server.stop()  # the connection goes away in the middle of the adapter
        original(self, remote, local)
        done.append(remote)

    monkeypatch.setattr(S3Resolver, "_download_file", dies_after_the_first_file)
    registry = Registry()
    with pytest.raises(AdapterDownloadError) as caught:
        registry.get(LoRARequest("flaky", 1, uri))
    assert caught.value.adapter == "flaky" and caught.value.path == uri
    assert "Nothing partial was kept" in str(caught.value)
    assert len(done) == 1  # the config arrived, the weights did not
    assert not (s3.cache / "p" / "flaky").exists()
    assert list((s3.cache / "p").iterdir()) == []  # no temp dir left behind
    assert registry.list() == ["flaky"] and registry.cache.names() == []

    monkeypatch.setattr(S3Resolver, "_download_file", original)
    healthy, healthy_endpoint = start_moto()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", healthy_endpoint)
        assert Registry().get(LoRARequest("flaky", 1, uri)).rank == 8  # a retry succeeds
    finally:
        healthy.stop()


def test_a_corrupted_transfer_is_caught_by_the_etag(s3, adapter_dir, monkeypatch):
    uri = s3.upload_dir(adapter_dir, "p/corrupt")
    original = S3Resolver._download_file

    def flips_a_byte(self, remote, local):
        original(self, remote, local)
        if remote.endswith(".safetensors"):
            data = bytearray(local.read_bytes())
            data[-1] ^= 0xFF
            local.write_bytes(bytes(data))

    monkeypatch.setattr(S3Resolver, "_download_file", flips_a_byte)
    with pytest.raises(AdapterDownloadError, match="does not match its ETag"):
        S3Resolver().fetch(uri)
    assert not (s3.cache / "p" / "corrupt").exists()


def test_concurrent_requests_download_once(s3, adapter_dir, monkeypatch):
    s3.upload_dir(adapter_dir, "base/shared")
    monkeypatch.setenv("LORAMUX_S3_URI", f"s3://{s3.name}/base")
    downloads = counting_downloads(monkeypatch)
    registry = Registry()
    results, barrier = [], threading.Barrier(4)

    def get():
        barrier.wait()
        results.append(registry.get("shared"))

    threads = [threading.Thread(target=get) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(r is results[0] for r in results)
    assert downloads == ["adapter_config.json", "adapter_model.safetensors"]


# -------------------------------------------------------------------------------------------------
# Refusals, each clear and leaving nothing behind
# -------------------------------------------------------------------------------------------------


def test_a_missing_adapter_is_not_found(s3, monkeypatch):
    monkeypatch.setenv("LORAMUX_S3_URI", f"s3://{s3.name}/base")
    with pytest.raises(AdapterNotFoundError) as caught:
        Registry().get("absent")
    assert f"s3 (s3://{s3.name}/base)" in str(caught.value)
    with pytest.raises(AdapterNotFoundError, match="no adapter_config.json under this S3 prefix"):
        S3Resolver().fetch(f"s3://{s3.name}/base/absent")
    with pytest.raises(AdapterNotFoundError):
        S3Resolver().fetch(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x")
    assert not s3.cache.exists()


def test_pickled_weights_are_refused_without_downloading(s3, adapter_dir):
    s3.put("p/pickled/adapter_config.json", (adapter_dir / "adapter_config.json").read_bytes())
    s3.put("p/pickled/adapter_model.bin", b"\x80\x04 pretend pickle")
    with pytest.raises(
        InvalidAdapterError, match="it has adapter_model.bin, which is never downloaded"
    ):
        S3Resolver().fetch(f"s3://{s3.name}/p/pickled")
    assert not s3.cache.exists()


def test_an_adapter_over_the_size_limit_is_refused_before_downloading(s3, adapter_dir, monkeypatch):
    s3.upload_dir(adapter_dir, "base/big")
    monkeypatch.setenv("LORAMUX_S3_URI", f"s3://{s3.name}/base")
    monkeypatch.setenv("LORAMUX_S3_MAX_BYTES", "1000")
    downloads = counting_downloads(monkeypatch)
    with pytest.raises(AdapterDownloadError, match="above the limit of 1000 bytes") as caught:
        Registry().get("big")
    assert "LORAMUX_S3_MAX_BYTES" in str(caught.value)
    assert downloads == [] and not s3.cache.exists()


@pytest.mark.parametrize(
    "uri",
    ["s3://bucket", "s3://bucket/a/../../x", "s3://bucket/a//b", "s3://bucket/./a", "s3://"],
)
def test_unsafe_or_malformed_uris_are_refused(s3, uri):
    with pytest.raises(InvalidAdapterError):
        S3Resolver().fetch(uri)
    assert not s3.cache.parent.exists() or list(s3.cache.parent.iterdir()) == []


def test_an_unreachable_endpoint_is_a_download_error(s3, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    with pytest.raises(AdapterDownloadError, match="listing the adapter failed"):
        S3Resolver().fetch(f"s3://{s3.name}/x")


# -------------------------------------------------------------------------------------------------
# As a new user would: the command line, in a fresh process
# -------------------------------------------------------------------------------------------------


def test_cli_lists_the_plugin_and_inspects_an_adapter_from_s3(s3, adapter_dir):
    s3.upload_dir(adapter_dir, "adapters/my-adapter")
    env = {
        **os.environ,
        "LORAMUX_S3_URI": f"s3://{s3.name}/adapters",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }

    def loramux(*args):
        return subprocess.run(
            [sys.executable, "-m", "loramux.cli", *args],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    listed = loramux("plugins")
    assert listed.returncode == 0, listed.stderr
    assert "loramux-s3 0.1.0\n  hooks: register_resolvers" in listed.stdout
    inspected = loramux("inspect", "my-adapter")
    assert inspected.returncode == 0, inspected.stderr
    out = inspected.stdout
    assert "found by    s3" in out and "rank        8" in out and "valid       yes" in out
    assert str(s3.cache / "adapters" / "my-adapter") in out

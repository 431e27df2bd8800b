"""Registry: name -> adapter through registrations and resolvers, single-flight, clear errors,
and a registry that is left as it was by every failure."""

from __future__ import annotations

import importlib.util
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from loramux.errors import (
    AdapterNotFoundError,
    CacheFullError,
    IncompatibleAdapterError,
    InvalidAdapterError,
    PluginError,
)
from loramux.registry import LoRAConfig, LoRARequest, Registry, load_adapter
from loramux.resolvers import FilesystemResolver, Resolver
from conftest import setenv

_spec = importlib.util.spec_from_file_location(
    "example_bad_plugins", Path(__file__).parent / "plugins" / "bad_plugins.py"
)
bad = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bad)


pytestmark = pytest.mark.usefixtures("clean_plugin_env")


@pytest.fixture(scope="module")
def adapters(make_adapter):
    return {
        "r8": make_adapter("r8"),
        "r4": make_adapter("r4", r=4, lora_alpha=8, seed=1),
    }


@pytest.fixture
def root(tmp_path, adapters):
    root = tmp_path / "root"
    shutil.copytree(adapters["r8"], root / "alpha")
    shutil.copytree(adapters["r4"], root / "beta")
    return root


class CountingResolver(FilesystemResolver):
    """A filesystem resolver that counts lookups and can be made slow or failing."""

    def __init__(self, root, delay: float = 0.0, error: Exception | None = None):
        super().__init__(root)
        self.calls: list[str] = []
        self.delay = delay
        self.error = error
        self._lock = threading.Lock()

    def resolve(self, base_model_name, lora_name):
        with self._lock:
            self.calls.append(lora_name)
        time.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return super().resolve(base_model_name, lora_name)


def same_weights(a, b) -> bool:
    return a.modules.keys() == b.modules.keys() and all(
        torch.equal(a.modules[k].lora_a, b.modules[k].lora_a)
        and torch.equal(a.modules[k].lora_b, b.modules[k].lora_b)
        for k in a.modules
    )


# -------------------------------------------------------------------------------------------------
# Getting adapters
# -------------------------------------------------------------------------------------------------


def test_get_resolves_on_demand_then_hits_the_cpu_tier(root):
    resolver = CountingResolver(root)
    registry = Registry(LoRAConfig(max_loras=2), resolvers=[resolver])
    adapter = registry.get("alpha")
    assert same_weights(adapter, load_adapter(root / "alpha"))
    assert adapter.name == "alpha" and adapter.path == root / "alpha"
    assert registry.get("alpha") is adapter
    assert resolver.calls == ["alpha"]
    assert registry.cache.stats.loads == 1 and registry.list() == ["alpha"]
    assert registry.locate("alpha").resolver == "filesystem"


def test_load_answers_from_the_cpu_tier_at_once_and_merges_every_load_of_a_name(root, adapters):
    """`load` does not wait: a load of a name in flight is joined (by `load` and `get` alike: one
    read), an adapter in memory is a future done at once, and a request's own error (an unsafe
    name) is its future's. Each ``pin=True`` call holds one pin on the result."""
    resolver = CountingResolver(root, delay=0.2)
    registry = Registry(LoRAConfig(max_loras=1, max_cpu_loras=1), resolvers=[resolver])
    futures = [registry.load(LoRARequest("alpha", 1), pin=True) for _ in range(3)]
    assert not any(future.done() for future in futures)  # read on a loading thread
    adapter = registry.get("alpha")  # joins the same load
    assert all(future.result(timeout=5) is adapter for future in futures) and resolver.calls == ["alpha"]
    assert registry.cache.pin_count(adapter.handle.id) == 3 and registry.cache.stats.loads == 1
    for _ in futures:
        registry.cache.unpin(adapter.handle.id)
    again = registry.load(LoRARequest("alpha", 3))
    assert again.done() and again.result() is adapter and registry.name_of_id(3) == "alpha"
    mine = registry.load(LoRARequest("mine", 7, f"{adapters['r8']}/../{adapters['r8'].name}/")).result(timeout=5)
    assert registry.load(LoRARequest("mine", 7, str(adapters["r8"]))).result() is mine  # the same path
    assert isinstance(registry.load("../up").exception(), InvalidAdapterError)
    assert resolver.calls == ["alpha"]


def test_loads_run_on_at_most_max_loading_workers_threads_that_end_when_idle(root):
    """Four names at once with ``max_loading_workers=2``: never more than two resolvers run at a
    time, every load completes, and no loading thread is left once the queue is empty."""
    for name in ("gamma", "delta"):
        shutil.copytree(root / "alpha", root / name)
    running, most, lock = [0], [0], threading.Lock()

    class Gauge(CountingResolver):
        def resolve(self, base_model_name, lora_name):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            try:
                return super().resolve(base_model_name, lora_name)
            finally:
                with lock:
                    running[0] -= 1

    resolver = Gauge(root, delay=0.1)
    registry = Registry(LoRAConfig(max_loras=4, max_loading_workers=2), resolvers=[resolver])
    futures = [registry.load(name) for name in ("alpha", "beta", "gamma", "delta")]
    assert [f.result(timeout=10).name for f in futures] == ["alpha", "beta", "gamma", "delta"]
    assert most[0] == 2 and sorted(resolver.calls) == ["alpha", "beta", "delta", "gamma"]
    deadline = time.monotonic() + 5
    while any(t.name.startswith("loramux-load") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t.name.startswith("loramux-load")]


def test_get_from_the_plugins_resolvers(root, monkeypatch):
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVER_DIR", str(root))
    registry = Registry()
    assert [r.name for r in registry.resolvers][0] == "filesystem"
    assert registry.get("beta").rank == 4


def test_get_a_request_with_a_local_path_registers_it(adapters, tmp_path):
    registry = Registry(LoRAConfig(max_loras=2), resolvers=[])
    request = LoRARequest("mine", 7, str(adapters["r4"]))
    assert registry.get(request).rank == 4
    assert registry.list() == ["mine"]
    assert registry.get("mine").rank == 4  # by name from now on
    location = registry.locate("mine")
    assert (location.path, location.source, location.resolver) == (
        adapters["r4"],
        str(adapters["r4"]),
        None,
    )


def test_file_uri_and_relative_paths_are_local(adapters, monkeypatch):
    registry = Registry(LoRAConfig(max_loras=3), resolvers=[])
    registry.register("by-uri", f"file://{adapters['r8']}")
    monkeypatch.chdir(adapters["r8"].parent)
    registry.register("relative", f"./{adapters['r8'].name}")
    monkeypatch.chdir("/")
    assert registry.get("by-uri").rank == 8 and registry.get("relative").rank == 8


def test_lora_path_uri_goes_to_the_resolver_of_its_scheme(adapters):
    fetched = []

    class Memory(Resolver):
        name, schemes = "memory", ("mem",)

        def fetch(self, uri):
            fetched.append(uri)
            return adapters["r4"]

    registry = Registry(resolvers=[Memory()])
    adapter = registry.get(LoRARequest("remote", 1, "mem://bucket/remote"))
    assert adapter.rank == 4 and fetched == ["mem://bucket/remote"]
    assert registry.locate("remote").resolver == "memory"


def test_concurrent_gets_of_a_missing_adapter_resolve_and_load_once(root):
    resolver = CountingResolver(root, delay=0.2)
    registry = Registry(resolvers=[resolver])
    results, barrier = [], threading.Barrier(8)

    def get():
        barrier.wait()
        results.append(registry.get("alpha"))

    threads = [threading.Thread(target=get) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert resolver.calls == ["alpha"]
    assert len(results) == 8 and all(result is results[0] for result in results)
    assert registry.cache.stats.loads == 1


def test_concurrent_gets_share_one_failure_and_the_next_get_retries(root):
    resolver = CountingResolver(root, delay=0.2, error=ConnectionError("simulated outage"))
    registry = Registry(resolvers=[resolver])
    errors, barrier = [], threading.Barrier(6)

    def get():
        barrier.wait()
        try:
            registry.get("alpha")
        except PluginError as error:
            errors.append(error)

    threads = [threading.Thread(target=get) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 6 and resolver.calls == ["alpha"]
    assert registry.list() == [] and registry.cache.stats.load_failures == 1
    resolver.error, resolver.delay = None, 0.0
    assert registry.get("alpha").rank == 8  # a failure is not cached


# -------------------------------------------------------------------------------------------------
# Errors, each leaving the registry as it was
# -------------------------------------------------------------------------------------------------


def test_unknown_name_lists_every_resolver_tried(root, tmp_path):
    hub = bad.NamedResolver("hub")
    registry = Registry(resolvers=[FilesystemResolver(root), hub])
    registry.get("alpha")
    with pytest.raises(AdapterNotFoundError) as caught:
        registry.get("missing")
    message = str(caught.value)
    assert message.startswith("adapter 'missing': no resolver found it (tried: ")
    assert f"filesystem (root {root})" in message and "; hub)" in message
    assert "LORAMUX_LORA_RESOLVER_DIR" in message
    assert registry.list() == ["alpha"]


def test_unknown_name_without_resolvers_says_none_is_configured():
    with pytest.raises(AdapterNotFoundError, match="no resolver is configured"):
        Registry(resolvers=[]).get("anything")


def test_a_resolver_crash_fails_only_that_request(root):
    registry = Registry(resolvers=[bad.CrashingResolver(), FilesystemResolver(root)])
    registry.register("static", root / "beta")
    with pytest.raises(PluginError) as caught:
        registry.get("alpha")
    assert "resolver 'crashing' failed in resolve(): ConnectionError: simulated" in str(
        caught.value
    )
    assert caught.value.adapter == "alpha"
    assert registry.get("static").rank == 4
    assert registry.list() == ["static"]
    with pytest.raises(PluginError, match="failed in fetch"):
        registry.get(LoRARequest("crash-uri", 1, "crash://x"))
    assert (
        Registry(
            resolvers=[bad.CrashingResolver(), FilesystemResolver(root)],
            resolver_order="filesystem",
        )
        .get("alpha")
        .rank
        == 8
    )


def test_a_resolver_returning_a_non_path_is_named(root):
    with pytest.raises(PluginError, match="resolver 'wrong-result' returned int from resolve"):
        Registry(resolvers=[bad.WrongResultResolver()]).get("alpha")


def test_a_uri_whose_scheme_no_resolver_claims(adapters):
    registry = Registry(resolvers=[bad.NamedResolver("zip", ("zip",))])
    with pytest.raises(AdapterNotFoundError) as caught:
        registry.register("remote", "s3://bucket/remote")
    assert "no resolver fetches 's3://' URIs (installed: zip://)" in str(caught.value)
    assert "pip install loramux-s3" in str(caught.value)
    with pytest.raises(AdapterNotFoundError):
        registry.get(LoRARequest("remote", 1, "s3://bucket/remote"))
    assert registry.list() == []


def test_register_a_missing_local_path_fails_at_once(tmp_path):
    registry = Registry(resolvers=[])
    with pytest.raises(AdapterNotFoundError, match="no adapter directory at this path"):
        registry.register("gone", tmp_path / "gone")
    assert registry.list() == []


@pytest.mark.parametrize("name", ["../x", "/abs", "a/./b", "", "bad\x07"])
def test_register_refuses_unsafe_names(adapters, name):
    registry = Registry(resolvers=[])
    with pytest.raises(InvalidAdapterError):
        registry.register(name, adapters["r8"])
    assert registry.list() == []


def test_a_name_keeps_its_path_unless_replaced(adapters):
    registry = Registry(LoRAConfig(max_loras=2), resolvers=[])
    registry.register("a", adapters["r8"])
    registry.register("a", adapters["r8"])  # the same again is fine
    first = registry.get("a")
    with pytest.raises(IncompatibleAdapterError, match="already registered for"):
        registry.register("a", adapters["r4"])
    with pytest.raises(IncompatibleAdapterError):
        registry.get(LoRARequest("a", 1, str(adapters["r4"])))
    assert registry.get("a") is first
    registry.register("a", adapters["r4"], replace=True)
    assert registry.get("a").rank == 4  # the old copy was dropped


def test_unregister_forgets_registration_and_loaded_copy(root, adapters):
    registry = Registry(LoRAConfig(max_loras=2), resolvers=[FilesystemResolver(root)])
    registry.register("static", adapters["r4"])
    registry.get("static")
    registry.get("alpha")
    assert registry.list() == ["alpha", "static"] and "static" in registry
    assert registry.unregister("static") is True
    assert registry.unregister("alpha") is True
    assert registry.unregister("never-seen") is False
    assert registry.list() == [] and "static" not in registry
    with pytest.raises(AdapterNotFoundError):
        registry.get("static")
    assert registry.get("alpha").rank == 8  # resolvable again


def test_an_invalid_adapter_fails_clearly_and_caches_nothing(root, tmp_path):
    broken = root / "broken"
    shutil.copytree(root / "alpha", broken)
    (broken / "adapter_config.json").write_text("{not json")
    registry = Registry(resolvers=[FilesystemResolver(root)])
    with pytest.raises(InvalidAdapterError) as caught:
        registry.get("broken")
    assert "adapter 'broken'" in str(caught.value) and "adapter_config.json" in str(caught.value)
    assert registry.list() == [] and registry.get("alpha").rank == 8


def test_rank_above_the_limit_is_incompatible(root):
    registry = Registry(LoRAConfig(max_lora_rank=4), resolvers=[FilesystemResolver(root)])
    with pytest.raises(IncompatibleAdapterError, match="max_lora_rank=4"):
        registry.get("alpha")
    assert registry.get("beta").rank == 4 and registry.list() == ["beta"]


def test_base_model_given_with_a_path_is_checked(adapters, tmp_path):
    trained_elsewhere = tmp_path / "elsewhere"
    shutil.copytree(adapters["r8"], trained_elsewhere)
    config_file = trained_elsewhere / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "base_model_name_or_path": "org/OtherModel"}))
    registry = Registry(resolvers=[])
    request = LoRARequest("elsewhere", 1, str(trained_elsewhere), base_model_name="org/MyModel")
    with pytest.raises(IncompatibleAdapterError, match="trained for base model 'org/OtherModel'"):
        registry.get(request)
    assert "elsewhere" not in registry.cache.names()


def test_validate_callback_failure_caches_nothing(root):
    def validate(adapter):
        if adapter.rank > 4:
            raise IncompatibleAdapterError("does not fit the model.", adapter=adapter.name)

    registry = Registry(resolvers=[FilesystemResolver(root)], validate=validate)
    with pytest.raises(IncompatibleAdapterError, match="does not fit"):
        registry.get("alpha")
    assert registry.list() == [] and registry.get("beta").rank == 4


def test_bad_resolver_order_is_refused_at_construction(root):
    with pytest.raises(ValueError, match="'s3', which no plugin registered"):
        Registry(resolvers=[FilesystemResolver(root)], resolver_order="s3")


def test_pin_keeps_an_adapter_resident(root):
    registry = Registry(LoRAConfig(max_loras=1), resolvers=[FilesystemResolver(root)])
    alpha = registry.get("alpha", pin=True).handle
    assert registry.cache.is_pinned(alpha.id)
    with pytest.raises(CacheFullError, match="full of adapters in use"):
        registry.get("beta")
    registry.cache.unpin(alpha.id)
    beta = registry.get("beta").handle
    assert registry.cache.handle_ids() == [beta.id]


def test_registering_a_path_for_a_name_a_resolver_found_drops_the_stale_copy(root, adapters):
    registry = Registry(LoRAConfig(max_loras=2), resolvers=[FilesystemResolver(root)])
    assert registry.get("alpha").rank == 8  # found by the resolver
    registry.get(LoRARequest("alpha", 1, str(adapters["r4"])))  # now given a path
    assert registry.get("alpha").rank == 4
    assert registry.locate("alpha").resolver is None

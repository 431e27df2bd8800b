"""One adapter identity: the registry issues a handle per load (validated once), binds the name to
it, and reload / unload rebind the name while the old handle lives on for whoever holds it."""

from __future__ import annotations

import shutil
import threading

import pytest
from safetensors.torch import load_file, save_file

from loramux.errors import AdapterNotFoundError, CacheFullError
from loramux.registry import LoRAConfig, LoRARequest, Registry, load_adapter
from loramux.resolvers import FilesystemResolver

pytestmark = pytest.mark.usefixtures("clean_plugin_env")


@pytest.fixture(scope="module")
def adapters(make_adapter):
    return {"r8": make_adapter("r8"), "r4": make_adapter("r4", r=4, lora_alpha=8, seed=1)}


@pytest.fixture
def root(tmp_path, adapters):
    root = tmp_path / "root"
    shutil.copytree(adapters["r8"], root / "alpha")
    shutil.copytree(adapters["r4"], root / "beta")
    return root


class CountingValidate:
    """The engine's validate callback, counted."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, adapter) -> None:
        with self._lock:
            self.calls.append(adapter.name)


def change_one_weight(directory) -> None:
    weights = directory / "adapter_model.safetensors"
    tensors = load_file(weights)
    key = sorted(tensors)[0]
    tensors[key][0, 0] += 1.0
    save_file(tensors, weights, metadata={"format": "pt"})


def registry_for(root, **kwargs) -> Registry:
    return Registry(kwargs.pop("config", LoRAConfig(max_loras=2)), resolvers=[FilesystemResolver(root)],
                    **kwargs)


def test_a_load_issues_a_handle_bound_to_the_name(root):
    registry = registry_for(root)
    adapter = registry.get("alpha")
    handle = adapter.handle
    assert handle is not None and handle.id > 0 and registry.handle("alpha") is handle
    assert (handle.name, handle.path, handle.rank) == ("alpha", str(root / "alpha"), 8)
    assert handle.nbytes == adapter.nbytes and handle.source == "filesystem"
    assert len(handle.digest) == 64 and handle.load_seconds > 0
    assert registry.get("alpha").handle is handle  # a hit: the same identity
    assert registry.cache.handle_ids() == [handle.id] and registry.cache.get(handle.id) is adapter
    assert registry.handle("beta") is None  # not loaded yet
    with pytest.raises(AttributeError):
        handle.id = 7  # immutable


def test_a_registered_path_is_source_path(adapters):
    registry = Registry(resolvers=[])
    assert registry.get(LoRARequest("mine", 1, str(adapters["r4"]))).handle.source == "path"


def test_handles_are_unique_in_the_process_and_never_reused(root):
    first, second = registry_for(root), registry_for(root)
    ids = [first.get("alpha").handle.id, second.get("alpha").handle.id, first.get("beta").handle.id]
    first.unregister("alpha")
    ids.append(first.get("alpha").handle.id)  # the same files again, after an unload: a new id
    assert len(set(ids)) == 4 and ids == sorted(ids)


def test_validation_runs_once_per_load_however_many_ask(root):
    validate = CountingValidate()
    registry = registry_for(root, validate=validate)
    barrier = threading.Barrier(6)
    handles = []

    def get():
        barrier.wait()
        handles.append(registry.get("alpha").handle)

    threads = [threading.Thread(target=get) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    registry.get("alpha")
    assert validate.calls == ["alpha"] and len({h.id for h in handles}) == 1
    registry.rebind("alpha")
    registry.get("beta")
    assert validate.calls == ["alpha", "alpha", "beta"]  # a reload and another adapter: one each


def test_an_evicted_adapter_read_again_keeps_its_handle_when_unchanged(root):
    validate = CountingValidate()
    registry = registry_for(root, config=LoRAConfig(max_loras=1), validate=validate)
    alpha = registry.get("alpha").handle
    registry.get("beta")  # evicts alpha from the CPU tier (one adapter fits)
    assert alpha.id not in registry.cache
    assert registry.get("alpha").handle is alpha  # same content: GPU slots keyed by it stay valid
    assert validate.calls == ["alpha", "beta", "alpha"]


def test_an_evicted_adapter_changed_on_disk_gets_a_new_handle(root):
    unbound = []
    registry = registry_for(root, config=LoRAConfig(max_loras=1), on_unbind=unbound.append)
    alpha = registry.get("alpha").handle
    registry.get("beta")
    change_one_weight(root / "alpha")
    fresh = registry.get("alpha").handle
    assert fresh.id != alpha.id and fresh.digest != alpha.digest and unbound == [alpha]


def test_reload_rebinds_the_name_and_the_old_handle_retires_at_its_last_unpin(root):
    unbound = []
    registry = registry_for(root, on_unbind=unbound.append)
    old = registry.get("alpha", pin=True).handle  # a running request holds it
    change_one_weight(root / "alpha")
    new = registry.rebind("alpha").handle
    assert new.id != old.id and new.digest != old.digest
    assert registry.handle("alpha") is new and registry.get("alpha").handle is new
    assert unbound == [old]
    assert registry.cache.get(old.id) is not None  # the running request finishes on the old weights
    registry.cache.unpin(old.id)
    assert old.id not in registry.cache and new.id in registry.cache


def test_reload_of_unchanged_content_keeps_the_handle(root):
    unbound = []
    registry = registry_for(root, on_unbind=unbound.append)
    handle = registry.get("alpha").handle
    assert registry.rebind("alpha").handle is handle and unbound == []


def test_reload_of_a_name_never_loaded_loads_it(root):
    registry = registry_for(root)
    assert registry.rebind("beta").handle is registry.handle("beta")


def test_unload_while_in_use_keeps_the_weights_until_the_last_unpin(root):
    unbound = []
    registry = registry_for(root, on_unbind=unbound.append)
    handle = registry.get("alpha", pin=True).handle
    assert registry.unregister("alpha") is True and unbound == [handle]
    assert registry.handle("alpha") is None and registry.list() == [] and "alpha" not in registry
    assert handle.id in registry.cache  # still running
    registry.cache.unpin(handle.id)
    assert handle.id not in registry.cache and len(registry.cache) == 0


def test_registering_another_path_retires_the_old_handle(root, adapters):
    registry = registry_for(root)
    old = registry.get("alpha").handle
    registry.register("alpha", adapters["r4"], replace=True)
    assert registry.handle("alpha") is None and old.id not in registry.cache
    assert registry.get("alpha").handle.rank == 4


def test_bind_serves_an_adapter_from_memory_and_holds_it(adapters, root):
    registry = registry_for(root, config=LoRAConfig(max_loras=2))
    built = load_adapter(adapters["r4"], name="built")
    served = registry.bind(built, name="in-memory")
    handle = served.handle
    assert (served.name, handle.name, handle.source, handle.path) == ("in-memory", "in-memory", "memory", None)
    assert registry.get("in-memory") is served and registry.list() == ["in-memory"]
    assert registry.cache.is_pinned(handle.id)  # nothing could read it again: never evicted
    alpha = registry.get("alpha").handle
    again = registry.bind(built, name="copy")  # evicts alpha, not the held one
    assert again.handle.digest == handle.digest and again.handle.id != handle.id
    assert registry.cache.handle_ids() == [handle.id, again.handle.id] and alpha.id not in registry.cache
    with pytest.raises(CacheFullError, match="full of adapters in use"):
        registry.bind(built, name="third")
    assert registry.list() == ["copy", "in-memory"]  # the refused bind changed nothing
    assert registry.unregister("in-memory") and handle.id not in registry.cache
    with pytest.raises(AdapterNotFoundError):
        registry.get("in-memory")


def test_names_found_by_resolvers_are_listed_while_resident_and_forgotten_under_churn(root):
    registry = registry_for(root, config=LoRAConfig(max_loras=1))
    alpha = registry.get("alpha").handle
    registry.get("beta")  # evicts alpha
    assert registry.list() == ["beta"] and "alpha" not in registry
    assert registry.get("alpha").handle is alpha  # still bound: same content, same handle
    for i in range(4 * 1 + 1024 + 1):  # more names than the map keeps for a 1-adapter tier
        registry._bindings[f"ghost{i}"] = type(registry._bindings["alpha"])()
    registry.get("beta")  # a new binding: the map is pruned of names nothing holds
    assert len(registry._bindings) == 1 and registry.list() == ["beta"]


def test_a_load_finished_after_an_unload_binds_nothing(root):
    registry = registry_for(root)
    release, started = threading.Event(), threading.Event()
    real_locate = registry.sources.locate

    def slow_locate(name, source):
        started.set()
        release.wait(5)
        return real_locate(name, source)

    registry.sources.locate = slow_locate
    results = []
    thread = threading.Thread(target=lambda: results.append(registry.get(LoRARequest("a", 1, str(root / "alpha")))))
    thread.start()
    started.wait(5)
    registry.unregister("a")
    release.set()
    thread.join(5)
    assert results[0].handle is not None  # the request that asked before the unload is served
    assert registry.handle("a") is None and registry.list() == [] and len(registry.cache) == 0

"""One name map: what /v1/models lists is what the engine serves, however many names come and go.

The server's `AdapterBook` lists a name only while the engine's registry serves it, and forgets a
name found on demand once the registry has (its adapter left the CPU tier and the registry
dropped it under churn). Driven without a model: the registry is the engine's name map, so
thousands of names pass through it in a couple of seconds.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("fastapi", reason="the serve extras are not installed: pip install -e .[serve,test]")
from loramux.registry import LoRAConfig, Registry  # noqa: E402
from loramux.resolvers import FilesystemResolver  # noqa: E402
from loramux.serving.adapters import AdapterBook  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_plugin_env")


class EveryName(FilesystemResolver):
    """Finds any name: each is the same small adapter on disk."""

    def __init__(self, path):
        super().__init__(path.parent)
        self.path = path

    def resolve(self, base_model_name, lora_name):
        return self.path


def test_models_list_and_engine_agree_after_thousands_of_names_come_and_go(make_adapter):
    path = make_adapter("every-name", r=1, target_modules=["q_proj"])
    registry = Registry(LoRAConfig(max_loras=2, max_cpu_loras=4), resolvers=[EveryName(path)])
    book = AdapterBook(["base"], registry.list)
    rng = random.Random(7)
    runtime: list[str] = []

    def listed() -> set[str]:
        return {name for name, _ in book.listed()}

    for i in range(2000):
        roll = rng.random()
        if roll < 0.8:  # a client names an adapter: found on demand, or served already
            name = f"hub-{rng.randrange(2500) if roll < 0.6 else i}"
            request = book.lookup(name)
            registry.get(request)
            book.settle(name, request, None)
        elif roll < 0.9 or not runtime:  # /v1/load_lora_adapter
            name = f"rt-{i}"
            request = book.prepare(name, str(path))
            registry.register(name, str(path), replace=True)
            registry.rebind(request)
            book.commit(name, request, source="runtime", path=str(path))
            runtime.append(name)
        else:  # /v1/unload_lora_adapter
            name = runtime.pop(rng.randrange(len(runtime)))
            book.remove(name)
            registry.unregister(name)
        if i % 250 == 249:  # no name the engine has forgotten, none it serves missing
            assert listed() == set(registry.list()) and set(runtime) <= listed()
    assert listed() == set(registry.list()) and len(registry.cache.names()) <= 4
    # the book is bounded by the engine's map (and a margin before it prunes), not by every name seen
    assert len(book._entries) <= 1024 + 1 < 2000

"""The plugin manager and the hooks: loading policy, allow-list, broken plugins, tracing.

Example plugins are real files under tests/plugins/. Entry-point plugins are made visible the way
pip makes them: a ``*.dist-info`` folder on ``sys.path`` with an ``entry_points.txt``.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest
import torch

import loramux
from loramux.errors import LoRAError, PluginError
from loramux.plugins import (
    DEFAULT_PLUGINS,
    get_plugin_manager,
    layer_from_plugins,
    list_plugins,
    plugin_errors,
    register_plugin,
    reset_plugin_manager,
)
from loramux.plugins import manager as manager_module
from loramux.registry import LoRAConfig, Registry
from loramux.resolvers import collect_resolvers
from conftest import setenv

PLUGINS_DIR = Path(__file__).parent / "plugins"


def load_plugin_file(stem: str):
    """Import tests/plugins/<stem>.py as a fresh module."""
    spec = importlib.util.spec_from_file_location(f"example_{stem}", PLUGINS_DIR / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bad = load_plugin_file("bad_plugins")
toy = load_plugin_file("toy_layer")


pytestmark = pytest.mark.usefixtures("clean_plugin_env")


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """Factory: ``installed(dist, "module[:attr]", entry_point=None)`` as ``pip install`` would."""
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.syspath_prepend(str(PLUGINS_DIR))
    monkeypatch.syspath_prepend(str(site))

    def install(dist: str, target: str, entry_point: str | None = None, version: str = "1.0"):
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[loramux]\n{entry_point or dist} = {target}\n")
        reset_plugin_manager()

    return install


def loaded_names() -> set[str]:
    return {name for name, plugin in get_plugin_manager().list_name_plugin() if plugin is not None}


# -------------------------------------------------------------------------------------------------
# Loading
# -------------------------------------------------------------------------------------------------


def test_manager_loads_once_however_many_threads_ask(monkeypatch):
    builds = []
    real_build = manager_module._build_manager

    def counting_build():
        builds.append(1)
        return real_build()

    monkeypatch.setattr(manager_module, "_build_manager", counting_build)
    managers = []
    threads = [
        threading.Thread(target=lambda: managers.append(get_plugin_manager())) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1
    assert all(manager is managers[0] for manager in managers)
    assert get_plugin_manager() is managers[0]


def test_builtins_are_plugins_registered_by_dotted_path():
    assert "loramux.resolvers.filesystem" in DEFAULT_PLUGINS
    assert "loramux.resolvers.huggingface" in DEFAULT_PLUGINS
    assert set(DEFAULT_PLUGINS) <= loaded_names()
    assert plugin_errors() == []
    listed = {info.name: info for info in list_plugins(include_builtins=True)}
    assert listed["loramux.resolvers.filesystem"].builtin
    assert listed["loramux.resolvers.filesystem"].hooks == ["register_resolvers"]
    assert not any(info.builtin for info in list_plugins())


def test_a_default_plugin_that_cannot_be_imported_is_reported_and_the_rest_load(monkeypatch):
    monkeypatch.setattr(
        manager_module, "DEFAULT_PLUGINS", DEFAULT_PLUGINS + ("loramux.engine.no_such_plugin",)
    )
    reset_plugin_manager()
    assert set(DEFAULT_PLUGINS) <= loaded_names()
    (error,) = plugin_errors()
    assert isinstance(error, PluginError)
    assert "'loramux.engine.no_such_plugin'" in str(error) and "failed to import" in str(error)
    failed = [info for info in list_plugins(include_builtins=True) if info.status == "failed"]
    assert [info.name for info in failed] == ["loramux.engine.no_such_plugin"]


def test_entry_point_plugins_load_with_their_version_and_hooks(installed):
    installed("loramux-toy", "toy_layer", version="2.5")
    assert "loramux-toy" in loaded_names()
    (info,) = [info for info in list_plugins() if info.name == "loramux-toy"]
    assert (info.version, info.distribution, info.hooks, info.status) == (
        "2.5",
        "loramux-toy",
        ["create_lora_layer"],
        "loaded",
    )


def test_s3_plugin_is_installed_with_pip_and_found_through_its_entry_point():
    info = {info.name: info for info in list_plugins()}.get("loramux-s3")
    assert info is not None, "run `make setup` (pip install -e ./plugins/loramux-s3)"
    assert info.distribution == "loramux-s3" and info.hooks == ["register_resolvers"]
    assert "s3" in [resolver.name for resolver in collect_resolvers()]


# -------------------------------------------------------------------------------------------------
# LORAMUX_PLUGINS
# -------------------------------------------------------------------------------------------------


def test_allow_list_unset_loads_every_installed_plugin(installed):
    installed("loramux-toy", "toy_layer")
    installed("loramux-zip", "zip_resolver")
    assert {"loramux-toy", "loramux-zip", "loramux-s3"} <= loaded_names()


@pytest.mark.parametrize("allowed", ["loramux-zip", "loramux_zip", " zip-ep , other-missing"])
def test_allow_list_loads_only_the_plugins_named(installed, monkeypatch, allowed):
    installed("loramux-toy", "toy_layer")
    installed("loramux-zip", "zip_resolver", entry_point="zip-ep")
    setenv(monkeypatch, "LORAMUX_PLUGINS", allowed)
    reset_plugin_manager()
    names = loaded_names()
    assert "zip-ep" in names
    assert "toy_layer" not in names and "loramux-toy" not in names and "loramux-s3" not in names
    assert set(DEFAULT_PLUGINS) <= names  # built-ins always load
    statuses = {info.name: info.status for info in list_plugins()}
    assert statuses["loramux-toy"] == "blocked" and statuses["loramux-s3"] == "blocked"
    assert "zip" in [resolver.name for resolver in collect_resolvers()]
    errors = [str(error) for error in plugin_errors()]
    if "other-missing" in allowed:
        assert (
            len(errors) == 1 and "'other-missing'" in errors[0] and "LORAMUX_PLUGINS" in errors[0]
        )
    else:
        assert errors == []


def test_empty_allow_list_loads_no_third_party_plugin_but_keeps_builtins(installed, monkeypatch):
    installed("loramux-toy", "toy_layer")
    setenv(monkeypatch, "LORAMUX_PLUGINS", "")
    reset_plugin_manager()
    assert loaded_names() == set(DEFAULT_PLUGINS)
    assert [resolver.name for resolver in collect_resolvers()] == ["huggingface"]
    assert plugin_errors() == []


# -------------------------------------------------------------------------------------------------
# Broken plugins: named, left out, and loramux carries on
# -------------------------------------------------------------------------------------------------


def test_a_plugin_that_fails_to_import_is_named_and_left_out(installed, make_adapter, tmp_path):
    installed("loramux-broken", "broken_import")
    installed("loramux-toy", "toy_layer")
    names = loaded_names()
    assert "loramux-broken" not in names and "loramux-toy" in names
    (error,) = plugin_errors()
    assert "plugin 'loramux-broken'" in str(error)
    assert "ModuleNotFoundError" in str(
        error
    ) and "loramux_dependency_that_is_not_installed" in str(error)
    (info,) = [info for info in list_plugins() if info.name == "loramux-broken"]
    assert info.status == "failed" and info.error == str(error)
    # The framework still works: resolvers, registry, layer hook.
    adapter = Registry(LoRAConfig()).get(loramux.LoRARequest("a", 1, str(make_adapter("a"))))
    assert adapter.rank == 8
    toy_layer = get_plugin_manager().get_plugin("loramux-toy")  # the module the entry point loaded
    assert isinstance(layer_from_plugins(toy_layer.ToyScale(4), "x", LoRAConfig()), torch.nn.Module)


def test_an_entry_point_that_breaks_the_contract_is_unregistered(installed):
    installed("loramux-typo", "bad_plugins:unknown_hook")
    installed("loramux-toy", "toy_layer")
    assert "loramux-typo" not in loaded_names() and "loramux-toy" in loaded_names()
    (error,) = plugin_errors()
    assert "plugin 'loramux-typo'" in str(error) and "'register_resolver'" in str(error)
    assert "known hooks: create_lora_layer, register_resolvers" in str(error)
    assert get_plugin_manager().hook.register_resolvers.get_hookimpls()  # the others still answer


@pytest.mark.parametrize(
    "plugin, expected",
    [
        (bad.DefaultArgument(), "register_resolvers's argument(s) register a default value"),
        (bad.UnknownHook(), "implements 'register_resolver', which is not a loramux hook"),
        (bad.ExtraArgument(), "cannot be registered"),
    ],
    ids=["default-argument", "unknown-hook", "extra-argument"],
)
def test_register_plugin_refuses_a_contract_breach_and_keeps_nothing(plugin, expected):
    with pytest.raises(PluginError) as caught:
        register_plugin(plugin, name="offender")
    assert "plugin 'offender'" in str(caught.value) and expected in str(caught.value)
    assert get_plugin_manager().get_plugin("offender") is None
    assert "huggingface" in [resolver.name for resolver in collect_resolvers()]


def test_an_optional_hook_from_a_newer_loramux_is_accepted(registered):
    registered(bad.FutureHook(), "future")
    assert "future" in loaded_names()


# -------------------------------------------------------------------------------------------------
# LORAMUX_TRACE_HOOKS
# -------------------------------------------------------------------------------------------------


def test_trace_env_var_prints_every_hook_call(monkeypatch, capsys, registered):
    setenv(monkeypatch, "LORAMUX_TRACE_HOOKS", "1")
    reset_plugin_manager()
    registered(toy, "toy")
    layer_from_plugins(toy.ToyScale(2), "model.scale", LoRAConfig())
    err = capsys.readouterr().err
    assert "loramux hook: create_lora_layer(base_layer=ToyScale()" in err
    assert "module_name='model.scale'" in err and "-> [toy]" in err
    assert "returned ToyScaleWithLoRA(" in err


def test_no_trace_without_the_env_var(capsys, registered):
    registered(toy, "toy")
    layer_from_plugins(toy.ToyScale(2), "model.scale", LoRAConfig())
    assert "loramux hook" not in capsys.readouterr().err


# -------------------------------------------------------------------------------------------------
# Each hook
# -------------------------------------------------------------------------------------------------


def test_hook_register_resolvers(registered, monkeypatch, tmp_path, make_adapter):
    import shutil

    zips = tmp_path / "zips"
    zips.mkdir()
    shutil.make_archive(str(zips / "zipped"), "zip", make_adapter("zipped"))
    monkeypatch.setenv("LORAMUX_ZIP_DIR", str(zips))
    zip_plugin = load_plugin_file("zip_resolver")
    registered(zip_plugin, "zip-example")

    resolvers = collect_resolvers()
    names = [resolver.name for resolver in resolvers]
    assert names.index("zip") < names.index("huggingface")  # the Hub is trylast
    registry = Registry(resolvers=resolvers)
    by_name = registry.get("zipped")
    assert by_name.rank == 8 and by_name.path.is_relative_to(
        tmp_path / "cache" / "adapters" / "zip"
    )
    by_uri = registry.get(loramux.LoRARequest("via-uri", 2, f"zip://{zips / 'zipped.zip'}"))
    assert by_uri.path == by_name.path
    assert registry.locate("zipped").resolver == "zip"


def test_hook_register_resolvers_refuses_a_zip_slip(registered, monkeypatch, tmp_path):
    import zipfile

    zips = tmp_path / "zips"
    zips.mkdir()
    with zipfile.ZipFile(zips / "evil.zip", "w") as bundle:
        bundle.writestr("../escaped.txt", "x")
    monkeypatch.setenv("LORAMUX_ZIP_DIR", str(zips))
    registered(load_plugin_file("zip_resolver"), "zip-example")
    with pytest.raises(loramux.InvalidAdapterError, match="would land outside"):
        Registry().get("evil")
    assert not (tmp_path / "cache" / "adapters" / "escaped.txt").exists()
    assert list((tmp_path / "cache" / "adapters" / "zip").iterdir()) == []


def test_hook_create_lora_layer(registered):
    config = LoRAConfig(max_loras=3)
    fallback = bad.WrapsEverything()
    registered(fallback, "fallback")
    registered(toy, "toy")
    scale = toy.ToyScale(4)
    wrapper = layer_from_plugins(scale, "model.layers.0.scale", config)
    assert isinstance(wrapper, toy.ToyScaleWithLoRA)
    assert wrapper.get_base_layer() is scale
    assert (wrapper.module_name, wrapper.lora_config) == ("model.layers.0.scale", config)
    assert fallback.calls == 0  # first result wins: trylast implementations are not asked
    linear = torch.nn.Linear(4, 4)
    other = layer_from_plugins(linear, "model.layers.0.proj", config)
    assert not isinstance(other, toy.ToyScaleWithLoRA) and other.get_base_layer() is linear


def test_create_lora_layer_returns_none_when_no_plugin_supports_the_layer(registered):
    registered(toy, "toy")
    assert layer_from_plugins(torch.nn.ReLU(), "act", LoRAConfig()) is None


def test_builtin_create_lora_layer_is_trylast():
    impls = get_plugin_manager().hook.create_lora_layer.get_hookimpls()
    builtins = [impl for impl in impls if impl.plugin_name in DEFAULT_PLUGINS]
    assert builtins, "a built-in create_lora_layer is listed in DEFAULT_PLUGINS"
    assert all(impl.trylast for impl in builtins)


@pytest.mark.parametrize(
    "offender, problem",
    [(bad.NotAWrapper(), "returned str"), (bad.RaisingLayer(), "raised RuntimeError")],
    ids=["wrong-result", "raises"],
)
def test_a_layer_plugin_breaking_the_contract_is_skipped_and_named(registered, offender, problem):
    fallback = bad.WrapsEverything()
    registered(fallback, "fallback")
    registered(offender, "offender")
    layer = torch.nn.Linear(2, 2)
    wrapper = layer_from_plugins(layer, "model.proj", LoRAConfig())
    assert wrapper.get_base_layer() is layer  # the next implementation in line answered
    (error,) = plugin_errors()
    assert (
        "plugin 'offender'" in str(error) and problem in str(error) and "'model.proj'" in str(error)
    )


def test_a_lora_error_from_a_layer_plugin_reaches_the_caller(registered):
    class Refuses:
        @loramux.hookimpl
        def create_lora_layer(self, base_layer):
            raise loramux.IncompatibleAdapterError("this layer's rank is too large.")

    registered(Refuses(), "refuses")
    with pytest.raises(LoRAError, match="rank is too large"):
        layer_from_plugins(torch.nn.Linear(2, 2), "x", LoRAConfig())

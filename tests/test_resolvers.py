"""Resolvers: the filesystem resolver and every way out of its root, collecting and ordering
resolvers from plugins (collisions name both plugins), and atomic installs into the cache."""

from __future__ import annotations

import importlib.util
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import setenv

from loramux.errors import AdapterDownloadError, InvalidAdapterError, PluginError
from loramux.plugins import plugin_errors
from loramux.registry import Registry, load_adapter
from loramux.resolvers import (
    FilesystemResolver,
    HuggingFaceResolver,
    ResolverSettings,
    adapters_cache_dir,
    atomic_directory,
    cache_dir,
    collect_resolvers,
    order_resolvers,
)

PLUGINS_DIR = Path(__file__).parent / "plugins"
_spec = importlib.util.spec_from_file_location(
    "example_bad_plugins", PLUGINS_DIR / "bad_plugins.py"
)
bad = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bad)


pytestmark = pytest.mark.usefixtures("clean_plugin_env")


@pytest.fixture(scope="module")
def adapter_dir(make_adapter):
    return make_adapter("template")


@pytest.fixture
def tree(tmp_path, adapter_dir):
    """``root/`` with adapters ``plain``, ``org/nested``, ``Model/grouped``, ``org/Model/grouped``
    and, outside the root, ``outside/secret`` (an adapter an escape would reach)."""
    root = tmp_path / "root"
    for relative in ("plain", "org/nested", "Model/grouped", "org/Model/grouped"):
        shutil.copytree(adapter_dir, root / relative)
    (root / "Model" / "grouped" / "marker").write_text("Model")
    (root / "org" / "Model" / "grouped" / "marker").write_text("org/Model")
    shutil.copytree(adapter_dir, tmp_path / "outside" / "secret")
    return root


# -------------------------------------------------------------------------------------------------
# Filesystem resolver: finding adapters
# -------------------------------------------------------------------------------------------------


def test_filesystem_finds_name_under_root(tree):
    resolver = FilesystemResolver(tree)
    assert resolver.resolve(None, "plain") == tree / "plain"
    assert resolver.resolve(None, "org/nested") == tree / "org" / "nested"
    assert resolver.resolve("AnyModel", "plain") == tree / "plain"
    assert resolver.resolve(None, "missing") is None
    assert load_adapter(resolver.resolve(None, "plain")).rank == 8


def test_filesystem_prefers_the_base_model_group(tree):
    resolver = FilesystemResolver(tree)
    assert (resolver.resolve("org/Model", "grouped") / "marker").read_text() == "org/Model"
    assert (resolver.resolve("Model", "grouped") / "marker").read_text() == "Model"
    # An absolute model path groups by its last component.
    assert (resolver.resolve("/models/Model", "grouped") / "marker").read_text() == "Model"
    assert resolver.resolve(None, "grouped") is None


def test_filesystem_root_must_exist(tmp_path):
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        FilesystemResolver(tmp_path / "missing")


def test_filesystem_hook_reads_its_root_from_the_environment(tree, monkeypatch):
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVER_DIR", str(tree))
    (resolver,) = [r for r in collect_resolvers() if r.name == "filesystem"]
    assert resolver.root == tree.resolve()
    assert Registry().get("plain").rank == 8


def test_filesystem_hook_with_a_bad_root_is_reported_and_others_carry_on(tmp_path, monkeypatch):
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVER_DIR", str(tmp_path / "nope"))
    names = [resolver.name for resolver in collect_resolvers()]
    assert "filesystem" not in names and "huggingface" in names
    (error,) = plugin_errors()
    assert "plugin 'loramux.resolvers.filesystem'" in str(error) and "nope" in str(error)


# -------------------------------------------------------------------------------------------------
# Filesystem resolver: no way out of the root
# -------------------------------------------------------------------------------------------------

ESCAPING_NAMES = [
    "..",
    "../outside/secret",
    "plain/../../outside/secret",
    "./plain",
    "/etc/passwd",
    str(Path("/") / "tmp"),
    "\\\\server\\share",
    "..\\outside\\secret",
    "C:\\Windows",
    "plain\x00",
    "plain\n",
    "",
    "   ",
    "x" * 300,
]


@pytest.mark.parametrize("name", ESCAPING_NAMES, ids=repr)
def test_filesystem_refuses_names_that_could_leave_the_root(tree, name):
    resolver = FilesystemResolver(tree)
    with pytest.raises(InvalidAdapterError):
        resolver.resolve(None, name)
    assert resolver.resolve(None, "plain") == tree / "plain"  # still works


@pytest.mark.parametrize("name", ESCAPING_NAMES, ids=repr)
def test_registry_refuses_the_same_names_before_any_resolver_sees_them(tree, name):
    seen = []

    class Spy(FilesystemResolver):
        def resolve(self, base_model_name, lora_name):
            seen.append(lora_name)
            return super().resolve(base_model_name, lora_name)

    registry = Registry(resolvers=[Spy(tree)])
    with pytest.raises(InvalidAdapterError, match="Adapter names are relative"):
        registry.get(name)
    assert seen == [] and registry.list() == []
    assert registry.get("plain").rank == 8


def test_filesystem_refuses_a_symlink_leading_out_of_the_root(tree, tmp_path):
    (tree / "linked").symlink_to(tmp_path / "outside" / "secret")
    with pytest.raises(InvalidAdapterError, match="leads outside the adapter root") as caught:
        FilesystemResolver(tree).resolve(None, "linked")
    assert caught.value.adapter == "linked"
    registry = Registry(resolvers=[FilesystemResolver(tree)])
    with pytest.raises(InvalidAdapterError):
        registry.get("linked")
    assert registry.list() == [] and registry.get("plain").rank == 8


def test_filesystem_refuses_a_symlinked_directory_on_the_way(tree, tmp_path):
    (tree / "team").symlink_to(tmp_path / "outside")
    with pytest.raises(InvalidAdapterError, match="leads outside"):
        FilesystemResolver(tree).resolve(None, "team/secret")


def test_filesystem_refuses_a_base_model_group_that_escapes(tree, tmp_path):
    resolver = FilesystemResolver(tree)
    # The model name is not used as a path when unsafe; only <root>/<name> is tried.
    assert resolver.resolve("../outside", "secret") is None
    (tree / "evil-model").symlink_to(tmp_path / "outside")
    with pytest.raises(InvalidAdapterError):
        resolver.resolve("evil-model", "secret")


def test_filesystem_follows_symlinks_that_stay_inside(tree):
    (tree / "alias").symlink_to(tree / "plain")
    assert FilesystemResolver(tree).resolve(None, "alias") == tree / "plain"


def test_filesystem_root_given_through_a_symlink_works(tree, tmp_path):
    (tmp_path / "root-link").symlink_to(tree)
    assert FilesystemResolver(tmp_path / "root-link").resolve(None, "plain") == tree / "plain"


# -------------------------------------------------------------------------------------------------
# Collecting and ordering resolvers
# -------------------------------------------------------------------------------------------------


def test_default_order_is_filesystem_then_plugins_then_the_hub(tree, monkeypatch, registered):
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVER_DIR", str(tree))
    registered(bad.Registers(bad.NamedResolver("third-party")), "third-party")
    names = [resolver.name for resolver in collect_resolvers()]
    assert names[0] == "filesystem" and names[-1] == "huggingface"
    assert names.index("third-party") < names.index("huggingface")


def test_order_resolvers_by_argument_and_the_environment_only_as_default(monkeypatch):
    a, b, c = (bad.NamedResolver(name) for name in "abc")
    assert order_resolvers([a, b, c]) == [a, b, c]
    assert order_resolvers([a, b, c], "c, a") == [c, a]
    assert order_resolvers([a, b, c], ["b"]) == [b]
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVERS", "b,a")
    assert order_resolvers([a, b, c]) == [a, b, c]  # reads no environment itself
    assert ResolverSettings.from_env().order == ("b", "a")  # the default, read at the border
    assert ResolverSettings.from_env(order="c").order == ("c",)  # an argument wins
    registry = Registry(resolvers=[a, b, c])
    assert registry.name_resolvers == [b, a]
    assert Registry(resolvers=[a, b, c], resolver_order="c").name_resolvers == [c]
    with pytest.raises(
        ValueError, match=r"'nope', which no plugin registered; registered resolvers: a, b, c"
    ):
        order_resolvers([a, b, c], "a,nope")


def test_resolver_order_decides_who_answers_a_name(tree, tmp_path, adapter_dir):
    other_root = tmp_path / "other"
    shutil.copytree(adapter_dir, other_root / "plain")

    class Other(FilesystemResolver):
        name = "other"

    first, second = FilesystemResolver(tree), Other(other_root)
    assert Registry(resolvers=[first, second]).locate("plain").path == tree / "plain"
    swapped = Registry(resolvers=[first, second], resolver_order="other,filesystem")
    assert swapped.locate("plain").path == other_root / "plain"
    assert swapped.locate("plain").resolver == "other"


def test_a_resolver_that_does_not_answer_in_time_fails_only_its_own_load(tree, tmp_path):
    """A hung source fails its load at the fetch timeout, naming the resolver and the setting,
    while another adapter loads meanwhile; the registry is as it was (the name loads later)."""
    release = threading.Event()

    class Silent(FilesystemResolver):
        name = "silent"
        schemes = ("silent",)

        def fetch(self, uri):
            release.wait(30)
            return self.root / uri.split("://", 1)[1]

    settings = ResolverSettings(fetch_timeout=0.5)
    registry = Registry(resolvers=[FilesystemResolver(tree), Silent(tree)], resolver_settings=settings)
    registry.register("hung", "silent://plain")
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        hung = pool.submit(registry.get, "hung")
        assert registry.get("plain").rank == 8  # not behind the silent source
        assert time.monotonic() - started < 0.5
        with pytest.raises(AdapterDownloadError, match=r"resolver 'silent' did not answer within 0.5 s") as caught:
            hung.result()
    assert "--lora-fetch-timeout" in str(caught.value) and time.monotonic() - started < 3
    release.set()
    assert registry.get("hung").rank == 8  # a source that answers again loads it


def test_the_fetch_timeout_comes_from_the_flag_or_the_environment(monkeypatch):
    assert ResolverSettings.from_env({}).fetch_timeout == 60
    assert ResolverSettings.from_env({"LORAMUX_LORA_FETCH_TIMEOUT": "2.5"}).fetch_timeout == 2.5
    assert ResolverSettings.from_env({"LORAMUX_LORA_FETCH_TIMEOUT": "2.5"}, fetch_timeout=9).fetch_timeout == 9
    for bad_value in ({"LORAMUX_LORA_FETCH_TIMEOUT": "soon"}, {"LORAMUX_LORA_FETCH_TIMEOUT": "0"}):
        with pytest.raises(ValueError, match="LORAMUX_LORA_FETCH_TIMEOUT|fetch_timeout"):
            ResolverSettings.from_env(bad_value)
    assert HuggingFaceResolver(timeout=3).timeout == 3


def test_two_plugins_registering_the_same_resolver_name_is_an_error_naming_both(
    tree, monkeypatch, registered
):
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVER_DIR", str(tree))
    registered(bad.Registers(bad.NamedResolver("filesystem")), "impostor")
    with pytest.raises(PluginError) as caught:
        collect_resolvers()
    message = str(caught.value)
    assert "'impostor'" in message and "'loramux.resolvers.filesystem'" in message
    assert "'filesystem'" in message and "LORAMUX_PLUGINS" in message


def test_two_resolvers_claiming_one_scheme_is_an_error_naming_both(registered):
    registered(bad.Registers(bad.NamedResolver("my-hub", ("hf",))), "second-hub")
    with pytest.raises(PluginError) as caught:
        collect_resolvers()
    message = str(caught.value)
    assert "'second-hub'" in message and "'loramux.resolvers.huggingface'" in message
    assert "'hf://'" in message


@pytest.mark.parametrize(
    "plugin, problem",
    [
        (bad.RaisingResolvers(), "RuntimeError: simulated"),
        (bad.NotAResolver(), "not a loramux Resolver"),
        (bad.Registers(bad.NamedResolver("")), "must be a non-empty string"),
        (bad.Registers(bad.NamedResolver("a,b")), "without spaces or commas"),
        (bad.Registers(bad.NamedResolver("x", "s3")), "must be a tuple"),
        (bad.Registers(bad.NamedResolver("x", ("S3",))), "lower-case"),
        (bad.Registers(bad.NamedResolver("x", ("file",))), "never 'file'"),
    ],
    ids=[
        "raises",
        "not-a-resolver",
        "empty-name",
        "comma-name",
        "str-schemes",
        "upper-scheme",
        "file",
    ],
)
def test_a_plugin_registering_badly_is_left_out_and_named(registered, plugin, problem):
    registered(bad.Registers(bad.NamedResolver("good")), "good")
    registered(plugin, "culprit")
    names = [resolver.name for resolver in collect_resolvers()]
    assert "good" in names and "huggingface" in names
    (error,) = plugin_errors()
    assert "plugin 'culprit'" in str(error) and problem in str(error)


# -------------------------------------------------------------------------------------------------
# Cache dir and atomic installs
# -------------------------------------------------------------------------------------------------


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    assert cache_dir() == tmp_path / "cache"
    assert adapters_cache_dir("s3", "b") == tmp_path / "cache" / "adapters" / "s3" / "b"
    setenv(monkeypatch, "LORAMUX_CACHE_DIR", None)
    assert cache_dir() == Path.home() / ".cache" / "loramux"


def test_atomic_directory_appears_only_when_complete(tmp_path):
    target = tmp_path / "a" / "adapter"
    with atomic_directory(target) as staging:
        (staging / "one").write_text("1")
        assert not target.exists()
    assert (target / "one").read_text() == "1"
    assert os.listdir(target.parent) == ["adapter"]


def test_atomic_directory_failure_leaves_nothing(tmp_path):
    target = tmp_path / "adapter"
    with pytest.raises(OSError, match="disk full"):
        with atomic_directory(target) as staging:
            (staging / "half").write_text("...")
            raise OSError("simulated: disk full")
    assert os.listdir(tmp_path) == []


def test_atomic_directory_replaces_a_stale_copy_and_keeps_it_on_failure(tmp_path):
    target = tmp_path / "adapter"
    with atomic_directory(target) as staging:
        (staging / "v").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as staging:
            (staging / "v").write_text("2")
            raise RuntimeError("simulated")
    assert (target / "v").read_text() == "1"
    with atomic_directory(target) as staging:
        (staging / "v").write_text("2")
    assert (target / "v").read_text() == "2"
    assert os.listdir(tmp_path) == ["adapter"]


def test_hf_resolver_is_registered_even_without_an_allow_list():
    (hub,) = [resolver for resolver in collect_resolvers() if resolver.name == "huggingface"]
    assert isinstance(hub, HuggingFaceResolver) and hub.repos == () and hub.schemes == ("hf",)
    assert hub.resolve(None, "org/repo") is None  # nothing is allow-listed: no network call

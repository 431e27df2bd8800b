"""Settings travel as arguments: the CLI's resolver and byte-budget flags reach the registry, the
engine and the CPU tier, and nothing writes ``os.environ`` on the way."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import tiny_llama, setenv

from loramux.cli import build_parser, main
from loramux.flags import parse_byte_size
from loramux.registry import Registry, default_cpu_lora_bytes
from loramux.resolvers import ResolverSettings
from loramux.resolvers.settings import resolver_settings

pytestmark = pytest.mark.usefixtures("clean_plugin_env")


@pytest.fixture
def root(tmp_path, make_adapter):
    root = tmp_path / "root"
    shutil.copytree(make_adapter("cli-settings"), root / "team" / "mine")
    return root


def test_inspect_reaches_the_resolver_through_flags_and_leaves_the_environment_alone(root, capsys):
    before = dict(os.environ)
    code = main(["inspect", "team/mine", "--lora-resolver-dir", str(root), "--lora-resolvers", "filesystem"])
    out = capsys.readouterr().out
    assert code == 0 and "found by    filesystem" in out
    assert dict(os.environ) == before


def test_a_registry_built_from_serve_flags_uses_them_and_leaves_the_environment_alone(root):
    before = dict(os.environ)
    args = build_parser().parse_args(["serve", "--lora-resolver", "filesystem", "--lora-resolver-dir", str(root)])
    settings = resolver_settings(args)
    assert settings == ResolverSettings(order=("filesystem",), directory=root)
    registry = Registry(resolver_settings=settings)
    assert [r.describe() for r in registry.name_resolvers] == [f"filesystem (root {root.resolve()})"]
    assert registry.get("team/mine").handle.source == "filesystem"
    assert dict(os.environ) == before


def test_environment_variables_are_only_the_defaults(root, tmp_path, monkeypatch):
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVER_DIR", str(tmp_path))
    setenv(monkeypatch, "LORAMUX_LORA_RESOLVERS", "huggingface")
    parse = build_parser().parse_args
    assert resolver_settings(parse(["serve"])) == ResolverSettings(order=("huggingface",), directory=tmp_path)
    flags = resolver_settings(parse(["inspect", "x", "--lora-resolver-dir", str(root), "--lora-resolvers", "a,b"]))
    assert flags == ResolverSettings(order=("a", "b"), directory=root)


@pytest.fixture
def serve_globals():
    """``serve`` configures process-wide logging and prometheus-client: put them back after."""
    import logging

    import prometheus_client

    logger = logging.getLogger("loramux")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    prometheus_client.enable_created_metrics()


@pytest.mark.usefixtures("serve_globals")
def test_serve_flags_reach_the_engine_as_arguments(root, monkeypatch, capsys):
    seen = {}

    class StopHere(ValueError):
        pass

    def fake_engine(model=None, *, config=None, **kwargs):  # serve builds an EngineConfig
        seen.update(vars(config) if config is not None else dict(kwargs, model=model))
        raise StopHere("stopped before loading a model")

    monkeypatch.setattr("loramux.engine.llm_engine.LLMEngine", fake_engine)
    before = dict(os.environ)
    code = main(["serve", "org/model", "--max-cpu-lora-bytes", "2GiB", "--lora-resolver", "filesystem",
                 "--lora-resolver-dir", str(root), "--no-async-scheduling"])
    assert code == 1 and "stopped before loading a model" in capsys.readouterr().err
    assert seen["model"] == "org/model" and seen["max_cpu_lora_bytes"] == 2 << 30
    assert seen["async_scheduling"] is False
    assert seen["resolver_settings"] == ResolverSettings(order=("filesystem",), directory=root)
    assert dict(os.environ) == before


def test_the_byte_budget_reaches_the_cpu_tier_of_the_engine(root):
    from loramux.engine.llm_engine import LLMEngine

    options = dict(enable_lora=True, max_loras=1, max_num_seqs=2, max_model_len=32)
    settings = ResolverSettings(directory=root)
    engine = LLMEngine(tiny_llama(), max_cpu_lora_bytes=12_345, resolver_settings=settings, **options)
    assert engine.registry.cache.max_bytes == 12_345
    assert engine.registry.resolver_settings == settings
    assert LLMEngine(tiny_llama(), **options).registry.cache.max_bytes == default_cpu_lora_bytes()


@pytest.mark.parametrize(
    "text, size",
    [("1073741824", 1 << 30), ("512MiB", 512 << 20), ("8gib", 8 << 30), ("2GB", 2_000_000_000),
     ("1.5G", 1_500_000_000), ("64 KiB", 64 << 10), ("100b", 100)],
)
def test_byte_sizes(text, size):
    assert parse_byte_size(text) == size


@pytest.mark.parametrize("text", ["lots", "0", "-5", "1.5XB", "", "0.1"])
def test_a_bad_byte_size_is_refused_with_the_forms_to_use(text, capsys):
    with pytest.raises(ValueError, match="size in bytes|less than 1 byte"):
        parse_byte_size(text)
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["serve", "--max-cpu-lora-bytes", text])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "--max-cpu-lora-bytes" in err


def test_settings_normalize_what_users_write(tmp_path):
    settings = ResolverSettings(order="a, b,,", directory=str(tmp_path), hf_repos="org/a, org/b")
    assert settings == ResolverSettings(order=("a", "b"), directory=Path(tmp_path), hf_repos=("org/a", "org/b"))
    assert ResolverSettings.from_env({}).order is None and ResolverSettings.from_env({}).directory is None


def test_the_pinned_reservation_takes_a_size_or_zero_and_reaches_the_engine(monkeypatch, capsys):
    from loramux.cli import main

    assert build_parser().parse_args(["serve", "--max-pinned-lora-bytes", "0"]).max_pinned_lora_bytes == 0
    assert build_parser().parse_args(["serve"]).max_pinned_lora_bytes is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-pinned-lora-bytes", "-1"])
    assert "--max-pinned-lora-bytes" in capsys.readouterr().err
    seen = {}

    def fake_engine(model=None, *, config=None, **kwargs):
        seen.update(vars(config))
        raise ValueError("stopped before loading a model")

    monkeypatch.setattr("loramux.engine.llm_engine.LLMEngine", fake_engine)
    assert main(["serve", "org/model", "--max-cpu-lora-bytes", "2GiB", "--max-pinned-lora-bytes", "1GiB"]) == 1
    assert seen["max_pinned_lora_bytes"] == 1 << 30
    assert main(["serve", "org/model", "--max-cpu-lora-bytes", "1GiB", "--max-pinned-lora-bytes", "2GiB"]) == 1
    error = capsys.readouterr().err
    assert "max_pinned_lora_bytes: got 2147483648; allowed: an int from 0 to max_cpu_lora_bytes" in error

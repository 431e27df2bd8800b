"""The ``loramux`` command: ``plugins`` and ``inspect``, run in-process through ``main(argv)``."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from loramux.cli import build_parser, main
from conftest import setenv

REPO_ROOT = Path(__file__).resolve().parents[1]
PLUGINS_DIR = Path(__file__).parent / "plugins"


pytestmark = pytest.mark.usefixtures("clean_plugin_env")


@pytest.fixture(scope="module")
def adapter_dir(make_adapter):
    return make_adapter(
        "cli-adapter", r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj"]
    )


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -------------------------------------------------------------------------------------------------
# loramux plugins
# -------------------------------------------------------------------------------------------------


def test_plugins_lists_installed_plugins_with_versions_and_hooks(capsys):
    code, out, err = run(capsys, "plugins")
    assert code == 0 and err == ""
    assert "loramux-s3 0.1.0\n  hooks: register_resolvers\n" in out
    assert "[built-in]" not in out


def test_plugins_all_includes_the_builtins(capsys):
    code, out, _ = run(capsys, "plugins", "--all")
    assert code == 0
    assert "loramux.resolvers.filesystem 0.1.0 [built-in]\n  hooks: register_resolvers" in out
    assert "loramux.resolvers.huggingface 0.1.0 [built-in]" in out


def test_plugins_json(capsys):
    code, out, _ = run(capsys, "plugins", "--json", "--all")
    plugins = {plugin["name"]: plugin for plugin in json.loads(out)}
    assert code == 0
    assert plugins["loramux-s3"] == {
        "name": "loramux-s3",
        "version": "0.1.0",
        "distribution": "loramux-s3",
        "hooks": ["register_resolvers"],
        "builtin": False,
        "status": "loaded",
        "error": None,
    }
    assert plugins["loramux.resolvers.filesystem"]["builtin"] is True


def test_plugins_with_an_empty_allow_list(capsys, monkeypatch):
    setenv(monkeypatch, "LORAMUX_PLUGINS", "")
    code, out, _ = run(capsys, "plugins")
    assert code == 0 and out == "loramux-s3 0.1.0: not loaded (not in LORAMUX_PLUGINS)\n"
    _, out, _ = run(capsys, "plugins", "--json")
    assert [p["status"] for p in json.loads(out)] == ["blocked"]  # loramux-s3, left out


def test_plugins_shows_a_broken_plugin_and_warns_about_unknown_names(capsys, monkeypatch, tmp_path):
    site = tmp_path / "site"
    (site / "loramux_broken-1.0.dist-info").mkdir(parents=True)
    (site / "loramux_broken-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: loramux-broken\nVersion: 1.0\n"
    )
    (site / "loramux_broken-1.0.dist-info" / "entry_points.txt").write_text(
        "[loramux]\nloramux-broken = broken_import\n"
    )
    monkeypatch.syspath_prepend(str(PLUGINS_DIR))
    monkeypatch.syspath_prepend(str(site))
    setenv(monkeypatch, "LORAMUX_PLUGINS", "loramux-broken,loramux-typo")
    code, out, err = run(capsys, "plugins")
    assert code == 0
    assert (
        "loramux-broken 1.0: FAILED\n  plugin 'loramux-broken' (loramux-broken 1.0) failed to load"
        in out
    )
    assert "loramux-s3 0.1.0: not loaded (not in LORAMUX_PLUGINS)" in out
    assert "loramux: warning: plugin 'loramux-typo' is named in LORAMUX_PLUGINS" in err


# -------------------------------------------------------------------------------------------------
# loramux inspect
# -------------------------------------------------------------------------------------------------


def test_inspect_a_path(capsys, adapter_dir):
    code, out, err = run(capsys, "inspect", str(adapter_dir))
    assert code == 0, err
    assert out.splitlines()[0] == "adapter     cli-adapter"
    assert "found by    local path" in out and f"directory   {adapter_dir}" in out
    assert "rank        4\n" in out and "lora_alpha  8\n" in out
    assert "targets     k_proj, o_proj, q_proj\n" in out and "modules     6\n" in out
    assert "\nparameters  1," in out and "(float32)" in out and out.endswith("valid       yes\n")


def test_inspect_json(capsys, adapter_dir):
    code, out, _ = run(capsys, "inspect", str(adapter_dir), "--json")
    report = json.loads(out)
    assert code == 0 and report["valid"] is True and report["error"] is None
    assert (report["rank"], report["lora_alpha"], report["modules"]) == (4, 8, 6)
    assert report["target_modules"] == ["k_proj", "o_proj", "q_proj"]
    assert report["parameters"] == 6 * 4 * (32 + 32) - 2 * 4 * (32 - 16)  # k_proj outputs 16
    assert report["bytes"] == report["parameters"] * 4


def test_inspect_a_name_through_the_resolver_dir_option(capsys, adapter_dir, tmp_path):
    shutil.copytree(adapter_dir, tmp_path / "root" / "team" / "mine")
    code, out, err = run(
        capsys, "inspect", "team/mine", "--lora-resolver-dir", str(tmp_path / "root")
    )
    assert code == 0, err
    assert "found by    filesystem" in out and "rank        4" in out


def test_inspect_an_unknown_name_lists_the_resolvers_tried(capsys):
    code, out, _ = run(capsys, "inspect", "nobody-has-this")
    assert code == 1
    assert "valid       no: adapter 'nobody-has-this': no resolver found it (tried: " in out
    assert "huggingface (no repo allow-listed" in out


def test_inspect_says_what_is_wrong_with_an_invalid_adapter(capsys, adapter_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(adapter_dir, broken)
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    code, out, _ = run(capsys, "inspect", str(broken), "--json")
    report = json.loads(out)
    assert code == 1 and report["valid"] is False
    assert "corrupt or truncated" in report["error"] and str(weights) in report["error"]
    assert report["path"] == str(broken)


def test_inspect_checks_rank_and_base_model_when_asked(capsys, adapter_dir, tmp_path):
    code, out, _ = run(capsys, "inspect", str(adapter_dir), "--max-lora-rank", "2")
    assert code == 1 and "above max_lora_rank=2" in out and "--max-lora-rank" in out
    config_file = tmp_path / "other" / "adapter_config.json"
    shutil.copytree(adapter_dir, config_file.parent)
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "base_model_name_or_path": "org/Trained"}))
    code, out, _ = run(capsys, "inspect", str(config_file.parent), "--model", "org/Served")
    assert code == 1 and "trained for base model 'org/Trained', not 'org/Served'" in out


@pytest.mark.parametrize("target", ["./missing-dir", "/definitely/not/here"])
def test_inspect_a_missing_path(capsys, target):
    code, out, _ = run(capsys, "inspect", target)
    assert code == 1 and "no adapter directory at this path" in out


def test_inspect_a_uri_no_plugin_handles(capsys):
    code, out, _ = run(capsys, "inspect", "ftp://host/adapter")
    assert code == 1 and "no resolver fetches 'ftp://' URIs" in out


def test_inspect_with_a_bad_resolver_order_is_a_one_line_error(capsys, adapter_dir):
    code, out, err = run(capsys, "inspect", "x", "--lora-resolvers", "nope")
    assert code == 1 and out == ""
    assert err.startswith("loramux: error: resolver order names 'nope'") and err.count("\n") == 1


# -------------------------------------------------------------------------------------------------
# The command itself
# -------------------------------------------------------------------------------------------------


def test_a_command_is_required_and_version_works(capsys):
    with pytest.raises(SystemExit) as caught:
        main([])
    assert caught.value.code == 2 and "plugins" in capsys.readouterr().err
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0 and capsys.readouterr().out.startswith("loramux ")


def test_subcommands_are_registered_in_the_parser():
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"plugins", "inspect"} <= set(subparsers.choices)


def test_the_console_script_is_main():
    from importlib.metadata import entry_points

    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "loramux"]
    assert script.value == "loramux.cli:main"
    assert sys.modules["loramux.cli"].main is main

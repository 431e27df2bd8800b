"""loramux.envs: every environment variable read in one module, once, with clear errors."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import setenv

from loramux import envs

PACKAGE = Path(__file__).resolve().parents[1] / "loramux"


def test_no_module_but_envs_reads_the_environment():
    readers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "envs.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
                    and isinstance(node.value, ast.Name) and node.value.id == "os"):
                readers.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert readers == []


def test_read_once_until_refreshed(monkeypatch):
    setenv(monkeypatch, "LORAMUX_KERNELS", "torch")
    assert envs.current().kernels == "torch"
    monkeypatch.setenv("LORAMUX_KERNELS", "triton")  # changed behind loramux's back: not read per call
    assert envs.current().kernels == "torch"
    assert envs.refresh().kernels == "triton" and envs.current().kernels == "triton"


def test_defaults_and_forms():
    defaults = envs.Envs.from_env({})
    assert defaults == envs.Envs() and defaults.kernel_warmup and defaults.plugins is None
    read = envs.Envs.from_env({"LORAMUX_KERNELS": " Torch ", "LORAMUX_KERNEL_WARMUP": "no",
                               "LORAMUX_KERNEL_WARMUP_THREADS": "0", "LORAMUX_PLUGINS": "",
                               "LORAMUX_CACHE_DIR": "~/x", "HF_HUB_OFFLINE": "YES", "LORAMUX_PDL": ""})
    assert (read.kernels, read.kernel_warmup, read.kernel_warmup_threads) == ("torch", False, 1)
    assert read.plugins == "" and read.cache_dir == Path("~/x").expanduser() and read.hf_hub_offline
    assert read.pdl is False  # empty: unset


@pytest.mark.parametrize("name, value, message", [
    ("LORAMUX_KERNELS", "cuda", "LORAMUX_KERNELS='cuda' is not understood; use 'triton', 'torch'"),
    ("LORAMUX_META_KERNEL", "yes", "LORAMUX_META_KERNEL='yes' is not understood; use 1 (on), 0 (off)"),
    ("LORAMUX_KERNEL_WARMUP_THREADS", "many", "LORAMUX_KERNEL_WARMUP_THREADS='many': not a whole number"),
    ("LORAMUX_LORA_FETCH_TIMEOUT", "soon", "LORAMUX_LORA_FETCH_TIMEOUT='soon': not a number of seconds"),
])
def test_a_value_not_understood_is_an_error_naming_the_variable(name, value, message):
    with pytest.raises(ValueError) as caught:
        envs.Envs.from_env({name: value})
    assert str(caught.value).startswith(message)


def test_the_cli_reports_a_bad_variable_in_one_line(monkeypatch, capsys):
    from loramux.cli import main

    monkeypatch.setenv("LORAMUX_KERNELS", "cuda")
    monkeypatch.setattr(envs, "_current", None)  # as at a process's start
    assert main(["plugins"]) == 1
    assert capsys.readouterr().err == (
        "loramux: error: LORAMUX_KERNELS='cuda' is not understood; use 'triton', 'torch' or leave it unset\n")

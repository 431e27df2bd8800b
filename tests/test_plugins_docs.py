"""Docs of hooks are contracts: every hook is documented under its exact signature and has a
``test_hook_<name>``, the resolver plugin of docs/plugins.md works as written, and the layer contract's
examples are the tested example plugins' code."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pluggy
import pytest

from loramux.plugins import hookspecs

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).parent


def hook_signatures() -> dict[str, str]:
    """``{name: "name(arg, ...)"}`` for every hook spec, as pluggy reads them."""
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    return {
        name: f"{name}({', '.join(caller.spec.argnames)})"
        for name, caller in vars(manager.hook).items()
        if caller.has_spec()
    }


def headings(markdown: str) -> list[str]:
    return [line.lstrip("#").strip() for line in markdown.splitlines() if line.startswith("#")]


def test_the_layer_contracts_examples_are_the_tested_plugins_code():
    """Each code block of "The LoRA layer contract" past its constructor's signature is code of
    a plugin under tests/plugins/ (tests/test_layer_plugins.py runs them against PEFT)."""
    docs = (REPO_ROOT / "docs" / "plugins.md").read_text()
    section = docs[docs.index("## The LoRA layer contract") :]
    section = section[: section.index("\n## ", 10)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)[1:]
    plugins = {stem: (TESTS / "plugins" / f"{stem}.py").read_text() for stem in ("scaled_linear_lora", "conv1x1_lora")}
    assert len(blocks) == 2
    for block, code in zip(blocks, plugins.values()):
        assert block.strip() in code, block
    from loramux.engine.layers import BaseLayerWithLoRA

    for hook in re.findall(r"^\| `(\w+)\(", section, re.MULTILINE):  # the hooks table names real methods
        assert callable(getattr(BaseLayerWithLoRA, hook)), hook


def test_there_are_hooks():
    assert set(hook_signatures()) == {"register_resolvers", "create_lora_layer"}


@pytest.mark.parametrize("name", sorted(hook_signatures()))
def test_every_hook_is_documented_under_its_exact_signature(name):
    documented = headings((REPO_ROOT / "docs" / "plugins.md").read_text())
    assert hook_signatures()[name] in documented


def test_the_docs_document_no_hook_that_does_not_exist():
    documented = headings((REPO_ROOT / "docs" / "plugins.md").read_text())
    calls = {
        heading.split("(")[0] for heading in documented if re.fullmatch(r"\w+\([\w, ]*\)", heading)
    }
    assert calls == set(hook_signatures())


@pytest.mark.parametrize("name", sorted(hook_signatures()))
def test_every_hook_has_a_test(name):
    sources = "".join(path.read_text() for path in TESTS.glob("test_plugins*.py"))
    assert re.search(rf"^def test_hook_{name}\(", sources, re.MULTILINE)


def test_every_hook_spec_has_a_full_docstring():
    for name, signature in hook_signatures().items():
        doc = inspect.getdoc(getattr(hookspecs, name))
        parameters = signature[len(name) + 1 : -1].split(", ")
        assert all(f":param {parameter}:" in doc for parameter in parameters), name
        assert ":returns:" in doc, name
    assert "Stops at first non-None result" in inspect.getdoc(hookspecs.create_lora_layer)


# -------------------------------------------------------------------------------------------------
# docs/plugins.md: "Write a resolver plugin", followed as a new user would
# -------------------------------------------------------------------------------------------------


def docs_section(title: str) -> str:
    text = (REPO_ROOT / "docs" / "plugins.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_the_docs_resolver_plugin_works_as_written(tmp_path, make_adapter):
    section = docs_section("Write a resolver plugin")
    project = tmp_path / "my-catalog"
    project.mkdir()
    for block in re.findall(r"```(?:toml|python)\n(.*?)```", section, re.DOTALL):
        first_line = block.splitlines()[0]
        relative = re.fullmatch(r"# (my-catalog/[\w.-]+)", first_line)[1]
        (tmp_path / relative).write_text(block)
    assert {p.name for p in project.iterdir()} == {"pyproject.toml", "loramux_catalog.py"}

    # `pip install ./my-catalog`, into a folder of its own (the shared environment stays as it is).
    site = tmp_path / "site"
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(project),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr

    catalog = tmp_path / "catalog.json"
    catalog.write_text(json.dumps({"support-bot": str(make_adapter("support-bot-v3"))}))
    env = {
        **os.environ,
        "LORAMUX_CATALOG": str(catalog),
        "LORAMUX_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO_ROOT)]),
    }
    for var in ("LORAMUX_PLUGINS", "LORAMUX_LORA_RESOLVERS", "LORAMUX_LORA_RESOLVER_DIR"):
        env.pop(var, None)

    def loramux(*args):
        return subprocess.run(
            [sys.executable, "-m", "loramux.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )

    assert "loramux plugins" in section and "loramux inspect support-bot" in section
    listed = loramux("plugins")
    assert listed.returncode == 0, listed.stderr
    assert "catalog 0.1.0\n  hooks: register_resolvers" in listed.stdout
    inspected = loramux("inspect", "support-bot")
    assert inspected.returncode == 0, inspected.stdout + inspected.stderr
    assert "found by    catalog" in inspected.stdout and "rank        8" in inspected.stdout
    missing = loramux("inspect", "unknown-bot")
    assert missing.returncode == 1 and f"catalog ({catalog})" in missing.stdout

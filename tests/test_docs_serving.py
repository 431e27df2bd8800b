"""docs/serving.md's `openai` client examples run as written against the embedded model and its
demo adapters (what `make serve` starts), on a free port instead of 8000."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the serve extras are not installed: pip install -e .[serve,test]")
import httpx  # noqa: E402
from test_server import Server  # noqa: E402

from loramux.serving.server import demo_adapters

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("Logprobs", "Structured outputs", "Sampling controls")


def examples() -> str:
    """The setup block, then the first python block of each section, as one script."""
    text = (REPO / "docs" / "serving.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    setup = next(b for b in blocks if "OpenAI(base_url=" in b)
    bodies = [re.search(r"```python\n(.*?)```", text.split(f"### {s}\n", 1)[1], re.S)[1] for s in SECTIONS]
    return "\n".join([setup, *bodies])


def test_serving_docs_examples_run_against_the_embedded_model(tmp_path):
    server = Server("embedded", [], dict(root=tmp_path, model=None, site=tmp_path, release=tmp_path / "release"))
    try:
        server.wait_until_listening()
        script = examples().replace("http://127.0.0.1:8000", server.url)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                                cwd=tmp_path)
        metrics = httpx.get(f"{server.url}/metrics").text
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr + server.log[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("' Paris': ") for line in lines)
    assert "{'capital': 'Tokyo', 'confidence': 'high'}" in lines
    assert lines[-1].startswith("Arr!")
    # `make serve` (no flags) sizes the adapter pool by bytes: room for every demo adapter at once,
    # so their requests share steps
    demo = [name for name, _, _ in demo_adapters()]
    assert sorted(demo) == ["capitals", "json", "pirate"]
    assert int(re.search(r'max_lora="(\d+)"', metrics)[1]) >= len(demo)
    usage = float(re.search(r'loramux_adapter_cache_usage_perc\{tier="gpu"\} (\S+)', metrics)[1])
    assert 0 < usage <= 1


def test_the_error_table_lists_every_code_the_server_sends():
    """docs/serving.md's error table and the server agree: every `code` a route can answer with is
    in the table, and every code in the table is one the server sends."""
    from loramux.serving.errors import _HTTP_CODES, _LORA_ERRORS

    text = (REPO / "docs" / "serving.md").read_text()
    table = text.split("## Errors\n", 1)[1].split("\n\n", 3)[2]
    documented = {code for row in table.splitlines()[2:] for code in re.findall(r"`(\w+)`", row.split("|")[2])}
    sent = {code for _, _, code in _LORA_ERRORS} | set(_HTTP_CODES.values())
    for source in (REPO / "loramux" / "serving").glob("*.py"):
        for expression in re.findall(r'code=("\w+"(?:\s+if\s+\w+\s+else\s+"\w+")?)', source.read_text()):
            sent |= set(re.findall(r'"(\w+)"', expression))
    assert documented == sent

"""The README's quick examples run as written (others are exercised by their sections' tests)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_block(section: str) -> str:
    """The first ```python block under the README heading ``## {section}``."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", body, re.S).group(1)


def test_load_and_inspect_snippet_prints_rank_targets_and_size():
    result = subprocess.run(
        [sys.executable, "-c", python_block("Load and inspect an adapter")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rank, rest = result.stdout.split(" ", 1)
    assert int(rank) == 8
    assert "q_proj" in rest and int(rest.split()[-1]) > 0

"""The project speaks of its code, not of its history: no ordinals of work periods, run or call
numbers, issue numbers or drafts in the code, docs, tests and tools; and every benchmark, tool or
results page the text names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ("loramux", "docs", "benchmarks", "tests", "scripts", "plugins")
SUFFIXES = {".py", ".md", ".sh", ".toml", ".yaml", ".json", ".txt"}
UNITS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth"
ORDINAL = rf"(?:{UNITS}|tenth|eleventh|twelfth|[a-z]+teenth|[a-z]+tieth|twenty[_-]?(?:{UNITS}))"
# separators: anything but a letter, so that names like runs_twentieth_call4.json count too
DIARY = {
    "an issue number": r"\bissues? #?\d+",
    "an ordinal of a work period": rf"(?<![a-z]){ORDINAL}[\s_-]+(?:session|draft)s?\b",
    "a period's ordinal": rf"(?<![a-z])(?:[a-z]+teenth|[a-z]+tieth|twenty[_-]?(?:{UNITS}))(?![a-z])",
    "a call number": r"(?<![a-z])calls?[\s_]?\d+",
    "a session": r"(?<![\"'])\bsessions?\b(?![\"'])",
    "a draft": r"\bdrafts?\b",
    "what changed": r"\bchanged from\b",
}
NAMED_FILE = re.compile(r"\b((?:docs/)?(?:benchmarks|scripts)/[\w/.-]+\.(?:py|md|json|sh|png))")


def text_files():
    yield ROOT / "README.md"
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                yield path


FILES = [p for p in text_files() if p != Path(__file__).resolve()]


@pytest.mark.parametrize("kind, pattern", DIARY.items(), ids=list(DIARY))
def test_no_diary_words(kind, pattern):
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
             for path in FILES for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if re.search(pattern, line, re.IGNORECASE)]
    assert not found, f"{kind} in the project's text (say the rule and why, not the history):\n" + "\n".join(found)


def test_the_patterns_catch_what_they_are_for():
    caught = ["issue 38 asks", "the nineteenth session", "measured in call 3", "changed from the first draft",
              "many_adapters_twentyfirst_call4.json", "a first draft", "Issue 10's crash"]
    fine = ['scope="session"', "AWS_SESSION_TOKEN", "the first call compiles", "a second run of the same trace"]
    assert all(any(re.search(p, text, re.IGNORECASE) for p in DIARY.values()) for text in caught)
    assert not any(re.search(p, text, re.IGNORECASE) for p in DIARY.values() for text in fine)


def test_every_named_benchmark_tool_and_results_page_exists():
    missing = []
    for path in FILES + [ROOT / "README.md"]:
        for name in NAMED_FILE.findall(path.read_text(errors="replace")):
            if not any((base / name).exists() for base in (ROOT, path.parent)):
                missing.append(f"{path.relative_to(ROOT)} names {name}")
    assert not missing, "\n".join(sorted(set(missing)))

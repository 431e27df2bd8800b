"""What one structured-output format may cost: size limits refused before any compile, a compile
stopped at the time limit (its child process killed), compiled grammars kept within a byte bound,
and the grammar engine's errors without its source paths. One `StructuredOutputs` for the module
(on the tiny model's character tokenizer), so the children start once."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("xgrammar", reason="the serve extras are not installed: pip install -e .[serve,test]")
from conftest import char_tokenizer  # noqa: E402

from loramux.engine.sampling_params import StructuredOutputsParams as Format  # noqa: E402
from loramux.engine.core.structured_output import (  # noqa: E402
    StructuredOutputLimitError,
    StructuredOutputLimits,
    StructuredOutputs,
    UnsupportedStructuredOutput,
)

LIMITS = StructuredOutputLimits(compile_timeout=1, cache_bytes=150_000, max_bytes=4096, max_depth=8,
                                max_enum_values=10, max_choices=10)
# 26 s to compile on the 2-core CPU machine with the 128-token test vocabulary: far past the 1 s limit
SLOW = Format(json={"type": "string", "pattern": "(ab|cd){1,10000}"})


@pytest.fixture(scope="module")
def formats():
    compiler = StructuredOutputs(char_tokenizer(), 128, [2], LIMITS)
    compiler.compile(Format(regex="[ab]+"))  # starts a child: the tests below time compiles only
    yield compiler
    compiler.close()


def trial_children() -> list[int]:
    """This process's child processes that run trial compiles."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and b"grammar_trials" in command:
            pids.append(int(stat.parent.name))
    return pids


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("spec, limit", [
    (Format(regex="a" * 5000), "max_bytes=4096"),
    (Format(json=nested(8)), "max_depth=8"),
    (Format(json={"anyOf": [{"enum": list(range(6))}, {"enum": list(range(4))}, {"const": 1}]}), "max_enum_values=10"),
    (Format(choice=[f"c{i}" for i in range(11)]), "max_choices=10"),
    (Format(structural_tag=json.dumps({"structures": [{"begin": "<a>", "schema": {"enum": ["x" * 5000]},
                                                       "end": "</a>"}], "triggers": ["<a>"]})), "max_bytes=4096"),
    (Format(structural_tag=json.dumps({"structures": [{"begin": "<a>", "schema": nested(6), "end": "</a>"}],
                                       "triggers": ["<a>"]})), "max_depth=8"),
])
def test_a_format_over_a_size_limit_is_refused_before_compiling(formats, spec, limit):
    started = time.monotonic()
    with pytest.raises(StructuredOutputLimitError, match=limit):
        formats.compile(spec)
    assert time.monotonic() - started < 0.5


def test_a_format_at_the_limits_compiles(formats):
    formats.compile(Format(json=nested(7)))  # 8 levels with the innermost schema
    formats.compile(Format(choice=[f"c{i}" for i in range(10)]))
    formats.compile(Format(json={"enum": list(range(10))}))


def fields(k: int) -> Format:
    """An object of ``k`` required string properties: its compiled grammar grows with ``k`` (about
    2.5-3.5 kB a property, by the xgrammar version), its spec stays small (34 bytes a property)."""
    names = [f"p{i}" for i in range(k)]
    return Format(json={"type": "object", "properties": {n: {"type": "string"} for n in names}, "required": names})


def test_compiled_grammars_are_kept_within_the_byte_bound_least_recently_used_first_out(formats):
    sized = [fields(k) for k in range(10, 25)]  # 25-85 kB each: a few fit the 150 kB cache
    first = formats.compile(sized[0])
    compiled = first.memory_size_bytes
    for spec in sized[1:]:
        compiled += formats.compile(spec).memory_size_bytes
        assert formats.cache_bytes <= LIMITS.cache_bytes
    assert compiled > 2 * LIMITS.cache_bytes  # so the cache had to let some go
    assert formats.compile(sized[-1]) is formats.compile(sized[-1])  # kept
    assert formats.compile(sized[0]) is not first  # pushed out, compiled again


def test_a_grammar_larger_than_the_cache_alone_is_refused(formats):
    with pytest.raises(StructuredOutputLimitError, match=f"over the limit cache_bytes={LIMITS.cache_bytes}"):
        formats.compile(fields(100))  # 245-325 kB compiled, from a spec of 3.4 kB
    assert formats.compile(fields(10)) is formats.compile(fields(10))  # the cache still serves


def test_the_grammar_engines_errors_carry_no_source_paths(formats):
    with pytest.raises(UnsupportedStructuredOutput) as caught:
        formats.compile(Format(regex="("))
    assert "parenthesis" in str(caught.value)
    assert ".cc:" not in str(caught.value) and "/project/" not in str(caught.value)
    assert not isinstance(caught.value, StructuredOutputLimitError)


@pytest.mark.parametrize("tag, words", [
    ({"structures": 5, "triggers": []}, '"structures" is a list of objects'),
    ({"structures": [1], "triggers": []}, '"structures" is a list of objects'),
    ({"structures": [{"begin": "<a>", "schema": {}}], "triggers": ["<a>"]}, '"structures" is a list of objects'),
    ({"structures": [{"begin": "<a>", "schema": {"not": {}}, "end": "</a>"}], "triggers": ["<a>"]},
     "'not' (negation) at $.structures[0].schema.not"),
    ([1, 2], "a structural tag is a JSON object, got list"),
])
def test_a_malformed_structural_tag_is_refused_by_name(formats, tag, words):
    with pytest.raises(UnsupportedStructuredOutput, match=re.escape(words)) as caught:
        formats.compile(Format(structural_tag=json.dumps(tag)))
    assert not isinstance(caught.value, StructuredOutputLimitError)


def test_limits_are_checked_when_set():
    for bad in (dict(compile_timeout=0), dict(max_depth=-1), dict(cache_bytes=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            StructuredOutputLimits(**bad)


def test_a_compile_past_the_time_limit_is_stopped_and_remembered(formats):
    """(Last: the killed child's replacement starts in the background.)"""
    running = trial_children()  # the idle child that takes the next trial
    started = time.monotonic()
    with pytest.raises(StructuredOutputLimitError, match=r"did not compile in time: over the limit compile_timeout=1 s"):
        formats.compile(SLOW)
    assert time.monotonic() - started < 1 + 1.5
    assert not set(running) & set(trial_children())  # killed, not left compiling for 26 s
    started = time.monotonic()
    with pytest.raises(StructuredOutputLimitError, match="compile_timeout"):
        formats.compile(SLOW)  # the same format again: refused without a compile
    assert time.monotonic() - started < 0.1

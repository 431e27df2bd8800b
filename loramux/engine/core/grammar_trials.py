"""Compiling a format within a time limit: a trial compile in a child process, killed at the limit.

xgrammar's compiler cannot be interrupted, and a format's size says little about its cost: on
this project's 2-core CPU machine the 47-byte schema ``{"type": "string", "pattern":
"(ab|cd){1,10000}"}`` compiled for 164 s (``{1,3000}``: 13 s), ``"maxLength": 100000`` for 4.3 s.
A compile in a thread of the server would go on burning a core long after its request was
answered. So each new format is compiled first in a child process (`TrialCompiler`), which is
killed at the limit; only a format the child compiled in time is compiled again in the server.

Why compile twice rather than bring the child's grammar back: a compiled grammar's serialized
form can be a hundred times its size in memory (a 1,000-property schema: 2.5 MB compiled, 254 MB
of JSON, 5.6 s to read back), while compiling it took 0.16 s; a format the child compiled in
time compiles in about that time again. The children also keep a crash in the grammar engine
(a C++ abort on a hostile format) out of the server: it ends the trial, not the server.

This file runs as the child's program too (``python grammar_trials.py``), so it imports nothing
of loramux: the child needs only xgrammar.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

__all__ = ["TrialCompiler", "TrialTimeout", "compile_format"]

# JSON is laid out as json.dumps(indent=2) writes it: instruction-tuned models write indented JSON
# (forcing the compact form pushes them off their distribution), and a fixed layout, unlike free
# whitespace, leaves no room to loop on blank lines. (xgrammar lays out the properties a schema
# declares; free-form objects and arrays come on one line, with ", " and ": " separators.)
JSON_LAYOUT = dict(any_whitespace=False, indent=2)
# disable_any_whitespace (vLLM's): one line, with xgrammar's default separators ", " and ": "
ONE_LINE_JSON = dict(any_whitespace=False)
_COMPILER_THREADS = 2
# A child's start (importing xgrammar, reading the tokenizer) is not a compile: it has its own bound.
_START_TIMEOUT_S = 300.0


def compile_format(compiler: Any, kind: str, text: str, one_line: bool = False) -> Any:
    """Compile one format, as ``StructuredOutputsParams.key()`` describes it (``one_line``: JSON
    on one line, vLLM's ``disable_any_whitespace``), with an xgrammar ``GrammarCompiler``."""
    import xgrammar as xgr

    layout = ONE_LINE_JSON if one_line else JSON_LAYOUT
    if kind == "json":
        return compiler.compile_json_schema(text, **layout)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', **layout)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        ebnf = "root ::= " + " | ".join(json.dumps(choice) for choice in json.loads(text))
        return compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf))
    if kind == "structural_tag":
        tag = json.loads(text)
        if "structures" in tag:  # vLLM's form; else xgrammar's own
            items = [xgr.StructuralTagItem(begin=item["begin"], schema=json.dumps(item.get("schema", {})),
                                           end=item["end"]) for item in tag["structures"]]
            return compiler.compile_structural_tag(items, tag.get("triggers", []))
        return compiler.compile_structural_tag(text)
    return compiler.compile_grammar(text)


def new_compiler(tokenizer_info: Any) -> Any:
    """The ``GrammarCompiler`` the server and the children use alike (so a trial's time predicts
    the server's); the cache is loramux's, bounded by bytes."""
    import xgrammar as xgr

    return xgr.GrammarCompiler(tokenizer_info, max_threads=_COMPILER_THREADS, cache_enabled=False)


class TrialTimeout(Exception):
    """The trial compile ran past the time limit (its child was killed)."""


class _Child:
    """One child process, ready for trials; started with the tokenizer's xgrammar description."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, encoding="utf-8")
        timer = threading.Timer(_START_TIMEOUT_S, self.kill)
        timer.start()
        try:
            self.process.stdin.write(json.dumps(tokenizer_info_json) + "\n")
            self.process.stdin.flush()
            ready = self.process.stdout.readline()
        except OSError:
            ready = ""
        finally:
            timer.cancel()
        if not ready:
            self.kill()
            raise RuntimeError("the grammar compiler's child process did not start (is xgrammar installed?)")

    def compile(self, kind: str, text: str, one_line: bool, timeout: float) -> dict:
        """The child's answer for one format; killed past ``timeout`` seconds."""
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            self.kill()

        timer = threading.Timer(timeout, expire)
        timer.start()
        try:
            self.process.stdin.write(json.dumps([kind, text, one_line]) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except OSError:  # killed while writing
            line = ""
        finally:
            timer.cancel()
        if line:
            return json.loads(line)
        self.kill()
        if expired.is_set():
            raise TrialTimeout
        return {"error": "the grammar engine crashed on this format"}

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class TrialCompiler:
    """Compiles formats in at most ``workers`` child processes at once, each trial killed past
    ``timeout`` seconds; children start on first use and stay for the next trials.

    :param tokenizer_info_json: ``xgrammar.TokenizerInfo.serialize_json()`` of the model's tokenizer.
    """

    def __init__(self, tokenizer_info_json: str, *, timeout: float, workers: int = 2) -> None:
        self.timeout = timeout
        self._info = tokenizer_info_json
        self._slots = threading.BoundedSemaphore(workers)
        self._idle: list[_Child] = []
        self._lock = threading.Lock()
        self._closed = False

    def trial(self, kind: str, text: str, one_line: bool = False) -> int:
        """Compile the format in a child; returns its compiled size in bytes.

        :raises TrialTimeout: it did not compile within ``timeout`` seconds.
        :raises ValueError: the grammar engine refused it (its message).
        """
        with self._slots:
            with self._lock:
                child = self._idle.pop() if self._idle else None
            if child is None:
                child = _Child(self._info)
            try:
                answer = child.compile(kind, text, one_line, self.timeout)
            except TrialTimeout:  # its child is gone: start the next one now, not on the next trial
                threading.Thread(target=self._start_idle_child, name="loramux-grammar-start", daemon=True).start()
                raise
            self._keep(child)
        if "error" in answer:
            raise ValueError(answer["error"])
        return int(answer["bytes"])

    def _keep(self, child: _Child) -> None:
        with self._lock:
            if child.process.poll() is None and not self._closed:
                self._idle.append(child)
                return
        child.kill()

    def _start_idle_child(self) -> None:
        try:
            self._keep(_Child(self._info))
        except RuntimeError:  # the next trial starts one, and says why if it cannot
            pass

    def close(self) -> None:
        """Stop the idle children (a trial running now stops its own when it ends)."""
        with self._lock:
            self._closed = True
            children, self._idle = self._idle, []
        for child in children:
            child.kill()


def _serve() -> None:
    """The child: read the tokenizer description, then compile each format it is sent and answer
    with its size or the grammar engine's message, one JSON line each, until stdin closes."""
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the answers
    import xgrammar as xgr

    compiler = new_compiler(xgr.TokenizerInfo.deserialize_json(json.loads(sys.stdin.readline())))
    answers.write("{}\n")
    answers.flush()
    for line in sys.stdin:
        kind, text, one_line = json.loads(line)
        try:
            answer = {"bytes": compile_format(compiler, kind, text, one_line).memory_size_bytes}
        except Exception as error:  # the grammar engine's message, for the request's 400
            answer = {"error": str(error) or type(error).__name__}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    _serve()

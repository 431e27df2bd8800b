"""Structured outputs: a grammar per request, enforced as a token mask in the sampler (xgrammar).

``StructuredOutputs(tokenizer, vocab_size, eos_token_ids)`` compiles a request's format (a JSON
schema, any JSON object, a regex, a choice of strings, an EBNF grammar or a structural tag) once
per distinct format (an LRU of compiled grammars, bounded by bytes) and hands each request its own
``GrammarState``. Each step the sampler asks every row that has one for its next-token bitmask,
fills them into one batched bitmask and applies it to the logits in place; after sampling, the
state accepts the token.

What one format may cost is bounded (`StructuredOutputLimits`): its size, a schema's depth and
enum values, a choice's strings, and its compile time (see :mod:`loramux.engine.core.grammar_trials`);
a format over a limit is refused with a `StructuredOutputLimitError` naming the limit.

xgrammar was chosen over llguidance by measurement: its masks take a steady, short time, where a
few of llguidance's took seconds and would stall the whole batch (docs/benchmarks/structured_output.md). Its JSON-schema converter accepts some keywords it does not enforce
(``not``, ``if``/``then``/``else``, ...); those are refused by name (``UnsupportedStructuredOutput``)
rather than silently ignored.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence as Seq
from dataclasses import dataclass, fields
from typing import Any

import torch

from loramux.engine.core.grammar_trials import TrialCompiler, TrialTimeout, compile_format, new_compiler
from loramux.engine.sampling_params import StructuredOutputsParams

__all__ = ["GrammarState", "StructuredOutputLimitError", "StructuredOutputLimits", "StructuredOutputs",
           "UnsupportedStructuredOutput", "apply_grammar_masks", "check_json_schema"]

# JSON-schema keywords xgrammar accepts but does not enforce (checked against xgrammar 0.2.8).
UNENFORCED_KEYWORDS = {
    "not": "'not' (negation)",
    "if": "'if'/'then'/'else' (conditionals)",
    "then": "'if'/'then'/'else' (conditionals)",
    "else": "'if'/'then'/'else' (conditionals)",
    "dependentSchemas": "'dependentSchemas'",
    "unevaluatedItems": "'unevaluatedItems'",
}
# xgrammar's messages may start with the C++ source location: "/project/cpp/regex_converter.cc:83: "
_SOURCE_LOCATION = re.compile(r"\S*\.(?:cc|cpp|cu|h|hpp):\d+:\s*|^\[[\d:.]+\]\s*")
_TIMED_OUT_KEPT = 4096  # formats remembered as past the time limit (their digests)
_FORMAT_NAMES = {"json": "JSON schema", "json_object": "JSON object format", "regex": "regex",
                 "choice": "choice", "grammar": "grammar",
                 "structural_tag": "structural tag"}  # as the limits' messages name them


class UnsupportedStructuredOutput(ValueError):
    """A format the grammar engine cannot enforce: names the feature (the server answers 400)."""


class StructuredOutputLimitError(UnsupportedStructuredOutput):
    """A format over one of the `StructuredOutputLimits`: names the limit (the server answers 400)."""


@dataclass(frozen=True)
class StructuredOutputLimits:
    """What one structured-output format may cost (``loramux serve --structured-outputs-limits``).

    :param compile_timeout: seconds a format may take to compile.
    :param cache_bytes: bytes of compiled grammars kept for reuse (least recently used first out);
        a grammar larger than this alone is refused.
    :param max_bytes: bytes of a format's text: the schema's JSON, the regex, the grammar, the choices.
    :param max_depth: how deep a JSON schema (or a structural tag, with its schemas) nests (its
        objects and arrays).
    :param max_enum_values: ``enum`` and ``const`` values in one JSON schema (or structural tag),
        together.
    :param max_choices: strings in a choice.
    """

    compile_timeout: float = 5.0
    cache_bytes: int = 256 * 2**20
    max_bytes: int = 64 * 2**10
    max_depth: int = 64
    max_enum_values: int = 1000
    max_choices: int = 1000

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"StructuredOutputLimits.{name}: got {value!r}; allowed: a number > 0")

    @classmethod
    def from_json(cls, text: str) -> StructuredOutputLimits:
        """``{"compile_timeout": 10, "cache_bytes": "512MiB", ...}`` -> the limits given, the
        defaults for the rest (sizes as numbers or as ``512MiB``).

        :raises ValueError: not JSON, an unknown limit, or a bad value, named.
        """
        from loramux.flags import parse_byte_size

        try:
            given = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{text!r}: not valid JSON ({error})") from None
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(given) - set(names)) if isinstance(given, dict) else ["(not an object)"]
        if unknown:
            raise ValueError(f"{text!r}: unknown {', '.join(unknown)}; the limits are {', '.join(names)}")
        for name in ("cache_bytes", "max_bytes"):
            if isinstance(given.get(name), str):
                given[name] = parse_byte_size(given[name])
        return cls(**given)

    @classmethod
    def describe(cls) -> str:
        """The limits and their defaults, for help texts."""
        return "Limits (default): " + ", ".join(f"{f.name} ({f.default})" for f in fields(cls)) + "."

    def check(self, kind: str, text: str, value: Any) -> None:
        """Refuse a format over a size limit before any work on it; ``value`` is the parsed
        schema (``json``) or tag (``structural_tag``: its schemas nest inside it), or the list of
        strings (``choice``).

        :raises StructuredOutputLimitError: names the limit.
        """
        what = _FORMAT_NAMES[kind]
        size = len(text.encode())
        if size > self.max_bytes:
            raise self.over(f"the {what} is {size} bytes", "max_bytes", self.max_bytes)
        if kind == "choice" and len(value) > self.max_choices:
            raise self.over(f"the choice has {len(value)} strings", "max_choices", self.max_choices)
        if kind in ("json", "structural_tag"):
            depth, enum_values = _depth_and_enum_values(value, self.max_depth)
            if depth > self.max_depth:
                raise self.over(f"the {what} nests too deeply (objects and arrays)", "max_depth", self.max_depth)
            if enum_values > self.max_enum_values:
                raise self.over(f"the {what} has {enum_values} enum and const values", "max_enum_values",
                                 self.max_enum_values)

    def timeout_error(self) -> StructuredOutputLimitError:
        return self.over("the format did not compile in time", "compile_timeout", self.compile_timeout, " s")

    @staticmethod
    def over(what: str, limit: str, value: float, unit: str = "") -> StructuredOutputLimitError:
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        return StructuredOutputLimitError(
            f"{what}: over the limit {limit}={shown}{unit}; simplify the format (the limits are "
            "loramux serve --structured-outputs-limits, LLM(structured_output_limits=...))")


def _depth_and_enum_values(schema: Any, max_depth: int) -> tuple[int, int]:
    """How deep ``schema`` nests (objects and arrays; measured up to ``max_depth`` + 1) and how many
    enum and const values it has."""
    depth, enum_values = 0, 0
    stack = [(schema, 1)]
    while stack:
        value, level = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        depth = max(depth, level)
        if level > max_depth:
            continue
        if isinstance(value, dict):
            if isinstance(value.get("enum"), list):
                enum_values += len(value["enum"])
            enum_values += "const" in value
            stack.extend((item, level + 1) for item in value.values())
        else:
            stack.extend((item, level + 1) for item in value)
    return depth, enum_values


def check_json_schema(schema: Any, path: str = "$") -> None:
    """Refuse a schema using a keyword that would be accepted but not enforced.

    :raises UnsupportedStructuredOutput: names the keyword and where it is (a JSON path).
    """
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_json_schema(item, f"{path}[{i}]")
        return
    if not isinstance(schema, dict):
        return
    for keyword, value in schema.items():
        where = f"{path}.{keyword}"
        if keyword in UNENFORCED_KEYWORDS:
            raise UnsupportedStructuredOutput(
                f"the JSON schema uses {UNENFORCED_KEYWORDS[keyword]} at {where}, which the grammar engine "
                "cannot enforce; rewrite the schema without it (anyOf, enum, const and $ref are supported)")
        if keyword == "multipleOf" and schema.get("type") != "integer":
            raise UnsupportedStructuredOutput(
                f"the JSON schema uses 'multipleOf' on a non-integer at {where}; only integers support it")
        if keyword == "$ref" and isinstance(value, str) and not value.startswith("#"):
            raise UnsupportedStructuredOutput(
                f"the JSON schema has a remote '$ref' ({value!r}) at {where}; only local references "
                "('#/$defs/...') are supported: inline the referenced schema")
        if keyword in ("properties", "$defs", "definitions", "patternProperties", "dependentRequired"):
            if isinstance(value, dict):  # a map of names to schemas: the names are not keywords
                for name, sub in value.items():
                    check_json_schema(sub, f"{where}.{name}")
            continue
        if keyword in ("enum", "const", "default", "examples", "required"):  # values, not schemas
            continue
        if isinstance(value, (dict, list)):
            check_json_schema(value, where)


def _parse_structural_tag(text: str) -> dict:
    try:
        tag = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        raise UnsupportedStructuredOutput(f"the structural tag is not valid JSON: {error}") from None
    if not isinstance(tag, dict):
        raise UnsupportedStructuredOutput(f"a structural tag is a JSON object, got {type(tag).__name__}")
    return tag


def _check_structural_tag(tag: dict) -> None:
    """A structural tag in either of vLLM's forms: ``{"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}``, or xgrammar's ``{"type": "structural_tag", "format": {...}}``; every JSON
    schema inside is checked like a ``json`` format's (`grammar_trials.compile_format` compiles it)."""
    if "structures" in tag:
        structures = tag["structures"]
        if not isinstance(structures, list) or not all(
                isinstance(item, dict) and isinstance(item.get("begin"), str) and isinstance(item.get("end"), str)
                for item in structures):
            raise UnsupportedStructuredOutput('a structural tag\'s "structures" is a list of objects '
                                              '{"begin": text, "schema": {...}, "end": text}')
        for i, item in enumerate(structures):
            check_json_schema(item.get("schema", {}), f"$.structures[{i}].schema")
    else:
        _check_tag_schemas(tag, "$")


def _check_tag_schemas(node: Any, path: str) -> None:
    """check_json_schema every ``{"type": "json_schema", "json_schema": ...}`` part of a structural tag."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_tag_schemas(item, f"{path}[{i}]")
    elif isinstance(node, dict):
        if node.get("type") == "json_schema":
            check_json_schema(node.get("json_schema"), f"{path}.json_schema")
        for key, value in node.items():
            _check_tag_schemas(value, f"{path}.{key}")


class GrammarState:
    """One request's place in its grammar (an ``xgrammar.GrammarMatcher``)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    @property
    def finished(self) -> bool:
        return self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar refuses it (it never should)."""
        if self.matcher.is_terminated():
            return False
        return self.matcher.accept_token(token)


def apply_grammar_masks(logits: torch.Tensor, rows: Seq[int], states: Seq[GrammarState]) -> None:
    """Set to -inf, in place, every logit of ``rows`` that its grammar does not allow next.

    logits: [B, V] float32; rows: indices into B, one per state. A finished grammar masks nothing
    (the request ends on its stop token, or goes on unconstrained if it ignores EOS).
    """
    import xgrammar as xgr

    live = [(row, state) for row, state in zip(rows, states) if not state.finished]
    if not live:
        return
    bitmask = xgr.allocate_token_bitmask(len(live), live[0][1].vocab_size)  # [N, ceil(V / 32)] int32
    for i, (_, state) in enumerate(live):
        state.matcher.fill_next_token_bitmask(bitmask, i)
    target = logits[[row for row, _ in live]]
    xgr.apply_token_bitmask_inplace(target, bitmask.to(logits.device), vocab_size=logits.shape[-1])
    logits[[row for row, _ in live]] = target


class StructuredOutputs:
    """Compiles formats into grammars for one tokenizer, within `StructuredOutputLimits`; thread-safe.

    A format is checked against the size limits here, then compiled in a child process killed at
    the time limit (`TrialCompiler`, which says why), then compiled here and kept in an LRU bounded
    by the grammars' bytes. A format that ran out of time is remembered and refused at once.

    :param tokenizer: the model's Hugging Face tokenizer.
    :param vocab_size: the model's logits width (may exceed the tokenizer's length).
    :param eos_token_ids: the tokens that end a request; the grammar allows them once it is complete.
    :param limits: the bounds on each format's work; default `StructuredOutputLimits()`.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int],
                 limits: StructuredOutputLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.limits = limits or StructuredOutputLimits()
        self._compiler = None
        self._trials: TrialCompiler | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self.cache_bytes = 0  # of the grammars in the cache (``memory_size_bytes``)
        self._timed_out: OrderedDict[str, None] = OrderedDict()  # digests of formats past the time limit

    def _get_compiler(self):
        try:
            import xgrammar as xgr
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(
                "structured outputs need xgrammar: pip install 'loramux[serve]' (or pip install xgrammar)"
            ) from error
        with self._lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise UnsupportedStructuredOutput("structured outputs need a tokenizer, and this model has none")
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_token_ids or None)
                self._compiler = new_compiler(info)
                self._trials = TrialCompiler(info.serialize_json(), timeout=self.limits.compile_timeout)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec`` (from the cache when seen before).

        :raises StructuredOutputLimitError: the format is over a limit; the message names it.
        :raises UnsupportedStructuredOutput: the format is invalid or uses a feature that cannot be
            enforced; the message names it.
        """
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(*key)
        size = compiled.memory_size_bytes
        with self._lock:
            if key not in self._cache:
                self._cache[key] = compiled
                self.cache_bytes += size
            while self.cache_bytes > self.limits.cache_bytes and len(self._cache) > 1:
                self.cache_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
        return compiled

    def _compile(self, kind: str, text: str, one_line: bool) -> Any:
        compiler = self._get_compiler()
        if kind == "json":
            try:
                schema = json.loads(text)
            except (json.JSONDecodeError, RecursionError) as error:
                raise UnsupportedStructuredOutput(f"the JSON schema is not valid JSON: {error}") from None
            if not isinstance(schema, (dict, bool)):
                raise UnsupportedStructuredOutput(f"a JSON schema is an object, got {type(schema).__name__}")
            self.limits.check(kind, text, schema)
            check_json_schema(schema)
        elif kind == "structural_tag":
            tag = _parse_structural_tag(text)
            self.limits.check(kind, text, tag)
            _check_structural_tag(tag)
        else:
            self.limits.check(kind, text, json.loads(text) if kind == "choice" else None)
        digest = hashlib.sha256(f"{kind}:{one_line}:{text}".encode()).hexdigest()
        if digest in self._timed_out:
            raise self.limits.timeout_error()
        try:
            size = self._trials.trial(kind, text, one_line)
        except TrialTimeout:
            with self._lock:
                self._timed_out[digest] = None
                while len(self._timed_out) > _TIMED_OUT_KEPT:
                    self._timed_out.popitem(last=False)
            raise self.limits.timeout_error() from None
        except ValueError as error:
            raise _cannot_compile(kind, error) from None
        if size > self.limits.cache_bytes:
            raise self.limits.over(f"the compiled grammar takes {size} bytes", "cache_bytes", self.limits.cache_bytes)
        try:
            return compile_format(compiler, kind, text, one_line)
        except Exception as error:  # the trial compiled it: this would be the grammar engine's own bug
            raise _cannot_compile(kind, error) from error

    def new_state(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for one request."""
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(self.compile(spec)), self.vocab_size)

    def close(self) -> None:
        """Stop the trial compilers' child processes."""
        if self._trials is not None:
            self._trials.close()


def _cannot_compile(kind: str, error: BaseException) -> UnsupportedStructuredOutput:
    """The grammar engine's refusal, without its C++ source locations."""
    lines = str(error).strip().splitlines()
    message = _SOURCE_LOCATION.sub("", lines[-1]).strip() if lines else type(error).__name__
    return UnsupportedStructuredOutput(f"the {kind.replace('_', ' ')} format cannot be compiled: {message}")

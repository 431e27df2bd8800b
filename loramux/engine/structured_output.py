"""Structured outputs: a grammar per request, enforced as a token mask in the sampler (xgrammar).

``StructuredOutputs(tokenizer, vocab_size, eos_token_ids)`` compiles a request's format (a JSON
schema, any JSON object, a regex, a choice of strings, an EBNF grammar or a structural tag) once
per distinct format (an LRU of compiled grammars) and hands each request its own
``GrammarState``. Each step the sampler asks every row that has one for its next-token bitmask,
fills them into one batched bitmask and applies it to the logits in place; after sampling, the
state accepts the token.

xgrammar was chosen over llguidance by measurement: its masks take a steady, short time, where a
few of llguidance's took seconds and would stall the whole batch (docs/benchmarks/structured_output.md). Its JSON-schema converter accepts some keywords it does not enforce
(``not``, ``if``/``then``/``else``, ...); those are refused by name (``UnsupportedStructuredOutput``)
rather than silently ignored.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence as Seq
from typing import Any

import torch

from loramux.engine.sampling_params import StructuredOutputsParams

__all__ = ["GrammarState", "StructuredOutputs", "UnsupportedStructuredOutput", "apply_grammar_masks",
           "check_json_schema"]

# JSON-schema keywords xgrammar accepts but does not enforce (checked against xgrammar 0.2.8).
UNENFORCED_KEYWORDS = {
    "not": "'not' (negation)",
    "if": "'if'/'then'/'else' (conditionals)",
    "then": "'if'/'then'/'else' (conditionals)",
    "else": "'if'/'then'/'else' (conditionals)",
    "dependentSchemas": "'dependentSchemas'",
    "unevaluatedItems": "'unevaluatedItems'",
}
_CACHE_SIZE = 256
# JSON is laid out as json.dumps(indent=2) writes it: instruction-tuned models write indented JSON
# (forcing the compact form pushes them off their distribution), and a fixed layout, unlike free
# whitespace, leaves no room to loop on blank lines.
_JSON_LAYOUT = dict(any_whitespace=False, indent=2)
# disable_any_whitespace (vLLM's): one line, with xgrammar's default separators ", " and ": "
_ONE_LINE_JSON = dict(any_whitespace=False)


class UnsupportedStructuredOutput(ValueError):
    """A format the grammar engine cannot enforce: names the feature (the server answers 400)."""


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


def _compile_structural_tag(compiler: Any, text: str) -> Any:
    """A structural tag in either of vLLM's forms: ``{"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}``, or xgrammar's ``{"type": "structural_tag", "format": {...}}``. Every
    JSON schema inside is checked like a ``json`` format's."""
    import xgrammar as xgr

    try:
        tag = json.loads(text)
    except json.JSONDecodeError as error:
        raise UnsupportedStructuredOutput(f"the structural tag is not valid JSON: {error}") from None
    if not isinstance(tag, dict):
        raise UnsupportedStructuredOutput(f"a structural tag is a JSON object, got {type(tag).__name__}")
    if "structures" in tag:
        items = []
        for i, item in enumerate(tag["structures"]):
            check_json_schema(item.get("schema", {}), f"$.structures[{i}].schema")
            items.append(xgr.StructuralTagItem(begin=item["begin"], schema=json.dumps(item.get("schema", {})),
                                               end=item["end"]))
        return compiler.compile_structural_tag(items, tag.get("triggers", []))
    _check_tag_schemas(tag, "$")
    return compiler.compile_structural_tag(text)


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
    """Compiles formats into grammars (cached) for one tokenizer; thread-safe.

    :param tokenizer: the model's Hugging Face tokenizer.
    :param vocab_size: the model's logits width (may exceed the tokenizer's length).
    :param eos_token_ids: the tokens that end a request; the grammar allows them once it is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()

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
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec`` (from the cache when seen before).

        :raises UnsupportedStructuredOutput: the format is invalid or uses a feature that cannot be
            enforced; the message names it.
        """
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        kind, text, one_line = spec.key()
        layout = _ONE_LINE_JSON if one_line else _JSON_LAYOUT
        try:
            if kind == "json":
                try:
                    schema = json.loads(text)
                except json.JSONDecodeError as error:
                    raise UnsupportedStructuredOutput(f"the JSON schema is not valid JSON: {error}") from None
                if not isinstance(schema, (dict, bool)):
                    raise UnsupportedStructuredOutput(
                        f"a JSON schema is an object, got {type(schema).__name__}")
                check_json_schema(schema)
                return compiler.compile_json_schema(text, **layout)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', **layout)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                import xgrammar as xgr

                choices = json.loads(text)
                ebnf = "root ::= " + " | ".join(json.dumps(c) for c in choices)
                return compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf))
            if kind == "structural_tag":
                return _compile_structural_tag(compiler, text)
            return compiler.compile_grammar(text)
        except UnsupportedStructuredOutput:
            raise
        except Exception as error:  # xgrammar's converter names the construct it could not handle
            message = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            message = message.split("] ", 1)[-1]  # drop the C++ source location prefix
            raise UnsupportedStructuredOutput(f"the {kind.replace('_', ' ')} format cannot be compiled: "
                                              f"{message}") from error

    def new_state(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for one request."""
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(self.compile(spec)), self.vocab_size)

"""`SamplingParams`: how one request turns logits into tokens and when it stops (vLLM's names)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["SamplingParams", "StructuredOutputsParams", "MAX_LOGPROBS", "SEED_RANGE"]

# The most alternatives a request may ask for per position (OpenAI's top_logprobs allows 20).
MAX_LOGPROBS = 20
# The seeds a request's generator takes (torch's: 64 bits, signed or not).
SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a format (vLLM's ``StructuredOutputsParams``); set exactly one of
    ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``, ``structural_tag``.

    :param json: a JSON schema (a dict or its JSON text); the output is a JSON value matching it.
    :param json_object: True: the output is any JSON object.
    :param regex: the output matches this regular expression.
    :param choice: the output is exactly one of these strings.
    :param grammar: an EBNF (GBNF) grammar the output follows.
    :param structural_tag: xgrammar's structural tag as JSON text (vLLM's form): free text in which
        each trigger starts a tagged part that follows its schema or format.
    :param disable_any_whitespace: JSON on one line (``", "`` and ``": "`` between items) instead of
        the ``indent=2`` layout. Free whitespace is never allowed in either.
    :param disable_additional_properties: accepted for vLLM's sake and always in effect: an object
        holds only the properties its schema names unless the schema allows more.
    :param whitespace_pattern: refused (a ValueError): the grammar engine lays JSON out itself.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _FORMATS if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams: set exactly one of json, json_object, regex, choice, grammar, "
                f"structural_tag; got {', '.join(given) or 'none'}")
        if self.whitespace_pattern is not None:
            raise ValueError("StructuredOutputsParams.whitespace_pattern: not supported (the grammar engine "
                             "lays JSON out itself); leave it out, or set disable_any_whitespace for one-line JSON")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"StructuredOutputsParams.json: got {type(self.json).__name__}; allowed: a JSON "
                             "schema as a dict or as JSON text")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple)) or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(f"StructuredOutputsParams.choice: got {self.choice!r}; allowed: a non-empty list of "
                             "non-empty strings")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{name}: got {value!r}; allowed: a non-empty string")

    def key(self) -> tuple[str, str, bool]:
        """A hashable description, ``(kind, text, one-line JSON)``; equal keys compile to the same
        grammar (the compile cache's key)."""
        compact = self.disable_any_whitespace
        if self.json is not None:
            # key order is kept: it is the order the grammar makes the properties come in
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return ("json", text, compact)
        if self.json_object:
            return ("json_object", "", compact)
        if self.choice is not None:
            return ("choice", json.dumps(list(self.choice)), False)
        kind = next(name for name in ("regex", "grammar", "structural_tag") if getattr(self, name) is not None)
        return (kind, getattr(self, kind), False)


_FORMATS = ("json", "regex", "choice", "grammar", "structural_tag")


@dataclass
class SamplingParams:
    """Sampling and stopping for one request (vLLM's names and meanings; docs/sampling.md compares
    every vLLM field with ours).

    :param n: how many completions to generate for the prompt (``LLM.generate`` returns them all in
        ``RequestOutput.outputs``; sample ``i`` of a seeded request uses ``seed + i``).
    :param best_of: None or ``n``: loramux generates no extra samples to rank (vLLM's V1 engine
        dropped ``best_of`` too); to rank samples, ask ``n`` of them with ``logprobs=0``.
    :param temperature: 0 means greedy; otherwise logits are divided by it before sampling.
    :param top_p: keep the smallest set of tokens whose probabilities add up to ``top_p`` (0, 1].
    :param top_k: keep the ``top_k`` most likely tokens; 0 (or -1) keeps all.
    :param min_p: drop tokens whose probability is below ``min_p`` times the top token's, [0, 1].
    :param presence_penalty: subtracted from the logit of every token already generated, [-2, 2].
    :param frequency_penalty: subtracted once per time a token was generated, [-2, 2].
    :param repetition_penalty: > 1 discourages tokens seen in the prompt or output (positive logits
        are divided by it, negative ones multiplied; CTRL's rule, as vLLM and transformers do), > 0.
    :param logit_bias: ``{token id: bias}`` added to those logits, each bias in [-100, 100].
    :param allowed_token_ids: only these tokens may be generated (None: any).
    :param min_tokens: the end-of-sequence and stop tokens are blocked until this many are generated.
    :param max_tokens: the most tokens to generate; None: until the context (``max_model_len``) is full.
    :param stop: a string or strings that end the output; the output stops before them.
    :param stop_token_ids: token ids that end the output (kept in ``token_ids``, not in ``text``).
    :param seed: a seed for this request's own random generator, for reproducible sampling
        (64 bits: from -2**63 to 2**64 - 1; -1 means none, as in vLLM).
    :param ignore_eos: keep going past the end-of-sequence token.
    :param include_stop_str_in_output: keep the matched stop string at the end of ``text``.
    :param skip_special_tokens: leave special tokens out of ``text``.
    :param detokenize: False: no ``text`` (token ids only; stop strings need text).
    :param logprobs: per generated token, return its log-probability and the ``logprobs`` most
        likely alternatives (0 to 20; None: none). Log-probabilities are the model's own
        (``log_softmax`` of the raw logits, before penalties, masks and temperature), as vLLM's.
    :param prompt_logprobs: the same for every prompt token (the first one has none), 0 to 20.
    :param skip_reading_prefix_cache: compute the whole prompt even where the prefix cache holds
        its start. None (the default) means: when ``prompt_logprobs`` is asked for, since only a
        computed position has logits to score (as vLLM decides); False with them is refused.
    :param structured_outputs: constrain the output to a JSON schema, a regex, a choice or a grammar.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    min_tokens: int = 0
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_reading_prefix_cache: bool | None = None
    structured_outputs: StructuredOutputsParams | None = None
    _stop_strings: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams.n: got {self.n!r}; allowed: an int >= 1")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"SamplingParams.best_of: got {self.best_of!r} with n={self.n}; allowed: None or n "
                             "(no extra samples are generated to rank; ask n samples with logprobs=0 and rank "
                             "them yourself)")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature: got {self.temperature!r}; allowed: a number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p: got {self.top_p!r}; allowed: a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k: got {self.top_k!r}; allowed: 0 or -1 (all) or an int >= 1")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p: got {self.min_p!r}; allowed: a number in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"SamplingParams.{name}: got {value!r}; allowed: a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                f"SamplingParams.repetition_penalty: got {self.repetition_penalty!r}; allowed: a number > 0 "
                "(1 is no penalty)")
        self.logit_bias = _check_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = list(self.allowed_token_ids) if isinstance(self.allowed_token_ids, (list, tuple)) else None
            if not ids or not all(_is_int(i) and i >= 0 for i in ids):
                raise ValueError(f"SamplingParams.allowed_token_ids: got {self.allowed_token_ids!r}; allowed: None "
                                 "or a non-empty list of token ids >= 0")
            self.allowed_token_ids = ids
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"SamplingParams.max_tokens: got {self.max_tokens!r}; allowed: an int >= 1, or None "
                             "(until the context is full)")
        most = self.max_tokens if self.max_tokens is not None else math.inf
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= most:
            raise ValueError(f"SamplingParams.min_tokens: got {self.min_tokens!r}; allowed: an int from 0 to "
                             f"max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"SamplingParams.{name}: got {value!r}; allowed: None or an int from 0 to "
                                 f"{MAX_LOGPROBS}")
        # A position's logprobs come from its logits, which only a forward pass over it makes: a
        # prompt whose start is cached either skips the hit (one pass over the whole prompt, what
        # vLLM does) or takes it and runs a second pass over the cached positions, the same tokens
        # in two smaller passes. Measured on CPU (SmolLM2-135M, float32, 2 threads, CPU seconds a
        # request, median of 3): 512 tokens with 496 cached, skipping 6.7 s against 1.0 s for the
        # uncached rest plus 7.5 s for the cached positions; 256 with 240 cached, 5.7 s against
        # 1.2 + 5.6 s. So a request that asks for prompt logprobs skips the hit.
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None
        elif self.prompt_logprobs is not None and not self.skip_reading_prefix_cache:
            raise ValueError("SamplingParams.skip_reading_prefix_cache: False with prompt_logprobs would leave the "
                             "cached positions unscored; leave it None")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"SamplingParams.structured_outputs: got {type(self.structured_outputs).__name__}; "
                             "allowed: a StructuredOutputsParams")
        if self.seed == -1 and _is_int(self.seed):  # vLLM's: -1 is no seed
            self.seed = None
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"SamplingParams.seed: got {self.seed!r}; allowed: None or an int from -2**63 to "
                             "2**64 - 1")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"SamplingParams.stop: got {self.stop!r}; allowed: a non-empty string or a list of them")
        if stop and not self.detokenize:
            raise ValueError("SamplingParams.stop: stop strings are matched in the text, and detokenize=False "
                             "makes none; use stop_token_ids, or detokenize=True")
        self._stop_strings = tuple(stop)
        ids = list(self.stop_token_ids or [])
        if not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids: got {self.stop_token_ids!r}; allowed: a list of token ids >= 0"
            )
        self.stop_token_ids = ids

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of ``n``: one sample, its seed ``seed + index`` (vLLM's rule;
        wrapped into the 64-bit range)."""
        seed = self.seed
        if seed is not None:
            seed += index
            if seed > SEED_RANGE[1]:
                seed -= 2**64
        return replace(self, n=1, best_of=None, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def reached_max_tokens(self, num_output_tokens: int) -> bool:
        return self.max_tokens is not None and num_output_tokens >= self.max_tokens

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop_strings

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def changes_logits(self) -> bool:
        """Whether anything beyond temperature / top-k / top-p acts on this request's logits."""
        return bool(self.has_penalties or self.logit_bias or self.min_tokens or self.min_p
                    or self.structured_outputs is not None or self.allowed_token_ids is not None)


def _check_logit_bias(bias: Any) -> dict[int, float] | None:
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"SamplingParams.logit_bias: got {type(bias).__name__}; allowed: a dict {{token id: bias}}")
    checked = {}
    for token, value in bias.items():
        try:  # OpenAI's JSON gives the ids as strings
            token_id = int(token)
        except (TypeError, ValueError):
            raise ValueError(f"SamplingParams.logit_bias: key {token!r} is not a token id") from None
        if token_id < 0 or not _is_number(value) or not -100 <= value <= 100:
            raise ValueError(f"SamplingParams.logit_bias: {token!r}: {value!r}; allowed: token ids >= 0 mapped "
                             "to numbers in [-100, 100]")
        checked[token_id] = float(value)
    return checked


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

"""`SamplingParams`: how one request turns logits into tokens and when it stops (vLLM's names)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SamplingParams", "StructuredOutputsParams", "MAX_LOGPROBS"]

# The most alternatives a request may ask for per position (OpenAI's top_logprobs allows 20).
MAX_LOGPROBS = 20


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a format (vLLM's ``StructuredOutputsParams``); set exactly one field.

    :param json: a JSON schema (a dict or its JSON text); the output is a JSON value matching it.
    :param json_object: True: the output is any JSON object.
    :param regex: the output matches this regular expression.
    :param choice: the output is exactly one of these strings.
    :param grammar: an EBNF (GBNF) grammar the output follows.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputsParams: set exactly one of json, json_object, regex, choice, grammar; got "
                f"{', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"StructuredOutputsParams.json: got {type(self.json).__name__}; allowed: a JSON "
                             "schema as a dict or as JSON text")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple)) or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(f"StructuredOutputsParams.choice: got {self.choice!r}; allowed: a non-empty list of "
                             "non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{name}: got {value!r}; allowed: a non-empty string")

    def key(self) -> tuple[str, str]:
        """A hashable description; equal keys compile to the same grammar (the compile cache's key)."""
        if self.json is not None:
            # key order is kept: it is the order the grammar makes the properties come in
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return ("json", text)
        if self.json_object:
            return ("json_object", "")
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", json.dumps(list(self.choice)))
        return ("grammar", self.grammar or "")


@dataclass
class SamplingParams:
    """Sampling and stopping for one request.

    :param temperature: 0 means greedy; otherwise logits are divided by it before sampling.
    :param top_p: keep the smallest set of tokens whose probabilities add up to ``top_p`` (0, 1].
    :param top_k: keep the ``top_k`` most likely tokens; -1 keeps all.
    :param min_p: drop tokens whose probability is below ``min_p`` times the top token's, [0, 1].
    :param presence_penalty: subtracted from the logit of every token already generated, [-2, 2].
    :param frequency_penalty: subtracted once per time a token was generated, [-2, 2].
    :param repetition_penalty: > 1 discourages tokens seen in the prompt or output (positive logits
        are divided by it, negative ones multiplied; CTRL's rule, as vLLM and transformers do), > 0.
    :param logit_bias: ``{token id: bias}`` added to those logits, each bias in [-100, 100].
    :param min_tokens: the end-of-sequence and stop tokens are blocked until this many are generated.
    :param max_tokens: the most tokens to generate.
    :param stop: a string or strings that end the output; the output stops before them.
    :param stop_token_ids: token ids that end the output (kept in ``token_ids``, not in ``text``).
    :param seed: a seed for this request's own random generator, for reproducible sampling.
    :param ignore_eos: keep going past the end-of-sequence token.
    :param include_stop_str_in_output: keep the matched stop string at the end of ``text``.
    :param skip_special_tokens: leave special tokens out of ``text``.
    :param logprobs: per generated token, return its log-probability and the ``logprobs`` most
        likely alternatives (0 to 20; None: none). Log-probabilities are the model's own
        (``log_softmax`` of the raw logits, before penalties, masks and temperature), as vLLM's.
    :param prompt_logprobs: the same for every prompt token (the first one has none), 0 to 20.
    :param structured_outputs: constrain the output to a JSON schema, a regex, a choice or a grammar.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    _stop_strings: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature: got {self.temperature!r}; allowed: a number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p: got {self.top_p!r}; allowed: a number in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"SamplingParams.top_k: got {self.top_k!r}; allowed: -1 (all) or an int >= 1")
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
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens: got {self.max_tokens!r}; allowed: an int >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens: got {self.min_tokens!r}; allowed: an int from 0 to "
                             f"max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"SamplingParams.{name}: got {value!r}; allowed: None or an int from 0 to "
                                 f"{MAX_LOGPROBS}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"SamplingParams.structured_outputs: got {type(self.structured_outputs).__name__}; "
                             "allowed: a StructuredOutputsParams")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"SamplingParams.seed: got {self.seed!r}; allowed: an int or None")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"SamplingParams.stop: got {self.stop!r}; allowed: a non-empty string or a list of them")
        self._stop_strings = tuple(stop)
        ids = list(self.stop_token_ids or [])
        if not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids: got {self.stop_token_ids!r}; allowed: a list of token ids >= 0"
            )
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

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
                    or self.structured_outputs is not None)


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

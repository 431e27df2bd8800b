"""`SamplingParams`: how one request turns logits into tokens and when it stops (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SamplingParams"]


@dataclass
class SamplingParams:
    """Sampling and stopping for one request.

    :param temperature: 0 means greedy; otherwise logits are divided by it before sampling.
    :param top_p: keep the smallest set of tokens whose probabilities add up to ``top_p`` (0, 1].
    :param top_k: keep the ``top_k`` most likely tokens; -1 keeps all.
    :param max_tokens: the most tokens to generate.
    :param stop: a string or strings that end the output; the output stops before them.
    :param stop_token_ids: token ids that end the output (kept in ``token_ids``, not in ``text``).
    :param seed: a seed for this request's own random generator, for reproducible sampling.
    :param ignore_eos: keep going past the end-of-sequence token.
    :param include_stop_str_in_output: keep the matched stop string at the end of ``text``.
    :param skip_special_tokens: leave special tokens out of ``text``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    _stop_strings: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature: got {self.temperature!r}; allowed: a number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p: got {self.top_p!r}; allowed: a number in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"SamplingParams.top_k: got {self.top_k!r}; allowed: -1 (all) or an int >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens: got {self.max_tokens!r}; allowed: an int >= 1")
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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

"""Logprobs in OpenAI's two wire formats, and vLLM's ``prompt_logprobs``.

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``
- completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; with
  ``echo`` the prompt's tokens come first, the very first with ``null`` (nothing predicts it).
- ``prompt_logprobs``: per prompt token ``null`` or ``{"<id>": {"logprob", "rank", "decoded_token"}}``.

A token's text is ``tokenizer.decode([id])`` (a piece of a multi-byte character decodes to U+FFFD,
as in vLLM); ``-inf`` is sent as -9999.0, since JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from functools import lru_cache
from typing import Any

__all__ = ["TokenText", "chat_logprobs", "completion_logprobs", "prompt_logprobs_json"]

_FLOOR = -9999.0


def _finite(value: float) -> float:
    return max(value, _FLOOR)


class TokenText:
    """Decodes single tokens, cached (the same tokens recur in every response).

    ``as_ids`` (vLLM's ``return_tokens_as_token_ids``): a token is ``"token_id:<id>"``, which names
    it even where its text does not (a piece of a multi-byte character).
    """

    def __init__(self, tokenizer: Any, *, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self.text = lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id])


def _top(entry: dict, n: int) -> list[tuple[int, Any]]:
    """The entry's ``n`` best alternatives, best first (the chosen token is among them only by rank)."""
    ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= n),
                    key=lambda item: item[1].rank)
    return ranked[:n]


def chat_logprobs(texts: TokenText, token_ids: Seq[int], entries: Seq[dict], top: int) -> dict:
    """OpenAI chat ``logprobs`` for the given generated tokens."""
    content = []
    for token, entry in zip(token_ids, entries):
        text = texts.text(token)
        content.append({
            "token": text, "logprob": _finite(entry[token].logprob), "bytes": list(text.encode()),
            "top_logprobs": [{"token": texts.text(t), "logprob": _finite(lp.logprob),
                              "bytes": list(texts.text(t).encode())} for t, lp in _top(entry, top)],
        })
    return {"content": content}


def completion_logprobs(texts: TokenText, token_ids: Seq[int], entries: Seq[dict | None], top: int,
                        offset: int = 0) -> dict:
    """OpenAI completions ``logprobs``; an entry of None (the first prompt token) gives nulls."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token, entry in zip(token_ids, entries):
        text = texts.text(token)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(entry[token].logprob))
        alternatives = {texts.text(t): _finite(lp.logprob) for t, lp in _top(entry, top)}
        alternatives.setdefault(text, _finite(entry[token].logprob))
        top_logprobs.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def prompt_logprobs_json(texts: TokenText, entries: Seq[dict | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token None or ``{id: {logprob, rank, decoded_token}}``."""
    if entries is None:
        return None
    return [None if entry is None else {
        str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": texts.text(t)}
        for t, lp in entry.items()} for entry in entries]

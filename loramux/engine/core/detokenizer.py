"""Incremental detokenization and stop strings: each new token costs two decodes of a short window.

Decoding the whole output every step costs O(length) per token; instead, like vLLM, decode a
window that starts a few tokens back (so a tokenizer that merges or strips spaces at the start of
a text sees context) and emit only the text past the window's previous end. Text ending in
U+FFFD is a multi-byte character split across tokens: wait for the next token.
"""

from __future__ import annotations

__all__ = ["IncrementalDetokenizer"]

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """The text of one sequence's output, grown a token at a time, cut at the first stop string."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in stop), default=0)
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids = context  # the window's context plus the output so far
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append ``token_id``; return the stop string it completed, if any (``text`` is then cut)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._append(delta)

    def flush(self) -> None:
        """At the end, emit what a split multi-byte character held back."""
        if self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            self._read_offset = len(self._ids)
            self._append(full[len(prefix) :])

    def _append(self, delta: str) -> str | None:
        start = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += delta
        if not self.stop:
            return None
        hits = [(self.text.find(s, start), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[: index + len(stop)] if self.include_stop else self.text[:index]
        return stop

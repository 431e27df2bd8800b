"""From an API request's prompts to the engine's: bounded before any work, tokenized beside it.

- A request has at most ``max_prompts_per_request`` prompts (``--max-prompts-per-request``).
- A text prompt with more bytes than ``max_model_len`` tokens could hold (``max_model_len`` times
  the longest token's bytes) is refused before it is tokenized: a 2 MB prompt costs nothing.
- Prompts are tokenized (and chat messages rendered) in a worker thread, off the event loop and
  the engine's threads, so a long prompt delays no other request's start; a rendered chat prompt
  is bounded by its bytes again before it is tokenized (documents and template arguments add text).
- The prompt must leave room in the context, and an explicit ``max_tokens`` must fit what it
  leaves (vLLM's rule; the 400 names both numbers).

The engine gets ``{"prompt": text, "prompt_token_ids": ids}``: it keeps the text (echo) and does
not tokenize again. vLLM's ``add_special_tokens`` says whether the tokenizer adds its special
tokens (BOS): by default to a completion's text, not to a rendered chat, whose template holds them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from loramux.serving.errors import APIError
from loramux.serving.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["Prompts", "longest_token_bytes"]

_FALLBACK_MAX_TOKENS = 256  # when the engine does not say how long its context is


def longest_token_bytes(tokenizer: Any) -> int | None:
    """The most bytes of text one token can stand for, or None if the tokenizer does not say.

    The vocabulary's strings in UTF-8 bound it from above for byte-level BPE (a byte is one
    character of two bytes or fewer), SentencePiece (``▁`` for a space) and byte fallback
    (``<0x0A>``) alike, so a prompt over ``max_model_len`` times this many bytes cannot fit.
    """
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    vocab = get_vocab()
    return max((len(token.encode()) for token in vocab), default=None) if vocab else None


def _context_error(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="context_length_exceeded")


class Prompts:
    """Turns the prompts of API requests into the engine's, within the server's bounds.

    :param tokenizer: the engine's tokenizer (None: text prompts are refused, token ids go to the
        engine as given).
    :param max_model_len: the context in tokens (None: not checked here).
    :param vocab_size: token ids must be below it (None: not checked).
    :param max_prompts_per_request: the most prompts one request may give.
    :param chat_template: a Jinja template replacing the tokenizer's.
    """

    def __init__(self, tokenizer: Any, *, max_model_len: int | None, vocab_size: int | None,
                 max_prompts_per_request: int, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_prompts_per_request = max_prompts_per_request
        self.chat_template = chat_template
        token_bytes = longest_token_bytes(tokenizer) if max_model_len else None
        self.max_prompt_bytes = max_model_len * token_bytes if token_bytes else None

    # -- completions ------------------------------------------------------------------------------

    async def completion(self, request: CompletionRequest) -> list[dict]:
        """The engine prompts of a completions request, tokenized and checked.

        :raises APIError: 400 for too many prompts, a text prompt to a model without a tokenizer,
            a token id outside the vocabulary, or a prompt too long for the context.
        """
        prompt = request.prompt
        items = [prompt] if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt) else prompt
        if len(items) > self.max_prompts_per_request:
            raise APIError(400, f"prompt: {len(items)} prompts in one request, over the limit of "
                           f"{self.max_prompts_per_request} (--max-prompts-per-request); send them in several "
                           "requests", param="prompt", code="invalid_parameter")
        texts = [item for item in items if isinstance(item, str)]
        if texts and self.tokenizer is None:
            raise APIError(400, "prompt: this model has no tokenizer; give token ids", param="prompt",
                           code="no_tokenizer")
        for text in texts:
            self._check_bytes("prompt", len(text.encode()))
        ids_of_text = iter(await asyncio.to_thread(self._tokenize, texts, request.add_special_tokens) if texts
                           else [])
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append({"prompt": item, "prompt_token_ids": next(ids_of_text)})
                continue
            self._check_vocab(item)
            prompts.append({"prompt_token_ids": list(item)})
        for engine_prompt in prompts:
            self._check_length("prompt", len(engine_prompt["prompt_token_ids"]))
        return prompts

    def _tokenize(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return list(self.tokenizer(texts, add_special_tokens=add_special_tokens).input_ids)

    def _check_vocab(self, ids: list[int]) -> None:
        bad = next((t for t in ids if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)), None)
        if bad is not None:
            limit = f"0 to {self.vocab_size - 1}" if self.vocab_size is not None else "0 or more"
            raise APIError(400, f"prompt: token id {bad} is outside the vocabulary ({limit})", param="prompt",
                           code="invalid_parameter")

    # -- chat ---------------------------------------------------------------------------------------

    async def chat(self, request: ChatCompletionRequest) -> dict:
        """The engine prompt of a chat request: its messages rendered with the chat template and
        tokenized (in a worker thread), checked against the context.

        :raises APIError: 400 for a model without a tokenizer or template, messages the template
            refuses, or messages too long for the context.
        """
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot chat; use /v1/completions "
                           "with token ids", param="messages", code="no_tokenizer")
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise APIError(400, "this model has no chat template; start the server with --chat-template "
                           "FILE, or use /v1/completions", param="messages", code="no_chat_template")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        except ValueError as error:
            raise APIError(400, f"messages: {error}", param="messages", code="invalid_parameter") from error
        self._check_bytes("messages", sum(len(m["content"].encode()) for m in messages))
        options = {**(request.chat_template_kwargs or {}), "chat_template": template, "tokenize": False,
                   "add_generation_prompt": request.add_generation_prompt,
                   "continue_final_message": request.continue_final_message, "documents": request.documents}
        prompt = await asyncio.to_thread(self._render, messages, options, request.add_special_tokens)
        self._check_length("messages", len(prompt["prompt_token_ids"]))
        return prompt

    def _render(self, messages: list[dict], options: dict, add_special_tokens: bool) -> dict:
        try:
            text = self.tokenizer.apply_chat_template(messages, **options)
        except Exception as error:  # a template that raises on these messages (e.g. role order)
            raise APIError(400, f"messages: the chat template refused them: {error}", param="messages",
                           code="invalid_parameter") from error
        self._check_bytes("messages", len(text.encode()))
        # as LLM.chat does: the template holds any BOS token, so none is added again unless asked
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        return {"prompt": text, "prompt_token_ids": ids}

    # -- the context ----------------------------------------------------------------------------------

    def _check_bytes(self, param: str, size: int) -> None:
        if self.max_prompt_bytes is not None and size > self.max_prompt_bytes:
            raise _context_error(param, f"{size} bytes of text are more than the model's context of "
                                 f"{self.max_model_len} tokens can hold (at most {self.max_prompt_bytes} bytes); "
                                 "shorten it")

    def _check_length(self, param: str, tokens: int) -> None:
        if not tokens:
            raise APIError(400, f"{param}: the prompt is empty (no tokens)", param=param, code="invalid_parameter")
        if self.max_model_len is not None and tokens >= self.max_model_len:
            raise _context_error(param, f"{tokens} tokens leave no room to generate in the model's context "
                                 f"of {self.max_model_len} tokens (max_model_len); shorten it")

    def check_max_tokens(self, param: str, max_tokens: int, prompts: list[dict]) -> None:
        """Refuse a ``max_tokens`` larger than the context left after the longest prompt.

        :raises APIError: 400 naming ``max_tokens`` and the room left.
        """
        longest = _longest(prompts)
        if self.max_model_len is None or longest is None:
            return
        if max_tokens > self.max_model_len - longest:
            raise _context_error(param, f"{max_tokens} is too large: the model's context is {self.max_model_len} "
                                 f"tokens and the prompt has {longest} ({max_tokens} > {self.max_model_len} - "
                                 f"{longest}); lower {param} or shorten the prompt")

    def default_max_tokens(self, prompts: list[dict]) -> int:
        """``max_tokens`` for a request that gives none: the context left after the longest prompt."""
        if not self.max_model_len:
            return _FALLBACK_MAX_TOKENS
        return max(1, self.max_model_len - (_longest(prompts) or 0))


def _longest(prompts: list[dict]) -> int | None:
    """Tokens in the longest of the engine prompts."""
    return max((len(p["prompt_token_ids"]) for p in prompts), default=None)

"""What a generation answers: the `Generation` a handler builds from an API request, and its JSON
bodies in OpenAI's completion and chat shapes, with vLLM's additions (``prompt_logprobs``,
``token_ids`` / ``prompt_token_ids``, ``prompt_text``, ``stop_reason``).

One engine request per choice (``n`` per prompt); ``group.latest[i]`` is choice ``i``'s newest
cumulative output. `streaming` sends the same bodies as chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from loramux.engine.core.outputs import RequestOutput
from loramux.errors import LoRAError
from loramux.registry import LoRARequest
from loramux.serving.async_engine import RequestGroup, SubRequest
from loramux.serving.logprobs import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs_json

__all__ = ["Generation", "choice_usage", "finish_reason", "full_response", "raise_output_error", "stop_reason",
           "usage"]


@dataclass
class Generation:
    """One generation request as the handlers see it."""

    endpoint: str  # "completions" | "chat"
    model: str  # the request's model field, echoed in responses
    lora_request: LoRARequest | None
    requests: list[SubRequest]
    response_id: str
    prompt_of_choice: list[int] = field(default_factory=list)  # choice index -> prompt index
    stream: bool = False
    include_usage: bool = False  # streams: a last chunk with the usage
    continuous_usage: bool = False  # streams: each chunk with its choice's usage so far
    stream_interval: int = 1  # streams: new tokens per chunk (the first and last chunks go at once)
    echo: bool = False  # completions: the prompt leads the text (and its logprobs lead the logprobs)
    echo_only: bool = False  # completions with max_tokens 0: the prompt alone, nothing generated
    chat_echo: str = ""  # chat with echo: the last message's content, which leads the answer
    logprobs: int | None = None  # alternatives per token (chat's top_logprobs); None: no logprobs
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs was asked for (not only to serve echo)
    return_token_ids: bool = False  # vLLM's: the token ids beside the text
    rendered_prompt: str | None = None  # chat's templated prompt, when return_prompt_text asked for it
    tokenizer: Any = None
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:<id>"
    _token_text: TokenText | None = field(default=None, repr=False)

    @property
    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.tokenizer, as_ids=self.tokens_as_ids)
        return self._token_text

    def text_of(self, output: RequestOutput) -> str:
        """A choice's text as the client sees it (with what echo puts first)."""
        text = "" if self.echo_only or not output.outputs else output.outputs[0].text
        if self.echo:
            return self.prompt_text(output) + text
        return self.chat_echo + text

    def prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        ids = output.prompt_token_ids or []
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def generated(self, output: RequestOutput) -> tuple[list[int], list]:
        """The generated tokens the client sees and their logprob entries."""
        if self.echo_only or not output.outputs:
            return [], []
        completion = output.outputs[0]
        return list(completion.token_ids), list(completion.logprobs or [])

    def logprobs_json(self, output: RequestOutput, start: int = 0, with_prompt: bool = True) -> dict | None:
        """The choice's ``logprobs`` for its generated tokens from ``start`` on (None if not asked)."""
        if self.logprobs is None:
            return None
        ids, entries = self.generated(output)
        ids, entries = ids[start:len(entries)], entries[start:]
        if self.endpoint == "chat":
            return chat_logprobs(self.token_text, ids, entries, self.logprobs)
        if self.echo and with_prompt:
            ids = list(output.prompt_token_ids or []) + ids
            entries = list(output.prompt_logprobs or [None] * len(output.prompt_token_ids or [])) + entries
        return completion_logprobs(self.token_text, ids, entries, self.logprobs)

    def prompt_logprobs_json(self, output: RequestOutput) -> list | None:
        return prompt_logprobs_json(self.token_text, output.prompt_logprobs) if self.prompt_logprobs else None


def raise_output_error(group: RequestGroup) -> None:
    """Raise the error of a choice whose engine request failed, if one did."""
    for output in group.latest:
        if output is not None and getattr(output, "error", None) is not None:
            raise output.error
        if output is not None and output.outputs and output.outputs[0].finish_reason == "error":
            raise LoRAError("the engine failed this request without saying why")


def usage(gen: Generation, group: RequestGroup) -> dict:
    """The request's usage: each prompt counted once, however many choices it has."""
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    for index, output in enumerate(group.latest):
        if output is None:
            continue
        prompt_tokens[gen.prompt_of_choice[index]] = len(output.prompt_token_ids or ())
        completion_tokens += len(gen.generated(output)[0])
    prompt = sum(prompt_tokens.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens}


def choice_usage(gen: Generation, output: RequestOutput) -> dict:
    """One choice's usage so far (vLLM's ``continuous_usage_stats``)."""
    prompt, completion = len(output.prompt_token_ids or ()), len(gen.generated(output)[0])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish_reason(gen: Generation, output: RequestOutput) -> str | None:
    if not output.finished:
        return None
    if gen.echo_only:
        return "length"
    reason = output.outputs[0].finish_reason if output.outputs else None
    return reason or "stop"


def stop_reason(output: RequestOutput) -> str | int | None:
    return output.outputs[0].stop_reason if output.outputs else None


def full_response(gen: Generation, group: RequestGroup) -> dict:
    """The non-streaming answer: every choice in full, and the usage."""
    choices = []
    for index, output in enumerate(group.latest):
        text = gen.text_of(output)
        choice: dict[str, Any] = {"index": index}
        if gen.endpoint == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=gen.logprobs_json(output), finish_reason=finish_reason(gen, output),
                      stop_reason=stop_reason(output))
        if gen.return_token_ids:
            choice["token_ids"] = gen.generated(output)[0]
        if gen.endpoint == "completions":
            if gen.return_token_ids:
                choice["prompt_token_ids"] = list(output.prompt_token_ids or [])
            prompt_logprobs = gen.prompt_logprobs_json(output)
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs
        choices.append(choice)
    body: dict[str, Any] = {"id": gen.response_id, "object": "chat.completion" if gen.endpoint == "chat" else
                            "text_completion", "created": int(time.time()), "model": gen.model, "choices": choices,
                            "usage": usage(gen, group)}
    if gen.endpoint == "chat":  # vLLM puts a chat's prompt fields beside its choices (one prompt)
        first = group.latest[0]
        prompt_logprobs = gen.prompt_logprobs_json(first)
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        if gen.return_token_ids:
            body["prompt_token_ids"] = list(first.prompt_token_ids or [])
        if gen.rendered_prompt is not None:
            body["prompt_text"] = gen.rendered_prompt
    return body

"""A generation as server-sent events, in OpenAI's chunk layout: one choice per chunk.

Each chunk carries one choice (``choices: [{"index": i, ...}]``), as OpenAI and vLLM send them, so
a client that reads ``chunk.choices[0]`` and keys its text by ``index`` misses nothing with ``n`` > 1
or several prompts. Chat streams open with one ``delta.role`` chunk per choice. A choice's last
chunk has its ``finish_reason``; with ``stream_options.include_usage`` every chunk has ``usage``
(null, or the choice's usage so far with ``continuous_usage_stats``) and a last chunk with empty
``choices`` holds the request's; then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from loramux.engine.core.outputs import RequestOutput
from loramux.engine.sampling_params import SamplingParams
from loramux.serving.async_engine import RequestGroup
from loramux.serving.errors import to_api_error
from loramux.serving.responses import (Generation, choice_usage, finish_reason, raise_output_error, stop_reason,
                                       usage)

__all__ = ["sse", "stream_events"]


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class _ChoiceStream:
    """What one choice has sent so far; `delta` makes its next chunk's choice from a newer output."""

    def __init__(self, gen: Generation, index: int, params: SamplingParams) -> None:
        self.gen = gen
        self.index = index
        # the engine cuts its text at a stop string once it is complete, so the start of a possible
        # stop string is held back while the request runs
        self.held_back = max((len(stop) for stop in params.stop_strings), default=1) - 1
        self.sent_chars = 0  # of the choice's text
        self.sent_logprobs = 0  # generated tokens whose logprobs were sent
        self.sent_tokens = 0  # generated tokens in the chunks sent (token ids, stream_interval)
        self.started = False
        self.done = False

    def delta(self, output: RequestOutput) -> dict | None:
        """The choice's part of the next chunk, or None when it has nothing new to send yet."""
        gen = self.gen
        reason = finish_reason(gen, output)
        ids, entries = gen.generated(output)
        if reason is None and self.started and len(ids) - self.sent_tokens < gen.stream_interval:
            return None
        text = gen.text_of(output)
        end = len(text) if reason is not None else max(self.sent_chars, len(text) - self.held_back)
        delta, self.sent_chars = text[self.sent_chars:end], end
        logprobs = None
        if gen.logprobs is not None:  # the logprobs of the tokens new since the last chunk
            if len(entries) > self.sent_logprobs or (not self.started and gen.echo):
                logprobs = gen.logprobs_json(output, self.sent_logprobs, with_prompt=not self.started)
            self.sent_logprobs = len(entries)
        new_ids = ids[self.sent_tokens:]
        if not delta and reason is None and logprobs is None and not (gen.return_token_ids and new_ids):
            return None
        body: dict[str, Any] = {"index": self.index}
        if gen.endpoint == "chat":
            body["delta"] = {"content": delta} if delta else {}
        else:
            body["text"] = delta
        body.update(logprobs=logprobs, finish_reason=reason, stop_reason=stop_reason(output) if reason else None)
        if gen.return_token_ids:
            body["token_ids"] = new_ids
            if gen.endpoint == "completions" and not self.started:
                body["prompt_token_ids"] = list(output.prompt_token_ids or [])
        self.started, self.done, self.sent_tokens = True, reason is not None, len(ids)
        return body


async def stream_events(state: ServerState, gen: Generation, group: RequestGroup, started: float) -> AsyncIterator[str]:
    """The SSE body: each choice's new text as it comes, one choice a chunk, then usage, then ``[DONE]``."""
    created = int(time.time())
    object_name = "chat.completion.chunk" if gen.endpoint == "chat" else "text_completion"
    streams = [_ChoiceStream(gen, index, request.params) for index, request in enumerate(gen.requests)]

    def chunk(choices: list[dict], usage_: dict | None = None, **extra: Any) -> str:
        body: dict[str, Any] = {"id": gen.response_id, "object": object_name, "created": created,
                                "model": gen.model, "choices": choices, **extra}
        if gen.include_usage:
            body["usage"] = usage_
        return sse(body)

    status = "cancelled"
    try:
        if gen.endpoint == "chat":  # OpenAI sends each choice's role first, alone
            prompt_ids = list(gen.requests[0].prompt["prompt_token_ids"])  # chat: one prompt, rendered here
            for index in range(len(streams)):
                extra: dict[str, Any] = {}
                if index == 0 and gen.return_token_ids:
                    extra["prompt_token_ids"] = prompt_ids
                if index == 0 and gen.rendered_prompt is not None:
                    extra["prompt_text"] = gen.rendered_prompt
                role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}
                counts = {"prompt_tokens": len(prompt_ids), "completion_tokens": 0, "total_tokens": len(prompt_ids)}
                yield chunk([role], counts if gen.continuous_usage else None, **extra)
        changed = range(len(streams))
        while True:
            for index in changed:
                output = group.latest[index]
                if output is None or streams[index].done:
                    continue
                body = streams[index].delta(output)
                if body is not None:
                    yield chunk([body], choice_usage(gen, output) if gen.continuous_usage else None)
            if all(stream.done for stream in streams):
                break
            changed = await group.changes()
            raise_output_error(group)
        if gen.include_usage:
            yield chunk([], usage(gen, group))
        status = "ok"
        yield sse("[DONE]")
    except Exception as error:  # mid-stream failure: an error event the openai client raises
        status = "error"
        yield sse(to_api_error(error).body())
        yield sse("[DONE]")
    finally:  # also runs when the client disconnects and the stream is cancelled
        state.engine.release(group)
        seconds = time.monotonic() - started if status == "ok" else None
        state.count_request(gen, status, group, seconds=seconds)


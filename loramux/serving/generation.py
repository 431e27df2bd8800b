"""Completions and chat completions: API request -> engine requests -> JSON or server-sent events.

One HTTP request becomes one engine request per choice (``n`` per prompt). Before anything is
sent the handler waits for the first output (or the engine's "adapter failed" event, which comes
the moment the load fails), so a request whose adapter cannot be found or loaded gets a plain
HTTP error (404/400/...) even with ``stream: true``; after that, a failure arrives as
an SSE ``error`` event, which the ``openai`` client raises. A client that goes away aborts its
engine requests (``AsyncEngine.release``), both while waiting and mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loramux.errors import AdapterNotFoundError, InvalidAdapterError, IncompatibleAdapterError, LoRAError
from loramux.serving.async_engine import RequestGroup, SubRequest
from loramux.serving.errors import APIError, EngineDeadError, error_response, to_api_error
from loramux.serving.logprobs import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs_json

__all__ = ["Generation", "build_requests", "run_generation"]

# Status for a client that went away before its answer (nginx's convention; nobody reads it).
_CLIENT_CLOSED = 499


@dataclass
class Generation:
    """One generation request as the handlers see it."""

    endpoint: str  # "completions" | "chat"
    model: str  # the request's model field, echoed in responses
    lora_request: Any  # LoRARequest | None
    requests: list[SubRequest]
    stream: bool
    include_usage: bool
    prompt_of_choice: list[int] = field(default_factory=list)  # choice index -> prompt index
    echo: bool = False  # completions: the prompt leads the text (and its logprobs lead the logprobs)
    echo_only: bool = False  # completions with max_tokens 0: the prompt alone, nothing generated
    logprobs: int | None = None  # alternatives per token (chat's top_logprobs); None: no logprobs
    tokenizer: Any = None
    _token_text: TokenText | None = field(default=None, repr=False)

    @property
    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.tokenizer)
        return self._token_text

    def text_of(self, output: Any) -> str:
        """A choice's text as the client sees it (with the prompt first under ``echo``)."""
        text = "" if self.echo_only or not output.outputs else output.outputs[0].text
        return self.prompt_text(output) + text if self.echo else text

    def prompt_text(self, output: Any) -> str:
        if output.prompt is not None:
            return output.prompt
        ids = output.prompt_token_ids or []
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def generated(self, output: Any) -> tuple[list[int], list]:
        """The generated tokens the client sees and their logprob entries."""
        if self.echo_only or not output.outputs:
            return [], []
        completion = output.outputs[0]
        return list(completion.token_ids), list(completion.logprobs or [])

    def logprobs_json(self, output: Any, start: int = 0, with_prompt: bool = True) -> dict | None:
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

    @property
    def response_id(self) -> str:
        return self.requests[0].request_id.rsplit("-", 1)[0]  # build_requests numbers the choices


def build_requests(prompts: list[Any], n: int, make_params: Callable[[int], Any],
                   lora_request: Any, prefix: str) -> tuple[list[SubRequest], list[int]]:
    """One engine request per (prompt, choice), ids ``<response id>-<choice>``; and each choice's prompt."""
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    requests, prompt_of_choice = [], []
    for prompt_index, prompt in enumerate(prompts):
        for sample in range(n):
            requests.append(SubRequest(f"{response_id}-{len(requests)}", prompt, make_params(sample), lora_request,
                                       api_request_id=response_id))
            prompt_of_choice.append(prompt_index)
    return requests, prompt_of_choice


# ---------------------------------------------------------------------------------------------
# Running one generation
# ---------------------------------------------------------------------------------------------


async def _until_disconnected(request: Request, awaitable) -> Any:
    """``await awaitable`` unless the client disconnects first (then raise ``ConnectionAbortedError``)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if work in done:
        return work.result()
    work.cancel()
    raise ConnectionAbortedError("the client disconnected")


async def _all_outputs(group: RequestGroup) -> None:
    while not group.finished:
        await group.changes()
        _raise_output_error(group)


def _raise_output_error(group: RequestGroup) -> None:
    for output in group.latest:
        if output is not None and getattr(output, "error", None) is not None:
            raise output.error
        if output is not None and output.outputs and output.outputs[0].finish_reason == "error":
            raise LoRAError("the engine failed this request without saying why")


def _resolution_outcome(error: BaseException | None) -> str:
    if error is None:
        return "found"
    if isinstance(error, AdapterNotFoundError):
        return "not_found"
    if isinstance(error, (InvalidAdapterError, IncompatibleAdapterError)):
        return "invalid"
    return "error"


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its stream when the response ends, however it ends.

    When a client disconnects while Starlette is sending, Starlette cancels the sending task and
    leaves the stream's generator suspended; its ``finally`` (which aborts the engine request)
    would then run only when the garbage collector finalizes it. Closing it here makes the abort
    prompt and certain.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def run_generation(state: Any, http_request: Request, gen: Generation) -> Response:
    """Submit ``gen`` to the engine and answer it, as JSON or as a stream of events."""
    started = time.monotonic()
    try:
        group = state.engine.submit(gen.requests)
    except EngineDeadError as error:
        return error_response(to_api_error(error))
    try:
        await _until_disconnected(http_request, group.changes())
        _raise_output_error(group)
    except ConnectionAbortedError as error:
        state.engine.release(group)
        if gen.lora_request is not None:  # an on-demand name nobody waits for any more is dropped
            state.book.settle(gen.model, gen.lora_request, error)
        state.count_request(gen, "cancelled", group)
        return Response(status_code=_CLIENT_CLOSED)
    except asyncio.CancelledError:
        state.engine.release(group)
        raise
    except Exception as error:
        state.engine.release(group)
        _settle_adapter(state, gen, group, error)
        state.count_request(gen, "error", group)
        return error_response(to_api_error(error))
    _settle_adapter(state, gen, group, None)

    if gen.stream:
        return _ClosingStreamingResponse(_stream(state, gen, group, started), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        await _until_disconnected(http_request, _all_outputs(group))
    except ConnectionAbortedError:
        state.count_request(gen, "cancelled", group)
        return Response(status_code=_CLIENT_CLOSED)
    except Exception as error:
        state.count_request(gen, "error", group)
        return error_response(to_api_error(error))
    finally:
        state.engine.release(group)
    state.count_request(gen, "ok", group, seconds=time.monotonic() - started)
    return JSONResponse(_full_response(gen, group))


def _settle_adapter(state: Any, gen: Generation, group: RequestGroup, error: BaseException | None) -> None:
    """Record how the adapter lookup ended: confirm or forget an on-demand name.

    The first request to settle a name found on demand counts the resolution and its latency:
    resolve + load as the engine's "ready" event measured it, under the resolver that found it
    (an engine without events: until the first output, source "unknown").
    """
    if gen.lora_request is None:
        return
    if state.book.settle(gen.model, gen.lora_request, error):
        state.metrics.resolutions.labels(_resolution_outcome(error)).inc()
        ready = group.adapter_event
        if error is None and ready is not None and ready.seconds is not None:
            state.metrics.load_seconds.labels("on_demand", ready.source or "unknown").observe(ready.seconds)
        elif error is None and group.first_output_at is not None:
            state.metrics.load_seconds.labels("on_demand", "unknown").observe(
                group.first_output_at - group.submitted_at)


# ---------------------------------------------------------------------------------------------
# Response bodies
# ---------------------------------------------------------------------------------------------


def _usage(gen: Generation, group: RequestGroup) -> dict:
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


def _finish_reason(output: Any) -> str | None:
    if not output.finished:
        return None
    reason = output.outputs[0].finish_reason if output.outputs else None
    return reason or "stop"


def _prompt_logprobs(gen: Generation, output: Any) -> list | None:
    asked = gen.requests[0].params
    if getattr(asked, "prompt_logprobs", None) is None or (gen.echo and gen.logprobs is not None):
        return None  # not asked, or asked only to serve echo's logprobs
    return prompt_logprobs_json(gen.token_text, output.prompt_logprobs)


def _full_response(gen: Generation, group: RequestGroup) -> dict:
    choices = []
    for index, output in enumerate(group.latest):
        text = gen.text_of(output)
        choice: dict[str, Any] = {"index": index, "logprobs": gen.logprobs_json(output),
                                  "finish_reason": "length" if gen.echo_only else _finish_reason(output)}
        if gen.endpoint == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        prompt_logprobs = _prompt_logprobs(gen, output)
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        choices.append(choice)
    object_name = "chat.completion" if gen.endpoint == "chat" else "text_completion"
    return {"id": gen.response_id, "object": object_name,
            "created": int(time.time()), "model": gen.model, "choices": choices,
            "usage": _usage(gen, group)}


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def _held_back(params: Any) -> int:
    """Characters a stream keeps back while a request runs: the engine cuts its text at a stop
    string once it is complete, so the start of a possible stop string must not be sent yet."""
    return max((len(stop) for stop in getattr(params, "stop_strings", ())), default=1) - 1


async def _stream(state: Any, gen: Generation, group: RequestGroup, started: float) -> AsyncIterator[str]:
    """The SSE body: one chunk per step with each choice's new text, then usage, then ``[DONE]``."""
    response_id, created = gen.response_id, int(time.time())
    object_name = "chat.completion.chunk" if gen.endpoint == "chat" else "text_completion"
    held_back = [_held_back(request.params) for request in gen.requests]
    sent = [0] * len(gen.requests)  # characters of each choice's text already sent
    sent_tokens = [0] * len(gen.requests)  # generated tokens whose logprobs were sent
    done = [False] * len(gen.requests)

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        body: dict[str, Any] = {"id": response_id, "object": object_name, "created": created,
                                "model": gen.model, "choices": choices}
        if gen.include_usage:
            body["usage"] = usage
        return _sse(body)

    def choice(index: int, output: Any) -> dict | None:
        text = gen.text_of(output)
        reason = _finish_reason(output)
        end = len(text) if reason is not None else max(sent[index], len(text) - held_back[index])
        first = sent[index] == 0 and sent_tokens[index] == 0
        delta, sent[index], done[index] = text[sent[index]:end], end, reason is not None
        logprobs = None
        if gen.logprobs is not None:  # the logprobs of the tokens new since the last chunk
            count = len(gen.generated(output)[1])
            logprobs = gen.logprobs_json(output, sent_tokens[index], with_prompt=first)
            has_new = count > sent_tokens[index] or (first and gen.echo)
            sent_tokens[index] = count
            logprobs = logprobs if has_new else None
        if not delta and reason is None and logprobs is None:
            return None
        body = ({"delta": {"content": delta} if delta else {}} if gen.endpoint == "chat" else {"text": delta})
        if gen.echo_only and reason is not None:
            reason = "length"
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": reason}

    status = "cancelled"
    try:
        if gen.endpoint == "chat":  # OpenAI sends the role first, alone
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(len(gen.requests))])
        changed = list(range(len(gen.requests)))
        while True:
            choices = [choice(i, group.latest[i]) for i in changed if group.latest[i] is not None and not done[i]]
            choices = [c for c in choices if c is not None]
            if choices:
                yield chunk(choices)
            if all(done):
                break
            changed = await group.changes()
            _raise_output_error(group)
        if gen.include_usage:
            yield chunk([], _usage(gen, group))
        status = "ok"
        yield _sse("[DONE]")
    except Exception as error:  # mid-stream failure: an error event the openai client raises
        status = "error"
        yield _sse(to_api_error(error).body())
        yield _sse("[DONE]")
    finally:  # also runs when the client disconnects and the stream is cancelled
        state.engine.release(group)
        seconds = time.monotonic() - started if status == "ok" else None
        state.count_request(gen, status, group, seconds=seconds)

"""Completions and chat completions: API request -> engine requests -> JSON or server-sent events.

One HTTP request becomes one engine request per choice (``n`` per prompt of those `prompts`
made), each naming its HTTP request (``api_request_id``) so that the engine admits the choices of
several HTTP requests in turns. Before anything is sent the handler waits for the first output
(or the engine's "adapter failed" event, which comes the moment the load fails), so a request
whose adapter cannot be found or loaded gets a plain HTTP error (404/400/...) even with
``stream: true``; after that, a failure arrives as an SSE ``error`` event, which the ``openai``
client raises. A client that goes away aborts its engine requests (``AsyncEngine.release``), both
while waiting and mid-stream.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loramux.engine.sampling_params import SamplingParams
from loramux.errors import AdapterNotFoundError, InvalidAdapterError, IncompatibleAdapterError
from loramux.registry import LoRARequest
from loramux.serving.async_engine import RequestGroup, SubRequest
from loramux.serving.errors import EngineDeadError, error_response, to_api_error
from loramux.serving.protocol import ChatCompletionRequest
from loramux.serving.responses import Generation, full_response, raise_output_error
from loramux.serving.state import ServerState
from loramux.serving.streaming import stream_events

__all__ = ["build_requests", "chat_echo", "run_generation"]

# Status for a client that went away before its answer (nginx's convention; nobody reads it).
_CLIENT_CLOSED = 499


def chat_echo(request: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the last message's content, when it has the answer's role (the answer
    goes on from it: ``continue_final_message``)."""
    role = "assistant" if request.add_generation_prompt else request.messages[-1].role
    last = request.messages[-1]
    return last.text() if request.echo and last.role == role else ""


def build_requests(prompts: list[dict], params: SamplingParams, lora_request: LoRARequest | None, base_id: str,
                   cache_salt: str | None = None) -> tuple[list[SubRequest], list[int]]:
    """One engine request per (prompt, sample of ``params.n``), ids ``<base_id>-<choice>``, all of
    API request ``base_id``; and each choice's prompt. ``cache_salt`` (vLLM's) joins every prompt:
    its blocks are shared only with prompts salted alike."""
    samples = [params.for_sample(i) for i in range(params.n)]
    requests, prompt_of_choice = [], []
    for prompt_index, prompt in enumerate(prompts):
        if cache_salt is not None:
            prompt = {**prompt, "cache_salt": cache_salt}
        for sample in samples:
            requests.append(SubRequest(f"{base_id}-{len(requests)}", prompt, sample, lora_request,
                                       api_request_id=base_id))
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
        raise_output_error(group)


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


async def run_generation(state: ServerState, http_request: Request, gen: Generation) -> Response:
    """Submit ``gen`` to the engine and answer it, as JSON or as a stream of events."""
    started = time.monotonic()
    try:
        group = state.engine.submit(gen.requests)
    except EngineDeadError as error:
        return error_response(to_api_error(error))
    try:
        await _until_disconnected(http_request, group.changes())
        raise_output_error(group)
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
        return _ClosingStreamingResponse(stream_events(state, gen, group, started), media_type="text/event-stream",
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
    return JSONResponse(full_response(gen, group))


def _settle_adapter(state: ServerState, gen: Generation, group: RequestGroup, error: BaseException | None) -> None:
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

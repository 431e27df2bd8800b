"""The HTTP entry of a loramux application on Ray Serve: every request goes to a replica.

OpenAI clients name the adapter in the body (``model``), not in Ray's routing header, so this
deployment reads it and calls the replicas with ``multiplexed_model_id=<adapter>``; a client may
also send the ``serve_multiplexed_model_id`` header itself, which wins. Everything else — auth,
validation, errors, streaming, ``/v1/models`` — is the replica's copy of the single server's app;
the request and its answer pass through unchanged.

A replica that dies before the first byte of its answer reached the client costs the client
nothing: the request is sent again, to a replica that is alive. One that dies mid-stream ends
that stream with an error (its tokens cannot be taken back).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError

from loramux.serving.ray.asgi_call import HTTPRequest, ResponseStart

__all__ = ["LoramuxIngress", "MULTIPLEXED_MODEL_ID_HEADER"]

logger = logging.getLogger("loramux.serving")

MULTIPLEXED_MODEL_ID_HEADER = "serve_multiplexed_model_id"  # Ray Serve's own routing header
_ATTEMPTS = 4  # tries per request while replicas die under it (Ray replaces them meanwhile)
_RETRY_WAIT_S = 0.5

app = FastAPI(title="loramux on Ray Serve", summary="OpenAI-compatible server for many LoRA adapters, "
              "routed to the replica that holds the request's adapter")


def _http_request(request: Request, body: bytes) -> HTTPRequest:
    return HTTPRequest(request.method, request.url.path, request.scope.get("query_string", b""),
                       list(request.headers.raw), body)


class _Ingress:
    """Forwards HTTP to the ``LoramuxReplica`` deployment, routed by adapter.

    :param replicas: the replicas' deployment handle.
    :param adapter_affinity: route by adapter (Ray's multiplexing); False spreads requests by
        queue length alone (a baseline to compare routing against).
    """

    def __init__(self, replicas: Any, adapter_affinity: bool = True) -> None:
        from loramux.serving.server import configure_logging

        configure_logging()
        self._replicas = replicas
        self._adapter_affinity = adapter_affinity
        self._base_names: set[str] | None = None

    async def _routing_key(self, request: HTTPRequest) -> str:
        """The adapter a request names ("" for the base model or none): the multiplexed model id."""
        explicit = request.header(MULTIPLEXED_MODEL_ID_HEADER)
        if explicit is not None:
            return explicit
        model = request.model()
        if not self._adapter_affinity or model is None:
            return ""
        if self._base_names is None:
            self._base_names = set(await self._replicas.served_names.remote())
        return "" if model in self._base_names else model

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        body = await request.body()
        fields = _http_request(request, body).json_object() or {}
        name, path = fields.get("lora_name"), fields.get("lora_path")
        if not (isinstance(name, str) and isinstance(path, str)):  # the replica says what is wrong
            return await self._forward(_http_request(request, body))
        base = fields.get("base_model_name")
        return await self._change(_http_request(request, body), name, path, base if isinstance(base, str) else None)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        body = await request.body()
        name = (_http_request(request, body).json_object() or {}).get("lora_name")
        if not isinstance(name, str):
            return await self._forward(_http_request(request, body))
        return await self._change(_http_request(request, body), name, None, None)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"])
    async def forward(self, path: str, request: Request) -> Response:
        return await self._forward(_http_request(request, await request.body()))

    # -- calling the replicas ---------------------------------------------------------------------

    async def _change(self, request: HTTPRequest, name: str, path: str | None, base: str | None) -> Response:
        """A load or unload: one replica runs it and answers; the others replay it (directory.py)."""
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                answer = await self._replicas.change_adapter.remote(request, name, path, base)
            except RayActorError as error:
                await self._replica_lost(request, attempt, error)
                continue
            start, chunks = answer[0], answer[1:]
            response = Response(b"".join(chunks), status_code=start.status)
            response.raw_headers = list(start.headers)
            return response
        raise AssertionError("unreachable")  # _replica_lost raises on the last attempt

    async def _forward(self, request: HTTPRequest) -> Response:
        key = await self._routing_key(request)
        for attempt in range(1, _ATTEMPTS + 1):
            stream = self._replicas.options(stream=True, multiplexed_model_id=key).handle_http.remote(request)
            try:  # nothing reaches the client before the first chunk: until then a retry is invisible
                start = await stream.__anext__()
                first = await anext(stream, None)
            except RayActorError as error:
                stream.cancel()
                await self._replica_lost(request, attempt, error)
                continue
            assert isinstance(start, ResponseStart), f"a replica answered {type(start).__name__} first"
            response = StreamingResponse(_rest(first, stream), status_code=start.status)
            response.raw_headers = list(start.headers)
            return response
        raise AssertionError("unreachable")

    async def _replica_lost(self, request: HTTPRequest, attempt: int, error: BaseException) -> None:
        if attempt >= _ATTEMPTS:
            logger.error("%s %s: gave up after %d replicas died under it", request.method, request.path, attempt)
            raise error
        logger.warning("%s %s: the replica died before answering (%s); sending it to another",
                       request.method, request.path, type(error).__name__)
        await asyncio.sleep(_RETRY_WAIT_S * attempt)


async def _rest(first: bytes | None, stream: Any) -> AsyncIterator[bytes]:
    try:
        if first is not None:
            yield first
        async for chunk in stream:
            yield chunk
    finally:
        stream.cancel()  # the client went away (or we are done): stop the replica's generation


LoramuxIngress = serve.ingress(app)(_Ingress)

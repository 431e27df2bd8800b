"""One HTTP request, carried as plain data across Ray, answered by an ASGI app in this process.

The replicas run the very app ``loramux serve`` runs (``loramux.serving.app.build_app``): the
ingress ships each request over as an :class:`HTTPRequest`, and :func:`call_asgi` plays it into
the app and yields the response back as it is produced — first a :class:`ResponseStart`, then the
body chunks — so streaming, errors and validation are the single-process server's own.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HTTPRequest", "ResponseStart", "call_asgi"]

logger = logging.getLogger("loramux.serving")

# How long a request whose caller went away may take to notice and free its engine requests.
_CLOSE_GRACE_S = 5.0


@dataclass(frozen=True)
class HTTPRequest:
    """What the ingress received, as plain data (pickled across Ray)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # names lower-case
    body: bytes = b""

    def header(self, name: str) -> str | None:
        wanted = name.lower().encode()
        return next((value.decode("latin-1") for key, value in self.headers if key == wanted), None)

    def json_object(self) -> dict | None:
        """The body as a JSON object, or None if it is not one (the app then says what is wrong)."""
        try:
            value = json.loads(self.body) if self.body else None
        except (ValueError, UnicodeDecodeError):
            return None
        return value if isinstance(value, dict) else None

    def model(self) -> str | None:
        """The body's ``model`` field, when it has one: the base model's name or an adapter's."""
        model = (self.json_object() or {}).get("model") if self.method.upper() == "POST" else None
        return model if isinstance(model, str) and model else None


@dataclass
class ResponseStart:
    """The status and headers of a response, and which replica answered."""

    status: int
    headers: list[tuple[bytes, bytes]]

    def header(self, name: str) -> str | None:
        wanted = name.lower().encode()
        return next((value.decode("latin-1") for key, value in self.headers if key.lower() == wanted), None)


def _scope(request: HTTPRequest) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method.upper(), "scheme": "http", "path": request.path,
        "raw_path": request.path.encode(), "root_path": "", "query_string": request.query_string,
        "headers": list(request.headers), "client": None, "server": None, "state": {},
    }


async def call_asgi(app: Any, request: HTTPRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``request`` through ``app``; yield a ``ResponseStart``, then the non-empty body chunks.

    Closing the iterator early (the client went away) tells the app ``http.disconnect``, which
    aborts the request's engine work, and waits briefly for the app to wind down.
    """
    messages: asyncio.Queue[dict | None] = asyncio.Queue()
    caller_gone = asyncio.Event()
    body_pending = True

    async def receive() -> dict:
        nonlocal body_pending
        if body_pending:
            body_pending = False
            return {"type": "http.request", "body": request.body, "more_body": False}
        await caller_gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if caller_gone.is_set() and message["type"] == "http.response.body":
            raise OSError("the caller went away")  # what a closed socket does to a streaming response
        await messages.put(message)

    async def run() -> None:
        try:
            await app(_scope(request), receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    started = finished = False
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                started = True
                yield ResponseStart(message["status"], [tuple(h) for h in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                finished = not message.get("more_body", False)
                if message.get("body"):
                    yield bytes(message["body"])
        await task  # re-raises what the app raised
    except Exception:
        if finished:  # Starlette answers 500 and then re-raises: the answer is whole, the error logged
            logger.exception("%s %s raised", request.method, request.path)
            return
        if started:
            raise
        logger.exception("The app raised before answering %s %s", request.method, request.path)
        yield ResponseStart(500, [(b"content-type", b"application/json")])
        yield b'{"error": {"message": "internal server error (see the replica\'s log)", "type": "server_error"}}'
    finally:
        caller_gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), _CLOSE_GRACE_S)
            except (asyncio.TimeoutError, Exception):
                task.cancel()

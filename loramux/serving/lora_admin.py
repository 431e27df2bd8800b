"""Adapters registered at start-up, and loaded or unloaded at runtime (vLLM's two routes).

``POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}`` loads and validates the
adapter before answering (400 invalid or incompatible, 404 path not found); ``load_inplace``
replaces a loaded adapter's weights. ``POST /v1/unload_lora_adapter {lora_name}`` stops serving a
name at once. Both need ``--allow-runtime-lora-updating`` (else 403).

Requests already running keep the weights they started with: a replaced or unloaded adapter
leaves the engine only once they finish (retried in the background until the engine agrees).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from loramux.errors import LoRAError
from loramux.registry import LoRARequest
from loramux.serving.errors import APIError, from_lora_error
from loramux.serving.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from loramux.serving.state import ServerState, get_state

__all__ = ["register_static_adapters", "router"]

logger = logging.getLogger("loramux.serving")

_RETIRE_RETRY_S = 0.2

router = APIRouter()


def register_static_adapters(state: ServerState, engine: Any) -> None:
    """Load the ``--lora-modules`` adapters now (before serving), so a bad one stops start-up."""
    for name, path, base_model_name in state.config.lora_modules:
        lora = state.book.prepare(name, path, base_model_name)
        engine.add_lora(lora)
        state.book.commit(name, lora, source="static", path=path)


def _check_runtime_updating(state: ServerState) -> None:
    if not state.config.allow_runtime_lora_updating:
        raise APIError(403, "loading and unloading adapters at runtime is disabled; start the server "
                       "with --allow-runtime-lora-updating (or LORAMUX_ALLOW_RUNTIME_LORA_UPDATING=1)",
                       code="runtime_lora_updating_disabled")


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state = get_state(request)
    _check_runtime_updating(state)
    name = body.lora_name
    async with state.lora_lock:
        existing = state.book.get(name)
        replacing = existing is not None and existing.confirmed
        if replacing and not body.load_inplace:
            raise APIError(400, f"an adapter named {name!r} is already loaded; pass load_inplace=true "
                           "to replace its weights, or unload it first", param="lora_name",
                           code="adapter_exists")
        lora = state.book.prepare(name, body.lora_path, body.base_model_name)
        started = time.monotonic()
        try:  # loads and validates; blocks on I/O, so not on the event loop nor the engine thread
            await asyncio.to_thread(state.engine.engine.add_lora, lora)
        except LoRAError as error:
            raise from_lora_error(error, param="lora_path") from error
        except ValueError as error:  # e.g. LoRA is disabled in this engine
            raise APIError(400, str(error), param="lora_path", code="invalid_request") from error
        state.metrics.load_seconds.labels("explicit").observe(time.monotonic() - started)
        previous = state.book.commit(name, lora, source="runtime", path=body.lora_path)
        if previous is not None:
            await _retire(state, name, previous.request)
    verb = "reloaded" if replacing else "added"
    logger.info("Adapter %r %s from %s", name, verb, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' {verb} successfully.")


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state = get_state(request)
    _check_runtime_updating(state)
    name = body.lora_name
    async with state.lora_lock:
        entry = state.book.get(name)
        if entry is None or not entry.confirmed:
            raise APIError(404, f"no adapter named {name!r} is loaded; GET /v1/models lists the loaded "
                           "ones", param="lora_name", code="model_not_found")
        state.book.remove(name)
        await _retire(state, name, entry.request)
    logger.info("Adapter %r unloaded", name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _retire(state: ServerState, name: str, lora: LoRARequest) -> None:
    """Take ``lora`` out of the engine now, or once the requests running with it finish."""
    state.book.retire(lora)
    if await _try_remove(state, lora):
        return
    logger.info("Adapter %r is in use by running requests; it leaves the engine when they finish", name)

    async def keep_trying() -> None:
        while not await _try_remove(state, lora):
            await asyncio.sleep(_RETIRE_RETRY_S)

    task = asyncio.create_task(keep_trying())
    state.background.add(task)
    task.add_done_callback(state.background.discard)


async def _try_remove(state: ServerState, lora: LoRARequest) -> bool:
    """True once the engine no longer holds ``lora`` (False: running requests still use it)."""
    try:
        await asyncio.to_thread(state.engine.engine.remove_lora, lora.lora_name)
    except LoRAError:  # in use by running requests
        return False
    except Exception:  # nothing sensible left to do with it; do not retry forever
        logger.exception("Removing adapter %r from the engine failed", lora.lora_name)
    state.book.retired(lora)
    return True

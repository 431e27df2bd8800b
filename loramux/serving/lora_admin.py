"""Adapters registered at start-up, and loaded or unloaded at runtime (vLLM's two routes).

``POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}`` loads and validates the
adapter before answering (400 invalid or incompatible, 404 path not found); ``load_inplace``
replaces a loaded adapter's weights. ``POST /v1/unload_lora_adapter {lora_name}`` stops serving a
name at once. Both need ``--allow-runtime-lora-updating`` (else 403).

Loads and unloads of one name run one at a time; loads of different names run together, at
most as many as the engine's loading workers, so a slow source holds up only its own name's
(the engine's fetch timeout bounds how long a fetch holds its place, `RUNTIME_LOAD_WAIT_S` a wait
for room in a full CPU tier).

Requests already running keep the weights they started with. A reload rebinds the name to new
weights (a new handle) in the engine's registry and an unload unbinds it; both answer at once.
The old handle leaves the engine when its last request ends: the engine says so with a
"retired" event, which a background task awaits (and logs); nothing polls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from loramux.errors import LoRAError
from loramux.registry import AdapterHandle
from loramux.serving.engine_client import EngineClient
from loramux.serving.errors import APIError, from_lora_error
from loramux.serving.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from loramux.serving.state import ServerState, get_state

__all__ = ["register_static_adapters", "router"]

logger = logging.getLogger("loramux.serving")

router = APIRouter()

#: How long a runtime load waits for room when the CPU tier is full of adapters that running or
#: queued requests, or other runtime loads, hold: they release it as they finish, so the load waits
#: its turn (as a completion naming a cold adapter does) rather than failing; an adapter that can
#: never fit (larger than the whole tier) fails at once.
RUNTIME_LOAD_WAIT_S = 300.0


def register_static_adapters(state: ServerState, engine: EngineClient) -> None:
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
    async with state.adapter_lock(name), state.adapter_loads:
        existing = state.book.get(name)
        replacing = existing is not None and existing.confirmed
        if replacing and not body.load_inplace:
            raise APIError(400, f"an adapter named {name!r} is already loaded; pass load_inplace=true "
                           "to replace its weights, or unload it first", param="lora_name",
                           code="adapter_exists")
        lora = state.book.prepare(name, body.lora_path, body.base_model_name)
        old = _bound_handle(state, name)
        retired = _retirement(state, old)  # asked before the engine can retire it
        started = time.monotonic()
        try:  # loads and validates; blocks on I/O, so not on the event loop nor the engine thread
            await asyncio.to_thread(state.engine.engine.add_lora, lora, wait_s=RUNTIME_LOAD_WAIT_S)
        except (LoRAError, ValueError) as error:
            if old is not None:
                state.engine.forget_retirement(old.id)
            if isinstance(error, LoRAError):
                raise from_lora_error(error, param="lora_path") from error
            raise APIError(400, str(error), param="lora_path", code="invalid_request") from error  # LoRA off
        new = _bound_handle(state, name)
        source = (new.source if new is not None else None) or "path"
        state.metrics.load_seconds.labels("explicit", source).observe(time.monotonic() - started)
        state.book.commit(name, lora, source="runtime", path=body.lora_path)
        if old is not None and new == old:  # the same content again: the same handle, nothing retires
            state.engine.forget_retirement(old.id)
        elif retired is not None:
            _log_when_retired(state, name, retired)
    verb = "reloaded" if replacing else "added"
    logger.info("Adapter %r %s from %s", name, verb, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' {verb} successfully.")


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state = get_state(request)
    _check_runtime_updating(state)
    name = body.lora_name
    async with state.adapter_lock(name):
        entry = state.book.get(name)
        if entry is None or not entry.confirmed:
            raise APIError(404, f"no adapter named {name!r} is loaded; GET /v1/models lists the loaded "
                           "ones", param="lora_name", code="model_not_found")
        handle = _bound_handle(state, name)
        retired = _retirement(state, handle)
        state.book.remove(name)
        await asyncio.to_thread(state.engine.engine.remove_lora, name)  # unbinds; returns at once
        if retired is not None:
            _log_when_retired(state, name, retired)
    logger.info("Adapter %r unloaded", name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _bound_handle(state: ServerState, name: str) -> AdapterHandle | None:
    """The handle the engine's registry binds ``name`` to (None: not loaded)."""
    return state.engine.engine.lora_handle(name)


def _retirement(state: ServerState, handle: AdapterHandle | None) -> asyncio.Future | None:
    return state.engine.retirement(handle.id) if handle is not None else None


def _log_when_retired(state: ServerState, name: str, retired: asyncio.Future) -> None:
    """Await the engine's "retired" event for the old handle in the background (no polling)."""

    async def wait() -> None:
        event = await retired
        logger.info("Adapter %r: the old weights (handle %d) left the engine as their last request "
                    "ended", name, event.handle.id)

    task = asyncio.create_task(wait())
    state.background.add(task)
    task.add_done_callback(state.background.discard)

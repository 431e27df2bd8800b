"""One Ray Serve replica: one loramux engine behind the same app ``loramux serve`` runs.

Ray Serve's model multiplexing does the adapter-aware routing: every request the ingress sends
carries the adapter's name as its multiplexed model id, and the replica marks that name "loaded"
through a ``@serve.multiplexed`` function whose per-replica cap is the CPU tier's size. Ray then
sends the adapter's requests to the replicas that report it while they have room
(``max_ongoing_requests``), and a new adapter to a replica with the fewest adapters. The marks
and the CPU tier see the same requests and keep the same number of adapters (both LRU), so what
Ray believes a replica holds is what its tier holds.

The adapter itself is found, loaded and cached by the engine exactly as in the single server:
same resolver plugins, same tiers, same errors.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from loramux.serving.ray.asgi_call import HTTPRequest, ResponseStart, call_asgi
from loramux.serving.ray.directory import AdapterChange

__all__ = ["REPLICA_HEADER", "COLD_LOAD_HEADER", "LoramuxReplica"]

logger = logging.getLogger("loramux.serving")

REPLICA_HEADER = "x-loramux-replica"  # which replica answered (its Ray Serve replica id)
COLD_LOAD_HEADER = "x-loramux-cold-load"  # "1": the adapter was not in that replica's CPU tier


class LoramuxReplica:
    """A Ray Serve deployment class (``serve.deployment(LoramuxReplica)``): one engine, one app.

    :param serve_args: the ``loramux serve`` settings (see :func:`loramux.serving.ray.serve_args.parse_serve_args`).
    :param directory: a handle to the ``AdapterDirectory`` deployment (runtime loads and unloads),
        or None when runtime loading is off.
    """

    async def __init__(self, serve_args: dict[str, Any], directory: Any = None) -> None:
        import prometheus_client
        from ray import serve

        from loramux.serving.app import build_app
        from loramux.serving.ray.serve_args import parse_serve_args
        from loramux.serving.server import build_engine, configure_logging, describe

        configure_logging()
        prometheus_client.disable_created_metrics()
        args = parse_serve_args(serve_args)
        # the resolver settings come from the flags in args (build_engine), never from os.environ
        self.engine, self.config = await asyncio.to_thread(build_engine, args)
        self.config.allow_runtime_lora_updating = True  # the ingress decides; replicas replay its changes
        self.app = build_app(self.engine, self.config)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the engine thread on this replica's event loop
        describe(self.engine, self.config)

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        cpu = self.engine.tier_stats().get("cpu")
        # Ray's -1: no count (the CPU tier is bounded by bytes alone)
        self.cpu_tier_size = (cpu.max_adapters or -1) if cpu is not None else 1

        async def hold_adapter(name: str) -> str:  # the engine loads it; this only tells Ray it is here
            return name

        self._hold_adapter = serve.multiplexed(max_num_models_per_replica=self.cpu_tier_size)(hold_adapter)
        self._directory = directory
        self._version = 0  # the directory's version this replica has replayed up to
        self._catch_up_lock = asyncio.Lock()
        logger.info("Replica %s ready: CPU tier of %s adapters", self.replica_id,
                    self.cpu_tier_size if self.cpu_tier_size > 0 else "any number of")

    # -- what the ingress calls -------------------------------------------------------------------

    def served_names(self) -> list[str]:
        """The base model's names: requests for them carry no adapter to route by."""
        return list(self.config.served_model_names)

    async def handle_http(self, request: HTTPRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Answer ``request`` with the single server's app: a ``ResponseStart``, then body chunks."""
        from ray import serve

        await self._catch_up()
        model = request.model()
        cold = None  # the header tells whether the adapter had to be loaded, whatever the routing
        if model is not None and model not in self.config.served_model_names:
            cold = model not in self._cpu_tier()
        routed_by = serve.get_multiplexed_model_id()
        async for item in call_asgi(self.app, request):
            if isinstance(item, ResponseStart):
                if routed_by and item.status < 400:  # a misspelt or missing adapter never takes a place
                    await self._hold_adapter(routed_by)
                item.headers.append((REPLICA_HEADER.encode(), self.replica_id.encode()))
                if cold is not None:
                    item.headers.append((COLD_LOAD_HEADER.encode(), b"1" if cold else b"0"))
            yield item

    async def change_adapter(self, request: HTTPRequest, name: str, path: str | None,
                             base_model_name: str | None = None) -> list[ResponseStart | bytes]:
        """Run a load (``path``) or unload (None) request here first; on success, record it for all."""
        await self._catch_up()
        answer = [item async for item in call_asgi(self.app, request)]
        if self._directory is not None and isinstance(answer[0], ResponseStart) and answer[0].status == 200:
            async with self._catch_up_lock:
                version = await self._directory.record.remote(name, path, base_model_name)
                if version == self._version + 1:  # nothing else changed meanwhile: no need to replay ours
                    self._version = version
        return answer

    # -- keeping up with the other replicas -------------------------------------------------------

    async def _catch_up(self) -> None:
        """Replay the runtime loads and unloads this replica has not seen yet."""
        if self._directory is None or await self._directory.version.remote() == self._version:
            return
        async with self._catch_up_lock:
            version, changes = await self._directory.changes_since.remote(self._version)
            for change in changes:
                await self._replay(change)
            self._version = version

    async def _replay(self, change: AdapterChange) -> None:
        if change.path is None:
            path, body = "/v1/unload_lora_adapter", {"lora_name": change.name}
        else:
            path = "/v1/load_lora_adapter"
            body = {"lora_name": change.name, "lora_path": change.path, "load_inplace": True,
                    "base_model_name": change.base_model_name}
        headers = [(b"content-type", b"application/json")]
        if self.config.api_key:
            headers.append((b"authorization", f"Bearer {self.config.api_key}".encode()))
        answer = [item async for item in call_asgi(self.app, HTTPRequest("POST", path, b"", headers,
                                                                          json.dumps(body).encode()))]
        status = answer[0].status if answer and isinstance(answer[0], ResponseStart) else None
        if status != 200 and not (change.path is None and status == 404):  # 404: never had it
            detail = b"".join(item for item in answer if isinstance(item, bytes)).decode(errors="replace")
            logger.warning("Replica %s could not replay %s of adapter %r (HTTP %s): %s", self.replica_id,
                           "the unload" if change.path is None else f"the load from {change.path}",
                           change.name, status, detail)

    def _cpu_tier(self) -> list[str]:
        cpu = self.engine.tier_stats().get("cpu")
        return cpu.resident if cpu is not None else []

    def __del__(self) -> None:  # Ray Serve calls it when it stops the replica
        state = getattr(getattr(getattr(self, "app", None), "state", None), "loramux", None)
        if state is not None:
            state.engine.stop()
        close = getattr(getattr(self, "engine", None), "close", None)
        if close is not None:
            close()

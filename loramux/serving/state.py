"""What the routes share: the settings, the engine bridge, the adapter names and the metrics."""

from __future__ import annotations

import asyncio
import logging
import re
import weakref
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request

from loramux.engine.sampling_params import SamplingParams, StructuredOutputsParams

from loramux.serving.adapters import AdapterBook
from loramux.serving.async_engine import AsyncEngine, RequestGroup
from loramux.serving.engine_client import EngineClient
from loramux.serving.errors import APIError
from loramux.serving.metrics import UNKNOWN_MODEL, Metrics
from loramux.serving.config import ServerConfig
from loramux.serving.prompts import Prompts
from loramux.serving.protocol import ChatCompletionRequest, CompletionRequest
from loramux.serving.request_params import extra_sampling_kwargs
from loramux.serving.responses import Generation

__all__ = ["ServerState", "get_state"]

logger = logging.getLogger("loramux.serving")

_COMPILE_THREADS = 2  # as many as the engine compiles at once (its trial processes)
_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+):")


class ServerState:
    """Everything the routes share (``request.app.state.loramux``)."""

    def __init__(self, engine: EngineClient, config: ServerConfig,
                 sampling_params_cls: type[SamplingParams] = SamplingParams) -> None:
        self.config = config
        if config.max_model_len is None:
            config.max_model_len = engine.max_model_len
        self.engine = AsyncEngine(engine)
        self.prompts = Prompts(engine.tokenizer, max_model_len=config.max_model_len,
                               vocab_size=engine.vocab_size, max_prompts_per_request=config.max_prompts_per_request,
                               chat_template=config.chat_template)
        # structured-output compiles wait here, not in the threads that tokenize prompts
        self.compile_threads = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="loramux-compile")
        self.book = AdapterBook(config.served_model_names, engine.list_loras if engine.lora_enabled else tuple)
        self.sampling_params_cls = sampling_params_cls
        self.metrics = Metrics(engine.tier_stats, lambda: self.engine.waiting,
                               lambda: self.engine.in_flight - self.engine.waiting,
                               engine.get_num_unfinished_requests, engine.router_stats,
                               config.served_model_names[0] if config.served_model_names else "")
        # one load or unload of a name at a time (weak: a lock lives while someone waits on it)
        self._adapter_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self.adapter_loads = asyncio.Semaphore(engine.max_loading_workers)
        self.background: set[asyncio.Task] = set()  # adapters waiting to leave the engine

    def adapter_lock(self, name: str) -> asyncio.Lock:
        """The lock that orders the loads and unloads of adapter ``name``."""
        lock = self._adapter_locks.get(name)
        if lock is None:
            lock = self._adapter_locks[name] = asyncio.Lock()
        return lock

    def count_request(self, gen: Generation, status: str, group: RequestGroup, *,
                      seconds: float | None = None) -> None:
        """Count a finished HTTP request and its tokens under its model's name."""
        known = gen.lora_request is None or self.book.is_known(gen.model, gen.lora_request)
        model = gen.model if known else UNKNOWN_MODEL
        self.metrics.requests.labels(model, gen.endpoint, status).inc()
        prompt_tokens = {gen.prompt_of_choice[i]: len(o.prompt_token_ids or ())
                         for i, o in enumerate(group.latest) if o is not None}
        generated = sum(len(o.outputs[0].token_ids) for o in group.latest if o is not None and o.outputs)
        if prompt_tokens:
            self.metrics.prompt_tokens.labels(model).inc(sum(prompt_tokens.values()))
        if generated:
            self.metrics.generation_tokens.labels(model).inc(generated)
        if seconds is not None:
            self.metrics.request_seconds.labels(gen.endpoint).observe(seconds)
        self._observe_latencies(model, group, ok=seconds is not None)

    def _observe_latencies(self, model: str, group: RequestGroup, ok: bool) -> None:
        """Time to first token (every choice that got one), inter-token gaps, and end-to-end latency
        (choices that finished), under the request's model."""
        for first, last in zip(group.first_token_at, group.last_token_at):
            if first is not None:
                self.metrics.time_to_first_token.labels(model).observe(first - group.submitted_at)
            if ok and last is not None:
                self.metrics.e2e_latency.labels(model).observe(last - group.submitted_at)
        histogram = self.metrics.inter_token_latency.labels(model)
        for gap in group.inter_token_gaps:
            histogram.observe(gap)

    def sampling_params(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """The engine's ``SamplingParams`` for ``body``, its ``n`` samples included (each choice's
        engine request takes ``for_sample(i)``)."""
        try:
            params = self.sampling_params_cls(
                n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, max_tokens=max_tokens,
                stop=body.stop_list(), stop_token_ids=body.stop_token_ids, seed=body.seed,
                ignore_eos=body.ignore_eos, **extra_sampling_kwargs(body, structured))
        except (TypeError, ValueError) as error:  # "SamplingParams.top_p: got 0; allowed: ..."
            field = _SAMPLING_FIELD.match(str(error))
            raise APIError(400, f"invalid sampling parameters: {error}", param=field[1] if field else None,
                           code="invalid_parameter") from error
        vocab = self.prompts.vocab_size
        for name in ("logit_bias", "allowed_token_ids"):
            bad = next((t for t in getattr(params, name, None) or () if vocab is not None and t >= vocab), None)
            if bad is not None:
                raise APIError(400, f"{name}: token id {bad} is outside the vocabulary (0 to {vocab - 1})",
                               param=name, code="invalid_parameter")
        return params


def get_state(request: Request) -> ServerState:
    return request.app.state.loramux

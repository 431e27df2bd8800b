"""What the routes share: the settings, the engine bridge, the adapter names and the metrics."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from loramux.serving.adapters import AdapterBook
from loramux.serving.async_engine import AsyncEngine, RequestGroup
from loramux.serving.engine_info import engine_requests, read_tiers, router_stats, vocab_size
from loramux.serving.errors import APIError
from loramux.serving.metrics import UNKNOWN_MODEL, Metrics
from loramux.serving.protocol import ChatCompletionRequest, CompletionRequest
from loramux.serving.request_params import extra_sampling_kwargs
from loramux.serving.responses import Generation

__all__ = ["ServerConfig", "ServerState", "get_state"]

logger = logging.getLogger("loramux.serving")

_FALLBACK_MAX_TOKENS = 256  # when the engine does not say how long its context is


@dataclass
class ServerConfig:
    """What the HTTP layer needs to know beyond the engine.

    :param served_model_names: the base model's names; the first is echoed in responses.
    :param api_key: when set, every /v1 route needs ``Authorization: Bearer <api_key>``.
    :param allow_runtime_lora_updating: enables /v1/load_lora_adapter and /v1/unload_lora_adapter
        (403 otherwise).
    :param lora_modules: ``(name, path, base_model_name)`` adapters registered at start-up.
    :param chat_template: a Jinja template overriding the tokenizer's.
    :param max_model_len: shown in /v1/models, and bounds ``max_tokens`` when a request gives none
        (default: the engine's ``max_model_len``).
    """

    served_model_names: list[str]
    api_key: str | None = None
    allow_runtime_lora_updating: bool = False
    lora_modules: list[tuple[str, str, str | None]] = field(default_factory=list)
    chat_template: str | None = None
    max_model_len: int | None = None


class ServerState:
    """Everything the routes share (``request.app.state.loramux``)."""

    def __init__(self, engine: Any, config: ServerConfig, sampling_params_cls: Any) -> None:
        self.config = config
        if config.max_model_len is None:
            config.max_model_len = getattr(engine, "max_model_len", None)
        self.engine = AsyncEngine(engine)
        self.vocab_size = vocab_size(engine)  # token-id prompts are checked against it
        self.book = AdapterBook(config.served_model_names)
        self.sampling_params_cls = sampling_params_cls
        self.metrics = Metrics(lambda: read_tiers(engine), lambda: self.engine.waiting,
                               lambda: self.engine.in_flight - self.engine.waiting,
                               lambda: engine_requests(engine), lambda: router_stats(engine),
                               config.served_model_names[0] if config.served_model_names else "")
        self.lora_lock = asyncio.Lock()  # one load or unload at a time
        self.background: set[asyncio.Task] = set()  # adapters waiting to leave the engine

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

    def default_max_tokens(self, prompt_len: int | None) -> int:
        """``max_tokens`` for a request that gives none: the rest of the context, if known."""
        limit = self.config.max_model_len
        if not limit:
            return _FALLBACK_MAX_TOKENS
        return max(1, limit - (prompt_len or 0))

    def sampling_params(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                        structured: Any = None) -> Any:
        """The engine's ``SamplingParams`` for ``body``, its ``n`` samples included (each choice's
        engine request takes ``for_sample(i)``)."""
        try:
            return self.sampling_params_cls(
                n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, max_tokens=max_tokens,
                stop=body.stop_list(), stop_token_ids=body.stop_token_ids, seed=body.seed,
                ignore_eos=body.ignore_eos, **extra_sampling_kwargs(body, structured))
        except (TypeError, ValueError) as error:
            raise APIError(400, f"invalid sampling parameters: {error}", code="invalid_parameter") from error


def get_state(request: Request) -> ServerState:
    return request.app.state.loramux

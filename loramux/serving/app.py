"""The OpenAI-compatible FastAPI app: its routes, auth, and ``build_app``.

``build_app(engine, config)`` takes any object with the ``LLMEngine`` contract; the engine thread
starts with the app (lifespan) and stops with it. Every ``/v1`` route needs
``Authorization: Bearer <key>`` when ``config.api_key`` is set; ``/health`` and ``/metrics`` never do.
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from loramux.engine.sampling_params import SamplingParams, StructuredOutputsParams
from loramux.engine.core.structured_output import StructuredOutputLimitError, UnsupportedStructuredOutput
from loramux.serving import lora_admin
from loramux.serving.errors import APIError, install_error_handlers
from loramux.serving.generation import build_requests, chat_echo, run_generation
from loramux.serving.metrics import CONTENT_TYPE
from loramux.serving.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from loramux.serving.request_params import structured_outputs_of
from loramux.serving.responses import Generation
from loramux.serving.config import ServerConfig
from loramux.serving.engine_client import EngineClient
from loramux.serving.state import ServerState, get_state

__all__ = ["build_app"]


def _check_api_key(request: Request) -> None:
    key = get_state(request).config.api_key
    if not key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                       "with the key the server was started with (--api-key)", code="invalid_api_key")


def _check_supported(body: CompletionRequest | ChatCompletionRequest) -> None:
    refused = body.unsupported()
    if refused is not None:
        name, what = refused
        raise APIError(400, f"{name}: not supported by loramux ({what}); leave it out", param=name,
                       code="unsupported_parameter")


async def _structured_outputs(state: ServerState, body: CompletionRequest | ChatCompletionRequest,
                              ) -> StructuredOutputsParams | None:
    """The request's format, compiled once here (in the compile threads, so a slow schema holds up
    neither the event loop, nor the engine's threads, whose compile then finds it cached, nor
    other requests' tokenizing), within the engine's limits."""
    asked = structured_outputs_of(body)
    if asked is None:
        return None
    field, spec = asked
    try:
        await asyncio.get_running_loop().run_in_executor(state.compile_threads,
                                                         state.engine.engine.compile_structured_output, spec)
    except UnsupportedStructuredOutput as error:
        over_limit = isinstance(error, StructuredOutputLimitError)
        raise APIError(400, f"{field}: {error}", param=field,
                       code="structured_output_limit" if over_limit else "unsupported_schema") from error
    return spec


async def _generation(state: ServerState, endpoint: str, body: CompletionRequest | ChatCompletionRequest,
                      prompts: list[dict],
                      max_tokens: int) -> Generation:
    if body.model not in state.book.served_names and not state.engine.engine.lora_enabled:
        raise APIError(404, f"the model {body.model!r} is not served here (this server serves "
                       f"{', '.join(state.book.served_names)}; LoRA adapters are off: --no-enable-lora)",
                       param="model", code="model_not_found")
    structured = await _structured_outputs(state, body)
    lora_request = state.book.lookup(body.model)
    prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
    engine_id = f"{prefix}-{uuid.uuid4().hex}"  # unique, whatever request_id a client gives
    response_id = f"{prefix}-{body.request_id}" if body.request_id else engine_id
    echo_only = endpoint == "completions" and max_tokens == 0  # score the prompt, generate nothing
    params = state.sampling_params(body, max_tokens or 1, structured)
    requests, prompt_of_choice = build_requests(prompts, params, lora_request, engine_id, body.cache_salt)
    options = body.stream_options
    include_usage = bool(body.stream and options and options.include_usage)
    return Generation(
        endpoint, body.model, lora_request, requests, response_id, prompt_of_choice, stream=body.stream,
        include_usage=include_usage, continuous_usage=include_usage and options.continuous_usage_stats,
        stream_interval=body.stream_interval or 1, echo=endpoint == "completions" and body.echo,
        echo_only=echo_only, chat_echo=chat_echo(body) if endpoint == "chat" else "",
        logprobs=body.logprobs if endpoint == "completions" else (body.top_logprobs or 0) if body.logprobs else None,
        prompt_logprobs=body.prompt_logprobs is not None,  # vLLM's field (echo's come in logprobs)
        return_token_ids=body.return_token_ids,
        rendered_prompt=prompts[0]["prompt"] if endpoint == "chat" and body.return_prompt_text else None,
        tokenizer=state.engine.engine.tokenizer, tokens_as_ids=body.return_tokens_as_token_ids)


# ---------------------------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------------------------

v1 = APIRouter(prefix="/v1", dependencies=[Depends(_check_api_key)])
public = APIRouter()


@public.get("/health")
async def health(request: Request) -> Response:
    dead = get_state(request).engine.dead
    if dead is not None:
        return JSONResponse({"status": "engine_dead", "error": str(dead)}, status_code=503)
    return JSONResponse({"status": "ok"})


@public.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)


def _model_cards(state: ServerState) -> list[ModelCard]:
    base, max_model_len = state.book.base_name, state.config.max_model_len
    cards = [ModelCard(id=name, root=base, max_model_len=max_model_len) for name in state.book.served_names]
    for name, entry in state.book.listed():
        cards.append(ModelCard(id=name, root=entry.path, parent=base, max_model_len=max_model_len))
    return cards


@v1.get("/models")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=_model_cards(get_state(request)))


@v1.get("/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> ModelCard:
    for card in _model_cards(get_state(request)):
        if card.id == model:
            return card
    raise APIError(404, f"the model {model!r} is not loaded (an adapter found on demand is listed "
                   "after its first request)", param="model", code="model_not_found")


@v1.post("/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = get_state(request)
    _check_supported(body)
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens: 0 is allowed only with echo: true (to score the prompt); give "
                       "max_tokens >= 1", param="max_tokens", code="invalid_parameter")
    prompts = await state.prompts.completion(body)
    if body.max_tokens is None:
        max_tokens = state.prompts.default_max_tokens(prompts)
    else:
        max_tokens = body.max_tokens
        if max_tokens:  # 0: score the prompt only
            state.prompts.check_max_tokens("max_tokens", max_tokens, prompts)
    gen = await _generation(state, "completions", body, prompts, max_tokens)
    return await run_generation(state, request, gen)


@v1.post("/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    _check_supported(body)
    prompt = await state.prompts.chat(body)
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:  # OpenAI's default: as long as the context allows
        max_tokens = state.prompts.default_max_tokens([prompt])
    else:
        state.prompts.check_max_tokens(param, max_tokens, [prompt])
    gen = await _generation(state, "chat", body, [prompt], max_tokens)
    return await run_generation(state, request, gen)


v1.include_router(lora_admin.router)


# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------


def build_app(engine: EngineClient, config: ServerConfig, *,
              sampling_params_cls: type[SamplingParams] = SamplingParams) -> FastAPI:
    """The FastAPI app serving ``engine`` (an ``LLMEngine``, or another `EngineClient`).

    The ``config.lora_modules`` adapters are loaded here, before the app serves anything.
    """
    state = ServerState(engine, config, sampling_params_cls)
    lora_admin.register_static_adapters(state, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        try:
            yield
        finally:
            for task in list(state.background):
                task.cancel()
            await asyncio.to_thread(state.engine.stop)
            state.compile_threads.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="loramux", summary="OpenAI-compatible server for many LoRA adapters on one model",
                  lifespan=lifespan)
    app.state.loramux = state
    install_error_handlers(app)
    app.include_router(public)
    app.include_router(v1)
    return app

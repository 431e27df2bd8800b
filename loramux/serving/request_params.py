"""From an API request's fields to the engine's ``SamplingParams`` arguments beyond the basics:
penalties, logit bias, min_tokens / min_p, allowed tokens, logprobs and structured outputs.

Structured outputs come from OpenAI's ``response_format``, vLLM's ``structured_outputs`` (its
``StructuredOutputsParams`` as a JSON object) or its older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``; a request gives at most one of them.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from loramux.engine.sampling_params import StructuredOutputsParams
from loramux.serving.errors import APIError
from loramux.serving.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["engine_logprobs", "extra_sampling_kwargs", "structured_outputs_of"]

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_SPEC_FIELDS = {f.name for f in fields(StructuredOutputsParams)}


def structured_outputs_of(
    body: CompletionRequest | ChatCompletionRequest,
) -> tuple[str, StructuredOutputsParams] | None:
    """The format the request asks for and the field that asked, or None (``response_format:
    {"type": "text"}`` is None).

    :raises APIError: 400 naming the field: two formats at once, a json_schema without a schema,
        or a ``structured_outputs`` object that is not vLLM's StructuredOutputsParams.
    """
    asked: list[tuple[str, dict[str, Any]]] = []
    format_ = body.response_format
    if format_ is not None and format_.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif format_ is not None and format_.type == "json_schema":
        schema = (format_.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format: type 'json_schema' needs json_schema.schema, a JSON schema "
                           'object: {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                           param="response_format", code="invalid_parameter")
        asked.append(("response_format", {"json": schema}))
    elif format_ is not None and format_.type == "structural_tag":
        asked.append(("response_format", {"structural_tag": format_.model_dump_json(exclude_none=True)}))
    if body.structured_outputs is not None:
        asked.append(("structured_outputs", dict(body.structured_outputs)))
    for field, kind in _GUIDED.items():
        value = getattr(body, field)
        if value is not None:
            asked.append((field, {kind: value}))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise APIError(400, f"{names}: give one structured-output format, not several", param=asked[1][0],
                       code="invalid_parameter")
    field, kwargs = asked[0]
    unknown = sorted(set(kwargs) - _SPEC_FIELDS)
    if unknown:
        raise APIError(400, f"{field}: unknown key {unknown[0]!r}; vLLM's StructuredOutputsParams has "
                       f"{', '.join(sorted(_SPEC_FIELDS))}", param=field, code="invalid_parameter")
    try:
        return field, StructuredOutputsParams(**kwargs)
    except ValueError as error:
        raise APIError(400, f"{field}: {error}", param=field, code="invalid_parameter") from error


def engine_logprobs(body: CompletionRequest | ChatCompletionRequest) -> tuple[int | None, int | None]:
    """``(logprobs, prompt_logprobs)`` for the engine: chat's ``top_logprobs`` only with
    ``logprobs: true``; completions' ``echo`` with ``logprobs`` scores the prompt too."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs",
                           code="invalid_parameter")
        return (body.top_logprobs or 0) if body.logprobs else None, body.prompt_logprobs
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    return body.logprobs, prompt_logprobs


def extra_sampling_kwargs(body: CompletionRequest | ChatCompletionRequest,
                          structured: StructuredOutputsParams | None) -> dict[str, Any]:
    """The ``SamplingParams`` arguments a request sets beyond temperature, top-p/k, stops and seed."""
    kwargs: dict[str, Any] = {}
    for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                          ("min_tokens", 0), ("min_p", 0.0), ("include_stop_str_in_output", False),
                          ("skip_special_tokens", True), ("allowed_token_ids", None)):
        if getattr(body, name) != default:
            kwargs[name] = getattr(body, name)
    if body.logit_bias:
        kwargs["logit_bias"] = body.logit_bias
    logprobs, prompt_logprobs = engine_logprobs(body)
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    if prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = prompt_logprobs
    if structured is not None:
        kwargs["structured_outputs"] = structured
    return kwargs

"""The OpenAI wire format: request and response bodies, as pydantic models.

Requests accept the fields OpenAI's clients send (and vLLM's extras: ``top_k``, ``ignore_eos``,
``stop_token_ids``, ``repetition_penalty``, ``min_tokens``, ``min_p``, ``prompt_logprobs``,
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``); unknown fields are ignored, as OpenAI's server does. Fields whose feature
loramux does not implement are refused by name rather than silently dropped (``unsupported``).
Each field has the type OpenAI's spec gives it, strictly: a string is not an integer, a boolean not
a number (pydantic's strict mode).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loramux.engine.sampling_params import MAX_LOGPROBS

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ErrorBody",
    "ErrorResponse",
    "LoadLoRAAdapterRequest",
    "ModelCard",
    "ModelList",
    "ResponseFormat",
    "StreamOptions",
    "UnloadLoRAAdapterRequest",
    "UsageInfo",
]


class _Request(BaseModel):
    # Types as OpenAI's spec gives them: no "10" for an integer, no true for a number, no NaN.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: ``text``, ``json_object``, or ``json_schema`` with
    ``{"name": ..., "schema": {...}, "strict": ...}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _SamplingFields(_Request):
    """What completions and chat share: the model, sampling, stopping and streaming."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # a signed 64-bit integer
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # structured outputs: OpenAI's response_format, or vLLM's guided_* fields (one of them)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def unsupported(self) -> str | None:
        """The first field asking for something loramux does not do, or None."""
        return None

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt`` is a string, a list of them, token ids or lists of those."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    # 0 only with echo: score the prompt and generate nothing (evaluation harnesses do this)
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.best_of not in (None, 1, self.n):
            return "best_of"
        if self.suffix:
            return "suffix"
        return super().unsupported()


class ChatMessage(_Request):
    role: str = Field(min_length=1)
    # A string, or OpenAI's list of content parts (only ``{"type": "text"}`` parts are supported).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        return super().unsupported()


class LoadLoRAAdapterRequest(_Request):
    """``POST /v1/load_lora_adapter``, as vLLM takes it."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(_Request):
    """``POST /v1/unload_lora_adapter``, as vLLM takes it."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``; an adapter's ``parent`` is the base model it runs on."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "loramux"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody

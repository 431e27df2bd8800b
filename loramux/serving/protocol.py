"""The OpenAI wire format: request and response bodies, as pydantic models.

Requests accept the fields OpenAI's clients send (and vLLM's extras: ``top_k``, ``ignore_eos``,
``stop_token_ids``); unknown fields are ignored, as OpenAI's server does. Fields whose feature
loramux does not implement are refused by name rather than silently dropped (``unsupported``).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ErrorBody",
    "ErrorResponse",
    "LoadLoRAAdapterRequest",
    "ModelCard",
    "ModelList",
    "StreamOptions",
    "UnloadLoRAAdapterRequest",
    "UsageInfo",
]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


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
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted so clients that always send them work; refused when they ask for an effect.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def unsupported(self) -> str | None:
        """The first field asking for something loramux does not do, or None."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return name
        if self.logit_bias:
            return "logit_bias"
        return None

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt`` is a string, a list of them, token ids or lists of those."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.logprobs is not None:
            return "logprobs"
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
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True

    def unsupported(self) -> str | None:
        if self.logprobs:
            return "logprobs"
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

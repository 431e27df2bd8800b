"""The OpenAI wire format: request and response bodies, as pydantic models.

Requests accept the fields OpenAI's clients send and vLLM's extras (docs/sampling.md lists every
one of vLLM's with what loramux does with it). A field whose feature loramux does not implement is
refused by name (``unsupported``: a 400) unless its value asks for nothing; unknown fields are
ignored, as OpenAI's server does. Each field has the type OpenAI's spec gives it, strictly: a
string is not an integer, a boolean not a number (pydantic's strict mode).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

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
    """``stream_options`` (with ``stream: true`` only): a last chunk with the request's ``usage``
    (vLLM's default when the object is given), and vLLM's ``continuous_usage_stats``: each chunk
    carries its choice's usage so far."""

    include_usage: bool = True
    continuous_usage_stats: bool = False


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: ``text``, ``json_object``, or ``json_schema`` with
    ``{"name": ..., "schema": {...}, "strict": ...}``; and vLLM's ``structural_tag`` (its other
    keys are the tag: ``structures`` and ``triggers``, or ``format``)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None


# vLLM's request fields for what loramux does not do: each is refused by name (a 400) unless its
# value asks for nothing (the values listed). docs/sampling.md lists them with the fields honoured.
NOT_IMPLEMENTED: dict[str, tuple[str, tuple]] = {
    "use_beam_search": ("beam search", (False,)),
    "length_penalty": ("beam search's length penalty", (1, 1.0)),
    "watermarking": ("watermarking", (False,)),
    "truncate_prompt_tokens": ("prompt truncation", ()),
    "truncation_side": ("prompt truncation", ()),
    "logprob_token_ids": ("logprobs for chosen token ids", ()),
    "bad_words": ("bad words", ([],)),
    "spaces_between_special_tokens": ("special tokens without spaces between them", (True,)),
    "prompt_embeds": ("prompt embeddings", ()),
    "priority": ("priority scheduling", (0,)),
    "routed_experts_prompt_start": ("routed-expert data", (0,)),
    "return_token_offsets": ("token offsets (vLLM's render endpoints)", (False,)),
    "return_mm_kwargs": ("multimodal features (vLLM's render endpoints)", (True,)),
    "kv_transfer_params": ("disaggregated serving", ({},)),
    "ec_transfer_params": ("disaggregated serving", ({},)),
    "vllm_xargs": ("custom request extensions", ({},)),
    "repetition_detection": ("repetition detection", ()),
    "thinking_token_budget": ("thinking budgets", (-1,)),
    "reasoning_effort": ("reasoning effort", ()),
    "chat_template": ("a chat template per request (start the server with --chat-template FILE)", ()),
    "media_io_kwargs": ("multimodal inputs", ({},)),
    "mm_processor_kwargs": ("multimodal inputs", ({},)),
}


class _SamplingFields(_Request):
    """What completions and chat share: the model, sampling, stopping and streaming."""

    model_config = ConfigDict(extra="allow")  # vLLM's fields loramux refuses land in model_extra
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # a signed 64-bit int, as OpenAI and vLLM
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
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)  # the response's id
    session_id: str | None = None  # a routing hint: one engine, so nothing to route
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    stream_interval: int | None = Field(default=None, ge=1)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs or its guided_* fields
    # (one of them)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream: true")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_when_streaming(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):  # vLLM's rule: a stream has no place for them
            raise ValueError("not available with stream: true; ask without streaming")
        return value

    def unsupported(self) -> tuple[str, str] | None:
        """The first field asking for something loramux does not do, and what that is; or None."""
        for name, value in (self.model_extra or {}).items():
            what, nothing = NOT_IMPLEMENTED.get(name, (None, ()))
            if what is not None and value is not None and value not in nothing:
                return name, what
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
    add_special_tokens: bool = True  # vLLM's: text prompts start with the tokenizer's BOS

    def unsupported(self) -> tuple[str, str] | None:
        if self.best_of not in (None, 1, self.n):
            return "best_of", "ranking extra samples (give best_of equal to n, or leave it out)"
        if self.suffix:
            return "suffix", "a suffix (fill-in-the-middle)"
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
    # vLLM's extras: how the chat template renders the messages, and what the answer shows
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message is left open, for the model to go on
    add_special_tokens: bool = False  # the template holds them already
    documents: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # the answer starts with the last message's content if it has the answer's role
    return_prompt_text: bool = False

    @field_validator("continue_final_message")
    @classmethod
    def _not_with_generation_prompt(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("continue the last message or add a generation prompt, not both: give "
                             "add_generation_prompt: false with it")
        return value

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tool calling"
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

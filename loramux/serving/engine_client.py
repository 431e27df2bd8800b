"""`EngineClient`: everything the server (and each Ray Serve replica) asks of an engine.

`loramux.LLMEngine` is one; a test's fake engine is another. The server reads nothing else of
the engine, so what it may rely on is written here, typed, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from loramux.engine.core.events import AdapterEvent
from loramux.engine.core.outputs import RequestOutput
from loramux.engine.sampling_params import SamplingParams, StructuredOutputsParams
from loramux.engine.core.stats import RouterStats, TierStats
from loramux.registry import AdapterHandle, LoRARequest

__all__ = ["EngineClient", "Prompt"]

Prompt = str | dict  # text, or {"prompt_token_ids": [...]}


class EngineClient(Protocol):
    """The engine contract the server is written against (see `loramux.engine.llm_engine.LLMEngine`)."""

    tokenizer: object | None  # a Hugging Face tokenizer; None: prompts come as token ids only
    max_model_len: int
    vocab_size: int  # token ids the model embeds

    # -- requests: the step loop (one thread) and the intake thread -----------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    lora_request: LoRARequest | None = None, api_request_id: str | None = None) -> None: ...

    def abort_request(self, request_id: str | list[str]) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def has_scheduled_work(self) -> bool: ...

    def get_num_unfinished_requests(self) -> int: ...

    def compile_structured_output(self, spec: StructuredOutputsParams) -> None: ...

    # -- adapters (any thread) ---------------------------------------------------------------------

    @property
    def lora_enabled(self) -> bool: ...

    @property
    def max_loading_workers(self) -> int: ...

    def add_lora(self, lora_request: LoRARequest, *, wait_s: float = 0.0) -> bool: ...

    def remove_lora(self, name_or_id: str | int) -> bool: ...

    def lora_handle(self, name: str) -> AdapterHandle | None: ...

    def list_loras(self) -> list[str]: ...

    def add_event_listener(self, listener: Callable[[AdapterEvent], None]) -> None: ...

    def remove_event_listener(self, listener: Callable[[AdapterEvent], None]) -> None: ...

    # -- what /metrics reads -------------------------------------------------------------------------

    def tier_stats(self) -> dict[str, TierStats]: ...

    def router_stats(self) -> RouterStats: ...

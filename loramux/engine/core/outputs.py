"""What the engine hands back: one `RequestOutput` per request per step, cumulative (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from loramux.engine.worker.logprobs import PromptLogprobs, SampleLogprobs
from loramux.errors import LoRAError

__all__ = ["CompletionOutput", "RequestOutput", "FinishReason"]

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class CompletionOutput:
    """One completion of a request; ``text`` and ``token_ids`` hold everything generated so far.

    :ivar finish_reason: ``"stop"`` (EOS, a stop string or a stop token), ``"length"`` (max_tokens
        or max_model_len), ``"abort"``, ``"error"`` (its adapter failed), or None while running.
    :ivar stop_reason: the stop string or stop token id that ended it, if one did.
    :ivar logprobs: per generated token ``{token id: Logprob}`` (the token and its top
        alternatives), when ``SamplingParams.logprobs`` asked for them.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: SampleLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step.

    :ivar error: the adapter error that failed this request (``finish_reason == "error"``).
    :ivar lora_name: the adapter the request used, or None for the base model.
    :ivar prompt_logprobs: per prompt token ``{token id: Logprob}`` (None for the first), when
        ``SamplingParams.prompt_logprobs`` asked for them.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: LoRAError | None = None
    lora_name: str | None = None
    metrics: dict = field(default_factory=dict, repr=False)
    prompt_logprobs: PromptLogprobs | None = None

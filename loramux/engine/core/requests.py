"""`RequestProcessor`: a request as a caller gives it (prompt, sampling parameters, adapter),
checked and made a `Sequence` before it joins the engine (vLLM v1's input processor).

Every check that can fail a request runs here, in the caller's thread: inside a step a bad token
id or parameter would fail the whole batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from loramux.engine.core.detokenizer import IncrementalDetokenizer
from loramux.engine.core.sequence import Sequence
from loramux.engine.core.structured_output import StructuredOutputs
from loramux.engine.sampling_params import SamplingParams
from loramux.registry import LoRARequest

__all__ = ["PromptType", "RequestProcessor"]

# "text", or {"prompt_token_ids": [...]} (optionally with "prompt"), or {"prompt": "text"}; a dict
# may hold a "cache_salt": its prefix-cache blocks are shared only with prompts of the same salt
PromptType = str | Mapping


class RequestProcessor:
    """Checks requests against one engine's model and options and makes their sequences.

    :param tokenizer: the model's tokenizer, or None (prompts then come as token ids).
    :param vocab_size: the model's vocabulary (token ids must fall inside it).
    :param max_model_len: a prompt must leave room to generate within it.
    :param lora_enabled: whether requests may name an adapter.
    :param structured_outputs: the engine's grammar compiler (a request's format is compiled here).
    :param device: where a seeded request's generator samples.
    :param model_name: the model, as errors name it.
    """

    def __init__(self, *, tokenizer, vocab_size: int, max_model_len: int, lora_enabled: bool,
                 structured_outputs: StructuredOutputs, device: torch.device, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.lora_enabled = lora_enabled
        self.structured_outputs = structured_outputs
        self.device = device
        self.model_name = model_name

    def sequence(self, request_id: str, prompt: PromptType, params: SamplingParams, lora_request: LoRARequest | None,
                 api_request_id: str | None, arrival: int) -> Sequence:
        """The request's `Sequence`, ready to queue.

        :raises ValueError: an empty or too long prompt, a token id outside the vocabulary, a
            text prompt without a tokenizer, an adapter with LoRA disabled, ``params.n > 1`` (one
            request is one sample), or a structured output that is not supported.
        """
        if params.n != 1:
            raise ValueError(f"request {request_id!r}: SamplingParams.n={params.n}; an engine request is one "
                             "sample: add one request per sample (params.for_sample(i)), or use LLM.generate")
        text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"request {request_id!r}: token id {bad} is outside the vocabulary "
                f"(0 to {self.vocab_size - 1})"
            )
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(token_ids)} tokens; max_model_len="
                f"{self.max_model_len} leaves no room to generate. Shorten it or raise max_model_len."
            )
        if lora_request is not None and not self.lora_enabled:
            raise ValueError(
                f"request {request_id!r} asks for adapter {lora_request.lora_name!r} but LoRA is "
                "disabled; build the engine with enable_lora=True."
            )
        if (params.stop_strings or params.include_stop_str_in_output) and self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: stop strings need a tokenizer, and this model has none")
        for name in ("logit_bias", "allowed_token_ids"):
            bad = next((t for t in getattr(params, name) or () if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"request {request_id!r}: {name} names token id {bad}, outside the vocabulary "
                                 f"(0 to {self.vocab_size - 1})")
        grammar = None if params.structured_outputs is None else self.structured_outputs.new_state(
            params.structured_outputs)  # raises UnsupportedStructuredOutput (a ValueError) naming the feature
        seq = Sequence(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            arrival=arrival,
            lora_request=lora_request,
            api_request_id=api_request_id,
            grammar=grammar,
            request_salt=cache_salt(request_id, prompt),
        )
        seq.salt_with(None)  # its adapter's digest joins once the adapter is resolved
        if self.tokenizer is not None and params.detokenize:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop_strings,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        return seq

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt's text (None when given as ids) and token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"model {self.model_name!r} has no tokenizer: give prompts as {{'prompt_token_ids': [...]}}"
                )
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, Mapping) and "prompt" in prompt:
            return self.tokenize(prompt["prompt"])
        raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}; got {type(prompt).__name__}")


def cache_salt(request_id: str, prompt: PromptType) -> str | None:
    """A prompt's ``cache_salt`` (vLLM's: ``{"prompt": ..., "cache_salt": "..."}``), or None."""
    salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"request {request_id!r}: cache_salt: got {salt!r}; allowed: a non-empty string")
    return salt

"""A request's state from arrival to finish: its tokens, its KV-cache row, its adapter, its output."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

import torch

from loramux.engine.core.detokenizer import IncrementalDetokenizer
from loramux.engine.worker.logprobs import PromptLogprobs, SampleLogprobs
from loramux.engine.core.outputs import CompletionOutput, FinishReason, RequestOutput
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.core.structured_output import GrammarState
from loramux.errors import LoRAError
from loramux.registry import AdapterHandle, LoRARequest

__all__ = ["Sequence", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    LOADING_ADAPTER = "loading_adapter"  # its adapter is being resolved and loaded beside the loop
    WAITING = "waiting"  # ready, queued for admission
    RUNNING = "running"  # owns KV blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request (vLLM's n=1 sequence group).

    ``num_computed`` counts the tokens whose keys and values are in the cache. A step computes
    the next ``num_tokens - num_computed`` tokens (or a chunk of them); when it reaches the last
    token, the step samples a new one. A decode is just a chunk of one token. ``block_table``
    lists the KV blocks it holds (`BlockManager`); ``num_cached_tokens`` of them came from the
    prefix cache. ``cache_salt`` is the adapter's identity in prefix-cache hashes (its content
    digest; None for the base model), joined with the request's own salt if it gave one
    (`salt_with`). ``handle`` is the adapter it runs with: the one its name was bound to when it
    was resolved, kept to the end even if the name is rebound meanwhile.

    ``num_pending`` counts the tokens a launched step samples that the host has not read back
    yet (async scheduling: the next step is launched first). They count in ``num_tokens``, so the
    next step computes the newest one, whose id the device takes from row ``pending_row`` of the
    step's sampled tokens; `append_token` replaces the oldest with its value.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    lora_request: LoRARequest | None = None
    # the API request it came with (None: its own); admission takes API requests in turn
    api_request_id: str | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)  # paged KV blocks (see block_manager.py)
    num_cached_tokens: int = 0  # leading tokens found in the prefix cache at allocation
    cache_salt: str | bytes | None = None  # the adapter's content digest; None for the base model
    request_salt: str | None = None  # the request's own cache_salt (vLLM's), joined into cache_salt
    num_preemptions: int = 0
    # its adapter, once the registry resolved it (the scheduler's reference keeps it in the CPU
    # tier), and the GPU slot it runs in (set at admission; -1 for the base model or while queued)
    handle: AdapterHandle | None = None
    lora_slot: int = -1
    detokenizer: IncrementalDetokenizer | None = None
    generator: torch.Generator | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: LoRAError | None = None
    # asked for by its params only (the sampler and the runner's prompt-logprobs helper fill them)
    output_logprobs: SampleLogprobs = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    grammar: GrammarState | None = None  # structured outputs: its place in its grammar
    num_pending: int = 0  # sampled on the device, not read back yet
    pending_row: int = -1  # the newest pending token's row in its step's sampled tokens

    def salt_with(self, adapter_digest: str | None) -> None:
        """Key its prefix-cache blocks by its adapter's content digest (None: the base model) and
        its own salt, if the request gave one: then only requests with the same salt share them."""
        if self.request_salt is None:
            self.cache_salt = adapter_digest
        else:
            self.cache_salt = json.dumps([adapter_digest, self.request_salt]).encode()

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt, output and pending tokens: the length the sequence has once its steps end."""
        return self.num_known_tokens + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output tokens whose ids the host has (all but the pending ones)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, the pending ones included."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def needs_host_tokens(self) -> bool:
        """Whether sampling its next token reads the tokens before it on the host (penalties,
        structured outputs): then no step is launched while one of its tokens is pending."""
        return self.grammar is not None or self.params.has_penalties

    def will_finish(self, max_model_len: int) -> bool:
        """Whether its tokens, pending ones included, reach ``max_tokens`` or ``max_model_len``: it
        finishes once they arrive, whatever they are, so no step need compute past them."""
        return self.params.reached_max_tokens(self.num_output_tokens) or self.num_tokens >= max_model_len

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether its prompt may start from cached KV blocks: not when every prompt position must be
        computed (prompt logprobs score only positions whose logits a step produced)."""
        return not self.params.skip_reading_prefix_cache

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions ``[start, end)``, prompt and output alike."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def add_input_ids(self, ids: list[int], pending: tuple[list[int], list[int]], start: int, end: int) -> None:
        """Append the ids of tokens ``[start, end)`` to a step's input ``ids``. A pending last token
        (its id still on the device) appends 0, and its index in ``ids`` and ``pending_row`` to
        ``pending``: the runner fills it in on the device (`ModelRunner.fill_pending`)."""
        known = self.num_known_tokens
        ids.extend(self.tokens(start, min(end, known)))
        if end > known:  # only a decode of the newest token can be pending: older ones arrived
            assert end == known + 1 == self.num_tokens, (self.request_id, start, end, self.num_pending)
            pending[0].append(len(ids))
            pending[1].append(self.pending_row)
            ids.append(0)

    def block_token_ids(self, index: int, block_size: int) -> list[int]:
        """The token ids of KV block ``index`` (the last one may be partial)."""
        return self.tokens(index * block_size, min((index + 1) * block_size, self.num_tokens))

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def expect_token(self, row: int) -> None:
        """A launched step samples its next token, row ``row`` of the step's sampled tokens."""
        self.num_pending += 1
        self.pending_row = row

    def append_token(self, token: int, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        """Add a sampled token (the oldest pending one's value, if any is pending); finish on EOS, a
        stop token or string, max_tokens or max_model_len."""
        self.output_token_ids.append(token)
        if self.num_pending:
            self.num_pending -= 1
        params = self.params
        if not params.ignore_eos and token in eos_token_ids:
            self.finish("stop")
        elif token in params.stop_token_ids:
            self.finish("stop", token)
        elif self.detokenizer is not None and (stop := self.detokenizer.add_token(token)) is not None:
            self.finish("stop", stop)
        elif params.reached_max_tokens(len(self.output_token_ids)) or self.num_known_tokens >= max_model_len:
            self.finish("length")

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """Finish now; a token still pending is dropped (its step's row is ignored)."""
        self.status = SequenceStatus.FINISHED
        self.num_pending = 0
        self.finish_reason = reason
        self.stop_reason = stop_reason
        if self.detokenizer is not None:
            self.detokenizer.flush()

    def fail(self, error: LoRAError) -> None:
        self.error = error
        self.finish("error")

    @property
    def text(self) -> str:
        return "" if self.detokenizer is None else self.detokenizer.text

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.output_logprobs) if self.params.logprobs is not None else None,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.is_finished,
            error=self.error,
            lora_name=self.lora_name,
            prompt_logprobs=self.prompt_logprobs,
        )

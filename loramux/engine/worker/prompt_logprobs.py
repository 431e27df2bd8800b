"""Prompt logprobs: the extra logits rows a step keeps for requests that ask for them.

The runner keeps one logits row per sampled sequence. A request with
``SamplingParams(prompt_logprobs=k)`` also needs the rows of its scheduled prompt chunk: the
logits at position ``p`` give the log-probability of prompt token ``p + 1``. These steps are
prefill steps (eager, never a CUDA graph). Kept apart from the runner so that the runner's only
changes are: ask for the plan, keep its rows after the sampled ones, hand their logits back.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from loramux.engine.worker.logprobs import token_logprobs

__all__ = ["PromptLogprobPlan", "plan_prompt_logprobs", "record_prompt_logprobs"]


@dataclass
class PromptLogprobPlan:
    """Extra logits rows: their index among the step's packed tokens, their adapter slot, and
    the (sequence, position) each one scores the next token of."""

    index: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    targets: list[tuple[object, int]] = field(default_factory=list)


def plan_prompt_logprobs(chunks: Seq[tuple[object, int]]) -> PromptLogprobPlan | None:
    """The rows to keep for ``chunks`` (in the order the runner packs them), or None when no
    sequence in the step asks for prompt logprobs (the common case: one pass over the chunks)."""
    if not any(seq.params.prompt_logprobs is not None for seq, _ in chunks):
        return None
    plan = PromptLogprobPlan()
    offset = 0
    for seq, n in chunks:
        if seq.params.prompt_logprobs is not None:
            if seq.prompt_logprobs is None:  # the first prompt token has no logprob
                seq.prompt_logprobs = [None] * seq.num_prompt_tokens
            slot = seq.lora_slot
            start = seq.num_computed
            # the last prompt position's logits are the sampled row (they score the first output token)
            for position in range(start, min(start + n, seq.num_prompt_tokens - 1)):
                plan.index.append(offset + position - start)
                plan.slots.append(slot)
                plan.targets.append((seq, position))
        offset += n
    return plan


def record_prompt_logprobs(logits: torch.Tensor, plan: PromptLogprobPlan) -> None:
    """Store the logprobs of the planned rows. logits: [len(plan.index), V], in plan order."""
    if not plan.targets:
        return
    next_tokens = torch.tensor([seq.prompt_token_ids[p + 1] for seq, p in plan.targets], device=logits.device)
    entries = token_logprobs(logits, next_tokens, [seq.params.prompt_logprobs for seq, _ in plan.targets]).entries()
    for (seq, position), entry in zip(plan.targets, entries):
        seq.prompt_logprobs[position + 1] = entry  # by position: a recomputed chunk rewrites the same

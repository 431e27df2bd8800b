"""Logit processors that depend on a request's history or its own table: penalties, logit bias,
allowed tokens, min_tokens and min_p. Each is vectorised over the batch (no loop over the
vocabulary), and the sampler calls them only for the rows whose request asks
(``SamplingParams.changes_logits``).

The rules are vLLM's (and OpenAI's for presence / frequency):

    logit -= frequency_penalty * count_in_output(token) + presence_penalty * (count_in_output > 0)
    logit  = logit / rp if logit > 0 else logit * rp      for tokens in the prompt or the output
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from loramux.engine.worker.device_tensors import device_tensor

__all__ = ["allow_only", "apply_logit_bias", "apply_min_p", "apply_penalties", "block_tokens", "token_counts"]


def token_counts(token_lists: Seq[Seq[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each list: [B, V] float32, one scatter for the whole batch."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)  # column V takes the padding
    if width:
        padded = device_tensor([list(t) + [vocab_size] * (width - len(t)) for t in token_lists], device)
        counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: Seq[Seq[int]],
    output_ids: Seq[Seq[int]],
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalised logits. logits: [B, V]; presence / frequency / repetition: [B]."""
    vocab = logits.shape[-1]
    output_counts = token_counts(output_ids, vocab, logits.device)  # [B, V]
    seen = (token_counts(prompt_ids, vocab, logits.device) > 0) | (output_counts > 0)  # [B, V]
    rp = torch.where(seen, repetition[:, None], torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / rp, logits * rp)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * (output_counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, rows: Seq[int], biases: Seq[dict[int, float]]) -> None:
    """Add each row's ``{token: bias}`` to its logits, in place (one indexed add for the batch)."""
    index_rows = [row for row, bias in zip(rows, biases) for _ in bias]
    index_tokens = [token for bias in biases for token in bias]
    values = [value for bias in biases for value in bias.values()]
    device = logits.device
    logits.index_put_((device_tensor(index_rows, device), device_tensor(index_tokens, device)),
                      device_tensor(values, device, logits.dtype), accumulate=True)


def block_tokens(logits: torch.Tensor, rows: Seq[int], tokens: Seq[Seq[int]]) -> None:
    """Set the given tokens of each row to -inf, in place (min_tokens: the stop tokens)."""
    index_rows = [row for row, ids in zip(rows, tokens) for _ in ids]
    index_tokens = [t for ids in tokens for t in ids]
    if index_rows:
        device = logits.device
        logits[device_tensor(index_rows, device), device_tensor(index_tokens, device)] = float("-inf")


def allow_only(logits: torch.Tensor, rows: Seq[int], allowed: Seq[Seq[int]]) -> None:
    """Set every token of each row but its allowed ones to -inf, in place (``allowed_token_ids``)."""
    device = logits.device
    keep = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=device)  # [R, V]
    keep[device_tensor([i for i, ids in enumerate(allowed) for _ in ids], device),
         device_tensor([t for ids in allowed for t in ids], device)] = True
    index = device_tensor(list(rows), device)
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the row's most likely one. logits: [B, V], min_p: [B]."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))

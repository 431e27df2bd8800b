"""Turn one step's logits into next tokens, each row with its own request's sampling params.

Greedy rows take the argmax. Sampled rows divide by their temperature, cut to top-k / top-p
(one sort shared by both), and draw with the exponential-race trick (``argmax(p / E)``, E ~
Exp(1)) so a request with a seed draws its noise from its own generator and gets the same tokens
whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from loramux.engine.sampling_params import SamplingParams

__all__ = ["Sampler"]


class Sampler:
    """``sampler(logits [B, V], params per row, generators per row) -> token ids [B] (int64)``."""

    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(
        self,
        logits: torch.Tensor,
        params: Seq[SamplingParams],
        generators: Seq[torch.Generator | None],
    ) -> torch.Tensor:
        greedy = [p.greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1)
        logits = logits.float()
        device = logits.device
        temperature = torch.tensor([p.temperature or 1.0 for p in params], device=device)
        logits = logits / temperature[:, None]
        vocab = logits.shape[-1]
        if any(p.top_k != -1 or p.top_p < 1.0 for p in params):
            logits = _top_k_top_p(
                logits,
                torch.tensor([vocab if p.top_k == -1 else min(p.top_k, vocab) for p in params], device=device),
                torch.tensor([p.top_p for p in params], device=device),
            )
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        seeded = [g is not None for g in generators]
        if not all(seeded):
            shared = torch.empty_like(probs).exponential_(generator=self.generator)
            mask = torch.tensor(seeded, device=device)[:, None]
            noise = torch.where(mask, noise, shared)
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            sampled = torch.where(torch.tensor(greedy, device=device), logits.argmax(dim=-1), sampled)
        return sampled


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside its row's top-k and top-p; logits: [B, V], top_k/top_p: [B]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    cut = ranks >= top_k[:, None]
    probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(dim=-1)
    # drop a token once the tokens before it already cover top_p (the first one always stays)
    cut |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

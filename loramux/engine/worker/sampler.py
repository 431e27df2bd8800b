"""Turn one step's logits into next tokens, each row with its own request's sampling params.

``sampler(logits [B, V], seqs) -> SamplerOutput``. In order, for the rows whose request asks:
logprobs are taken from the raw logits; then the grammar mask (structured outputs), logit bias,
the allowed-tokens mask, the min_tokens block on stop tokens, and the presence / frequency /
repetition penalties act on the logits. Greedy rows take the argmax. Sampled rows divide by their
temperature, cut to top-k / top-p (one sort shared by both) and min_p, and draw with the
exponential-race trick (``argmax(p / E)``, E ~ Exp(1)) so a request with a seed draws its noise
from its own generator and gets the same tokens whatever else is in the batch.

A batch where no request asks for any of it pays one pass over the params and nothing else.

The rows' logprobs come back in the output, copied to the host behind the step like its tokens
(the engine appends them with the token, once the token is read back). A sequence with a grammar
is sampled only once its earlier tokens are read back (`Sequence.needs_host_tokens`), so the
sampler advances its grammar (``seq.grammar``) here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence as Seq
from dataclasses import dataclass, field

import torch

from loramux.engine.worker.device_tensors import device_tensor
from loramux.engine.worker.logprobs import Logprob, TokenLogprobs, token_logprobs
from loramux.engine.worker.penalties import allow_only, apply_logit_bias, apply_min_p, apply_penalties, block_tokens
from loramux.engine.core.structured_output import apply_grammar_masks

__all__ = ["Sampler", "SamplerOutput"]


@dataclass
class SamplerOutput:
    """The step's new tokens, and the logprobs of the rows that asked (``logprob_rows``), on their
    way to the host: read them with `row_logprobs` once the step's tokens are read."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: TokenLogprobs | None = None
    logprob_rows: list[int] = field(default_factory=list)

    def row_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """Per row, its logprobs entry (None for a row that did not ask); None if none asked."""
        if self.logprobs is None:
            return None
        out: list[dict[int, Logprob] | None] = [None] * len(self.token_ids)
        for row, entry in zip(self.logprob_rows, self.logprobs.entries()):
            out[row] = entry
        return out


class Sampler:
    """``sampler(logits [B, V], seqs) -> SamplerOutput``, a row per sequence (its params, its history).

    :param device: where the logits live (the shared generator's device).
    :param seed: seeds the generator of requests without a seed of their own.
    :param eos_token_ids: the tokens ``min_tokens`` holds back, with each request's stop tokens.
    """

    def __init__(self, device: torch.device, seed: int | None = None,
                 eos_token_ids: Iterable[int] = ()) -> None:
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        self.eos_token_ids = sorted(eos_token_ids)

    def __call__(self, logits: torch.Tensor, seqs: Seq) -> SamplerOutput:
        params = [s.params for s in seqs]
        wants_logprobs = [p.logprobs is not None for p in params]
        processed = [p.changes_logits for p in params]
        greedy = [p.greedy for p in params]
        if all(greedy) and not any(processed) and not any(wants_logprobs):  # the common fast path
            return SamplerOutput(logits.argmax(dim=-1))
        logits = logits.float()
        raw = logits
        if any(processed):
            logits = self._process(logits.clone(), seqs)
        tokens = self._sample(logits, params, [s.generator for s in seqs], greedy)
        out = SamplerOutput(tokens)
        if any(wants_logprobs):
            rows = [i for i, w in enumerate(wants_logprobs) if w]
            index = device_tensor(rows, logits.device)
            out.logprobs = token_logprobs(raw[index], tokens[index], [params[i].logprobs for i in rows],
                                          non_blocking=True)
            out.logprob_rows = rows
        if any(s.grammar is not None for s in seqs):
            for seq, token in zip(seqs, tokens.tolist()):
                if seq.grammar is not None:
                    seq.grammar.accept(token)
        return out

    def _process(self, logits: torch.Tensor, seqs: Seq) -> torch.Tensor:
        """Grammar masks, logit bias, allowed tokens, min_tokens and penalties; logits: [B, V]
        float32 (a copy)."""
        device = logits.device
        grammar_rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if grammar_rows:
            apply_grammar_masks(logits, grammar_rows, [seqs[i].grammar for i in grammar_rows])
        bias_rows = [i for i, s in enumerate(seqs) if s.params.logit_bias]
        if bias_rows:
            apply_logit_bias(logits, bias_rows, [seqs[i].params.logit_bias for i in bias_rows])
        allowed_rows = [i for i, s in enumerate(seqs) if s.params.allowed_token_ids is not None]
        if allowed_rows:
            allow_only(logits, allowed_rows, [seqs[i].params.allowed_token_ids for i in allowed_rows])
        early = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens]
        if early:
            block_tokens(logits, early, [self.eos_token_ids + seqs[i].params.stop_token_ids for i in early])
        penalised = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        if penalised:
            chosen = [seqs[i] for i in penalised]
            logits[penalised] = apply_penalties(
                logits[penalised],
                [s.prompt_token_ids for s in chosen],
                [s.output_token_ids for s in chosen],
                device_tensor([s.params.presence_penalty for s in chosen], device),
                device_tensor([s.params.frequency_penalty for s in chosen], device),
                device_tensor([s.params.repetition_penalty for s in chosen], device),
            )
        return logits

    def _sample(self, logits: torch.Tensor, params: Seq, generators: Seq, greedy: list[bool]) -> torch.Tensor:
        if all(greedy):
            return logits.argmax(dim=-1)
        device = logits.device
        temperature = device_tensor([p.temperature or 1.0 for p in params], device)
        scaled = logits / temperature[:, None]
        vocab = scaled.shape[-1]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):  # top_k 0 or -1: no cut
            scaled = _top_k_top_p(
                scaled,
                device_tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device),
                device_tensor([p.top_p for p in params], device),
            )
        if any(p.min_p for p in params):
            scaled = apply_min_p(scaled, device_tensor([p.min_p for p in params], device))
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        seeded = [g is not None for g in generators]
        if not all(seeded):
            shared = torch.empty_like(probs).exponential_(generator=self.generator)
            mask = device_tensor(seeded, device)[:, None]
            noise = torch.where(mask, noise, shared)
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            sampled = torch.where(device_tensor(greedy, device), logits.argmax(dim=-1), sampled)
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

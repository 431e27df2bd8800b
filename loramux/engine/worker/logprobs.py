"""Log-probabilities of chosen tokens and their top alternatives, in vLLM's shape.

Per position a dict ``{token id: Logprob}``: the chosen (or, for a prompt, the actual) token and the
``k`` most likely ones, each with its rank (1 = most likely). The values are the model's own
distribution, ``log_softmax`` of the raw logits of the request's adapter, before any penalty, mask
or temperature (vLLM's default, and what evaluation harnesses score).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

__all__ = ["Logprob", "PromptLogprobs", "SampleLogprobs", "TokenLogprobs", "token_logprobs"]


@dataclass
class Logprob:
    """One token's log-probability at a position, its rank there, and its text (filled by the server)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # one dict per generated token
PromptLogprobs = list[dict[int, Logprob] | None]  # one per prompt token; the first is None


@dataclass
class TokenLogprobs:
    """Per row: the chosen token's logprob and rank, and the row's ``num_top`` best alternatives, as
    tensors (`token_logprobs`); `entries` reads them into vLLM's dicts."""

    num_top: list[int]
    chosen: torch.Tensor  # [N]
    chosen_logprob: torch.Tensor  # [N]
    ranks: torch.Tensor  # [N]
    top_values: torch.Tensor  # [N, k]
    top_ids: torch.Tensor  # [N, k]

    def entries(self) -> list[dict[int, Logprob]]:
        chosen_l, chosen_lp, ranks_l = self.chosen.tolist(), self.chosen_logprob.tolist(), self.ranks.tolist()
        top_v, top_i = self.top_values.tolist(), self.top_ids.tolist()
        out = []
        for row, n in enumerate(self.num_top):
            entry = {chosen_l[row]: Logprob(chosen_lp[row], ranks_l[row])}
            for rank in range(n):
                entry.setdefault(top_i[row][rank], Logprob(top_v[row][rank], rank + 1))
            out.append(entry)
        return out


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: Seq[int], *,
                   non_blocking: bool = False) -> TokenLogprobs:
    """Per row: the chosen token's logprob and rank, and the row's ``num_top`` best alternatives.

    logits: [N, V] (raw); chosen: [N] token ids; num_top: N counts (0 to 20). ``non_blocking``
    (CUDA): the results are copied to page-locked host memory behind the work queued so far and
    the host goes on; read `entries` only once that work is done (a step's tokens were read).
    """
    logprobs = logits.float().log_softmax(dim=-1)  # [N, V]
    chosen_logprob = logprobs.gather(1, chosen[:, None])[:, 0]  # [N]
    ranks = (logprobs > chosen_logprob[:, None]).sum(dim=-1) + 1  # [N]
    k = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], chosen[:, None][:, :0])
    tensors = (chosen, chosen_logprob, ranks, top_values, top_ids)
    if non_blocking and logits.device.type == "cuda":
        tensors = tuple(t.to("cpu", non_blocking=True) for t in tensors)
    return TokenLogprobs(list(num_top), *tensors)

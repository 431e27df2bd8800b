"""Where a LoRA projection's delta is computed: on a side CUDA stream, beside its base GEMM.

At decode a projection's LoRA work (shrink, expand) is a chain of latency-bound launches that
move a few MB: in line with the base GEMM it adds its whole latency to every projection. So in a
step graph on CUDA with the Triton kernels (`delta_beside_base`; eager steps add it in line,
`LoRAContext.beside`) the whole delta is computed on a side stream into a buffer of its own,
while the main stream runs the base GEMM; the op returns both and the compiled layer adds them in
the pointwise kernel that reads the output next (RoPE, SiLU-mul, the residual add). Nothing of
the delta is left in line with the GEMM but the join.

A GEMM at decode takes every multiprocessor, so the side stream's kernels would wait for its
tail. The GEMM is told to leave some free instead (`gemm_carveout`: cuBLASLt's SM count target,
through torch's experimental carveout), and the LoRA launches are sized for those
(`lora_sms_beside`): beside the GEMM, the delta costs a fraction of what it costs in line, and
of what it costs beside a GEMM that takes every multiprocessor (docs/benchmarks/throughput.md).

One side stream per device, shared by every layer of every model in the process. The split-K
shrink keeps one counter table per device (`loramux.kernels.shrink`: two split-K shrinks must
never run at once on different streams). Every delta goes to this one stream, in launch order,
after the main stream's earlier work and before its later work (each layer joins the fork before
it returns), so two shrinks never overlap.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from loramux.kernels.dispatch import uses_triton
from loramux.kernels.tiles import DECODE_MAX_TOKENS, num_sms

__all__ = ["beside_streams", "delta_beside_base", "gemm_carveout", "is_big_gemm", "lora_sms_beside", "side_stream"]

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def delta_beside_base(device: torch.device | str) -> bool:
    """Whether LoRA projections on ``device`` compute their delta beside the base GEMM: on CUDA,
    when the Triton kernels run (`loramux.kernels.dispatch.uses_triton`). Elsewhere, and with the
    torch reference kernels (``LORAMUX_KERNELS=torch``), the delta is added after the base layer,
    in order."""
    device = torch.device(device)
    return device.type == "cuda" and uses_triton(device)


def side_stream(device: torch.device | str) -> torch.cuda.Stream:
    """The side stream of CUDA ``device`` (its current device when it names no index), made on
    first use: by the warm-up run `loramux.engine.worker.cuda_graphs` makes before each capture, so a
    capture finds it made."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:  # two threads racing here keep one stream between them
        stream = _SIDE_STREAMS.setdefault(index, torch.cuda.Stream(index))
    return stream


def beside_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream] | None:
    """(the current stream, the side stream) of a CUDA ``device``; None elsewhere (no fork)."""
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device), side_stream(device)


#: Steps of more tokens run their GEMMs on every multiprocessor (`lora_sms_beside`): the GEMMs are
#: compute-bound, and the share they would leave costs them more than the delta beside them gains.
CARVEOUT_MAX_TOKENS = 1024
#: The same for an FP8 GEMM, which computes twice as fast beside the same delta: past this, the
#: share it leaves made mixed steps no faster or slower.
FP8_CARVEOUT_MAX_TOKENS = 256

#: A GEMM reading at least this many weights runs long enough at 9-1024 tokens for the delta
#: beside it to finish on a smaller share of the multiprocessors (`lora_sms_beside`); on
#: Llama-3.1-8B shapes gate_up (117M weights) and down (59M) do, qkv (25M) and o (17M) do not.
BIG_GEMM_WEIGHTS = 1 << 25


def is_big_gemm(gemm_weights: int) -> bool:
    """Whether a GEMM of ``gemm_weights`` weights (``in_features * out_features``) is big
    (`BIG_GEMM_WEIGHTS`): it leaves a smaller share of the SMs to its delta, and a step graph for
    adapters that touch no big GEMM runs it alone (`LoRAContext.skip_big`)."""
    return gemm_weights >= BIG_GEMM_WEIGHTS


def lora_sms_beside(num_tokens: int, device: torch.device, gemm_weights: int = 0, fp8: bool = False) -> int:
    """Multiprocessors the base GEMM of a ``num_tokens``-token step leaves to the LoRA work beside
    it (0: the GEMM takes them all, and the LoRA launches are sized for all); ``gemm_weights``:
    the GEMM's ``in_features * out_features``; ``fp8``: an FP8 GEMM.

    None up to 8 tokens (the GEMM's tail leaves room, and a carveout costs the GEMM more than
    the delta gains), and none past `CARVEOUT_MAX_TOKENS` (`FP8_CARVEOUT_MAX_TOKENS`). Between
    them a GEMM reads its weights at near full bandwidth on a fraction of the SMs, and the
    delta's many short programs want the rest: a big GEMM (`BIG_GEMM_WEIGHTS`) leaves a third at
    33-128 tokens and an eighth elsewhere; a small one two thirds at 33-128, a half at 129-256 (a
    third beside an FP8 GEMM) and a third elsewhere (past 256 the GEMMs are nearly compute-bound
    and a larger share slows them more than the delta gains). These shares were the fastest
    decode steps of the choices tried, at every batch size and adapter mix measured
    (docs/benchmarks/throughput.md), and the fastest mixed steps (decodes beside a prefill chunk,
    one adapter or many) up to the limit; at 129-256 tokens a small GEMM's delta over a mixed
    step's decode adapters outlasted the GEMM on a third.
    """
    limit = FP8_CARVEOUT_MAX_TOKENS if fp8 else CARVEOUT_MAX_TOKENS
    if device.type != "cuda" or num_tokens <= 8 or num_tokens > limit:
        return 0
    sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
    big = is_big_gemm(gemm_weights)
    if 32 < num_tokens <= 128:
        return sms // 3 if big else sms * 2 // 3
    if big:
        return sms // 8
    return sms // 2 if 128 < num_tokens <= DECODE_MAX_TOKENS and not fp8 else sms // 3


@contextmanager
def gemm_carveout(sms: int) -> Iterator[None]:
    """Matrix products in this block leave ``sms`` multiprocessors free: cuBLASLt with its SM
    count target (torch's ``_set_sm_carveout_experimental``; the only BLAS that honours it), both
    settings put back on exit. A no-op for 0, or where this torch has no carveout."""
    set_carveout = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if not sms or set_carveout is None:
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    set_carveout(sms)
    try:
        yield
    finally:
        set_carveout(None)
        torch.backends.cuda.preferred_blas_library(previous)

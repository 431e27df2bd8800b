"""Where a LoRA projection's delta is computed: on a side CUDA stream, beside its base GEMM.

At decode a projection's LoRA work (shrink, expand) is a chain of latency-bound launches that
move a few MB: in line with the base GEMM it costs its latency, ~10 us a projection, 38 us a
layer at Llama-3.1-8B shapes. So in a step graph on CUDA with the Triton kernels
(`delta_beside_base`; eager steps add it in line, `LoRAContext.beside`) the whole
delta is computed on a side stream into a buffer of its own, while the main stream runs the base
GEMM; the op returns both and the compiled layer adds them in the pointwise kernel that reads the
output next (RoPE, SiLU-mul, the residual add). Nothing of the delta is left in line with the
GEMM but the join.

A GEMM at decode takes every multiprocessor, so the side stream's kernels would wait for its
tail. The GEMM is told to leave some free instead (`gemm_carveout`: cuBLASLt's SM count target,
through torch's experimental carveout), and the LoRA launches are sized for those
(`lora_sms_beside`). Measured on an H100 (`benchmarks/lora_decode.py`, 8B fused layout, rank 16,
32 layers in one CUDA graph; us a layer over the base GEMMs, 1 / 32 adapters; no add after the
join, which the compiled layer folds into its next kernel):

    tokens   shrink beside, expand after   delta beside   delta beside, GEMM leaves SMs free
    8        22.5 / 43.3                   10.0 / 30.0    15.6 / 33.0 (32 SMs)
    16       27.0 / 63.4                   13.4 / 45.1    13.4 / 36.7 (16 SMs)
    32       37.4 / 102.2                  20.7 / 86.9    14.8 / 54.5 (16 SMs)
    64       38.5 / 88.0                   34.0 / 81.0    15.3 / 53.7 (32 SMs)
    128      44.8 / 78.8                   41.4 / 71.2    28.3 / 62.4 (32 SMs)
    256      72.6 / 110.6                  55.3 / 107.4   49.6 / 67.6 (32 SMs)

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
from loramux.kernels.tiles import num_sms

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
    first use: by the warm-up run `loramux.engine.cuda_graphs` makes before each capture, so a
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


#: A GEMM reading at least this many weights runs long enough at 9-256 tokens for the delta
#: beside it to finish on a smaller share of the multiprocessors (`lora_sms_beside`); on
#: Llama-3.1-8B shapes gate_up (117M weights) and down (59M) do, qkv (25M) and o (17M) do not.
BIG_GEMM_WEIGHTS = 1 << 25


def is_big_gemm(gemm_weights: int) -> bool:
    """Whether a GEMM of ``gemm_weights`` weights (``in_features * out_features``) is big
    (`BIG_GEMM_WEIGHTS`): it leaves a smaller share of the SMs to its delta, and a step graph for
    adapters that touch no big GEMM runs it alone (`LoRAContext.skip_big`)."""
    return gemm_weights >= BIG_GEMM_WEIGHTS


def lora_sms_beside(num_tokens: int, device: torch.device, gemm_weights: int = 0) -> int:
    """Multiprocessors the base GEMM of a ``num_tokens``-token step leaves to the LoRA work beside
    it (0: the GEMM takes them all, and the LoRA launches are sized for all); ``gemm_weights``:
    the GEMM's ``in_features * out_features``.

    From the table in this module's docstring: none up to 8 tokens (the GEMM's tail leaves room,
    and the GEMM lost more than the delta gained), and none past 256 tokens, where the GEMM is
    compute-bound and every multiprocessor counts. Between them a GEMM reads its weights at near
    full bandwidth on a fraction of the SMs, and the delta's many short programs want the rest:
    a big GEMM (`BIG_GEMM_WEIGHTS`) leaves an eighth and a small one a third at 9-32 and at
    129-256 tokens, a third and two thirds at 33-128 tokens. Measured on an H100 (8B, decode
    replays, us; docs/benchmarks/engine-h100.md), against an eighth and a third at 33-128 tokens
    (thirteenth session): batch 64, one adapter on all seven projections 7,666 -> 7,663, 32
    adapters 8,882 -> 8,624, q/v adapters 7,456 -> 7,348 (one) and 7,950 -> 7,830 (32), a
    47-adapter fleet 8,388 -> 8,333 (base 7,186-7,205); batch 128, 32 adapters 11,237 -> 10,069.
    Against an eighth for every GEMM at 9-32 tokens: batch 32, one adapter 7,489 -> 7,299, 32
    adapters 8,880 -> 8,826, the fleet 7,743 -> 7,450; batch 16, 7,173 -> 7,065, 8,103 -> 8,043,
    7,236 -> 7,126. At 256 tokens the GEMMs are near compute-bound, and a third of the SMs ran
    qkv at half speed (eighteenth session; base 10,317-10,388): one adapter 13,338 with a third
    and two thirds, 11,086 with an eighth and a third, 12,079 with none left; 32 adapters 13,761,
    12,387, 12,974.
    """
    if device.type != "cuda" or num_tokens <= 8 or num_tokens > 256:
        return 0
    sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
    big = is_big_gemm(gemm_weights)
    if 32 < num_tokens <= 128:
        return sms // 3 if big else sms * 2 // 3
    return sms // 8 if big else sms // 3


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

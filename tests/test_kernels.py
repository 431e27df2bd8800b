"""Multi-LoRA kernels: Triton vs a float64 torch reference, the reference vs a
per-token loop, metadata, argument checks and dispatch; the static (CUDA-graph) meta: launch grids
that do not depend on the mapping, any mapping against the reference, no zeroed buffers.

Without CUDA the Triton kernels run under TRITON_INTERPRET=1 (set in conftest.py) in float32 and
float16; `gpu` tests run the same matrix plus bfloat16 and large shapes on CUDA.
Outputs are poisoned first, rows of tokens without an adapter are compared bit for bit, and the
error check fails on NaN.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass

import pytest
import numpy as np
import torch

from loramux.kernels import LoRABatchMeta, build_lora_meta, lora_expand, lora_shrink, reference

from conftest import INTERPRET, needs_cuda, needs_interpreter, rel_err, setenv


# ---------------------------------------------------------------------------------------------
# helpers


@dataclass(frozen=True)
class Case:
    T: int
    H: int
    S: int
    R: int
    slice_sizes: tuple[int, ...]
    mapping: str  # random | partly_empty | none | one | reversed
    per_slot_ranks: bool

    def __str__(self):
        return (f"T{self.T}-H{self.H}-S{self.S}-R{self.R}-n{'x'.join(map(str, self.slice_sizes))}"
                f"-{self.mapping}{'-ranks' if self.per_slot_ranks else ''}")


def make_slots(case: Case, gen: torch.Generator) -> torch.Tensor:
    T, S = case.T, case.S
    if case.mapping == "none":
        return torch.full((T,), -1, dtype=torch.int32)
    if case.mapping == "one":
        return torch.full((T,), S - 1, dtype=torch.int32)
    if case.mapping == "partly_empty":  # a few slots used, a third of the tokens without adapter
        used = torch.randperm(S, generator=gen)[: max(1, S // 3)]
        slots = used[torch.randint(0, used.numel(), (T,), generator=gen)]
        slots[torch.rand(T, generator=gen) < 0.33] = -1
        return slots.to(torch.int32)
    if case.mapping == "reversed":  # descending runs: sorted the wrong way round
        return torch.sort(torch.randint(-1, S, (T,), generator=gen), descending=True).values.to(torch.int32)
    return torch.randint(-1, S, (T,), generator=gen, dtype=torch.int32)


def make_inputs(case: Case, dtype: torch.dtype, device: str, seed: int):
    """x, A, B, scales, ranks, slots; weights past each slot's rank are zero (as the slot manager
    stores them)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(case.slice_sizes)
    NR, N = n * case.R, sum(case.slice_sizes)
    x = torch.randn(case.T, case.H, generator=gen)
    A = torch.randn(case.S, NR, case.H, generator=gen) / case.H ** 0.5
    B = torch.randn(case.S, N, case.R, generator=gen) / case.R ** 0.5
    scales = torch.rand(case.S, n, generator=gen) * 1.5 + 0.5
    ranks = None
    if case.per_slot_ranks:
        ranks = torch.randint(0, case.R + 1, (case.S,), generator=gen, dtype=torch.int32)
        keep = torch.arange(case.R)[None, :] < ranks[:, None]  # [S, R]
        A = A * keep.repeat(1, n)[:, :, None]
        B = B * keep[:, None, :]
        ranks = ranks.to(device)
    slots = make_slots(case, gen)
    to = dict(device=device)
    return (x.to(dtype=dtype, **to), A.to(dtype=dtype, **to), B.to(dtype=dtype, **to),
            scales.to(**to), ranks, slots.to(**to))


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern, so NaN payloads and -0.0 compare exactly."""
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(view)


TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def shrunk_rows(slots: torch.Tensor, ranks: torch.Tensor | None) -> torch.Tensor:
    """[T] bool on the CPU: the rows of buf a shrink writes, those of tokens whose slot has a rank
    on the module (a slot -1 token's row, and a rank-0 slot's, are left as they were)."""
    slots = slots.cpu().long()
    if ranks is None:
        return slots >= 0
    return (slots >= 0) & (ranks.cpu()[slots.clamp(min=0)] > 0)


def check_pipeline(case: Case, dtype, device, seed, shrink, expand, y_offset=3):
    """Run shrink then expand (given callables) and compare both with the float64 reference.

    y is a column window at y_offset of a wider tensor: 3 gives an unaligned base and row stride,
    8 a 16-byte-aligned one when the width is a multiple of 8 (the vectorised path on a GPU)."""
    x, A, B, scales, ranks, slots = make_inputs(case, dtype, device, seed)
    meta = build_lora_meta(slots, case.S)
    meta64 = build_lora_meta(slots.cpu(), case.S)
    n, N = len(case.slice_sizes), sum(case.slice_sizes)
    active = (slots >= 0).cpu()

    buf = shrink(x, A, scales, meta, ranks)
    assert buf.shape == (case.T, n * case.R) and buf.dtype == torch.float32 and buf.device == x.device
    ranks_cpu = ranks.cpu() if ranks is not None else None
    buf_ref = reference.lora_shrink_ref(x.cpu().double(), A.cpu().double(), scales.cpu().double(), meta64, ranks_cpu)
    written = shrunk_rows(slots, ranks)
    err = rel_err(buf.cpu()[written], buf_ref[written])
    assert err < TOL[torch.float32 if dtype == torch.float32 else dtype], f"shrink rel err {err:.2e}"

    # y: a column window of a wider tensor (row stride != width), poisoned around the window
    gen = torch.Generator().manual_seed(seed + 1)
    o = y_offset
    wide = torch.randn(case.T, N + 2 * o + (1 if o % 8 else 0), generator=gen).to(device=device, dtype=dtype)
    wide[:, :o] = float("nan")
    wide[:, o + N :] = float("nan")
    y = wide[:, o : o + N]
    wide_before = wide.clone()
    y64 = y.cpu().double()
    expand(y, buf, B, case.slice_sizes, meta, ranks)
    reference.lora_expand_ref(y64, buf.cpu().double(), B.cpu().double(), case.slice_sizes, meta64, ranks_cpu)

    wide_c, before_c = wide.cpu(), wide_before.cpu()
    y_before = before_c[:, o : o + N]
    assert torch.equal(bits(wide_c[:, :o]), bits(before_c[:, :o])), "expand wrote left of the y window"
    assert torch.equal(bits(wide_c[:, o + N :]), bits(before_c[:, o + N :])), "expand wrote right of the y window"
    assert torch.equal(bits(y.cpu()[~active]), bits(y_before[~active])), "expand touched a slot -1 row"
    delta_ref = y64[active] - y_before[active].double()
    delta = y.cpu()[active].double() - y_before[active].double()
    err = rel_err(delta, delta_ref)
    assert err < TOL[dtype], f"expand rel err {err:.2e}"
    return meta


CPU_CASES = [
    Case(1, 33, 1, 8, (17,), "one", False),
    Case(37, 70, 5, 8, (20, 9, 31), "random", True),
    Case(64, 129, 64, 16, (40,), "random", False),
    Case(50, 96, 8, 4, (24, 24), "partly_empty", True),
    Case(23, 45, 3, 16, (19, 7), "none", False),
    Case(90, 200, 4, 32, (65,), "reversed", True),
    Case(40, 300, 2, 16, (16, 48, 8), "random", False),
]


def triton_ops(shrink_cfg=None, expand_cfg=None):
    from loramux.kernels.expand import lora_expand_triton
    from loramux.kernels.shrink import lora_shrink_triton

    def shrink(x, A, scales, meta, ranks):
        return lora_shrink_triton(x, A, scales, meta, ranks, config=shrink_cfg)

    def expand(y, buf, B, sizes, meta, ranks):
        lora_expand_triton(y, buf, B, sizes, meta, ranks, config=expand_cfg)

    return shrink, expand


# ---------------------------------------------------------------------------------------------
# metadata


def test_meta_groups_tokens_by_slot():
    slots = torch.tensor([3, -1, 0, 3, 1, -1, 3, 0], dtype=torch.int32)
    meta = build_lora_meta(slots, 5)
    assert isinstance(meta, LoRABatchMeta)
    assert (meta.num_tokens, meta.num_slots, meta.num_active, meta.num_lora_tokens, meta.max_segment) == (8, 5, 3, 6, 3)
    assert meta.active_slots_host == (0, 1, 3) and meta.active_counts_host == (2, 1, 3)
    assert meta.active_starts_host == (0, 2, 3)
    assert meta.sorted_token_ids.tolist()[:6] == [2, 7, 4, 0, 3, 6]  # stable within a slot
    assert sorted(meta.sorted_token_ids.tolist()[6:]) == [1, 5]
    assert meta.active_slots.tolist()[:3] == [0, 1, 3] and meta.active_counts.tolist()[:3] == [2, 1, 3]
    assert meta.active_counts.tolist()[3:] == [0, 0]
    assert meta.num_tiles(2) == 1 + 1 + 2


def test_meta_all_tokens_without_adapter_and_empty_batch():
    meta = build_lora_meta(torch.full((6,), -1), 4)
    assert meta.num_active == 0 and meta.num_lora_tokens == 0 and meta.num_tiles(16) == 0
    meta = build_lora_meta(torch.zeros(0, dtype=torch.int64), 4)
    assert meta.num_tokens == 0 and meta.num_active == 0


@pytest.mark.parametrize("slots, num_slots, match", [
    (torch.tensor([0, 4]), 4, "outside"),
    (torch.tensor([0, -2]), 4, "outside"),
    (torch.tensor([[0, 1]]), 4, "1-D"),
    (torch.tensor([0.0, 1.0]), 4, "integer"),
    (torch.tensor([0, 1]), 0, "num_slots"),
])
def test_meta_rejects_bad_input(slots, num_slots, match):
    with pytest.raises(ValueError, match=match):
        build_lora_meta(slots, num_slots)


# ---------------------------------------------------------------------------------------------
# the reference against a per-token loop (PEFT's semantics written the slow, obvious way)


@pytest.mark.parametrize("case", [CPU_CASES[1], CPU_CASES[3], CPU_CASES[4]], ids=str)
def test_reference_matches_per_token_loop(case):
    x, A, B, scales, ranks, slots = make_inputs(case, torch.float64, "cpu", seed=7)
    meta = build_lora_meta(slots, case.S)
    buf = reference.lora_shrink_ref(x, A, scales, meta, ranks)
    y0 = torch.randn(case.T, sum(case.slice_sizes), dtype=torch.float64)
    y = y0.clone()
    reference.lora_expand_ref(y, buf, B, case.slice_sizes, meta, ranks)
    R, offs = case.R, [0]
    for n in case.slice_sizes:
        offs.append(offs[-1] + n)
    for t in range(case.T):
        s = int(slots[t])
        if s < 0:
            assert torch.equal(y[t], y0[t])
            continue
        for i in range(len(case.slice_sizes)):
            h = (A[s, i * R : (i + 1) * R] @ x[t]) * scales[s, i]  # [R]
            torch.testing.assert_close(buf[t, i * R : (i + 1) * R], h, rtol=1e-12, atol=1e-12)
            want = y0[t, offs[i] : offs[i + 1]] + B[s, offs[i] : offs[i + 1]] @ h
            torch.testing.assert_close(y[t, offs[i] : offs[i + 1]], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_cpu_path(dtype, monkeypatch):
    setenv(monkeypatch, "LORAMUX_KERNELS", None)
    case = CPU_CASES[1]
    check_pipeline(case, dtype, "cpu", 3, lora_shrink, lora_expand)


# ---------------------------------------------------------------------------------------------
# Triton under the interpreter (CPU)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_triton_interpreter_matches_reference(case, dtype, monkeypatch):
    setenv(monkeypatch, "LORAMUX_KERNELS", "triton")
    y_offset = 8 if dtype == torch.float16 else 3
    check_pipeline(case, dtype, "cpu", zlib.crc32(str(case).encode()) % 1000, lora_shrink, lora_expand, y_offset)


@needs_interpreter
@pytest.mark.parametrize("seed", range(4))
def test_triton_interpreter_random_shapes(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    n = ri(1, 3)
    case = Case(T=ri(1, 80), H=ri(1, 160), S=ri(1, 64), R=[4, 8, 16, 32][ri(0, 3)],
                slice_sizes=tuple(ri(1, 50) for _ in range(n)),
                mapping=["random", "partly_empty", "reversed", "one"][ri(0, 3)], per_slot_ranks=bool(ri(0, 1)))
    dtype = [torch.float32, torch.float16][seed % 2]
    check_pipeline(case, dtype, "cpu", seed, *triton_ops())


@needs_interpreter
@pytest.mark.parametrize("case", [CPU_CASES[1], CPU_CASES[3], CPU_CASES[6]], ids=str)
def test_triton_interpreter_forced_launch_shapes(case):
    """Split-K with atomics, narrow blocks, and the 16-bit cast path of expand."""
    from loramux.kernels.expand import ExpandConfig
    from loramux.kernels.shrink import ShrinkConfig

    ops = triton_ops(ShrinkConfig(16, 16, 16, split_k=3, num_warps=4, num_stages=2),
                     ExpandConfig(16, 16, 4, num_warps=4, num_stages=2, cast_buf=True))
    check_pipeline(case, torch.float16, "cpu", 11, *ops)
    ops = triton_ops(ShrinkConfig(32, 64, 32, split_k=1, num_warps=4, num_stages=2),
                     ExpandConfig(32, 32, 2, num_warps=4, num_stages=2, cast_buf=False))
    check_pipeline(case, torch.float32, "cpu", 12, *ops)


@needs_interpreter
def test_triton_shrink_writes_every_element():
    """Poisoned output buffer: every row of a token whose slot has a rank is written (zeros past
    the rank); rows without an adapter, and of a rank-0 slot (no kernel reads them), are not."""
    from loramux.kernels.shrink import ShrinkConfig, lora_shrink_triton

    case = CPU_CASES[1]
    x, A, B, scales, ranks, slots = make_inputs(case, torch.float32, "cpu", 5)
    ranks[int(slots[slots >= 0][0])] = 0  # one used slot of rank 0
    meta = build_lora_meta(slots, case.S)
    out = torch.full((case.T, len(case.slice_sizes) * case.R), float("nan"))
    buf = lora_shrink_triton(x, A, scales, meta, ranks, config=ShrinkConfig(16, 16, 32, 1, 4, 2), out=out)
    assert buf is out
    written = shrunk_rows(slots, ranks)
    assert written.any() and ((slots >= 0) & ~written).any()
    assert torch.isfinite(buf[written]).all()
    assert torch.isnan(buf[~written]).all()
    ref = reference.lora_shrink_ref(x.double(), A.double(), scales.double(), meta, ranks)
    assert rel_err(buf[written], ref[written]) < 1e-5


def test_nan_never_passes():
    ref = torch.randn(8, 4)
    bad = ref.clone()
    bad[3, 1] = float("nan")
    assert rel_err(bad, ref) == float("inf")
    assert not rel_err(bad, ref) < 1e-2


# ---------------------------------------------------------------------------------------------
# argument checks (shared by Triton and the reference) and dispatch


def _good(T=6, H=10, S=3, R=4, sizes=(5, 7)):
    x = torch.randn(T, H)
    A = torch.randn(S, len(sizes) * R, H)
    B = torch.randn(S, sum(sizes), R)
    scales = torch.ones(S, len(sizes))
    meta = build_lora_meta(torch.tensor([0, 1, -1, 2, 0, 1][:T]), S)
    buf = torch.zeros(T, len(sizes) * R)
    y = torch.zeros(T, sum(sizes))
    return x, A, B, scales, meta, buf, y, sizes


SHRINK_ERRORS = [
    (lambda x, A, s, m: (x[0], A, s, m), "2-D"),
    (lambda x, A, s, m: (x, A[0], s, m), "3-D"),
    (lambda x, A, s, m: (x[:, :9], A, s, m), "hidden size"),
    (lambda x, A, s, m: (x[:5], A, s, m), "tokens"),
    (lambda x, A, s, m: (x.double(), A.double(), s, m), "dtype"),
    (lambda x, A, s, m: (x.half(), A, s, m), "store adapter weights"),
    (lambda x, A, s, m: (x, A, s[:2], m), "slots"),
    (lambda x, A, s, m: (x, A[:, :7], s, m), "n_slices"),
    (lambda x, A, s, m: (x, A, s.double(), m), "float32"),
    (lambda x, A, s, m: (x, A, s, "meta"), "LoRABatchMeta"),
    (lambda x, A, s, m: (x, A[:2], s[:2], m), "num_slots"),
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("mutate, match", SHRINK_ERRORS, ids=[m for _, m in SHRINK_ERRORS])
def test_shrink_rejects_bad_arguments(impl, mutate, match, monkeypatch):
    if impl == "triton" and not INTERPRET:
        pytest.skip("needs the interpreter on CPU")
    setenv(monkeypatch, "LORAMUX_KERNELS", impl)
    x, A, B, scales, meta, buf, y, sizes = _good()
    args = mutate(x, A, scales, meta)
    if impl == "torch" and match in ("dtype", "float32"):
        pytest.skip("the reference also takes float64 (it is the oracle)")
    with pytest.raises(ValueError, match=match):
        lora_shrink(*args)


EXPAND_ERRORS = [
    (lambda y, b, B, s, m: (y[0], b, B, s, m), "2-D"),
    (lambda y, b, B, s, m: (y, b, B[0], s, m), "3-D"),
    (lambda y, b, B, s, m: (y, b, B, (5, 6), m), "sum"),
    (lambda y, b, B, s, m: (y, b, B, (12,), m), "slices of rank"),
    (lambda y, b, B, s, m: (y, b, B, (), m), "non-empty"),
    (lambda y, b, B, s, m: (y, b, B, (5, 7.0), m), "positive ints"),
    (lambda y, b, B, s, m: (y, b.half(), B, s, m), "float32"),
    (lambda y, b, B, s, m: (y.half(), b, B, s, m), "store adapter weights"),
    (lambda y, b, B, s, m: (y[:5], b[:5], B, s, m), "tokens"),
    (lambda y, b, B, s, m: (y, b, B[:2], s, m), "num_slots"),
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("mutate, match", EXPAND_ERRORS, ids=[m for _, m in EXPAND_ERRORS])
def test_expand_rejects_bad_arguments(impl, mutate, match, monkeypatch):
    if impl == "triton" and not INTERPRET:
        pytest.skip("needs the interpreter on CPU")
    setenv(monkeypatch, "LORAMUX_KERNELS", impl)
    x, A, B, scales, meta, buf, y, sizes = _good()
    with pytest.raises(ValueError, match=match):
        lora_expand(*mutate(y, buf, B, sizes, meta))


def test_ranks_are_checked():
    x, A, B, scales, meta, buf, y, sizes = _good()
    with pytest.raises(ValueError, match="ranks"):
        lora_shrink(x, A, scales, meta, torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="ranks"):
        lora_expand(y, buf, B, sizes, meta, torch.ones(3))


def test_dispatch_env_var(monkeypatch):
    x, A, B, scales, meta, buf, y, sizes = _good()
    setenv(monkeypatch, "LORAMUX_KERNELS", "torch")
    out = lora_shrink(x, A, scales, meta)
    torch.testing.assert_close(out, reference.lora_shrink_ref(x, A, scales, meta))
    with pytest.raises(ValueError, match="LORAMUX_KERNELS='cuda-please' is not understood"):
        setenv(monkeypatch, "LORAMUX_KERNELS", "cuda-please")  # read once, at start: refused there


# ---------------------------------------------------------------------------------------------
# GPU


GPU_CASES = CPU_CASES + [
    Case(256, 4096, 32, 16, (4096, 1024, 1024), "random", False),
    Case(300, 2049, 64, 64, (2048, 1000), "partly_empty", True),
    Case(16384, 4096, 64, 16, (4096, 1024, 1024), "random", True),
    Case(16384, 1000, 64, 128, (777,), "reversed", False),
    Case(1, 14336, 1, 64, (4096,), "one", False),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_matches_reference(case, dtype, monkeypatch):
    setenv(monkeypatch, "LORAMUX_KERNELS", None)  # default dispatch must pick Triton
    seed = zlib.crc32(str(case).encode()) % 1000
    check_pipeline(case, dtype, "cuda", seed, lora_shrink, lora_expand, y_offset=3)
    if sum(case.slice_sizes) % 8 == 0 and all(n % 8 == 0 for n in case.slice_sizes):
        check_pipeline(case, dtype, "cuda", seed + 1, lora_shrink, lora_expand, y_offset=8)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [GPU_CASES[2], GPU_CASES[8]], ids=str)
def test_gpu_forced_launch_shapes(case, dtype):
    from loramux.kernels.expand import ExpandConfig
    from loramux.kernels.shrink import ShrinkConfig

    for scfg, ecfg in [
        (ShrinkConfig(16, 16, 64, 5, 4, 3), ExpandConfig(16, 32, 4, 4, 2, cast_buf=True)),
        (ShrinkConfig(64, 64, 64, 1, 4, 3), ExpandConfig(64, 128, 2, 8, 2, cast_buf=False)),
        (ShrinkConfig(128, 64, 128, 2, 4, 3), ExpandConfig(128, 64, 8, 4, 2, cast_buf=True)),
    ]:
        check_pipeline(case, dtype, "cuda", 21, *triton_ops(scfg, ecfg))


@pytest.mark.gpu
@needs_cuda
def test_gpu_dispatch_picks_triton_and_never_syncs(monkeypatch):
    setenv(monkeypatch, "LORAMUX_KERNELS", None)
    case = Case(512, 4096, 8, 16, (4096, 1024, 1024), "random", True)
    x, A, B, scales, ranks, slots = make_inputs(case, torch.bfloat16, "cuda", 0)
    meta = build_lora_meta(slots, case.S)
    y = torch.randn(case.T, sum(case.slice_sizes), device="cuda", dtype=torch.bfloat16)
    buf = lora_shrink(x, A, scales, meta, ranks)  # warm up: compile outside the sync check
    lora_expand(y, buf, B, case.slice_sizes, meta, ranks)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            buf = lora_shrink(x, A, scales, meta, ranks)
            lora_expand(y, buf, B, case.slice_sizes, meta, ranks)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replay_matches_eager():
    """A decode step captured in a CUDA graph (meta built outside) gives the eager result."""
    case = Case(64, 4096, 8, 16, (4096, 1024, 1024), "random", True)
    x, A, B, scales, ranks, slots = make_inputs(case, torch.bfloat16, "cuda", 4)
    meta = build_lora_meta(slots, case.S)
    y0 = torch.randn(case.T, sum(case.slice_sizes), device="cuda", dtype=torch.bfloat16)
    y_eager = y0.clone()
    lora_expand(y_eager, lora_shrink(x, A, scales, meta, ranks), B, case.slice_sizes, meta, ranks)
    y = y0.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compile) off the capture
        lora_expand(y.clone(), lora_shrink(x, A, scales, meta, ranks), B, case.slice_sizes, meta, ranks)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        lora_expand(y, lora_shrink(x, A, scales, meta, ranks), B, case.slice_sizes, meta, ranks)
    y.copy_(y0)
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(y.float() - y0.float(), y_eager.float() - y0.float()) < 1e-2


# ---------------------------------------------------------------------------------------------
# regression: the launches of benchmarks/throughput.py at rank 64 (Llama-3.1-8B shapes, 32 slots)
#
# That run once died with "an illegal memory access" at rank 64 (rank 16 passed). These tests pin
# the exact launch set it makes: the H200 heuristic's configs at R=64 (64-row tiles, 64-wide rank
# blocks, split-K with atomics, expand groups of 8 with 3 stages), the `ranks` tensor, a 32-slot
# table, and the adapter in the *last* slot, whose weights end the stacked buffers, so any read
# past a slot's rows or past a buffer would leave it. On the CPU every tensor sits inside a
# NaN-poisoned margin: an out-of-bounds read that reaches a result shows up as NaN, an
# out-of-bounds write as a changed margin.

THROUGHPUT_S = 32


def throughput_slots(scenario: str, T_prefill: int = 8192) -> list[int]:
    """token_slots of one step of the throughput run, adapters mapped from the last slot down."""
    last = THROUGHPUT_S - 1
    if scenario == "warmup":  # 33 requests x 4 tokens: no adapter, then one per adapter
        return [-1] * 4 + [last - s for s in range(THROUGHPUT_S) for _ in range(4)]
    n, kind = scenario.split("-")
    n = int(n)
    per_request = [last - (i % n) for i in range(64)]
    if kind == "decode":
        return per_request
    per_tok = T_prefill // 64
    return [s for s in per_request for _ in range(per_tok)]


def guarded(t: torch.Tensor, margin: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, whole): t copied into the middle of a NaN-filled buffer `margin` elements wider on
    each side; `whole` keeps the margins for the out-of-bounds-write check."""
    whole = torch.full((t.numel() + 2 * margin,), float("nan"), dtype=t.dtype, device=t.device)
    view = whole[margin : margin + t.numel()].view(t.shape)
    view.copy_(t)
    return view, whole


def margins_intact(whole: torch.Tensor, n: int, margin: int = 4096) -> bool:
    return bool(torch.isnan(whole[:margin]).all() and torch.isnan(whole[margin + n :]).all())


def run_throughput_launch(slots, H, N, R, dtype, device, seed, shrink_cfg=None, expand_cfg=None, guard=False):
    """One shrink + expand as a LinearWithLoRA of the throughput run makes it; returns the errors
    against the reference (shrink, expand)."""
    from loramux.kernels.expand import lora_expand_triton
    from loramux.kernels.shrink import lora_shrink_triton

    S, T = THROUGHPUT_S, len(slots)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(device=device, dtype=dtype)
    A = (torch.randn(S, R, H, generator=gen) / H**0.5).to(device=device, dtype=dtype)
    B = (torch.randn(S, N, R, generator=gen) / R**0.5).to(device=device, dtype=dtype)
    y0 = torch.randn(T, N, generator=gen).to(device=device, dtype=dtype)
    scales = torch.full((S, 1), 2.0, device=device)
    ranks = torch.full((S,), R, dtype=torch.int32, device=device)
    token_slots = torch.tensor(slots, dtype=torch.int32, device=device)
    meta = build_lora_meta(token_slots, S)
    if guard:
        (x_, xw), (A_, Aw), (B_, Bw), (y, yw) = guarded(x), guarded(A), guarded(B), guarded(y0)
    else:
        x_, A_, B_, y = x, A, B, y0.clone()
    buf = lora_shrink_triton(x_, A_, scales, meta, ranks, config=shrink_cfg)
    lora_expand_triton(y, buf, B_, (N,), meta, ranks, config=expand_cfg)
    if guard:
        for name, whole, t in (("x", xw, x), ("A", Aw, A), ("B", Bw, B), ("y", yw, y0)):
            assert margins_intact(whole, t.numel()), f"a kernel wrote outside {name}"
    ref_dtype = torch.float32 if device != "cpu" else torch.float64
    buf_ref = reference.lora_shrink_ref(x.to(ref_dtype), A.to(ref_dtype), scales.to(ref_dtype) if device == "cpu"
                                        else scales, meta, ranks)
    y_ref = y0.to(ref_dtype)
    reference.lora_expand_ref(y_ref, buf.to(ref_dtype), B.to(ref_dtype), (N,), meta, ranks)
    act = token_slots >= 0
    assert torch.isfinite(buf[act]).all() and torch.isfinite(y).all(), "NaN: a read past a buffer reached a result"
    def err(out, ref):  # rel_err on the tensors' own device (the GPU shapes are ~1 GB in float64)
        return ((out - ref).norm() / ref.norm()).item()

    e_shrink = err(buf[act].to(ref_dtype), buf_ref[act])
    e_expand = err((y.to(ref_dtype) - y0.to(ref_dtype))[act], (y_ref - y0.to(ref_dtype))[act])
    return e_shrink, e_expand


# (scenario, shrink config, expand config): what shrink_config/expand_config choose on an H100/H200
# (132 SMs) at R=64 for the throughput launches (tests/test_kernels.py::test_h200_heuristic_configs_at_r64 pins them)
R64_LAUNCHES = [
    ("1-prefill", (64, 64, 64, 2, 4, 4), (64, 128, 4, 4, 3)),
    ("32-prefill", (64, 64, 64, 2, 4, 4), (64, 128, 4, 4, 3)),
    ("1-decode", (16, 16, 128, 16, 4, 4), (64, 32, 1, 4, 2)),
    ("32-decode", (16, 16, 128, 2, 4, 4), (16, 64, 2, 4, 3)),
    ("warmup", (16, 16, 128, 2, 4, 4), (16, 64, 8, 4, 3)),
]


def test_h200_heuristic_configs_at_r64(monkeypatch):
    """The launch shapes the H200 heuristic picks for the rank-64 throughput run (132 SMs)."""
    from loramux.kernels import expand, shrink
    from loramux.kernels.expand import ExpandConfig
    from loramux.kernels.shrink import ShrinkConfig

    monkeypatch.setattr(shrink, "target_programs", lambda device, sms=None: 2 * sms if sms else 264)
    monkeypatch.setattr(expand, "target_programs", lambda device, sms=None: 2 * sms if sms else 264)
    want = {  # (scenario, H, N): (shrink, expand)
        ("1-prefill", 4096, 14336): R64_LAUNCHES[0][1:],
        ("32-prefill", 4096, 1024): R64_LAUNCHES[1][1:],
        ("1-decode", 4096, 4096): R64_LAUNCHES[2][1:],
        ("32-decode", 4096, 4096): R64_LAUNCHES[3][1:],
        ("warmup", 4096, 14336): R64_LAUNCHES[4][1:],
    }
    for (scenario, H, N), (s_cfg, e_cfg) in want.items():
        meta = build_lora_meta(torch.tensor(throughput_slots(scenario)), THROUGHPUT_S)
        dev = torch.device("cpu")
        assert shrink.shrink_config(meta, 64, H, torch.bfloat16, dev) == ShrinkConfig(*s_cfg), scenario
        assert expand.expand_config(meta, (N,), 64, torch.bfloat16, dev) == ExpandConfig(*e_cfg), scenario


def test_shrink_few_adapters_at_decode_size_take_the_static_shape(monkeypatch):
    """An exact meta of one adapter over 64-256 tokens (more tokens than rank columns) launches
    the static decode shape, not the 64-wide prefill one (2x slower on an H100 for qkv r16 T=64);
    a prefill-sized batch keeps the 64-wide shape."""
    from loramux.kernels import shrink

    monkeypatch.setattr(shrink, "target_programs", lambda device, sms=None: 2 * sms if sms else 264)
    dev = torch.device("cpu")
    for T in (64, 256):
        meta = build_lora_meta(torch.zeros(T, dtype=torch.long), 32)
        cfg = shrink.shrink_config(meta, 48, 4096, torch.bfloat16, dev, rank=16)
        static = shrink._static_shrink_config(T, 48, 4096, torch.bfloat16, 264, 16)
        assert (cfg.block_m, cfg.block_n, cfg.block_k) == (static.block_m, static.block_n, static.block_k), T
        assert cfg.block_n == 16
    prefill = build_lora_meta(torch.zeros(1024, dtype=torch.long), 32)
    assert shrink.shrink_config(prefill, 48, 4096, torch.bfloat16, dev).block_n == 64


@needs_interpreter
@pytest.mark.parametrize("scenario, s_cfg, e_cfg", R64_LAUNCHES, ids=[c[0] for c in R64_LAUNCHES])
def test_triton_interpreter_throughput_r64_launches(scenario, s_cfg, e_cfg):
    """The rank-64 throughput launch shapes, forced at small sizes, last slot, poisoned margins."""
    from loramux.kernels.expand import ExpandConfig
    from loramux.kernels.shrink import ShrinkConfig

    T_prefill = 192  # 3 tokens per request: 64-row tiles, partial last tiles
    slots = throughput_slots(scenario, T_prefill)
    H = 2 * s_cfg[2]  # two K blocks: split-K with atomics where the config splits
    N = e_cfg[1] * e_cfg[2] + 8 * 3  # a full group of blocks, then a partial chunk (16-byte multiple)
    e_s, e_e = run_throughput_launch(slots, H, N, 64, torch.float16, "cpu", 31,
                                     ShrinkConfig(*s_cfg), ExpandConfig(*e_cfg), guard=True)
    assert e_s < 1e-2 and e_e < 1e-2, (e_s, e_e)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rank", [64, 16])
@pytest.mark.parametrize("scenario", ["warmup", "1-prefill", "32-prefill", "1-decode", "32-decode"])
def test_gpu_throughput_launches_llama8b(scenario, rank):
    """Every distinct launch benchmarks/throughput.py makes on Llama-3.1-8B (q/o: 4096->4096,
    k/v: 4096->1024, gate/up: 4096->14336, down: 14336->4096), 32 slots, bf16, the `ranks` tensor,
    adapters from the last slot down, with the heuristic's launch shapes; synchronised after each
    so a fault names its launch."""
    for i, (H, N) in enumerate([(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]):
        e_s, e_e = run_throughput_launch(throughput_slots(scenario), H, N, rank, torch.bfloat16, "cuda", 40 + i)
        torch.cuda.synchronize()
        assert e_s < 1e-2 and e_e < 2e-2, (H, N, e_s, e_e)


@needs_interpreter
def test_triton_interpreter_grid_past_the_last_tile():
    """A grid sized from a bound rather than from the batch (a CUDA graph's static meta) has tiles
    past the last real one; they must store nothing and read nothing past the slot vectors, which
    here are exactly num_slots long (no padding)."""
    import dataclasses

    from loramux.kernels.expand import ExpandConfig, lora_expand_triton
    from loramux.kernels.shrink import ShrinkConfig, lora_shrink_triton

    case = Case(40, 64, 4, 16, (24, 16), "partly_empty", True)
    x, A, B, scales, ranks, slots = make_inputs(case, torch.float32, "cpu", 9)
    meta = build_lora_meta(slots, case.S)
    assert meta.active_slots.numel() == case.S
    # host counts of a worse batch: 3 more 16-row tiles than this one has
    big = dataclasses.replace(meta, _cache={},
                              active_counts_host=meta.active_counts_host[:-1] + (meta.active_counts_host[-1] + 48,))
    assert big.num_tiles(16) == meta.num_tiles(16) + 3
    buf = lora_shrink_triton(x, A, scales, big, ranks, config=ShrinkConfig(16, 16, 32, 2, 4, 2))
    y0 = torch.randn(case.T, sum(case.slice_sizes))
    y = y0.clone()
    lora_expand_triton(y, buf, B, case.slice_sizes, big, ranks, config=ExpandConfig(16, 16, 2, 4, 2, cast_buf=False))
    buf_ref = reference.lora_shrink_ref(x.double(), A.double(), scales.double(), meta, ranks)
    y_ref = y0.double()
    reference.lora_expand_ref(y_ref, buf_ref, B.double(), case.slice_sizes, meta, ranks)
    act = slots >= 0
    assert rel_err(buf[act], buf_ref[act]) < 1e-5
    assert torch.equal(y[~act], y0[~act])
    assert rel_err(y - y0, y_ref - y0.double()) < 1e-5


# ---------------------------------------------------------------------------------------------
# static meta (CUDA graphs): grids from T and S only, no zeroing, any mapping


def static_slots(mapping: str, T: int, S: int, ranks: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """token_slots [T] of the mappings a captured decode graph must replay correctly."""
    if mapping == "all_base":
        return torch.full((T,), -1, dtype=torch.int32)
    if mapping == "one_slot":
        return torch.full((T,), S - 1, dtype=torch.int32)
    if mapping == "all_different":  # every token its own slot (T <= S)
        return torch.randperm(S, generator=gen)[:T].to(torch.int32)
    if mapping == "rank0_and_base":  # slots whose adapter has rank 0 here, mixed with base rows
        zero = torch.nonzero(ranks == 0).flatten()
        slots = zero[torch.randint(0, zero.numel(), (T,), generator=gen)]
        slots[torch.rand(T, generator=gen) < 0.4] = -1
        return slots.to(torch.int32)
    slots = torch.randint(0, S, (T,), generator=gen, dtype=torch.int32)  # "mixed": base rows too
    slots[torch.rand(T, generator=gen) < 0.3] = -1
    return slots


STATIC_MAPPINGS = ("all_base", "one_slot", "all_different", "rank0_and_base", "mixed")


def per_slice_rank_inputs(T, H, S, R, sizes, dtype, seed):
    """A packed module whose adapters have a different rank per slice (zero-padded, as set_lora
    stores them; `ranks` is the largest per slot), two slots of rank 0 for the whole module."""
    gen = torch.Generator().manual_seed(seed)
    n, N = len(sizes), sum(sizes)
    slice_ranks = torch.randint(0, R + 1, (S, n), generator=gen)
    slice_ranks[:2] = 0
    x = torch.randn(T, H, generator=gen)
    A = torch.randn(S, n * R, H, generator=gen) / H**0.5
    B = torch.randn(S, N, R, generator=gen) / R**0.5
    offs = [0]
    for size in sizes:
        offs.append(offs[-1] + size)
    for s in range(S):
        for i in range(n):
            r = int(slice_ranks[s, i])
            A[s, i * R + r : (i + 1) * R] = 0
            B[s, offs[i] : offs[i + 1], r:] = 0
    scales = torch.rand(S, n, generator=gen) + 0.5
    ranks = slice_ranks.max(1).values.to(torch.int32)
    return x.to(dtype), A.to(dtype), B.to(dtype), scales, ranks, gen


def static_launches(meta, H, R, sizes, dtype, device=torch.device("cpu")):
    from loramux.kernels.expand import expand_launch
    from loramux.kernels.shrink import shrink_launch

    return (shrink_launch(meta, len(sizes) * R, H, dtype, device, rank=R),
            expand_launch(meta, tuple(sizes), R, dtype, device))


def test_static_meta_rejects_a_non_bool_static():
    with pytest.raises(ValueError, match="static must be a bool"):
        build_lora_meta(torch.tensor([0, 1]), 4, static=4)


@pytest.mark.parametrize("kwargs", [dict(max_distinct=2), dict(static=True, max_distinct=0),
                                    dict(static=True, max_distinct=2.0)], ids=["exact", "zero", "float"])
def test_max_distinct_bounds_static_metas_only(kwargs):
    slots = torch.tensor([0, 1, -1])
    with pytest.raises(ValueError, match="max_distinct bounds a static meta"):
        build_lora_meta(slots, 4, **kwargs)
    assert build_lora_meta(slots, 4, static=True, max_distinct=2).num_active == 2  # the same slots, bounded


def test_static_grids_hold_max_distinct_segments_not_one_per_slot(monkeypatch):
    """640 tokens of at most 64 sequences over 256 slots: the grids hold 63 one-token segments and
    one of the rest (82 tiles of 32 rows), not 255 and one (268), every mapping of at most 64
    distinct slots the same launches; the segment scan reads 64 lanes, not 256."""
    from loramux.kernels import expand, shrink
    from loramux.kernels.tiles import slot_lanes

    monkeypatch.setattr(shrink, "target_programs", lambda device, sms=None: 264)
    monkeypatch.setattr(expand, "target_programs", lambda device, sms=None: 264)
    T, S, gen = 640, 256, torch.Generator().manual_seed(0)
    bounded = [build_lora_meta(slots, S, static=True, max_distinct=64) for slots in (
        torch.zeros(T, dtype=torch.int32), torch.randperm(S, generator=gen)[:64].repeat(10).to(torch.int32))]
    launches = {static_launches(meta, 4096, 64, (4096, 1024, 1024), torch.bfloat16) for meta in bounded}
    assert len(launches) == 1
    unbounded = build_lora_meta(torch.zeros(T, dtype=torch.int32), S, static=True)
    assert [meta.num_tiles(32) for meta in (bounded[0], unbounded)] == [63 + 19, 255 + 13]
    assert [slot_lanes(meta) for meta in (bounded[0], unbounded)] == [64, 256]


@pytest.mark.parametrize("T", [1, 8, 64, 256])
def test_static_launch_grid_depends_only_on_tokens_and_slots(T, monkeypatch):
    """Same T, S and module: the same launches (config and grid) for every mapping, at 8B shapes
    and the H100's program target (132 SMs); an exact meta's grid follows its mapping."""
    from loramux.kernels import expand, shrink

    monkeypatch.setattr(shrink, "target_programs", lambda device, sms=None: 2 * sms if sms else 264)
    monkeypatch.setattr(expand, "target_programs", lambda device, sms=None: 2 * sms if sms else 264)
    S, R, gen = 32, 16, torch.Generator().manual_seed(T)
    ranks = torch.tensor([0, 0] + [R] * (S - 2), dtype=torch.int32)
    for H, sizes in [(4096, (4096, 1024, 1024)), (4096, (14336, 14336)), (14336, (4096,))]:
        launches = set()
        for mapping in STATIC_MAPPINGS:
            if mapping == "all_different" and T > S:
                continue
            meta = build_lora_meta(static_slots(mapping, T, S, ranks, gen), S, static=True)
            launches.add(static_launches(meta, H, R, sizes, torch.bfloat16))
        assert len(launches) == 1, launches
        (s_launch, (e_cfg, e_grid, _)), = launches
        assert s_launch.grid[0] >= 1 and e_grid[0] >= 1
    one = build_lora_meta(torch.zeros(T, dtype=torch.int32), S)
    many = build_lora_meta(torch.arange(T, dtype=torch.int32) % S, S)
    if T > 1:
        assert static_launches(one, 4096, R, (4096,), torch.bfloat16) != \
            static_launches(many, 4096, R, (4096,), torch.bfloat16)


def test_static_split_k_is_sized_for_the_one_adapter_batch(monkeypatch):
    """Decode at 64 tokens, 32 slots, q/k/v r16, on a GPU of 132 SMs: 16-row tiles, K split 11
    ways (the one-adapter grid's 12 programs a tile-row x 11 fill half the target of 264, each
    program three 128-wide K steps); the grid is the bound, 34 tiles (31 one-token slots + 33
    tokens) x 3 x 11 work items, fewer than `LOOP_FILL` x the target."""
    from loramux.kernels import shrink
    from loramux.kernels.tiles import LOOP_FILL

    monkeypatch.setattr(shrink, "target_programs", lambda device, sms=None: 2 * sms if sms else 264)
    meta = build_lora_meta(torch.full((64,), -1), 32, static=True)
    launch = shrink.shrink_launch(meta, 48, 4096, torch.bfloat16, torch.device("cpu"), rank=16)
    assert (launch.config.block_m, launch.config.block_n, launch.split_k, launch.n_tiles) == (16, 16, 11, 34)
    assert launch.grid == (34 * 3 * 11,) and 34 * 3 * 11 < LOOP_FILL * 264


def test_static_decode_blocks_split_k_at_rank_64(monkeypatch):
    """At max_lora_rank 64 (a fleet of mixed ranks), on the two thirds of an H100 that qkv's delta
    gets at 64 tokens: 32-wide rank blocks, so the one-adapter grid leaves room to split K (4 ways,
    each program 8 K steps: the fill asks 3, `DECODE_MAX_K_PER_SPLIT` 4); 16-wide blocks filled
    it, and every program of a many-adapter batch read all of K. At rank 16 the blocks stay 16 wide."""
    from loramux.kernels import shrink

    monkeypatch.setattr(shrink, "target_programs", lambda device, sms=None: 2 * sms if sms else 264)
    meta = build_lora_meta(torch.full((64,), -1), 256, static=True)
    cpu = torch.device("cpu")
    r64 = shrink.shrink_launch(meta, 3 * 64, 4096, torch.bfloat16, cpu, sms=88, rank=64)
    assert (r64.config.block_n, r64.split_k, r64.k_per_split) == (32, 4, 8 * 128)
    r16 = shrink.shrink_launch(meta, 3 * 16, 4096, torch.bfloat16, cpu, sms=88, rank=16)
    assert (r16.config.block_n, r16.split_k) == (16, 7)


@pytest.mark.parametrize("H", [4096, 14336])
def test_static_mixed_step_splits_k_into_short_ranges(H, monkeypatch):
    """A mixed step's graph (176 tokens: decodes beside a prompt chunk) on the eighth of an H100
    that a big GEMM leaves: the one-adapter grid (6 tiles x 2 rank blocks) nearly fills the 16
    programs, but each program of a many-adapter batch (a one-row tile per adapter) would loop
    over all of K; K is split into ranges of at most `DECODE_MAX_K_PER_SPLIT`."""
    from loramux.kernels import shrink

    monkeypatch.setattr(shrink, "target_programs", lambda device, sms=None: 2 * sms if sms else 264)
    meta = build_lora_meta(torch.full((176,), -1), 256, static=True)
    launch = shrink.shrink_launch(meta, 64, H, torch.bfloat16, torch.device("cpu"), sms=16, rank=64)
    assert launch.k_per_split <= shrink.DECODE_MAX_K_PER_SPLIT
    assert launch.split_k == H // shrink.DECODE_MAX_K_PER_SPLIT


def test_static_grids_loop_over_the_bound_with_a_program_per_one_adapter_item(monkeypatch):
    """A mixed step's graph (176 tokens of at most 64 sequences) on the 16 multiprocessors a big
    GEMM leaves: gate_up's expand bound is 67 tiles (63 one-token segments and 4 of the rest) x 56
    column chunks, but its grid runs the one-adapter batch's 6 x 56 items' worth of programs, each
    looping over the live items; the down shrink's the same, `LOOP_FILL` x the target where that
    is more."""
    from loramux.kernels import expand, shrink
    from loramux.kernels.tiles import LOOP_FILL, cdiv

    monkeypatch.setattr(shrink, "target_programs", lambda device, sms=None: 2 * sms if sms else 264)
    monkeypatch.setattr(expand, "target_programs", lambda device, sms=None: 2 * sms if sms else 264)
    meta = build_lora_meta(torch.full((176,), -1), 256, static=True, max_distinct=64)
    cpu = torch.device("cpu")
    cfg, grid, n_units = expand.expand_launch(meta, (14336, 14336), 64, torch.bfloat16, cpu, sms=16)
    assert (cfg.block_m, n_units, meta.num_tiles(32)) == (32, 56, 67)
    assert grid == (6 * 56,)
    down = shrink.shrink_launch(meta, 64, 14336, torch.bfloat16, cpu, sms=16, rank=64)
    per_tile = 2 * down.split_k
    assert down.n_tiles * per_tile > down.grid[0] == max(cdiv(176, down.config.block_m) * per_tile, LOOP_FILL * 32)


def test_static_decode_expand_fills_half_the_target(monkeypatch):
    """A decode graph's expand (64 tokens, the two thirds of an H100 beside qkv and o) takes as
    many column blocks a program as keep its one-adapter grid at half the target: qkv 4 a program
    (2 would fill it twice), o 2 (4 would leave it short). A prefill's takes 512-column chunks."""
    from loramux.kernels import expand

    monkeypatch.setattr(expand, "target_programs", lambda device, sms=None: 2 * sms if sms else 264)
    cpu = torch.device("cpu")
    qkv = expand.static_expand_config(64, (4096, 1024, 1024), 16, torch.bfloat16, cpu, sms=88)
    o = expand.static_expand_config(64, (4096,), 16, torch.bfloat16, cpu, sms=88)
    assert (qkv.block_n, qkv.group, o.group) == (64, 4, 2)
    prefill = expand.static_expand_config(8192, (1024,), 64, torch.bfloat16, cpu)
    assert (prefill.block_m, prefill.block_n * prefill.group) == (64, 512)


def run_static_apply(x, A, B, scales, ranks, sizes, slots, y0, S, monkeypatch=None, poison=False, max_distinct=None):
    """lora_apply (Triton, static meta) into a copy of y0; with `poison`, buf and the split-K
    scratch are handed out NaN-filled (nothing may rely on them being zero)."""
    from loramux.kernels import lora_apply, shrink

    if poison:
        monkeypatch.setattr(shrink, "_scratch", lambda *shape, device: torch.full(shape, float("nan"), device=device))
    try:
        meta = build_lora_meta(slots, S, static=True, max_distinct=max_distinct)
        y = y0.clone()
        lora_apply(y, x, A, B, scales, ranks, sizes, meta)
    finally:
        if poison:
            monkeypatch.undo()
            setenv(monkeypatch, "LORAMUX_KERNELS", "triton")
    return y, meta


def check_static_against_reference(x, A, B, scales, ranks, sizes, slots, y0, y, dtype):
    meta64 = build_lora_meta(slots, A.shape[0])
    y_ref = y0.double()
    buf = reference.lora_shrink_ref(x.double(), A.double(), scales.double(), meta64, ranks)
    reference.lora_expand_ref(y_ref, buf, B.double(), sizes, meta64, ranks)
    untouched = (slots < 0) | (ranks[slots.clamp(min=0).long()] == 0)
    assert torch.equal(bits(y[untouched]), bits(y0[untouched])), "a base or rank-0 row changed"
    delta, delta_ref = (y.double() - y0.double())[~untouched], (y_ref - y0.double())[~untouched]
    assert rel_err(delta, delta_ref) < TOL[dtype], rel_err(delta, delta_ref)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("mapping", STATIC_MAPPINGS)
def test_triton_interpreter_static_meta_matches_reference(mapping, dtype, monkeypatch):
    """Static meta through lora_apply: any mapping (all base, one slot, every token its own slot,
    rank-0 slots, a mix) of a 3-slice module with a different rank per slice, split-K on."""
    from loramux.kernels import shrink

    setenv(monkeypatch, "LORAMUX_KERNELS", "triton")
    monkeypatch.setattr(shrink, "target_programs", lambda device, sms=None: 8)  # as on a GPU: K split
    T, H, S, R, sizes = 10, 520, 12, 8, (16, 8, 24)
    x, A, B, scales, ranks, gen = per_slice_rank_inputs(T, H, S, R, sizes, dtype, seed=len(mapping))
    slots = static_slots(mapping, T, S, ranks, gen)
    y0 = torch.randn(T, sum(sizes), generator=gen).to(dtype)
    y, meta = run_static_apply(x, A, B, scales, ranks, sizes, slots, y0, S)
    assert static_launches(meta, H, R, sizes, dtype)[0].split_k > 1  # the counter path runs
    check_static_against_reference(x, A, B, scales, ranks, sizes, slots, y0, y, dtype)


@needs_interpreter
def test_triton_interpreter_static_meta_wide_rank_blocks(monkeypatch):
    """R = 32: a decode block spans a slice's 32 rank columns, of which each slot's adapter fills
    its own rank (0 to 32) per slice; split-K on, against the reference."""
    from loramux.kernels import shrink

    setenv(monkeypatch, "LORAMUX_KERNELS", "triton")
    monkeypatch.setattr(shrink, "target_programs", lambda device, sms=None: 12)  # as on a GPU: K split
    T, H, S, R, sizes = 10, 520, 12, 32, (16, 8, 24)
    x, A, B, scales, ranks, gen = per_slice_rank_inputs(T, H, S, R, sizes, torch.float32, seed=7)
    slots = static_slots("mixed", T, S, ranks, gen)
    y0 = torch.randn(T, sum(sizes), generator=gen)
    y, meta = run_static_apply(x, A, B, scales, ranks, sizes, slots, y0, S)
    launch = static_launches(meta, H, R, sizes, torch.float32)[0]
    assert launch.config.block_n == 32 and launch.split_k > 1
    check_static_against_reference(x, A, B, scales, ranks, sizes, slots, y0, y, torch.float32)


@needs_interpreter
@pytest.mark.parametrize("mapping", ["one_slot", "mixed"])
def test_triton_interpreter_static_meta_more_tokens_than_slots(mapping, monkeypatch):
    """40 tokens on 2 slots: one slot's 40 tokens need 3 tiles of 16, the grid's bound holds them."""
    setenv(monkeypatch, "LORAMUX_KERNELS", "triton")
    T, H, S, R, sizes = 40, 24, 2, 4, (8,)
    x, A, B, scales, ranks, gen = per_slice_rank_inputs(T, H, S, R, sizes, torch.float32, seed=5)
    ranks[1], A[1], B[1] = R, torch.randn(R, H), torch.randn(sizes[0], R)  # slot 1 (one_slot) has rank R
    slots = static_slots(mapping, T, S, ranks, gen)
    y0 = torch.randn(T, sum(sizes), generator=gen)
    y, _ = run_static_apply(x, A, B, scales, ranks, sizes, slots, y0, S)
    check_static_against_reference(x, A, B, scales, ranks, sizes, slots, y0, y, torch.float32)


@needs_interpreter
def test_triton_interpreter_static_meta_bounded_distinct_slots(monkeypatch):
    """A static meta bounded to 5 distinct slots of 12 (its grid: 4 one-token tiles and the rest):
    a mapping of 5 slots, one of them holding most of the 40 tokens, plus base rows, matches the
    reference, split-K on."""
    from loramux.kernels import shrink

    setenv(monkeypatch, "LORAMUX_KERNELS", "triton")
    monkeypatch.setattr(shrink, "target_programs", lambda device, sms=None: 64)  # K split, as on a GPU
    T, H, S, R, sizes = 40, 520, 12, 8, (16, 8, 24)
    x, A, B, scales, ranks, gen = per_slice_rank_inputs(T, H, S, R, sizes, torch.float32, seed=11)
    used = torch.tensor([2, 5, 7, 9, 11], dtype=torch.int32)
    slots = used[torch.randint(0, 5, (T,), generator=gen)]
    slots[:20], slots[torch.rand(T, generator=gen) < 0.2] = 11, -1
    y0 = torch.randn(T, sum(sizes), generator=gen)
    y, meta = run_static_apply(x, A, B, scales, ranks, sizes, slots, y0, S, max_distinct=5)
    assert meta.num_active == 5 and meta.num_tiles(16) < build_lora_meta(slots, S, static=True).num_tiles(16)
    assert static_launches(meta, H, R, sizes, torch.float32)[0].split_k > 1
    check_static_against_reference(x, A, B, scales, ranks, sizes, slots, y0, y, torch.float32)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("meta_kind", ["static", "exact"])
def test_expand_store_overwrites_the_rows_with_an_adapter_without_reading_them(impl, meta_kind, monkeypatch):
    """``store=True`` (the delta buffer of `BaseLayerWithLoRA.lora_delta_forward`): rows whose slot
    has a rank here get exactly the delta, whatever they held (NaN: never read); base rows and
    rank-0 slots' rows are left bit for bit."""
    if impl == "triton" and not INTERPRET:
        pytest.skip("the Triton kernels on the CPU need TRITON_INTERPRET=1")
    setenv(monkeypatch, "LORAMUX_KERNELS", impl)
    T, H, S, R, sizes = 12, 40, 6, 8, (16, 8, 24)
    x, A, B, scales, ranks, gen = per_slice_rank_inputs(T, H, S, R, sizes, torch.float32, seed=11)
    slots = static_slots("mixed", T, S, ranks, gen)
    slots[:2] = torch.tensor([0, 1], dtype=torch.int32)  # rank-0 slots' rows too
    meta = build_lora_meta(slots, S, static=meta_kind == "static")
    touched = (slots >= 0) & (ranks[slots.clamp(min=0).long()] > 0)
    assert touched.any() and (~touched).any()
    y0 = torch.randn(T, sum(sizes), generator=gen)
    y0[touched] = float("nan")
    y = y0.clone()
    lora_expand(y, lora_shrink(x, A, scales, meta, ranks), B, sizes, meta, ranks, store=True)
    delta = torch.zeros(T, sum(sizes), dtype=torch.float64)
    meta64 = build_lora_meta(slots, S)
    reference.lora_expand_ref(delta, reference.lora_shrink_ref(x.double(), A.double(), scales.double(), meta64, ranks),
                              B.double(), sizes, meta64, ranks)
    assert torch.equal(bits(y[~touched]), bits(y0[~touched])), "a base or rank-0 row changed"
    assert torch.isfinite(y[touched]).all() and rel_err(y[touched].double(), delta[touched]) < 1e-5


@needs_interpreter
def test_triton_interpreter_no_zeroing_needed(monkeypatch):
    """buf and the split-K scratch NaN-filled, run twice: both results equal the reference, and the
    split-K counter table is left all zero (no launch needs a memset before it)."""
    from loramux.kernels import shrink

    setenv(monkeypatch, "LORAMUX_KERNELS", "triton")
    T, H, S, R, sizes = 9, 520, 6, 8, (16, 8)
    x, A, B, scales, ranks, gen = per_slice_rank_inputs(T, H, S, R, sizes, torch.float32, seed=3)
    slots = static_slots("mixed", T, S, ranks, gen)
    y0 = torch.randn(T, sum(sizes), generator=gen)
    for _ in range(2):
        y, meta = run_static_apply(x, A, B, scales, ranks, sizes, slots, y0, S, monkeypatch, poison=True)
        check_static_against_reference(x, A, B, scales, ranks, sizes, slots, y0, y, torch.float32)
    assert static_launches(meta, H, R, sizes, torch.float32)[0].split_k > 1
    assert int(shrink._LOCK_TABLES[torch.device("cpu")].abs().sum()) == 0
    # the shrink alone, exact meta, forced 3-way split into a NaN-filled out: every row with an
    # adapter written once, zeros past the rank
    meta = build_lora_meta(slots, S)
    out = torch.full((T, len(sizes) * R), float("nan"))
    shrink.lora_shrink_triton(x, A, scales, meta, ranks, config=shrink.ShrinkConfig(16, 16, 64, 3, 4, 2), out=out)
    ref = reference.lora_shrink_ref(x.double(), A.double(), scales.double(), meta, ranks)
    written = shrunk_rows(slots, ranks)
    assert rel_err(out[written], ref[written]) < 1e-5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mapping", STATIC_MAPPINGS)
def test_gpu_static_meta_llama8b_matches_reference(mapping, monkeypatch):
    """bf16, Llama-3.1-8B's q/k/v, gate/up and down at 64 decode tokens over 32 slots, at
    max_lora_rank 16 and 64 (slots of ranks 0 to R per slice; 32-wide rank blocks at 64)."""
    setenv(monkeypatch, "LORAMUX_KERNELS", None)
    T, S = 64, 32
    shapes = [(4096, (4096, 1024, 1024)), (4096, (14336, 14336)), (14336, (4096,))]
    for R, (H, sizes) in itertools.product((16, 64), shapes):
        x, A, B, scales, ranks, gen = per_slice_rank_inputs(T, H, S, R, sizes, torch.float32, seed=H)
        slots = static_slots(mapping, T, S, ranks, gen) if mapping != "all_different" else \
            torch.randperm(S, generator=gen).repeat(2).to(torch.int32)
        to = lambda t: t.to("cuda", torch.bfloat16)  # noqa: E731
        y0 = torch.randn(T, sum(sizes), generator=gen)
        y, _ = run_static_apply(to(x), to(A), to(B), scales.cuda(), ranks.cuda(), sizes, slots.cuda(), to(y0), S)
        check_static_against_reference(to(x).cpu(), to(A).cpu(), to(B).cpu(), scales, ranks, sizes, slots,
                                       to(y0).cpu(), y.cpu(), torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("meta_kernel", ["0", "1"])
def test_gpu_graph_captured_with_all_base_rows_replays_any_mix(meta_kernel, monkeypatch):
    """One CUDA graph captured with every row base (-1), replayed with 1 adapter and with 32
    adapters over its 64 tokens: the reference's results each time (3 projections of a layer),
    with the static meta built by torch ops and by one launch (``LORAMUX_META_KERNEL``)."""
    from loramux.kernels import lora_apply

    setenv(monkeypatch, "LORAMUX_META_KERNEL", meta_kernel)

    T, S, R = 64, 32, 16
    modules = [(4096, (4096, 1024, 1024)), (4096, (14336, 14336)), (14336, (4096,))]
    weights = []
    for H, sizes in modules:
        x, A, B, scales, ranks, _ = per_slice_rank_inputs(T, H, S, R, sizes, torch.float32, seed=H + 1)
        ranks[:2] = R  # every slot holds an adapter here
        A[:2].normal_(std=H**-0.5)
        B[:2].normal_(std=R**-0.5)
        weights.append(tuple(t.cuda() for t in (x.bfloat16(), A.bfloat16(), B.bfloat16(), scales, ranks)))
    slots = torch.full((T,), -1, dtype=torch.int32, device="cuda")
    ys0 = [torch.randn(T, sum(sizes), device="cuda").bfloat16() for _, sizes in modules]
    ys = [y.clone() for y in ys0]

    def step():
        meta = build_lora_meta(slots, S, static=True)  # rebuilt from `slots` on every replay
        for (x, A, B, scales, ranks), y, (_, sizes) in zip(weights, ys, modules):
            lora_apply(y, x, A, B, scales, ranks, sizes, meta)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compile, make the split-K counter table
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for mapping in (torch.full((T,), 7), torch.arange(T) % S, -torch.ones(T)):
        slots.copy_(mapping.to(torch.int32))
        for y, y0 in zip(ys, ys0):
            y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        meta64 = build_lora_meta(slots.cpu(), S)
        for (x, A, B, scales, ranks), y, y0, (_, sizes) in zip(weights, ys, ys0, modules):
            y_ref = y0.double().cpu()
            buf = reference.lora_shrink_ref(x.double().cpu(), A.double().cpu(), scales.double().cpu(), meta64,
                                            ranks.cpu())
            reference.lora_expand_ref(y_ref, buf, B.double().cpu(), sizes, meta64, ranks.cpu())
            base_rows = (slots < 0).cpu()
            assert torch.equal(bits(y.cpu()[base_rows]), bits(y0.cpu()[base_rows])), "a base row changed"
            if not base_rows.all():
                err = rel_err(y.double().cpu() - y0.double().cpu(), y_ref - y0.double().cpu())
                assert err < 2e-2, (mapping[:4].tolist(), sizes, err)


def test_reference_reads_each_ranks_tensor_it_is_given():
    """Two modules' ranks, each a fresh temporary (the second may take the first's freed memory),
    with one meta: each call masks with its own ranks (a cache keyed by address mixed them up)."""
    from loramux.kernels import reference

    T, S, R, H = 8, 4, 4, 16
    slots = torch.arange(T, dtype=torch.int32) % S
    meta = build_lora_meta(slots, S)
    x = torch.randn(T, H, dtype=torch.float64)
    A = torch.randn(S, R, H, dtype=torch.float64)
    scales = torch.ones(S, 1, dtype=torch.float64)
    memory = np.zeros(S, dtype=np.int32)  # every ranks tensor below lives at this one address
    for rank in (1, 3, 2, 4):
        memory[:] = rank  # a write torch does not see (no version bump), as a freed-and-reused block
        buf = reference.lora_shrink_ref(x, A, scales, meta, torch.from_numpy(memory))
        assert bool((buf[:, rank:] == 0).all()) and bool((buf[:, :rank] != 0).all()), rank

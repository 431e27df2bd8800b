"""The kernels reading adapters from a rank-row pool: every slot's rows at its own
start in a pool [U, n_slices, H] / [U, N] shared by adapters of different ranks, the rows around
them another adapter's (NaN here, so a read past a slot's rank shows). Triton (the interpreter on
the CPU, the GPU under `gpu`) and the torch reference against the float64 reference on the
same weights stored one slot per adapter."""

from __future__ import annotations

import pytest
import torch

from loramux.kernels import build_lora_meta, lora_expand, lora_shrink, reference
from loramux.kernels.pool import POOL_ROW_ALIGN, pool_rows

from conftest import INTERPRET, needs_cuda, rel_err, setenv
from test_kernels import TOL, Case, bits, make_inputs, shrunk_rows


def to_pool(case: Case, A: torch.Tensor, B: torch.Tensor, ranks: torch.Tensor, gen: torch.Generator):
    """(pool_a [U, n, H], pool_b [U, N], starts [S]) as a pooled layer lays them out: slot s owns
    pool_rows(ranks[s]) rows from a random start, in a random order; A's rows past its rank and
    every row outside the slots are NaN, B's columns past its rank zero (the layout's contract)."""
    S, n, R, N = case.S, len(case.slice_sizes), case.R, B.shape[1]
    r = ranks.tolist()
    widths = [pool_rows(rank) for rank in r]
    gaps = (torch.randint(0, 3, (S + 1,), generator=gen) * POOL_ROW_ALIGN).tolist()
    order = torch.randperm(S, generator=gen).tolist()
    U = sum(widths) + sum(gaps)
    pool_a = torch.full((U, n, case.H), float("nan"), dtype=A.dtype, device=A.device)
    pool_b = torch.full((U, N), float("nan"), dtype=B.dtype, device=B.device)
    starts, at = [0] * S, gaps[0]
    for i, s in enumerate(order):
        starts[s] = at
        pool_a[at : at + r[s]] = A[s].view(n, R, case.H)[:, : r[s]].transpose(0, 1)
        block = torch.zeros(N, widths[s], dtype=B.dtype, device=B.device)
        block[:, : r[s]] = B[s][:, : r[s]]
        pool_b.view(-1)[at * N : (at + widths[s]) * N] = block.view(-1)
        at += widths[s] + gaps[i + 1]
    return pool_a, pool_b, torch.tensor(starts, dtype=torch.int32, device=A.device)


CASES = [
    Case(1, 33, 1, 8, (17,), "one", True),
    Case(37, 70, 5, 8, (20, 9, 31), "random", True),
    Case(50, 96, 8, 4, (24, 24), "partly_empty", True),
    Case(90, 200, 4, 32, (65,), "reversed", True),
    Case(5, 40, 100, 8, (24,), "random", True),  # far more slots than tokens: 32 lanes for slots up to 99
]


def run_pool_pipeline(case: Case, dtype: torch.dtype, device: str, *, static: bool, seed: int = 0) -> None:
    """The pool against the float64 reference on one-slot-per-adapter weights; on a GPU also bit
    for bit against the Triton kernels on those weights (the same tiles and sums)."""
    x, A, B, scales, ranks, slots = make_inputs(case, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    pool_a, pool_b, starts = to_pool(case, A, B, ranks.cpu(), gen)
    meta = build_lora_meta(slots, case.S, static=static)
    meta64 = build_lora_meta(slots.cpu(), case.S)
    active = (slots >= 0).cpu()
    ranks_cpu = ranks.cpu()

    buf = lora_shrink(x, pool_a, scales, meta, ranks, pool_starts=starts, max_rank=case.R)
    buf_ref = reference.lora_shrink_ref(x.cpu().double(), A.cpu().double(), scales.cpu().double(), meta64, ranks_cpu)
    written = shrunk_rows(slots, ranks)
    err = rel_err(buf.cpu()[written], buf_ref[written])
    assert err < TOL[torch.float32 if dtype == torch.float32 else dtype], f"shrink rel err {err:.2e}"

    # from zero, so that rounding y + delta to 16 bits does not hide the delta's own error
    y = torch.zeros(case.T, sum(case.slice_sizes), device=device, dtype=dtype)
    y64 = y.cpu().double()
    lora_expand(y, buf, pool_b, case.slice_sizes, meta, ranks, pool_starts=starts)
    reference.lora_expand_ref(y64, buf.cpu().double(), B.cpu().double(), case.slice_sizes, meta64, ranks_cpu)
    assert not y.cpu()[~active].any(), "expand touched a slot -1 row"
    err = rel_err(y.cpu()[active].double(), y64[active])
    assert err < TOL[dtype], f"expand rel err {err:.2e}"

    if device == "cuda":  # bit for bit the kernels on one [S, ...] block per adapter
        rows = written.to(device)  # buf's rows of tokens without an adapter, or of a rank-0 slot, are unspecified
        assert torch.equal(bits(buf[rows]), bits(lora_shrink(x, A, scales, meta, ranks)[rows]))
        y_rows = torch.randn(case.T, sum(case.slice_sizes), generator=gen).to(device=device, dtype=dtype)
        y_pool, y_dense = y_rows.clone(), y_rows.clone()
        lora_expand(y_pool, buf, pool_b, case.slice_sizes, meta, ranks, pool_starts=starts)
        lora_expand(y_dense, buf, B, case.slice_sizes, meta, ranks)
        assert torch.equal(bits(y_pool), bits(y_dense))


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_pool_equals_one_slot_per_adapter(case, kernels, monkeypatch):
    if kernels == "triton" and not INTERPRET:
        pytest.skip("the CPU run of the Triton kernels needs the interpreter")
    setenv(monkeypatch, "LORAMUX_KERNELS", "torch" if kernels == "reference" else "triton")
    run_pool_pipeline(case, torch.float32, "cpu", static=False)


@pytest.mark.skipif(not INTERPRET, reason="the CPU run of the Triton kernels needs the interpreter")
@pytest.mark.parametrize("case", [CASES[1], Case(64, 40, 64, 8, (24, 16), "partly_empty", True)], ids=str)
def test_pool_with_a_static_meta(case, monkeypatch):
    """The CUDA-graph path: grids from (T, S) only, the pool read the same way; the second case's
    bound (64 tiles) holds more work items than its grid has programs, so each loops over several."""
    from loramux.kernels.expand import expand_launch

    setenv(monkeypatch, "LORAMUX_KERNELS", "triton")
    meta = build_lora_meta(torch.zeros(case.T, dtype=torch.int32), case.S, static=True)
    _, grid, n_units = expand_launch(meta, case.slice_sizes, case.R, torch.float32, torch.device("cpu"))
    assert (grid[0] < meta.num_tiles(16) * n_units) == (case.T >= 48)
    run_pool_pipeline(case, torch.float32, "cpu", static=True)


def test_pool_needs_ranks_and_a_max_rank():
    case = CASES[1]
    x, A, B, scales, ranks, slots = make_inputs(case, torch.float32, "cpu", 0)
    pool_a, pool_b, starts = to_pool(case, A, B, ranks, torch.Generator().manual_seed(1))
    meta = build_lora_meta(slots, case.S)
    with pytest.raises(ValueError, match="a pool needs ranks"):
        lora_shrink(x, pool_a, scales, meta, None, pool_starts=starts, max_rank=case.R)
    with pytest.raises(ValueError, match="max_rank"):
        lora_shrink(x, pool_a, scales, meta, ranks, pool_starts=starts)
    with pytest.raises(ValueError, match=r"pool_starts must be an int32/int64 tensor of shape \[5\]"):
        lora_shrink(x, pool_a, scales, meta, ranks, pool_starts=starts[:2], max_rank=case.R)
    buf = lora_shrink(x, pool_a, scales, meta, ranks, pool_starts=starts, max_rank=case.R)
    y = torch.zeros(case.T, sum(case.slice_sizes))
    with pytest.raises(ValueError, match=r"lora_b must be 2-D \[U, N\] \(a pool\)"):
        lora_expand(y, buf, B, case.slice_sizes, meta, ranks, pool_starts=starts)
    with pytest.raises(ValueError, match=r"the pool lora_b must be contiguous"):  # same values, column-major
        lora_expand(y, buf, pool_b.t().contiguous().t(), case.slice_sizes, meta, ranks, pool_starts=starts)
    assert torch.equal(y, torch.zeros_like(y))  # nothing was written by the refused call


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("static", [False, True], ids=["exact", "static"])
def test_pool_on_gpu(dtype, static):
    for case in CASES + [Case(256, 4096, 32, 64, (4096, 1024, 1024), "random", True)]:
        run_pool_pipeline(case, dtype, "cuda", static=static)


def run_untargeted_slices(dtype: torch.dtype, device: str, *, static: bool, seed: int = 5) -> None:
    """Slices a slot's adapter does not target (scale 0, as a pooled layer writes a q/v adapter's k
    slice): their A rows and B columns hold NaN here, so a kernel that read them would show it.
    buf's columns of those slices are exact zeros, y's keep their bits, the rest is the reference's
    on the weights with those slices zeroed."""
    case = Case(40, 96, 6, 8, (32, 16, 16), "random", True)
    x, A, B, scales, ranks, slots = make_inputs(case, dtype, "cpu", seed)
    n, R, sizes = 3, case.R, case.slice_sizes
    off = torch.zeros(case.S, n, dtype=torch.bool)
    off[::2, 1] = True  # every other slot: the middle slice (k of a q/v adapter)
    off[1, 0] = off[1, 2] = True  # one slot whose only slice is the middle one
    scales = scales.masked_fill(off, 0.0)
    cols = torch.repeat_interleave(off, torch.tensor(sizes), dim=1)  # [S, N]
    gen = torch.Generator().manual_seed(seed + 7)
    pool_a, pool_b, starts = to_pool(case, A.masked_fill(off.repeat_interleave(R, 1)[:, :, None], float("nan")),
                                     B.masked_fill(cols[:, :, None], float("nan")), ranks, gen)
    A0 = A.masked_fill(off.repeat_interleave(R, 1)[:, :, None], 0.0)
    B0 = B.masked_fill(cols[:, :, None], 0.0)
    on = [t.to(device) for t in (x, pool_a, pool_b, starts, scales, ranks, slots)]
    x_d, pool_a, pool_b, starts, scales_d, ranks_d, slots_d = on
    meta = build_lora_meta(slots_d, case.S, static=static)
    meta64 = build_lora_meta(slots, case.S)
    active = slots >= 0
    assert (off[slots[active].long()].any(1)).any(), "no token of an adapter with an untargeted slice"

    buf = lora_shrink(x_d, pool_a, scales_d, meta, ranks_d, pool_starts=starts, max_rank=R).cpu()
    slot_of, written = slots.clamp(min=0).long(), shrunk_rows(slots, ranks)
    off_cols = off[slot_of].repeat_interleave(R, 1) & written[:, None]  # [T, n*R]
    assert torch.equal(bits(buf[off_cols]), bits(torch.zeros_like(buf[off_cols]))), "an untargeted slice was read"
    buf_ref = reference.lora_shrink_ref(x.double(), A0.double(), scales.double(), meta64, ranks)
    assert rel_err(buf[written], buf_ref[written]) < TOL[torch.float32 if dtype == torch.float32 else dtype]

    y0 = torch.randn(case.T, sum(sizes), generator=gen).to(dtype)
    y = y0.to(device, copy=True)
    lora_expand(y, buf.to(device), pool_b, sizes, meta, ranks_d, pool_starts=starts, scales=scales_d)
    y = y.cpu()
    kept = cols[slot_of] & active[:, None]  # [T, N]
    assert torch.equal(bits(y[kept]), bits(y0[kept])), "an untargeted slice's y columns changed"
    assert torch.equal(bits(y[~active]), bits(y0[~active])), "a slot -1 row changed"
    y64 = y0.double()
    reference.lora_expand_ref(y64, buf_ref, B0.double(), sizes, meta64, ranks)
    assert rel_err(y[active].double() - y0[active].double(), y64[active] - y0[active].double()) < TOL[dtype]

    # store (a delta buffer of its own, never read): a written row is whole, zeros in the untargeted slices
    delta = torch.full_like(y0, float("nan")).to(device)
    lora_expand(delta, buf.to(device), pool_b, sizes, meta, ranks_d, pool_starts=starts, scales=scales_d, store=True)
    delta = delta.cpu()
    written = active & (ranks[slot_of] > 0)
    assert (kept & written[:, None]).any() and torch.isfinite(delta[written]).all()
    assert not delta[kept & written[:, None]].any(), "an untargeted slice's delta columns are not zero"
    assert torch.isnan(delta[~written]).all(), "a row without an adapter here was written"
    assert rel_err(delta[written].double(), y64[written] - y0[written].double()) < TOL[dtype]


@pytest.mark.parametrize("static", [False, True], ids=["exact", "static"])
@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_untargeted_slices_are_never_read(kernels, static, monkeypatch):
    if kernels == "triton" and not INTERPRET:
        pytest.skip("the CPU run of the Triton kernels needs the interpreter")
    setenv(monkeypatch, "LORAMUX_KERNELS", "torch" if kernels == "reference" else "triton")
    run_untargeted_slices(torch.float32, "cpu", static=static)


def test_expand_checks_its_scales():
    case = CASES[1]
    x, A, B, scales, ranks, slots = make_inputs(case, torch.float32, "cpu", 0)
    meta = build_lora_meta(slots, case.S)
    buf = lora_shrink(x, A, scales, meta, ranks)
    y = torch.zeros(case.T, sum(case.slice_sizes))
    for bad, match in [(scales[:, :2], r"scales must be \[S, n_slices\] = \[5, 3\]"),
                       (scales.half(), "scales must be float32"),
                       (scales.tolist(), "scales must be a torch.Tensor")]:
        with pytest.raises(ValueError, match=match):
            lora_expand(y, buf, B, case.slice_sizes, meta, ranks, scales=bad)
    assert not y.any()  # nothing was written by the refused calls


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("static", [False, True], ids=["exact", "static"])
def test_untargeted_slices_on_gpu(dtype, static):
    run_untargeted_slices(dtype, "cuda", static=static)

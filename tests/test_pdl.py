"""Programmatic dependent launch (PDL) for the LoRA expand: when it is available, that a
request where it is not changes nothing, that the launcher asks Triton for it only when it is on,
and (gpu) that an expand launched with PDL right after a base GEMM in a CUDA graph gives the
result of the same step without PDL.
"""

from __future__ import annotations

import pytest
import torch

from loramux.kernels import build_lora_meta, lora_apply, lora_expand, reference
from loramux.kernels import expand as expand_module
from loramux.kernels import tiles

from conftest import needs_cuda, needs_interpreter, rel_err, setenv
from test_kernels import bits, per_slice_rank_inputs, static_slots


@pytest.fixture
def fresh_pdl_cache():
    """`pdl_available` caches per device: start and end each test with an empty cache."""
    tiles._pdl_on_device.cache_clear()
    yield
    tiles._pdl_on_device.cache_clear()


@pytest.fixture
def fake_cuda(monkeypatch, fresh_pdl_cache):
    """A CUDA device whose compute capability the test sets (`fake_cuda(9, 0)`), interpreter off;
    returns a list that counts the capability queries."""
    queries = []

    def set_capability(major: int, minor: int = 0) -> list:
        def capability(index):
            queries.append(index)
            return (major, minor)

        monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
        monkeypatch.setattr(tiles, "interpreting", lambda: False)
        tiles._pdl_on_device.cache_clear()
        return queries

    return set_capability


# ---------------------------------------------------------------------------------------------
# availability and the default


def test_pdl_is_not_available_on_the_cpu(fresh_pdl_cache):
    assert tiles.pdl_available("cpu") is False
    assert tiles.pdl_available(torch.device("cpu")) is False


@pytest.mark.parametrize("capability, available", [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)])
def test_pdl_needs_compute_capability_9(capability, available, fake_cuda):
    fake_cuda(*capability)
    assert tiles.pdl_available("cuda:0") is available


def test_pdl_is_cached_per_device(fake_cuda):
    queries = fake_cuda(9, 0)
    for _ in range(3):
        assert tiles.pdl_available("cuda:0") and tiles.pdl_available("cuda:1")
    assert sorted(queries) == [0, 1]


def test_pdl_is_off_under_the_interpreter(fake_cuda, monkeypatch):
    fake_cuda(9, 0)
    monkeypatch.setattr(tiles, "interpreting", lambda: True)
    assert tiles.pdl_available("cuda:0") is False


def test_pdl_needs_gdc_wait_in_triton(fake_cuda, monkeypatch):
    import triton.language as tl

    fake_cuda(9, 0)
    monkeypatch.delattr(tl.extra.cuda, "gdc_wait")
    assert tiles.pdl_available("cuda:0") is False


def test_pdl_needs_the_launch_pdl_option_in_triton(fake_cuda, monkeypatch):
    from triton.backends.nvidia.compiler import CUDAOptions

    fake_cuda(9, 0)
    fields = {k: v for k, v in CUDAOptions.__dataclass_fields__.items() if k != "launch_pdl"}
    monkeypatch.setattr(CUDAOptions, "__dataclass_fields__", fields)
    assert tiles.pdl_available("cuda:0") is False


@pytest.mark.parametrize("value, on", [(None, False), ("", False), ("0", False), ("1", True), (" 1 ", True)])
def test_pdl_default_is_off_unless_the_env_var_says_1(value, on, monkeypatch):
    if value is None:
        setenv(monkeypatch, tiles.PDL_ENV_VAR, None)
    else:
        setenv(monkeypatch, tiles.PDL_ENV_VAR, value)
    assert tiles.pdl_default() is on


def test_pdl_env_var_rejects_other_values(monkeypatch):
    with pytest.raises(ValueError, match=r"LORAMUX_PDL='yes'.*use 1"):
        setenv(monkeypatch, tiles.PDL_ENV_VAR, "yes")


@pytest.mark.parametrize("requested, env, available, on", [
    (None, None, True, False),  # the default: off
    (None, "1", True, True),
    (None, "1", False, False),
    (True, None, True, True),
    (True, "0", False, False),  # asked for where it is not available: dropped
    (False, "1", True, False),  # the caller's word beats the env var
])
def test_resolve_pdl(requested, env, available, on, monkeypatch):
    if env is None:
        setenv(monkeypatch, tiles.PDL_ENV_VAR, None)
    else:
        setenv(monkeypatch, tiles.PDL_ENV_VAR, env)
    monkeypatch.setattr(tiles, "pdl_available", lambda device: available)
    assert tiles.resolve_pdl(requested, torch.device("cuda", 0)) is on


# ---------------------------------------------------------------------------------------------
# the launcher


def small_case(seed: int = 0):
    T, H, S, R, sizes = 12, 40, 4, 8, (16, 24)
    x, A, B, scales, ranks, gen = per_slice_rank_inputs(T, H, S, R, sizes, torch.float32, seed)
    slots = static_slots("mixed", T, S, ranks, gen)
    y0 = torch.randn(T, sum(sizes), generator=gen)
    return x, A, B, scales, ranks, sizes, slots, y0, S


@needs_interpreter
def test_pdl_requested_on_the_cpu_changes_nothing(monkeypatch):
    """pdl=True where PDL is not available (the interpreter) gives bit for bit the result of pdl
    off and of the default; were USE_PDL compiled in here, the interpreter would fail on gdc_wait."""
    from loramux.kernels.expand import lora_expand_triton
    from loramux.kernels.shrink import lora_shrink_triton

    setenv(monkeypatch, "LORAMUX_KERNELS", "triton")
    setenv(monkeypatch, tiles.PDL_ENV_VAR, "1")
    x, A, B, scales, ranks, sizes, slots, y0, S = small_case()
    for static in (False, True):
        meta = build_lora_meta(slots, S, static=static)
        buf = lora_shrink_triton(x, A, scales, meta, ranks)
        ys = {}
        for pdl in (None, False, True):
            ys[pdl] = y0.clone()
            lora_expand_triton(ys[pdl], buf, B, sizes, meta, ranks, pdl=pdl)
        y_apply = y0.clone()
        lora_apply(y_apply, x, A, B, scales, ranks, sizes, meta, pdl=True)
        assert torch.equal(bits(ys[True]), bits(ys[False])) and torch.equal(bits(ys[None]), bits(ys[False]))
        assert torch.equal(bits(y_apply), bits(ys[False]))
    meta64 = build_lora_meta(slots, S)
    y_ref = y0.double()
    reference.lora_expand_ref(y_ref, reference.lora_shrink_ref(x.double(), A.double(), scales.double(), meta64, ranks),
                              B.double(), sizes, meta64, ranks)
    assert rel_err(ys[True] - y0, y_ref - y0.double()) < 1e-5


class _RecordingKernel:
    """Stands in for `_expand_kernel`: records each launch's keyword arguments."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(kwargs)


@needs_interpreter  # lora_apply runs the real shrink
@pytest.mark.parametrize("on", [False, True])
def test_launch_pdl_is_passed_to_triton_only_when_pdl_is_on(on, monkeypatch):
    """`launch_pdl` goes to the launch only with PDL on (a Triton without the option raises on an
    unknown keyword), together with USE_PDL; `lora_expand` and `lora_apply` pass `pdl` through."""
    setenv(monkeypatch, "LORAMUX_KERNELS", "triton")
    asked = []
    monkeypatch.setattr(expand_module, "resolve_pdl", lambda pdl, device: asked.append(pdl) or on)
    kernel = _RecordingKernel()
    monkeypatch.setattr(expand_module, "_expand_kernel", kernel)
    x, A, B, scales, ranks, sizes, slots, y0, S = small_case()
    meta = build_lora_meta(slots, S)
    buf = torch.zeros(x.shape[0], A.shape[1])  # [T, n_slices*R]
    lora_expand(y0.clone(), buf, B, sizes, meta, ranks, pdl=on)
    lora_apply(y0.clone(), x, A, B, scales, ranks, sizes, meta, pdl=on)
    lora_expand(y0.clone(), buf, B, sizes, meta, ranks)
    assert asked == [on, on, None] and len(kernel.launches) == 3
    for launch in kernel.launches:
        assert launch["USE_PDL"] is on
        assert launch.get("launch_pdl", False) is on and ("launch_pdl" in launch) is on


# ---------------------------------------------------------------------------------------------
# gpu: a CUDA graph with the expand launched with PDL right after the base GEMM


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n_adapters", [1, 32])
def test_gpu_pdl_expand_after_a_gemm_in_a_cuda_graph(n_adapters):
    """T=64 bf16, 32 slots, Llama-3.1-8B's qkv: meta (static), shrink, base GEMM into y, then the
    expand with PDL, all on one stream and captured with every row base. Replayed for a mix of
    1 or 32 adapters, three times: bit for bit what the same graph without PDL gives, and the
    eager step with PDL bit for bit the eager step without; graph and eager agree, and both are
    near the float64 reference."""
    from loramux.kernels.expand import lora_expand_triton
    from loramux.kernels.shrink import lora_shrink_triton

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0 or more")
    assert tiles.pdl_available("cuda"), "a Hopper GPU, but this Triton lacks gdc_wait or the launch_pdl option"
    T, S, R, H, sizes = 64, 32, 16, 4096, (4096, 1024, 1024)
    gen = torch.Generator().manual_seed(n_adapters)
    N = sum(sizes)
    A = torch.randn(S, len(sizes) * R, H, generator=gen) / H**0.5
    B = torch.randn(S, N, R, generator=gen) / R**0.5
    W = torch.randn(N, H, generator=gen) / H**0.5
    x = torch.randn(T, H, generator=gen)
    x, A, B, W = (t.to("cuda", torch.bfloat16) for t in (x, A, B, W))
    scales = (torch.rand(S, len(sizes), generator=gen) + 0.5).cuda()
    ranks = torch.full((S,), R, dtype=torch.int32, device="cuda")
    mix = (torch.arange(T) % n_adapters)[torch.randperm(T, generator=gen)].to(torch.int32)
    slots = torch.full((T,), -1, dtype=torch.int32, device="cuda")
    y = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)

    def step(pdl: bool) -> None:
        meta = build_lora_meta(slots, S, static=True)
        buf = lora_shrink_triton(x, A, scales, meta, ranks)
        torch.mm(x, W.t(), out=y)  # the expand's stream predecessor: a cuBLAS GEMM writing y
        lora_expand_triton(y, buf, B, sizes, meta, ranks, pdl=pdl)

    graphs = {}
    for pdl in (False, True):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(pdl)  # warm-up: compile, split-K counter table
        torch.cuda.current_stream().wait_stream(s)
        graphs[pdl] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[pdl]):
            step(pdl)
    slots.copy_(mix)
    results = {}
    for pdl in (False, True):
        step(pdl)
        results[("eager", pdl)] = y.clone()
        for replay in range(3):
            y.fill_(float("nan"))
            graphs[pdl].replay()
            results[("graph", pdl, replay)] = y.clone()
    torch.cuda.synchronize()
    eager_off, graph_off = results[("eager", False)], results[("graph", False, 0)]
    assert torch.equal(bits(results[("eager", True)]), bits(eager_off)), "PDL changed the eager step"
    for pdl in (False, True):
        for replay in range(3):
            assert torch.equal(bits(results[("graph", pdl, replay)]), bits(graph_off)), \
                f"replay {replay} with pdl={pdl} differs from the graph without PDL"
    assert rel_err(graph_off, eager_off) < 1e-2  # the same step (cuBLAS may pick another GEMM under capture)
    want = graph_off
    meta64 = build_lora_meta(mix, S)
    y_base = (x.double() @ W.double().t()).cpu()
    y_ref = y_base.clone()
    buf = reference.lora_shrink_ref(x.double().cpu(), A.double().cpu(), scales.double().cpu(), meta64, ranks.cpu())
    reference.lora_expand_ref(y_ref, buf, B.double().cpu(), sizes, meta64, ranks.cpu())
    assert rel_err(want.double().cpu() - y_base, y_ref - y_base) < 3e-2

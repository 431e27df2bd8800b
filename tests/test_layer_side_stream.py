"""A LoRA projection computes its delta on a side CUDA stream beside its base GEMM, which
leaves it some multiprocessors, in one custom op (``loramux::lora_delta``) that returns the base
output and the delta apart; the layer adds them in traced code. CPU tests: the decision, the
fork/join order (with recording stand-ins for the CUDA streams), equality with the sequential
path (``loramux::lora_layer``), the ops under torch.compile; the real streams run in
tests/test_layer_side_stream_gpu.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import loramux.engine.layers.backend as backend_module
import loramux.engine.layers.side_stream as side_stream_module
from layer_helpers import in_order, pool_of, reset_lora, set_lora
from loramux.engine.layers import BaseLayerWithLoRA, EmbeddingWithLoRA, LinearWithLoRA, LoRAContext, Route
from loramux.engine.layers.side_stream import delta_beside_base, gemm_carveout, lora_sms_beside
from loramux.kernels import build_lora_meta, lora_shrink
from loramux.registry import LoRAConfig, LoRAModuleWeights
from conftest import setenv

CONFIG = LoRAConfig(max_loras=3, max_lora_rank=8)
SLOTS = torch.tensor([0, -1, 1, 1, -1, 0], dtype=torch.int32)  # adapters and base rows mixed


def with_adapters(layer, ranks=(4, 8)):
    """``layer`` with a context and one random adapter per slot of ``ranks`` (rank 0: none)."""
    layer.lora_context = LoRAContext(CONFIG.max_loras)
    pool_of(layer, CONFIG)
    generator = torch.Generator().manual_seed(len(ranks))
    for slot, rank in enumerate(ranks):
        set_lora(layer, slot, [None if rank == 0 else LoRAModuleWeights(
            torch.randn(rank, layer.in_features, generator=generator),
            torch.randn(size, rank, generator=generator), scaling=0.5 + slot, is_embedding=layer.is_embedding)
            for size in layer.output_sizes])
    return layer


def linear(dtype=torch.float32):
    torch.manual_seed(0)
    return with_adapters(LinearWithLoRA(nn.Linear(16, 12).to(dtype), "proj", CONFIG))


@pytest.fixture
def beside(monkeypatch):
    """Layers built from now on compute their delta beside the base GEMM, as on CUDA (here with
    no streams: in order)."""
    monkeypatch.setattr(side_stream_module, "delta_beside_base", lambda device: True)


# -- the decision -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("device", "kernels", "expected"), [
    ("cuda", None, True), ("cuda:1", None, True), ("cuda", "triton", True),
    ("cuda", "torch", False),  # the torch reference on a GPU: sequential
    ("cpu", None, False), ("cpu", "triton", False),  # Triton's interpreter on the CPU: no streams there
])
def test_the_delta_goes_beside_the_base_gemm_only_on_cuda_with_the_triton_kernels(
        device, kernels, expected, monkeypatch):
    if kernels is None:
        setenv(monkeypatch, "LORAMUX_KERNELS", None)
    else:
        setenv(monkeypatch, "LORAMUX_KERNELS", kernels)
    assert delta_beside_base(device) is expected
    assert delta_beside_base(torch.device(device)) is expected


def test_a_layer_decides_once_and_again_when_moved(monkeypatch):
    layer = linear()
    assert layer.route_plan.graph is Route.BASE_THEN_DELTA  # on the CPU
    monkeypatch.setattr(side_stream_module, "delta_beside_base", lambda device: True)
    assert layer.route_plan.graph is Route.BASE_THEN_DELTA
    assert layer.float().route_plan.graph is Route.DELTA_BESIDE  # `_apply` (module.to, .float) asks again
    embedding = with_adapters(EmbeddingWithLoRA(nn.Embedding(50, 12), "embed", CONFIG)).float()
    assert embedding.route_plan.graph is Route.BASE_THEN_DELTA  # its own kernels: base, then its delta, in order


@pytest.mark.parametrize(("tokens", "sms"), [(1, 0), (8, 0), (16, 44), (32, 44), (48, 88), (128, 88), (129, 66),
                                             (256, 66), (257, 44), (1024, 44), (1025, 0), (4096, 0)])
def test_the_gemm_leaves_the_delta_a_share_of_the_multiprocessors_between_9_and_1024_tokens(
        tokens, sms, monkeypatch):
    """A third; two thirds at 33-128 tokens, a half at 129-256 (an FP8 GEMM a third, and none
    past 256)."""
    monkeypatch.setattr(side_stream_module, "num_sms", lambda index: 132)
    assert lora_sms_beside(tokens, torch.device("cuda:0")) == sms
    assert lora_sms_beside(tokens, torch.device("cpu")) == 0
    fp8 = 0 if tokens > 256 else 44 if 128 < tokens else sms
    assert lora_sms_beside(tokens, torch.device("cuda:0"), fp8=True) == fp8


@pytest.mark.parametrize(("tokens", "sms"), [(8, 0), (32, 16), (64, 44), (128, 44), (129, 16), (1024, 16),
                                             (1025, 0)])
def test_a_big_gemm_leaves_a_third_at_33_to_128_tokens_else_an_eighth(tokens, sms, monkeypatch):
    monkeypatch.setattr(side_stream_module, "num_sms", lambda index: 132)
    gate_up, o = 4096 * 2 * 14336, 4096 * 4096  # Llama-3.1-8B
    assert lora_sms_beside(tokens, torch.device("cuda:0"), gate_up) == sms
    assert lora_sms_beside(tokens, torch.device("cuda:0"), o) == lora_sms_beside(tokens, torch.device("cuda:0"))


@pytest.mark.parametrize("fp8", [False, True])
def test_a_projection_asks_the_share_for_its_gemm_fp8_or_not(fp8, monkeypatch):
    from loramux.engine.quantization import Fp8Linear

    torch.manual_seed(0)
    base = nn.Linear(16, 12)
    layer = in_graphs(with_adapters(LinearWithLoRA(Fp8Linear.from_linear(base) if fp8 else base, "proj", CONFIG)),
                      Route.DELTA_BESIDE)
    layer.lora_context.set(SLOTS, static=True)
    asked = []
    monkeypatch.setattr(backend_module, "lora_sms_beside", lambda *args, **kwargs: asked.append((args, kwargs)) or 0)
    layer(torch.randn(6, 16))
    assert asked == [((6, torch.device("cpu"), 16 * 12), {"fp8": fp8})]


def test_gemm_carveout_sets_and_puts_back_cublaslt_and_the_carveout(monkeypatch):
    log, backend = [], ["cublas"]

    def preferred(name=None):
        if name is not None:
            log.append(f"blas {name}")
            backend[0] = name
        return backend[0]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", lambda n: log.append(f"carveout {n}"),
                        raising=False)
    with gemm_carveout(0):
        log.append("gemm")
    assert log == ["gemm"]  # nothing to leave: nothing changes
    log.clear()
    with pytest.raises(RuntimeError, match="boom"):
        with gemm_carveout(33):
            log.append("gemm")
            raise RuntimeError("boom")
    assert log == ["blas cublaslt", "carveout 33", "gemm", "carveout None", "blas cublas"]
    assert backend == ["cublas"]


# -- the fork and the join, with recording stand-ins for the CUDA streams ------------------------------


class Streams:
    """Stand-ins for the current and the side stream, ``torch.cuda.stream`` and the carveout, that
    log, in order, every wait and which stream each LoRA kernel and base GEMM was launched on."""

    def __init__(self, monkeypatch, sms: int = 0) -> None:
        self.log: list[str] = []
        self.current = "main"
        self.main, self.side = _Stream("main", self.log), _Stream("side", self.log)
        monkeypatch.setattr(backend_module, "beside_streams", lambda device: (self.main, self.side))
        monkeypatch.setattr(backend_module, "lora_sms_beside", lambda tokens, device, gemm_weights, fp8: sms)
        monkeypatch.setattr(backend_module, "gemm_carveout", self._carveout)
        monkeypatch.setattr(torch.cuda, "stream", self._on)
        for name in ("lora_shrink", "lora_expand", "lora_apply"):
            monkeypatch.setattr(backend_module, name, self._logged(name, getattr(backend_module, name)))

    @contextlib.contextmanager
    def _on(self, stream):
        before, self.current = self.current, stream.name
        try:
            yield
        finally:
            self.current = before

    @contextlib.contextmanager
    def _carveout(self, sms):
        self.log.append(f"carveout {sms} on {self.current}")
        yield

    def _logged(self, name, kernel):
        def run(*args, **kwargs):
            self.log.append(f"{name} on {self.current}" + (f" for {kwargs['sms']} SMs" if kwargs.get("sms") else ""))
            if "out" in kwargs:
                self.out = kwargs["out"]
            return kernel(*args, **kwargs)

        return run

    def watch(self, layer) -> None:
        layer.base_layer.register_forward_hook(lambda *_: self.log.append(f"base on {self.current}"))


class _Stream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(f"{self.name} waits {other.name}")


def in_graphs(layer, route):
    """``layer`` takes ``route`` in step graphs, whatever its device decided."""
    layer.route_plan = layer.route_plan._replace(graph=route)
    return layer


def sequential(layer, x):
    """The layer's output with the delta added after the base layer (``loramux::lora_layer``)."""
    with in_order(layer):
        return layer(x)


# bfloat16 base with float32 slots: the delta is added in the slot dtype, the sum rounded once
@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
def test_a_projection_forks_its_delta_beside_the_base_gemm_and_joins_before_returning(
        base_dtype, beside, monkeypatch):
    layer = linear()
    layer.base_layer.to(base_dtype)
    assert layer.route_plan.graph is Route.DELTA_BESIDE
    x = torch.randn(2, 3, 16, dtype=base_dtype)  # [B, S, in]: T = 6 rows
    layer.lora_context.set(SLOTS, static=True)  # a step graph's mapping
    expected = sequential(layer, x)
    assert not torch.equal(expected, layer.base_layer(x))  # the adapters change it

    streams = Streams(monkeypatch, sms=5)
    streams.watch(layer)
    empty = torch.empty  # fresh memory holds NaN: the base rows' zero delta is the layer's doing
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    got = layer(x)
    # the GEMM enqueued before the delta's kernels (faster beside them so) and after the side
    # stream's wait, which therefore does not wait for it
    assert streams.log == ["side waits main", "carveout 5 on main", "base on main", "lora_shrink on side for 5 SMs",
                           "lora_expand on side for 5 SMs", "main waits side"]
    assert streams.out.dtype == torch.float32 and streams.out.shape == (6, 8)  # buf: [T, n_slices*R]
    assert got.dtype == base_dtype and got.shape == (2, 3, 12) and got.is_contiguous()
    # the same kernels, and one rounding of base + delta: exactly the sequential path's sum
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    output, delta = torch.ops.loramux.lora_delta(x, [], layer.layer_id, (2, 3, 12), base_dtype, (2, 3, 12), torch.float32)
    assert torch.equal(output, layer.base_layer(x)) and delta.dtype == torch.float32
    assert torch.equal(delta.view(6, 12)[SLOTS < 0], torch.zeros(2, 12))  # base rows: no delta


def test_an_eager_step_adds_the_delta_in_line(beside, monkeypatch):
    """An exact (eager) mapping: no fork, the delta added after the base GEMM on the main stream,
    the same sum as the step graph's; a layer no adapter of the step touches runs its GEMM alone."""
    layer = linear()
    x = torch.randn(6, 16)
    layer.lora_context.set(SLOTS, static=True)
    in_graph = layer(x)
    streams = Streams(monkeypatch, sms=5)
    streams.watch(layer)
    layer.lora_context.set(SLOTS)
    assert not layer.lora_context.beside
    torch.testing.assert_close(layer(x), in_graph, rtol=0, atol=0)
    assert streams.log == ["base on main", "lora_apply on main"]


def test_the_lm_head_adds_its_delta_in_line_in_a_step_graph_too(beside, monkeypatch):
    """Nothing would fold the LM head's sum (it runs outside the compiled layers): no fork, the
    delta added after the base GEMM, the same logits as the sequential path."""
    head = linear()
    head.computes_logits = True
    x = torch.randn(6, 16)
    head.lora_context.set(SLOTS, static=True)
    expected = sequential(head, x)
    streams = Streams(monkeypatch, sms=5)
    streams.watch(head)
    torch.testing.assert_close(head(x), expected, rtol=0, atol=0)
    assert streams.log == ["base on main", "lora_apply on main"]


def test_nothing_forks_without_adapters_for_a_rank_0_layer_or_for_an_embedding(beside, monkeypatch):
    streams = Streams(monkeypatch)
    layer = linear()
    streams.watch(layer)
    x = torch.randn(6, 16)
    layer.lora_context.set(None)  # a base-only step: the base GEMM alone
    torch.testing.assert_close(layer(x), layer.base_layer(x), rtol=0, atol=0)
    assert streams.log == ["base on main", "base on main"]

    streams.log.clear()
    untouched = with_adapters(LinearWithLoRA(nn.Linear(16, 12), "proj", CONFIG), ranks=(0, 0))
    streams.watch(untouched)
    untouched.lora_context.set(SLOTS)  # the active adapters do not touch this layer (an eager step)
    assert torch.equal(untouched(x), untouched.base_layer(x)) and streams.log == ["base on main", "base on main"]

    streams.log.clear()
    embedding = with_adapters(EmbeddingWithLoRA(nn.Embedding(50, 12), "embed", CONFIG))
    streams.watch(embedding)
    embedding.lora_context.set(SLOTS)
    ids = torch.tensor([3, 7, 7, 0, 49, 12])
    got = embedding(ids)  # a lookup hides nothing: base, then its own delta, on the main stream
    assert streams.log == ["base on main"]
    assert not torch.equal(got, embedding.base_layer(ids)) and got.dtype == embedding.weight.dtype


def test_on_the_cpu_a_layer_never_touches_cuda_streams(monkeypatch):
    def no_streams(*args, **kwargs):
        pytest.fail("a CPU forward asked for a CUDA stream")

    monkeypatch.setattr(side_stream_module, "side_stream", no_streams)
    monkeypatch.setattr(torch.cuda, "current_stream", no_streams)
    for route in (Route.BASE_THEN_DELTA, Route.DELTA_BESIDE):  # as the CPU decides, and forced
        layer = in_graphs(linear(), route)
        layer.lora_context.set(SLOTS, static=True)
        x = torch.randn(6, 16)
        assert not torch.equal(layer(x), layer.base_layer(x))


# -- the op's contract ----------------------------------------------------------------------------


@pytest.mark.parametrize("route", [Route.BASE_THEN_DELTA, Route.DELTA_BESIDE], ids=["lora_layer", "lora_delta"])
def test_the_op_under_autocast_returns_autocasts_dtype(route):
    layer = in_graphs(linear(), route)
    layer.lora_context.set(SLOTS, static=True)
    x = torch.randn(6, 16)
    expected = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x)  # the base GEMM runs in bfloat16; the delta is added in the slots' float32
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=5e-2)


class _Float64Out(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 12)
        self.weight = self.inner.weight

    def forward(self, x):
        return self.inner(x).double()


@pytest.mark.parametrize("route", [Route.BASE_THEN_DELTA, Route.DELTA_BESIDE], ids=["lora_layer", "lora_delta"])
def test_a_base_layer_returning_other_than_its_spec_names_the_fix(route):
    wrapper = with_adapters(BaseLayerWithLoRA(_Float64Out(), "odd", CONFIG, in_features=16, output_sizes=(12,)))
    in_graphs(wrapper, route)
    wrapper.lora_context.set(SLOTS, static=True)
    with pytest.raises(ValueError, match=r"'odd'.*returned torch.float64 \[6, 12\].*said torch.float32 \[6, 12\]"
                                         r".*override base_output_spec"):
        wrapper(torch.randn(6, 16))


def test_lora_shrink_writes_into_out_and_rejects_an_out_of_the_wrong_dtype_or_shape():
    generator = torch.Generator().manual_seed(0)
    x, lora_a = torch.randn(6, 16, generator=generator), torch.randn(3, 8, 16, generator=generator)
    scales = torch.ones(3, 1)
    meta = build_lora_meta(SLOTS, 3)
    out = torch.empty(6, 8)
    assert lora_shrink(x, lora_a, scales, meta, out=out) is out
    torch.testing.assert_close(out, lora_shrink(x, lora_a, scales, meta), rtol=0, atol=0)
    for bad in (torch.empty(6, 8, dtype=torch.float64), torch.empty(5, 8)):
        with pytest.raises(ValueError, match=r"out must be a torch.float32 \[6, 8\] tensor on cpu, got"):
            lora_shrink(x, lora_a, scales, meta, out=bad)


# -- under torch.compile ----------------------------------------------------------------------------


class TwoProjections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = with_adapters(EmbeddingWithLoRA(nn.Embedding(50, 16), "embed", CONFIG))
        self.up = with_adapters(LinearWithLoRA(nn.Linear(16, 12), "up", CONFIG))
        self.down = with_adapters(LinearWithLoRA(nn.Linear(12, 16), "down", CONFIG), ranks=(0, 2))
        context = self.embed.lora_context  # one context for the model, as the model manager does
        self.up.lora_context = self.down.lora_context = context

    def forward(self, ids):
        return self.down(torch.relu(self.up(self.embed(ids))))


@pytest.mark.parametrize(("delta_beside", "frames"), [(False, 1), (True, 2)], ids=["lora_layer", "lora_delta"])
def test_compiled_layers_do_not_recompile_as_adapters_come_and_go(delta_beside, frames, monkeypatch):
    """One frame, or with the delta beside the base GEMM two: a step graph's mapping, and any
    other (none, or an eager step's; the context's ``beside`` flag picks the op), each compiled
    once whatever the adapters."""
    torch._dynamo.reset()
    monkeypatch.setattr(side_stream_module, "delta_beside_base", lambda device: delta_beside)
    model = TwoProjections()
    assert (model.up.route_plan.graph is Route.DELTA_BESIDE) is delta_beside
    assert model.embed.route_plan.graph is Route.BASE_THEN_DELTA
    counter = CompileCounterWithBackend("aot_eager")  # functionalizes the op, as inductor does
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    ids = torch.tensor([3, 7, 7, 0, 49, 12])
    context = model.embed.lora_context
    weights = LoRAModuleWeights(torch.randn(3, 16), torch.randn(12, 3), scaling=2.0)
    steps = [
        lambda: context.set(None),  # no adapter: the base layers alone
        lambda: context.set(SLOTS),  # two adapters and base rows
        lambda: context.set(SLOTS, static=True),  # the same, as a step graph maps them
        lambda: context.set(torch.tensor([1, 1, 1, 1, 1, 1], dtype=torch.int32)),  # one adapter
        lambda: set_lora(model.up, 2, [weights]),  # an adapter arrives in a new slot ...
        lambda: context.set(torch.tensor([2, -1, 2, 0, -1, -1], dtype=torch.int32), static=True),
        lambda: reset_lora(model.up, 0),  # ... and one leaves
        lambda: context.set(torch.tensor([-1, -1, -1, -1, -1, -1], dtype=torch.int32)),  # base rows only
        lambda: context.set(torch.tensor([1, -1, 1, 1, -1, 1], dtype=torch.int32), static=True),
    ]
    outputs = set()
    for change in steps:
        change()
        got = compiled(ids)
        torch.testing.assert_close(got, model(ids), rtol=0, atol=0)
        outputs.add(got.sum().item())
    assert counter.frame_count == frames and counter.op_count > 0
    assert len(outputs) >= 5  # the adapters did change the output, step after step

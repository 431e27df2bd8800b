"""The LoRA layer's structure: no import circle under loramux/engine/layers/, one function that
computes slot writes, one table of forward routes read from what a layer declares, never from
which methods a subclass defines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from torch import nn

from loramux.engine.layers import LayerSupport, LinearWithLoRA, Route, backend
from loramux.engine.layers.backend import Batch, Facts, Phase, choose, plan_routes
from loramux.registry import LoRAConfig

PACKAGE = Path(__file__).resolve().parents[1] / "loramux"
LAYERS = PACKAGE / "engine" / "layers"


def imports_of(path: Path, prefix: str) -> set[str]:
    """The modules under ``prefix`` that ``path`` imports, at run time or for type checking."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from package import module`
    return {name for name in found if name.startswith(prefix)}


def test_no_import_circle_under_engine_layers():
    prefix = "loramux.engine.layers."
    modules = {f"{prefix}{path.stem}": path for path in LAYERS.glob("*.py") if path.stem != "__init__"}
    graph = {name: imports_of(path, prefix) & modules.keys() for name, path in modules.items()}
    visiting, done = [], set()

    def visit(name: str) -> None:
        assert name not in visiting, f"an import circle: {' -> '.join(visiting[visiting.index(name):] + [name])}"
        if name in done:
            return
        visiting.append(name)
        for imported in graph[name]:
            visit(imported)
        visiting.pop()
        done.add(name)

    for name in graph:
        visit(name)
    assert graph[f"{prefix}base"].isdisjoint({f"{prefix}weight_pool", f"{prefix}write_plan", f"{prefix}slot_copy"})


def test_no_behaviour_is_chosen_by_which_methods_a_subclass_defines():
    for path in (PACKAGE / "engine").rglob("*.py"):
        text = path.read_text()
        assert "is BaseLayerWithLoRA." not in text and "__func__" not in text, path


def test_one_function_computes_slot_writes():
    """Only `WritePlanner.plan` lays out what a write copies (`slot_copy` runs its plan); the
    layer-by-layer writes survive in tests/slot_write_oracle.py only."""
    sources = {path.relative_to(PACKAGE).as_posix(): path.read_text() for path in PACKAGE.rglob("*.py")}
    assert [path for path, text in sources.items() if "def plan(self, slot" in text] == ["engine/layers/write_plan.py"]
    gone = ("def set_lora", "def slot_write", "def _pool_write", "def apply_slot_writes", "def table_of", "def reset_cells")
    assert not [(path, name) for path, text in sources.items() for name in gone if name in text]


FACTS = dict(big_gemm=False, forks=True, logits=False, gemm_dtype=True)


@pytest.mark.parametrize(("support", "facts", "expected"), [
    # a bias-free nn.Linear on CUDA: beside the GEMM in graphs, the GEMM onto the delta at prefill
    (LayerSupport({Route.BASE_THEN_DELTA, Route.DELTA_BESIDE, Route.DELTA_THEN_GEMM}), {},
     (Route.DELTA_BESIDE, Route.DELTA_BESIDE, Route.BASE_THEN_DELTA, Route.DELTA_THEN_GEMM, Route.BASE)),
    # the same on the CPU, big, and the LM head: in order everywhere, alone in small-GEMM graphs
    (LayerSupport({Route.BASE_THEN_DELTA, Route.DELTA_BESIDE, Route.DELTA_THEN_GEMM}),
     dict(forks=False, big_gemm=True, logits=True),
     (Route.BASE_THEN_DELTA, Route.BASE, Route.BASE_THEN_DELTA, Route.DELTA_THEN_GEMM, Route.BASE)),
    # a quantized projection (no GEMM onto the delta), its weight int8
    (LayerSupport({Route.BASE_THEN_DELTA, Route.DELTA_BESIDE}), dict(gemm_dtype=False),
     (Route.DELTA_BESIDE, Route.DELTA_BESIDE, Route.BASE_THEN_DELTA, Route.BASE_THEN_DELTA, Route.BASE)),
    # an output that is not rows: apart, beside on CUDA
    (LayerSupport({Route.DELTA_APART, Route.DELTA_BESIDE}), {},
     (Route.DELTA_BESIDE, Route.DELTA_BESIDE, Route.DELTA_APART, Route.DELTA_APART, Route.BASE)),
    # a delta of its own (the embedding): in order, whatever the device
    (LayerSupport(own_delta=True), {},
     (Route.BASE_THEN_DELTA, Route.BASE_THEN_DELTA, Route.BASE_THEN_DELTA, Route.BASE_THEN_DELTA, Route.BASE)),
], ids=["linear on cuda", "big lm head on cpu", "quantized", "convolution", "own delta"])
def test_the_table_gives_each_declaration_its_routes(support, facts, expected):
    assert tuple(plan_routes(Facts(support, **{**FACTS, **facts}))) == expected


def test_every_route_is_in_the_table_and_has_a_body():
    assert {rule.route for rule in backend.ROUTES} == set(Route)
    assert set(backend.ROUTE_BODIES) | backend.APART_ROUTES == set(Route)
    facts = Facts(LayerSupport({Route.BASE_THEN_DELTA}), **FACTS)
    assert choose(facts, Phase.EAGER, Batch.NO_DELTA) is Route.BASE


def test_a_subclass_that_redefines_no_method_takes_its_declared_routes(monkeypatch):
    """The routes follow `support`, on the class or passed to the constructor; a subclass that
    only declares is as fast as loramux's own."""
    import loramux.engine.layers.side_stream as side_stream

    monkeypatch.setattr(side_stream, "delta_beside_base", lambda device: True)
    config = LoRAConfig(max_loras=2, max_lora_rank=8)
    plain = LinearWithLoRA(nn.Linear(16, 8, bias=False), "p", config)
    assert plain.route_plan.graph is Route.DELTA_BESIDE and plain.route_plan.eager_prefill is Route.DELTA_THEN_GEMM

    class Quantized(LinearWithLoRA):
        support = LayerSupport({Route.BASE_THEN_DELTA})

    narrowed = Quantized(nn.Linear(16, 8, bias=False), "q", config)
    assert narrowed.route_plan.graph is Route.BASE_THEN_DELTA  # the subclass's declaration holds
    assert narrowed.route_plan.eager_prefill is Route.BASE_THEN_DELTA
    biased = LinearWithLoRA(nn.Linear(16, 8), "b", config)  # a bias: the GEMM onto the delta would drop it
    assert biased.route_plan.graph is Route.DELTA_BESIDE and biased.route_plan.eager_prefill is Route.BASE_THEN_DELTA

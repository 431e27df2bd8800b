"""`PoolWriter`: a slot write's table over every pooled layer in one numpy computation
(`loramux.engine.layers.pool_writer`) equals the one `_pool_write` describes layer by layer, and
the model manager writing through it keeps every slot equal to its adapter and PEFT."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from conftest import needs_cuda, needs_interpreter
from test_lora_pool import check_outputs, check_slots, pool_setup, pooled, row_bytes  # noqa: F401 (a fixture)

import loramux.engine.lora_model as lora_model
from loramux.engine.layers.pool_writer import PoolWriter
from loramux.engine.layers.slot_write import launch_table, table_of
from loramux.engine.lora_model import LoRAModelManager
from loramux.registry import LoRAConfig

NAMES = ["qv2", "all4", "attn8-head", "mlp6", "embed2", "qv4-a", "qv8", "qv16", "qv3", "qv9"]


def cells_of(table):
    """{device address: its values} of a table's scales, ranks and pool starts."""
    ends = np.cumsum(table.cells[:, 1])
    return {int(address): table.values[end - count : end].tolist()
            for (address, count), end in zip(table.cells.tolist(), ends)}


def test_the_numpy_table_equals_the_layer_by_layer_one(pool_setup):
    """Slots written and rewritten by adapters of ranks 2..16 over different layers (a slice left
    out, per-module ranks, an embedding, the LM head; a rewrite at a lower rank, whose padding the
    table clears): the same blocks to copy and to zero, the same scales, ranks and pool starts, and
    the covered layers it leaves alone are those the adapter has no weights for."""
    base, adapters, _ = pool_setup
    _, manager = pooled(base, 64)
    writer = PoolWriter(list(manager.layers.values()))
    assert len(writer.layers) == len([layer for layer in manager.layers.values() if layer.pooled]) > 0
    for slot, name in [(0, "all4"), (1, "qv16"), (0, "qv2"), (2, "mlp6"), (1, "embed2"), (3, "attn8-head"),
                       (2, "qv9"), (3, "qv3")]:
        adapter = adapters[name]
        parts = [(layer, [adapter.modules.get(m) for m in layer.slice_names]) for layer in writer.layers]
        touched = [(layer, weights) for layer, weights in parts if any(w is not None for w in weights)]
        expected = table_of([layer.slot_write(slot, weights, checked=True) for layer, weights in touched])
        for layer, _ in touched:  # give the rows back: the writer takes the same ones
            layer.rank_pool.free(slot)
        got, untouched = writer.table(slot, adapter)
        for field in ("copies", "zeros"):
            assert sorted(map(tuple, getattr(got, field).tolist())) == sorted(
                map(tuple, getattr(expected, field).tolist())), (name, field)
        assert cells_of(got) == cells_of(expected), name
        assert got.host.data_ptr() == expected.host.data_ptr()
        assert untouched == [layer for layer, weights in parts if all(w is None for w in weights)]
        for layer in untouched:  # as the model manager clears them
            layer.reset_cells(slot)


def test_weights_a_table_cannot_copy_as_they_are_change_nothing(pool_setup):
    """Weights in another dtype than the pools (a cast) or in several host buffers: None, and no
    layer's rows or ranks moved."""
    base, adapters, _ = pool_setup
    _, manager = pooled(base, 64)
    writer = PoolWriter(list(manager.layers.values()))
    qv = adapters["qv8"]
    cast = qv.pack(torch.float16)
    apart = qv.map_tensors(lambda t: t.clone())
    for adapter in (cast, apart):
        assert writer.table(1, adapter) is None
        assert all(1 not in layer.rank_pool and layer._host_ranks[1] == 0 for layer in writer.layers)


def test_a_pool_without_room_is_refused_with_the_layers_name(pool_setup):
    """Rows the model manager did not make room for: the same clear error as `_pool_write`, and
    the adapter already in the pool keeps its rows."""
    base, adapters, _ = pool_setup
    _, manager = pooled(base, 16)
    writer = PoolWriter(list(manager.layers.values()))
    writer.table(0, adapters["qv8"])  # 8 of the 16 rows of every q and v layer
    with pytest.raises(RuntimeError, match=r"q_proj: no 16 free rows in its LoRA pool of 16 \(8 free\)"):
        writer.table(1, adapters["qv16"])
    assert all(layer.rank_pool.start_of(0) == 0 for layer in writer.layers if 0 in layer.rank_pool)


def churn(manager, model, adapters, oracle, steps=24):
    """Activate, evict, free and activate again in a shuffled order; every slot and a mixed batch
    checked against the adapters and PEFT as it goes."""
    rng = random.Random(5)
    for step in range(steps):
        resident = manager.resident()
        if resident and rng.random() < 0.25:
            assert manager.deactivate(rng.choice(resident))
        else:
            manager.activate(adapters[rng.choice(NAMES)])
        check_slots(manager, adapters)
        if step % 4 == 0 or step == steps - 1:
            rows = manager.resident() + [None]
            rng.shuffle(rows)
            check_outputs(model, manager, oracle, rows)
    assert manager.stats.evictions >= 3


@needs_interpreter
def test_the_model_manager_writes_through_it_and_equals_peft_through_churn(pool_setup, monkeypatch):
    """The manager with a writer (on CUDA it always has one; here its table runs under Triton's
    interpreter): every pooled layer's part of every write comes from the numpy table, and every
    slot holds its adapter's weights and equals PEFT through churn. An adapter the table cannot
    express (a cast) still goes the layer-by-layer way."""
    base, adapters, oracle = pool_setup
    model, manager = pooled(base, 24)
    manager._pool_writer = PoolWriter(list(manager.layers.values()))
    launched = []

    def launch(table, device):
        launched.append(len(table.copies))
        launch_table(table, device, stage=False)

    monkeypatch.setattr(lora_model, "launch_table", launch)
    churn(manager, model, adapters, oracle)
    assert len(launched) >= 10 and all(launched)
    before = len(launched)
    manager.deactivate("qv8")
    manager.activate(adapters["qv8"].map_tensors(torch.Tensor.double))
    assert len(launched) == before  # cast on the way, block by block
    check_slots(manager, adapters)


@pytest.mark.gpu
@needs_cuda
def test_gpu_the_model_manager_writes_every_pooled_layer_through_it(pool_setup):
    """On CUDA the manager writes every pooled layer through the numpy table, from page-locked host
    memory as the CPU tier holds adapters: through churn every slot holds its adapter's weights."""
    base, adapters, _ = pool_setup
    device = torch.device("cuda")
    budget = 24 * row_bytes(base, max_lora_rank=16)
    manager = LoRAModelManager(copy.deepcopy(base).to(device),
                               LoRAConfig(max_loras=8, max_lora_rank=16, max_gpu_lora_bytes=budget))
    assert manager.pool_units == 24 and manager._pool_writer is not None and manager._pool_writer.layers
    pinned = {name: adapter.pin_memory() for name, adapter in adapters.items()}
    on_device = {name: adapter.map_tensors(lambda t: t.to(device)) for name, adapter in adapters.items()}
    tables = []
    real = manager._pool_writer.table
    manager._pool_writer.table = lambda slot, adapter: tables.append(real(slot, adapter)) or tables[-1]
    rng = random.Random(5)
    for _ in range(24):
        resident = manager.resident()
        if resident and rng.random() < 0.25:
            assert manager.deactivate(rng.choice(resident))
        else:
            manager.activate(pinned[rng.choice(NAMES)])
        torch.cuda.synchronize()
        check_slots(manager, on_device)
    assert manager.stats.evictions >= 3 and tables and all(t is not None for t in tables)

"""The adapter weight pool (`loramux.engine.layers.weight_pool`): its one write path, planned for
every layer at once with numpy and run as one `copy_blocks` table or block by block, equals the
layer-by-layer oracle (tests/slot_write_oracle.py) buffer for buffer; the model manager writing
through it equals PEFT through churn; the helpers that run a plan."""

from __future__ import annotations

import copy
import gc
import random
import sys
import threading
import weakref

import numpy as np
import pytest
import torch
from conftest import needs_cuda, needs_interpreter
from slot_write_oracle import assert_same_state, state, write_adapter
from test_lora_pool import check_outputs, check_slots, pool_setup, pooled, row_bytes  # noqa: F401 (a fixture)
from torch import nn

import loramux.engine.layers.weight_pool as weight_pool_module
from loramux.engine.layers import LoRAContext
from loramux.engine.layers.slot_copy import _dense, shared_buffer, zero_all
from loramux.engine.layers.weight_pool import AdapterWeightPool
from loramux.engine.adapters.lora_model import LoRAModelManager, wrap_layer
from loramux.registry import LoRAAdapter, LoRAConfig, LoRAModuleWeights

CONFIG = LoRAConfig(max_loras=3, max_lora_rank=8)
NAMES = ["qv2", "all4", "attn8-head", "mlp6", "embed2", "qv4-a", "qv8", "qv16", "qv3", "qv9"]


def fused_layers(n=2, sizes=(12, 4, 4), dtype=torch.float32):
    """``n`` fused q/k/v-like layers (three slices over one input), as `fuse_siblings` makes them."""
    torch.manual_seed(0)
    layers = {}
    for j in range(n):
        base = nn.Linear(16, sum(sizes)).to(dtype)
        base.loramux_slices = tuple((f"l{j}.s{i}", size) for i, size in enumerate(sizes))
        layers[f"l{j}"] = wrap_layer(base, f"l{j}", CONFIG)
    return layers


def fused_adapter(ranks, seed, dtype=torch.float32, n=2, sizes=(12, 4, 4), pack=True) -> dict[str, LoRAModuleWeights]:
    """One adapter's modules for `fused_layers` (rank 0: the slice left out), packed into one
    host buffer as the CPU tier holds them."""
    g = torch.Generator().manual_seed(seed)
    modules = {f"l{j}.s{i}": LoRAModuleWeights(torch.randn(r, 16, generator=g).to(dtype),
                                               torch.randn(size, r, generator=g).to(dtype), scaling=0.5 + i + j)
               for j in range(n) for i, (r, size) in enumerate(zip(ranks, sizes)) if r}
    adapter = LoRAAdapter("a", None, modules, 8, ["s"])
    return (adapter.pack() if pack else adapter).modules


@pytest.fixture
def launches(monkeypatch):
    """The copy rows of every `copy_blocks` table the pools launch (staged from host memory on
    CUDA; under Triton's interpreter on the CPU, read where they are)."""
    rows = []
    launch = weight_pool_module.launch_table
    monkeypatch.setattr(weight_pool_module, "launch_table",
                        lambda table, device, stage: rows.append(len(table.copies)) or launch(table, device, stage))
    return rows


WRITES = ((0, (8, 8, 8), 1), (1, (8, 3, 8), 2), (0, (4, 0, 2), 3), (2, (0, 5, 0), 4), (1, (2, 2, 2), 5))


@pytest.mark.parametrize("use_table", [False, pytest.param(True, marks=needs_interpreter)], ids=["blocks", "table"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writes_equal_the_layer_by_layer_oracle(use_table, dtype, launches):
    """Writes and rewrites into the same slots (a slice left out, per-slice ranks, a slot
    rewritten at a lower rank whose padding must be cleared, a slot's adapter leaving one layer):
    every pool, scale, rank, start and row owned as the oracle leaves them, through a table when
    the pool runs one."""
    by_pool, by_oracle = fused_layers(dtype=dtype), fused_layers(dtype=dtype)
    pool = AdapterWeightPool(by_pool, CONFIG, use_table=use_table)
    AdapterWeightPool(by_oracle, CONFIG)
    for slot, ranks, seed in WRITES:
        modules = fused_adapter(ranks, seed, dtype)
        if seed == 4:  # this adapter touches the first layer only
            modules = {name: w for name, w in modules.items() if name.startswith("l0.")}
        pool.write(slot, modules)
        write_adapter(by_oracle, slot, modules)
        assert_same_state(state(by_pool), state(by_oracle))
    # an A and a B block per slice written; a rewrite clears the slot first (a table with no copies)
    assert launches == ([] if not use_table else [12, 12, 0, 8, 2, 0, 12])
    for layer in by_pool.values():
        layer.slots.rows.check()


@needs_interpreter
def test_weights_a_table_cannot_copy_as_they_are_are_copied_block_by_block(launches):
    """A cast (float32 weights, bfloat16 pools) or weights in several host buffers: no table,
    and the block-by-block copies leave what the oracle leaves."""
    by_pool, by_oracle = fused_layers(dtype=torch.bfloat16), fused_layers(dtype=torch.bfloat16)
    pool = AdapterWeightPool(by_pool, CONFIG, use_table=True)
    AdapterWeightPool(by_oracle, CONFIG)
    cast = fused_adapter((8, 8, 8), 1, torch.float32)
    apart = fused_adapter((8, 3, 8), 2, torch.bfloat16, pack=False)
    for slot, modules in ((1, cast), (2, apart)):
        pool.write(slot, modules)
        write_adapter(by_oracle, slot, modules)
    assert launches == []
    assert_same_state(state(by_pool), state(by_oracle))
    pool.write(0, fused_adapter((8, 3, 8), 3, torch.bfloat16))
    assert launches == [12]


def test_a_layer_without_room_stops_the_write_before_anything_changes():
    """A layer without room stops the write, the rows of the layers before it given back: the
    error names the layer, and no layer's rows, ranks or weights moved."""
    layers = fused_layers()
    big = LoRAConfig(max_loras=3, max_lora_rank=16, max_gpu_lora_bytes=24 * sum(
        (3 * 16 + 20) * 4 for _ in layers))
    pool = AdapterWeightPool(layers, big)
    assert pool.units == 24
    pool.write(0, fused_adapter((8, 8, 8), 1))  # rows 0-7 of both layers
    modules = fused_adapter((16, 16, 16), 2)
    del modules["l1.s0"], modules["l1.s1"], modules["l1.s2"]
    pool.write(1, modules)  # rows 8-23 of the first layer only
    before = state(layers)
    with pytest.raises(RuntimeError, match=r"l0: no 16 free rows in its LoRA pool of 24 \(0 free\)"):
        pool.write(2, fused_adapter((9, 9, 9), 3))  # l1 has room, l0 has none
    assert_same_state(state(layers), before)
    # and the other way round: l0 takes its rows, then l1 has none, so l0 gives them back
    l1_only = fused_adapter((16, 16, 16), 4)
    del l1_only["l0.s0"], l1_only["l0.s1"], l1_only["l0.s2"]
    pool.write(2, l1_only)  # rows 8-23 of the second layer
    pool.clear(1)  # rows 8-23 of the first layer free again
    before = state(layers)
    with pytest.raises(RuntimeError, match=r"l1: no 16 free rows in its LoRA pool of 24 \(0 free\)"):
        pool.write(1, fused_adapter((9, 9, 9), 5))
    assert_same_state(state(layers), before)
    for layer in layers.values():
        layer.slots.rows.check()
        assert 1 not in layer.slots.rows


def test_a_write_is_worked_out_once_per_adapter_and_forgotten_with_its_weights(monkeypatch):
    """`prepare` works an adapter's write out once: a footprint, writes into two slots and a
    rewrite reuse it; modules of other weights (one module replaced, or another load of the same
    file) are worked out again; once the adapter is dropped, its entry and its host buffer go."""
    pool = AdapterWeightPool(fused_layers(), CONFIG)
    images = []
    image = pool._planner.image
    monkeypatch.setattr(pool._planner, "image", lambda modules: images.append(len(modules)) or image(modules))
    modules = fused_adapter((8, 3, 8), 1)
    footprint = pool.footprint(modules)
    pool.write(0, modules)
    pool.write(1, modules)
    pool.clear(0)
    pool.write(0, modules)
    assert images == [6] and pool.prepare(modules)[1] is footprint
    other = dict(modules, **{"l1.s1": LoRAModuleWeights(modules["l1.s1"].lora_a, modules["l1.s1"].lora_b, 2.0)})
    pool.clear(1)
    pool.write(1, other)
    assert images == [6, 6]
    slots = pool.layers["l1"].slots  # its own scaling for that slice, the same weights
    assert slots.scales[1, 1] == 2.0 * pool.layers["l1"].scale_multiplier()
    assert torch.equal(slots.slot_weights(1)[1][1][:, :3], modules["l1.s1"].lora_b)
    again = fused_adapter((8, 3, 8), 1)  # equal weights, other tensors: its own entry
    pool.prepare(again)
    assert images == [6, 6, 6]
    buffer = weakref.ref(modules["l0.s0"].lora_a.untyped_storage())
    del modules, other, again
    gc.collect()
    assert pool._prepared == {} and buffer() is None


def test_loading_threads_work_out_writes_at_once_on_a_fresh_pool():
    """`prepare` runs on loading threads, several at a time: on a pool whose shapes no one has
    read yet, each still works its adapter's write out whole (the pools are read once, and
    published whole), and each writes what the oracle writes."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave as often as they can
    try:
        for attempt in range(20):
            by_pool = fused_layers()
            pool = AdapterWeightPool(by_pool, CONFIG)
            adapters = [fused_adapter((8, 3, 8), seed) for seed in range(3)]
            start, errors = threading.Barrier(len(adapters)), []

            def work(modules):
                start.wait()
                try:
                    pool.prepare(modules)
                except BaseException as error:  # noqa: BLE001 (reported below)
                    errors.append(error)

            threads = [threading.Thread(target=work, args=(m,)) for m in adapters]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert not errors, (attempt, errors)
    finally:
        sys.setswitchinterval(interval)
    by_oracle = fused_layers()
    AdapterWeightPool(by_oracle, CONFIG)
    for slot, modules in enumerate(adapters):
        pool.write(slot, modules)
        write_adapter(by_oracle, slot, modules)
    assert_same_state(state(by_pool), state(by_oracle))


def test_a_write_worked_out_before_the_pools_moved_lands_in_the_new_pools():
    """An image holds offsets into the pools, not their addresses: worked out, then the pools
    replaced (``module.to`` moves them), the write still leaves what the oracle leaves."""
    by_pool, by_oracle = fused_layers(), fused_layers()
    pool = AdapterWeightPool(by_pool, CONFIG)
    AdapterWeightPool(by_oracle, CONFIG)
    modules = fused_adapter((8, 3, 8), 1)
    pool.prepare(modules)
    for layer in by_pool.values():
        layer.slots._apply(lambda t: t.clone())
    pool.write(2, modules)
    write_adapter(by_oracle, 2, modules)
    assert_same_state(state(by_pool), state(by_oracle))


def test_shards_are_views_of_the_adapters_buffer():
    """A tensor-parallel rank's part of a column layer's B and a row layer's A are views of the
    adapter's one host buffer, so a table still copies them."""
    from loramux.engine.tensor_parallel.sharding import _column_shard, _row_shard

    full = nn.Linear(16, 12, bias=False)
    layers = {"col": wrap_layer(_column_shard(full, 1, 2), "col", CONFIG),
              "row": wrap_layer(_row_shard(full, "row", 1, 2).linear, "row", CONFIG)}
    pool = AdapterWeightPool(layers, CONFIG)
    g = torch.Generator().manual_seed(0)
    modules = LoRAAdapter("a", None, {name: LoRAModuleWeights(torch.randn(4, 16, generator=g), torch.randn(12, 4, generator=g), 1.0)
                                      for name in ("col", "row", "other")}, 8, ["col"]).pack().modules
    part = pool.shard(modules, 1)
    assert set(part) == {"col", "row"}  # a module of no layer is left out
    assert torch.equal(part["col"].lora_b, modules["col"].lora_b[6:]) and part["col"].lora_a is modules["col"].lora_a
    assert torch.equal(part["row"].lora_a, modules["row"].lora_a[:, 8:]) and part["row"].lora_b is modules["row"].lora_b
    assert shared_buffer(*spans([t for w in part.values() for t in (w.lora_a, w.lora_b)])) is not None
    pool.write(0, part)
    (a, b), = layers["row"].slots.slot_weights(0)
    assert torch.equal(a, modules["row"].lora_a[:, 8:]) and torch.equal(b, modules["row"].lora_b)


def test_the_shared_buffer_is_the_one_host_buffer_the_weights_lie_in():
    modules = fused_adapter((4, 4, 4), 0)
    weights = [t for w in modules.values() for t in (w.lora_a, w.lora_b)]
    buffer = shared_buffer(*spans(weights))
    assert buffer is not None and buffer.dtype == torch.uint8
    start = buffer.data_ptr()
    assert all(start <= t.data_ptr() and t.data_ptr() + t.nbytes <= start + buffer.numel() for t in weights)
    assert shared_buffer(*spans([w.clone() for w in weights])) is None  # no shared buffer: copied one by one
    assert shared_buffer(*spans(weights[:1] + [weights[1].clone()])) is None  # one of them elsewhere
    huge = torch.zeros(1 << 22)  # a buffer mostly of something else (a saved base embedding)
    assert shared_buffer(*spans([huge[:64].view(8, 8)])) is None


def spans(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, np.ndarray]:
    """`shared_buffer`'s arguments for these matrices: the first, and each one's (address, bytes
    from its first element to past its last)."""
    return tensors[0], np.array([(t.data_ptr(), ((t.shape[0] - 1) * t.stride(0) + t.shape[1]) * t.element_size())
                                 for t in tensors], dtype=np.int64)


def test_zero_all_zeroes_mixed_dtypes_in_one_call_per_dtype(monkeypatch):
    """A slot's cells are float32 scales and int32 ranks: one ``_foreach_zero_`` per dtype, so
    CUDA's foreach fast path (one dtype a list) takes each."""
    tensors = [torch.ones(3), torch.ones(2, dtype=torch.int32), torch.ones(4), torch.ones(2, dtype=torch.bfloat16)]
    calls = []
    foreach_zero = torch._foreach_zero_
    monkeypatch.setattr(torch, "_foreach_zero_", lambda group: calls.append([t.dtype for t in group]) or foreach_zero(group))
    zero_all(tensors)
    assert all(not t.any() for t in tensors)
    assert sorted(calls, key=str) == sorted([[torch.float32, torch.float32], [torch.int32], [torch.bfloat16]], key=str)
    zero_all([])
    assert len(calls) == 3


def test_dense_reads_strides_as_aten_does():
    t = torch.zeros(4, 3, 5)
    assert _dense(t) and _dense(t.transpose(0, 1)) and _dense(t[:1])
    assert not _dense(t[:, :1]) and not _dense(t[:, :2]) and not _dense(t[::2]) and not _dense(t.expand(2, 4, 3, 5))


def test_a_model_written_by_the_pool_equals_the_oracle_through_churn(pool_setup):
    """Slots written and rewritten by adapters of ranks 2..16 over different layers (a slice left
    out, per-module ranks, an embedding, the LM head; a rewrite at a lower rank): the whole
    model's pools as the oracle leaves them."""
    base, adapters, _ = pool_setup
    _, manager = pooled(base, 64)
    _, oracle = pooled(base, 64)
    for slot, name in [(0, "all4"), (1, "qv16"), (0, "qv2"), (2, "mlp6"), (1, "embed2"), (3, "attn8-head"),
                       (2, "qv9"), (3, "qv3")]:
        manager.pool.write(slot, adapters[name].modules)
        write_adapter(oracle.layers, slot, adapters[name].modules)
        assert_same_state(state(manager.layers), state(oracle.layers))


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
def test_the_model_manager_writes_through_the_table_and_equals_peft_through_churn(pool_setup, launches):
    """The manager's pool running tables (on CUDA it always does; here under Triton's
    interpreter): every write is one table, as is every clear of a slot (with no copies), and
    every slot holds its adapter's weights and equals PEFT through churn. An adapter the table
    cannot express (a cast) goes block by block."""
    base, adapters, oracle = pool_setup
    model, manager = pooled(base, 24)
    manager.pool.use_table = True
    churn(manager, model, adapters, oracle)
    assert len([copies for copies in launches if copies]) >= 10 and 0 in launches
    manager.deactivate("qv8")
    before = len(launches)
    manager.activate(adapters["qv8"].map_tensors(torch.Tensor.double))
    assert not any(launches[before:])  # cast on the way, block by block (a clear to make room: no copies)
    check_slots(manager, adapters)


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_slot_write_over_many_layers_is_one_kernel():
    """On CUDA a write over 8 fused layers (48 blocks of one adapter from one pinned host buffer,
    and the scales, ranks and starts) is the weights' copy, the table's copy and ONE kernel; every
    block lands where it belongs."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    layers = {}
    for i in range(8):
        torch.manual_seed(i)
        base = nn.Linear(64, 48).to(device, torch.bfloat16)
        base.loramux_slices = tuple((f"fused.{i}.{n}", size) for n, size in (("q", 32), ("k", 8), ("v", 8)))
        layers[f"fused.{i}"] = wrap_layer(base, f"fused.{i}", CONFIG)
        layers[f"fused.{i}"].lora_context = LoRAContext(CONFIG.max_loras)
    pool = AdapterWeightPool(layers, CONFIG)
    g = torch.Generator().manual_seed(0)
    modules = {f"fused.{i}.{name}": LoRAModuleWeights(torch.randn(8, 64, generator=g).to(torch.bfloat16),
                                                      torch.randn(size, 8, generator=g).to(torch.bfloat16), scaling=0.5)
               for i in range(8) for name, size in (("q", 32), ("k", 8), ("v", 8))}
    adapter = LoRAAdapter("a", None, modules, 8, ["q", "k", "v"]).pack(pin_memory=True)  # as the CPU tier holds it
    pool.write(0, adapter.modules)  # compiles the kernel; slot 1's rows come after
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pool.write(1, adapter.modules)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA" and "emcpy" not in e.name]
    copies = [e.name for e in prof.events() if e.device_type.name == "CUDA" and "emcpy" in e.name]
    assert len(kernels) == 1 and "copy_blocks" in kernels[0], kernels
    assert len(copies) == 2, copies  # the weights, the table
    for i, layer in enumerate(layers.values()):
        s = layer.slots
        assert s.scales[1].tolist() == [0.5] * 3 and s.ranks[1] == 8
        assert s.pool_starts[1] == s.rows.start_of(1) == 8
        for (a, b), n in zip(s.slot_weights(1), "qkv"):
            w = adapter.modules[f"fused.{i}.{n}"]
            assert torch.equal(a.cpu(), w.lora_a) and torch.equal(b.cpu(), w.lora_b)


@pytest.mark.gpu
@needs_cuda
def test_gpu_the_model_manager_writes_every_layer_through_the_table(pool_setup, launches):
    """On CUDA the manager writes every layer through one table a write, from page-locked host
    memory as the CPU tier holds adapters, and clears a slot through one with no copies: through
    churn every slot holds its adapter's weights."""
    base, adapters, _ = pool_setup
    device = torch.device("cuda")
    budget = 24 * row_bytes(base, max_lora_rank=16)
    manager = LoRAModelManager(copy.deepcopy(base).to(device),
                               LoRAConfig(max_loras=8, max_lora_rank=16, max_gpu_lora_bytes=budget))
    assert manager.pool_units == 24 and manager.pool.use_table
    pinned = {name: adapter.pin_memory() for name, adapter in adapters.items()}
    on_device = {name: adapter.map_tensors(lambda t: t.to(device)) for name, adapter in adapters.items()}
    rng = random.Random(5)
    for _ in range(24):
        resident = manager.resident()
        if resident and rng.random() < 0.25:
            assert manager.deactivate(rng.choice(resident))
        else:
            manager.activate(pinned[rng.choice(NAMES)])
        torch.cuda.synchronize()
        check_slots(manager, on_device)
    writes = [copies for copies in launches if copies]
    assert manager.stats.evictions >= 3 and manager.stats.loads == len(writes) and 0 in launches

"""Writing an adapter into a slot as one batch over every layer (`loramux.engine.layers.slot_write`)."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_cuda, needs_interpreter, save_peft_adapter, tiny_model
from torch import nn

from loramux.engine.layers import LinearWithLoRA, LoRAContext
from loramux.engine.layers.slot_write import _run_as_table, _shared_buffer, apply_slot_writes
from loramux.engine.lora_model import LoRAModelManager, create_lora_layer
from loramux.registry import LoRAAdapter, LoRAConfig, LoRAModuleWeights, load_adapter

CONFIG = LoRAConfig(max_loras=3, max_lora_rank=8)


def layers(n=3):
    torch.manual_seed(0)
    out = []
    for i in range(n):
        layer = create_lora_layer(nn.Linear(16, 12 + 4 * i), f"block.{i}", CONFIG)
        layer.lora_context = LoRAContext(CONFIG.max_loras)
        out.append(layer)
    return out


def weights_for(layer, rank, seed):
    g = torch.Generator().manual_seed(seed)
    return [LoRAModuleWeights(torch.randn(rank, layer.in_features, generator=g),
                              torch.randn(layer.out_features, rank, generator=g), scaling=0.5 + seed)]


def assert_slot_holds(layer, slot, weights):
    (w,) = weights
    r = w.rank
    ((a, b),) = layer.slot_weights(slot)
    assert torch.equal(a, w.lora_a) and torch.equal(b, w.lora_b)
    assert layer.lora_scales[slot].tolist() == [w.scaling]
    assert layer.lora_ranks[slot] == r and layer._host_ranks[slot] == r


def test_one_batch_over_every_layer_writes_each_slot_and_clears_the_last_adapters_padding():
    group = layers()
    big = {layer: weights_for(layer, 8, seed=i) for i, layer in enumerate(group)}
    small = {layer: weights_for(layer, 3, seed=10 + i) for i, layer in enumerate(group)}
    other = {layer: weights_for(layer, 5, seed=20 + i) for i, layer in enumerate(group)}
    apply_slot_writes([layer.slot_write(2, other[layer]) for layer in group])
    apply_slot_writes([layer.slot_write(1, big[layer]) for layer in group])
    apply_slot_writes([layer.slot_write(1, small[layer]) for layer in group])  # rank 8 -> 3 in place
    for layer in group:
        assert_slot_holds(layer, 1, small[layer])
        assert_slot_holds(layer, 2, other[layer])  # the other slot is untouched
        assert layer.lora_ranks[0] == 0 and 0 not in layer.rank_pool
        # the slots own disjoint pool rows: ranks 3 and 5 take 8 each (POOL_ROW_ALIGN) of the 24
        assert layer.rank_pool.free_units == layer.rank_pool.units - 16


def test_a_bad_layer_stops_the_batch_before_anything_is_written():
    group = layers()
    parts = [group[0].slot_write(1, weights_for(group[0], 4, seed=1))]
    with pytest.raises(ValueError, match="rank 9, above max_lora_rank=8"):
        parts.append(group[1].slot_write(1, weights_for(group[1], 9, seed=2)))
    assert not group[0].lora_scales.any() and not group[0].lora_ranks.any()


def test_the_shared_buffer_is_the_one_host_buffer_the_weights_lie_in():
    group = layers(2)
    adapter = LoRAAdapter("a", None, {f"block.{i}": weights_for(layer, 4, seed=i)[0]
                                      for i, layer in enumerate(group)}, 4, ["block"]).pack()
    weights = [t for w in adapter.modules.values() for t in (w.lora_a, w.lora_b)]
    buffer = _shared_buffer(weights)
    assert buffer is not None and buffer.dtype == torch.uint8
    start = buffer.data_ptr()
    assert all(start <= t.data_ptr() and t.data_ptr() + t.nbytes <= start + buffer.numel() for t in weights)
    assert _shared_buffer([w.clone() for w in weights]) is None  # no shared buffer: copied one by one
    huge = torch.zeros(1 << 22)  # a buffer mostly of something else (a saved base embedding)
    assert _shared_buffer([huge[:64].view(8, 8)]) is None


def test_a_layer_that_overrides_set_lora_is_still_called_by_the_manager(tmp_path):
    model = tiny_model("llama")
    adapter_dir = save_peft_adapter(tiny_model("llama"), tmp_path / "qv", r=4)
    manager = LoRAModelManager(model, CONFIG)
    calls = []

    class OwnWrites(LinearWithLoRA):
        def set_lora(self, slot, weights_by_slice):
            calls.append(self.module_name)
            super().set_lora(slot, weights_by_slice)

    special = manager.layers["model.layers.0.self_attn.q_proj"]
    special.__class__ = OwnWrites
    slot = manager.activate(load_adapter(adapter_dir, name="qv"))
    assert calls == ["model.layers.0.self_attn.q_proj"]
    written = [name for name, layer in manager.layers.items() if layer.lora_ranks[slot] > 0]
    assert len(written) == 4 and special.lora_ranks[slot] == 4  # q and v of both layers


def test_zero_all_zeroes_mixed_dtypes_in_one_call_per_dtype(monkeypatch):
    """A slot's cells are float32 scales and int32 ranks (and a dense slot's 16-bit blocks): one
    ``_foreach_zero_`` per dtype, so CUDA's foreach fast path (one dtype a list) takes each."""
    from loramux.engine.layers.slot_write import zero_all

    tensors = [torch.ones(3), torch.ones(2, dtype=torch.int32), torch.ones(4), torch.ones(2, dtype=torch.bfloat16)]
    calls = []
    foreach_zero = torch._foreach_zero_
    monkeypatch.setattr(torch, "_foreach_zero_", lambda group: calls.append([t.dtype for t in group]) or foreach_zero(group))
    zero_all(tensors)
    assert all(not t.any() for t in tensors)
    assert sorted(calls, key=str) == sorted([[torch.float32, torch.float32], [torch.int32], [torch.bfloat16]], key=str)
    zero_all([])
    assert len(calls) == 3


def fused_layer(sizes=(12, 4, 4), dtype=torch.float32):
    """A fused q/k/v-like layer (three slices over one input), pooled, as `fuse_siblings` makes."""
    torch.manual_seed(0)
    base = nn.Linear(16, sum(sizes)).to(dtype)
    base.loramux_slices = tuple((f"s{i}", size) for i, size in enumerate(sizes))
    layer = create_lora_layer(base, "fused", CONFIG)
    layer.lora_context = LoRAContext(CONFIG.max_loras)
    return layer


def fused_adapter(layer, ranks, seed, dtype):
    """One adapter's weights for ``layer``'s slices (rank 0: the slice left out), packed into one
    host buffer as the CPU tier holds them."""
    g = torch.Generator().manual_seed(seed)
    modules = {f"s{i}": LoRAModuleWeights(torch.randn(r, 16, generator=g).to(dtype),
                                          torch.randn(size, r, generator=g).to(dtype), scaling=0.5 + i)
               for i, (r, size) in enumerate(zip(ranks, layer.output_sizes)) if r}
    packed = LoRAAdapter("a", None, modules, 8, ["s"]).pack()
    return [packed.modules.get(f"s{i}") for i in range(len(ranks))]


def layer_state(layer):
    return [t.clone() for t in (layer.lora_a_pool, layer.lora_b_pool, layer.lora_scales, layer.lora_ranks,
                                layer.lora_pool_starts)]


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_launch_table_writes_what_the_block_by_block_path_writes(dtype):
    """Two writes into the same slots (ranks per slice 8/3/8 with slice 1 left out next, a slot
    rewritten at a lower rank, whose padding must be cleared): `copy_blocks`' table under the
    interpreter leaves every pool, scale, rank and start as the block-by-block copies do."""
    by_blocks, by_table = fused_layer(dtype=dtype), fused_layer(dtype=dtype)
    for slot, ranks, seed in ((0, (8, 8, 8), 1), (1, (8, 3, 8), 2), (0, (4, 0, 2), 3), (2, (0, 5, 0), 4)):
        weights = fused_adapter(by_blocks, ranks, seed, dtype)
        apply_slot_writes([by_blocks.slot_write(slot, weights)])  # on the CPU: block by block
        assert _run_as_table([by_table.slot_write(slot, weights)], torch.device("cpu"), stage=False)
        by_table._host_ranks[slot] = by_blocks._host_ranks[slot]
        for got, expected in zip(layer_state(by_table), layer_state(by_blocks)):
            assert torch.equal(got, expected)
    for (a, b), w in zip(by_table.slot_weights(0), fused_adapter(by_blocks, (4, 0, 2), 3, dtype)):
        r = 0 if w is None else w.rank
        assert not a[r:].any() and not b[:, r:].any()  # the padding of the rank-8 adapter before is gone
        if w is not None:
            assert torch.equal(a[:r], w.lora_a) and torch.equal(b[:, :r], w.lora_b)


@needs_interpreter
def test_the_table_refuses_weights_it_cannot_copy_as_they_are_and_writes_nothing():
    """A cast (float32 weights, bfloat16 pool) or weights in several host buffers: the table
    says no before anything is written, and the block-by-block path writes them."""
    layer = fused_layer(dtype=torch.bfloat16)
    before = layer_state(layer)
    cast = fused_adapter(layer, (8, 8, 8), 1, torch.float32)
    apart = [LoRAModuleWeights(w.lora_a.clone(), w.lora_b.clone(), w.scaling)
             for w in fused_adapter(layer, (8, 8, 8), 1, torch.bfloat16)]
    for weights in (cast, apart):
        assert not _run_as_table([layer.slot_write(1, weights)], torch.device("cpu"), stage=False)
        layer.rank_pool.free(1)
        layer._host_ranks[1] = 0
        assert all(torch.equal(got, expected) for got, expected in zip(layer_state(layer), before))
    apply_slot_writes([layer.slot_write(1, cast)])
    for (a, b), w in zip(layer.slot_weights(1), cast):
        assert torch.equal(a, w.lora_a.bfloat16()) and torch.equal(b, w.lora_b.bfloat16())


def test_dense_reads_strides_as_aten_does():
    from loramux.engine.layers.slot_write import _dense

    t = torch.zeros(4, 3, 5)
    assert _dense(t) and _dense(t.transpose(0, 1)) and _dense(t[:1])
    assert not _dense(t[:, :1]) and not _dense(t[:, :2]) and not _dense(t[::2]) and not _dense(t.expand(2, 4, 3, 5))


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_slot_write_over_many_layers_is_one_kernel():
    """On CUDA a write over 8 fused layers (48 blocks of one adapter from one pinned host buffer,
    and the scales, ranks and starts) is the weights' copy, the table's copy and ONE kernel; every
    block lands where it belongs."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    group = []
    for i in range(8):
        torch.manual_seed(i)
        base = nn.Linear(64, 48).to(device, torch.bfloat16)
        base.loramux_slices = (("q", 32), ("k", 8), ("v", 8))
        layer = create_lora_layer(base, f"fused.{i}", CONFIG)
        layer.lora_context = LoRAContext(CONFIG.max_loras)
        group.append(layer)
    g = torch.Generator().manual_seed(0)
    modules = {f"fused.{i}.{name}": LoRAModuleWeights(torch.randn(8, 64, generator=g).to(torch.bfloat16),
                                                      torch.randn(size, 8, generator=g).to(torch.bfloat16), scaling=0.5)
               for i in range(8) for name, size in (("q", 32), ("k", 8), ("v", 8))}
    adapter = LoRAAdapter("a", None, modules, 8, ["q", "k", "v"]).pack(pin_memory=True)  # as the CPU tier holds it
    apply_slot_writes([layer.slot_write(0, [adapter.modules[f"fused.{i}.{n}"] for n in "qkv"])
                       for i, layer in enumerate(group)])  # compiles the kernel; slot 1's rows come after
    writes = [layer.slot_write(1, [adapter.modules[f"fused.{i}.{n}"] for n in "qkv"]) for i, layer in enumerate(group)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        apply_slot_writes(writes)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA" and "emcpy" not in e.name]
    copies = [e.name for e in prof.events() if e.device_type.name == "CUDA" and "emcpy" in e.name]
    assert len(kernels) == 1 and "copy_blocks" in kernels[0], kernels
    assert len(copies) == 2, copies  # the weights, the table
    for i, layer in enumerate(group):
        assert layer.lora_scales[1].tolist() == [0.5] * 3 and layer.lora_ranks[1] == 8
        assert layer.lora_pool_starts[1] == layer.rank_pool.start_of(1) == 8
        for (a, b), n in zip(layer.slot_weights(1), "qkv"):
            w = adapter.modules[f"fused.{i}.{n}"]
            assert torch.equal(a.cpu(), w.lora_a) and torch.equal(b.cpu(), w.lora_b)

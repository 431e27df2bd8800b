"""Writing an adapter into a slot as one batch over every layer (`loramux.engine.layers.slot_write`)."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_cuda, save_peft_adapter, tiny_model
from torch import nn

from loramux.engine.layers import LinearWithLoRA, LoRAContext
from loramux.engine.layers.slot_write import _staged, apply_slot_writes
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


def test_staged_views_map_the_one_host_buffer_the_weights_share():
    group = layers(2)
    adapter = LoRAAdapter("a", None, {f"block.{i}": weights_for(layer, 4, seed=i)[0]
                                      for i, layer in enumerate(group)}, 4, ["block"]).pack()
    weights = [t for w in adapter.modules.values() for t in (w.lora_a, w.lora_b)]
    staged = _staged(weights, torch.device("cpu"))  # the mapping of views, on a CPU "device" copy
    assert staged is not None and len(staged) == len(weights)
    for host, copy in zip(weights, staged):
        assert torch.equal(copy, host) and copy.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
    assert len({t.untyped_storage().data_ptr() for t in staged}) == 1  # one copy of the buffer
    apart = [w.clone() for w in weights]  # no shared buffer: copied one by one
    assert _staged(apart, torch.device("cpu")) is None
    huge = torch.zeros(1 << 22)  # a buffer mostly of something else (a saved base embedding)
    assert _staged([huge[:64].view(8, 8)], torch.device("cpu")) is None


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


def fused_layer(sizes=(12, 4, 4)):
    """A fused q/k/v-like layer (three slices over one input), pooled, as `fuse_siblings` makes."""
    torch.manual_seed(0)
    base = nn.Linear(16, sum(sizes))
    base.loramux_slices = tuple((f"s{i}", size) for i, size in enumerate(sizes))
    layer = create_lora_layer(base, "fused", CONFIG)
    layer.lora_context = LoRAContext(CONFIG.max_loras)
    return layer


def test_a_fused_layers_slot_blocks_are_dense_so_the_foreach_copy_batches_them(monkeypatch):
    """torch's foreach ops batch a list only when every tensor in it is dense: a fused layer's
    slot write (A rows of each slice, B block, padding) must give only such blocks for an adapter
    of one rank, and a slice it leaves out too; all in one ``_foreach_copy_`` and one zeroing."""
    from loramux.engine.layers.slot_write import _dense, _same_dense_layout

    layer = fused_layer()
    assert layer.pooled and layer.lora_a_pool.shape == (layer.rank_pool.units, 3, 16)
    g = torch.Generator().manual_seed(0)
    weights = [LoRAModuleWeights(torch.randn(8, 16, generator=g), torch.randn(size, 8, generator=g), scaling=0.5)
               for size in layer.output_sizes]
    apply_slot_writes([layer.slot_write(0, weights)])  # slot 0 first: slot 1's rows start past it
    weights[1] = None  # slot 1's adapter leaves slice 1 out: its part of the slot is cleared
    write = layer.slot_write(1, weights)
    assert len(write.copies) == 4 and len(write.zeros) == 2
    assert all(_same_dense_layout(block, w) for block, w in write.copies)
    assert all(_dense(block) for block in write.zeros)
    calls = []
    for name in ("_foreach_copy_", "_foreach_zero_"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _name=name: calls.append((_name, len(a[0]))) or _real(*a))
    apply_slot_writes([write])
    assert ("_foreach_zero_", 2) in calls
    got = layer.slot_weights(1)
    for i in (0, 2):
        assert torch.equal(got[i][0], weights[i].lora_a) and torch.equal(got[i][1], weights[i].lora_b)
    assert not got[1][0].any() and not got[1][1].any()


def test_blocks_that_are_not_dense_are_copied_one_by_one_beside_the_batched_ones():
    """Slices of different ranks: the lower rank's B block is narrower than the slot's width (not
    dense), copied on its own; the rest still batched; every block lands where it belongs."""
    from loramux.engine.layers.slot_write import _same_dense_layout

    layer = fused_layer()
    g = torch.Generator().manual_seed(1)
    weights = [LoRAModuleWeights(torch.randn(r, 16, generator=g), torch.randn(size, r, generator=g), scaling=1.0)
               for r, size in zip((8, 3, 8), layer.output_sizes)]
    write = layer.slot_write(2, weights)
    assert [_same_dense_layout(block, w) for block, w in write.copies] == [True, True, True, False, True, True]
    apply_slot_writes([write])
    for (a, b), w in zip(layer.slot_weights(2), weights):  # read at the slot's rank, 8: zeros past 3
        r = w.rank
        assert torch.equal(a[:r], w.lora_a) and torch.equal(b[:, :r], w.lora_b)
        assert not a[r:].any() and not b[:, r:].any()


def test_dense_reads_strides_as_aten_does():
    from loramux.engine.layers.slot_write import _dense

    t = torch.zeros(4, 3, 5)
    assert _dense(t) and _dense(t.transpose(0, 1)) and _dense(t[:1])
    assert not _dense(t[:, :1]) and not _dense(t[:, :2]) and not _dense(t[::2]) and not _dense(t.expand(2, 4, 3, 5))


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_fused_slot_write_spreads_its_blocks_in_a_few_kernels():
    """On CUDA a write over 8 fused layers (48 blocks of one adapter from one pinned host buffer)
    runs its device-to-device spread as batched foreach kernels, not a copy kernel per block, and
    every block lands where it belongs."""
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
    writes = [layer.slot_write(1, [adapter.modules[f"fused.{i}.{n}"] for n in "qkv"]) for i, layer in enumerate(group)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        apply_slot_writes(writes)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and "emcpy" not in e.name]
    assert 1 <= len(kernels) <= 12, [e.name for e in kernels]  # a kernel per block would be 48 and more
    for i, layer in enumerate(group):
        for (a, b), n in zip(layer.slot_weights(1), "qkv"):
            w = adapter.modules[f"fused.{i}.{n}"]
            assert torch.equal(a.cpu(), w.lora_a) and torch.equal(b.cpu(), w.lora_b)

"""GPU LoRA memory pooled by rank: `RankPool`'s bookkeeping, `RowGroups` sharing one table
between layers written alike (against a pool per layer), the model manager sizing
every pool by ``max_gpu_lora_bytes`` and evicting by rows (PEFT the oracle through churn), a
slot owning its rank rounded up to `POOL_ROW_ALIGN` rows (B's columns past the rank zero), held
adapters never evicted for rows, the scheduler's room question (``AdapterUses.fit``), and an engine serving more
adapters of mixed ranks than the budget holds at max rank. The kernels reading the pool are
tested in test_slot_pool_kernels.py."""

from __future__ import annotations

import copy
import itertools
import random
import threading

import numpy as np
import pytest
import torch
from conftest import peft_greedy, save_peft_adapter, step_to_end, tiny_llama, tiny_model
from layer_helpers import pool_of, set_lora
from test_engine_scheduler import advance, step
from test_lora_model import peft_oracle
from test_engine_scheduler import scheduler as make_scheduler

from loramux import LoRARequest, SamplingParams
from loramux.engine.layers.layer_slots import LayerSlots
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.adapters.lora_model import LoRAModelManager
from loramux.engine.adapters.rank_pool import RankPool, RowGroups
from loramux.engine.core.scheduler import Scheduler
from loramux.engine.core.sequence import Sequence
from loramux.errors import CacheFullError
from loramux.kernels.pool import POOL_ROW_ALIGN, pool_rows
from loramux.registry import AdapterHandle, LoRAConfig, load_adapter

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QV = ["q_proj", "v_proj"]

# --------------------------------------------------------------------------------------------------
# RankPool on its own
# --------------------------------------------------------------------------------------------------


def test_allocate_takes_the_smallest_free_range_that_fits():
    pool = RankPool(16)
    assert [pool.allocate(k, n) for k, n in enumerate([6, 2, 4, 4])] == [0, 6, 8, 12]
    assert pool.free_units == 0 and not pool.fits(1) and pool.fits(0)
    pool.free(0)  # rows 0..5
    pool.free(2)  # rows 8..11
    assert pool.free_units == 10 and pool.fits(6) and not pool.fits(7)
    assert pool.allocate(4, 3) == 8  # the 4-row hole, not the first rows of the 6-row one
    assert pool.allocate(5, 4) == 0  # the 1 row left at 11 is too small
    assert pool.allocate(6, 2) == 4 and pool.allocate(7, 1) == 11
    assert pool.free_units == 0
    assert [pool.start_of(k) for k in range(8)] == [None, 6, None, 12, 8, 0, 4, 11]
    assert 0 not in pool and 4 in pool


def test_free_merges_neighbours_into_one_range():
    pool = RankPool(12)
    for key in range(4):
        pool.allocate(key, 3)  # rows 0-2, 3-5, 6-8, 9-11
    pool.free(0)
    pool.free(2)
    assert pool.free_units == 6 and not pool.fits(4)  # two holes of 3, apart
    pool.free(1)  # joins both neighbours: rows 0..8
    assert pool.fits(9) and not pool.fits(10)
    assert pool.allocate(9, 9) == 0
    pool.free(3)  # a neighbour below only: rows 9..11
    pool.free(9)
    assert pool.fits(12) and pool.allocate(0, 12) == 0
    pool.free(42)  # owns nothing: a no-op
    assert pool.free_units == 0


def test_fits_keeping_counts_only_the_kept_keys_rows():
    pool = RankPool(16)
    for key in range(4):
        pool.allocate(key, 4)  # rows 0-3, 4-7, 8-11, 12-15
    before = (pool.free_units, [pool.start_of(k) for k in range(4)])
    assert not pool.fits(1)
    assert pool.fits_keeping(8, {0, 1}) and pool.fits_keeping(8, {2, 3}) and pool.fits_keeping(8, {0, 3})
    assert not pool.fits_keeping(8, {0, 2})  # 8 rows would be free, but as two holes of 4
    assert pool.fits_keeping(4, {0, 2}) and not pool.fits_keeping(5, {1, 3})
    assert pool.fits_keeping(16, set()) and pool.fits_keeping(16, {7}) and not pool.fits_keeping(13, {1})
    assert pool.fits_keeping(0, {0, 1, 2, 3})
    assert (pool.free_units, [pool.start_of(k) for k in range(4)]) == before  # nothing freed


def test_a_failed_allocation_changes_nothing():
    pool = RankPool(10)
    pool.allocate(0, 4)
    pool.allocate(1, 2)
    pool.allocate(2, 4)
    pool.free(1)  # a hole of 2 at 4
    assert pool.allocate(3, 3) is None
    assert 3 not in pool and pool.free_units == 2 and pool.start_of(0) == 0 and pool.start_of(2) == 6
    assert pool.allocate(3, 2) == 4  # the hole is still whole
    with pytest.raises(AssertionError, match="owns rows already"):
        pool.allocate(3, 1)


def test_size_zero_owns_nothing_and_an_empty_pool_holds_nothing():
    pool = RankPool(4)
    assert pool.allocate(0, 0) is None and 0 not in pool and pool.free_units == 4
    assert pool.allocate(0, 4) == 0  # the key was free to take rows after all
    empty = RankPool(0)
    assert empty.units == empty.free_units == 0
    assert empty.fits(0) and not empty.fits(1) and empty.fits_keeping(0, set()) and not empty.fits_keeping(1, set())
    assert empty.allocate(0, 1) is None and empty.allocate(1, 0) is None and 0 not in empty
    with pytest.raises(AssertionError, match="units must be >= 0"):
        RankPool(-1)


def test_the_invariant_assert_catches_lost_rows():
    pool = RankPool(8)
    pool.allocate(0, 4)
    pool.allocate(1, 4)
    pool.check()
    pool._free.append((20, 1))  # bookkeeping gone wrong: rows that are not the pool's
    with pytest.raises(AssertionError, match="rows lost or gained"):
        pool.check()
    pool._free.pop()
    pool._owned[2] = (2, 4)  # rows two keys own
    with pytest.raises(AssertionError, match="ranges overlap"):
        pool.check()


def test_random_allocations_agree_with_a_row_by_row_model():
    """Against a plain list of row owners: ranges never overlap, an allocation fails exactly when
    no run of free rows is long enough, and it takes the shortest such run (frees merge fully)."""
    rng = random.Random(0)
    units = 40
    pool, rows = RankPool(units), [None] * units

    def free_runs():
        runs, start = [], None
        for i, owner in enumerate([*rows, "end"]):
            if owner is None and start is None:
                start = i
            elif owner is not None and start is not None:
                runs.append((start, i - start))
                start = None
        return runs

    failures = 0
    for _ in range(400):
        owned = [k for k in range(12) if k in pool]
        if owned and rng.random() < 0.4:
            key = rng.choice(owned)
            pool.free(key)
            rows[:] = [None if owner == key else owner for owner in rows]
            pool.check()
            continue
        key = rng.choice([k for k in range(12) if k not in pool] or [None])
        if key is None:
            continue
        size = rng.randint(1, 10)
        fitting = [run for run in free_runs() if run[1] >= size]
        assert pool.fits(size) == bool(fitting)
        start = pool.allocate(key, size)
        if not fitting:
            assert start is None and key not in pool
            failures += 1
            continue
        assert start is not None and (start, min(n for _, n in fitting)) in fitting
        assert rows[start : start + size] == [None] * size
        rows[start : start + size] = [key] * size
        assert pool.free_units == rows.count(None)
        pool.check()
    assert failures > 10  # the model was exercised when full, too


# --------------------------------------------------------------------------------------------------
# RowGroups: the pools of many layers, shared by layers written alike
# --------------------------------------------------------------------------------------------------


class Owner:
    """A layer's slots as `RowGroups` sees them: something with ``rows``."""

    rows: RankPool | None = None


def test_row_groups_split_by_what_a_write_asks_and_merge_when_equal_again():
    """One pool for six layers until a write asks different rows of them: each count's layers
    then share a copy; when the tables are equal again (the write that split them freed) the
    groups merge back into one."""
    owners = [Owner() for _ in range(6)]
    groups = RowGroups(owners, 64)
    assert len(groups.pools) == 1 and all(o.rows is groups.pools[0] for o in owners)
    both = np.array([8, 8, 8, 8, 8, 8])
    assert groups.allocate(0, both).tolist() == [0] * 6 and len(groups.pools) == 1
    qv = np.array([16, 0, 16, 0, 16, 0])
    assert groups.allocate(1, qv).tolist() == [8, 0, 8, 0, 8, 0]
    assert len(groups.pools) == 2 and owners[0].rows is owners[2].rows is not owners[1].rows
    assert 1 in owners[0].rows and 1 not in owners[1].rows and 0 in owners[1].rows
    mixed = np.array([8, 24, 16, 24, 8, 0])
    assert groups.allocate(2, mixed).tolist() == [24, 8, 24, 8, 24, 0]  # each group split in two
    assert len({id(o.rows) for o in owners}) == len(groups.pools) == 4
    needs = {id(pool): n for pool, n in groups.needs(np.array([1, 2, 3, 4, 5, 6]))}  # a group's most
    assert needs == {id(owners[j].rows): n for j, n in ((0, 5), (1, 4), (2, 3), (5, 6))}
    groups.free(2)
    assert len(groups.pools) == 2  # back to the q/v split
    groups.free(1)
    assert len(groups.pools) == 1 and all(o.rows is groups.pools[0] for o in owners)
    assert groups.pools[0].start_of(0) == 0 and groups.pools[0].free_units == 56
    groups.pools[0].check()


def test_a_row_groups_allocation_without_room_takes_nothing():
    owners = [Owner() for _ in range(3)]
    groups = RowGroups(owners, 16)
    groups.allocate(0, np.array([8, 16, 8]))
    before = [(o.rows.free_units, o.rows.start_of(0)) for o in owners]
    assert groups.allocate(1, np.array([8, 8, 8])) is None  # the middle layer has no 8 rows
    assert [(o.rows.free_units, o.rows.start_of(0)) for o in owners] == before and all(1 not in o.rows for o in owners)
    assert not groups.fits(np.array([8, 8, 8])) and groups.fits(np.array([8, 0, 0]))
    assert groups.short(np.array([8, 8, 8])) == [owners[1].rows]
    assert groups.fits_keeping(np.array([16, 16, 16]), set()) and not groups.fits_keeping(np.array([16, 16, 16]), {0})
    none = np.zeros(0, dtype=np.int64)  # a model without wrapped layers: nothing to take, always room
    assert RowGroups([], 0).allocate(0, none).tolist() == [] and RowGroups([], 0).fits(none)


@pytest.mark.parametrize("region", [None, 8])
def test_random_row_groups_agree_with_a_pool_per_layer(region):
    """Random writes over eight layers (each asking rows of a few layers, by a few patterns or
    at random) and frees: every layer's table equals the one a pool of its own keeps, every
    answer of room too; the groups stay as few as the writes make them."""
    rng = random.Random(1)
    n, units = 8, 96  # twelve keys' regions of 8 rows
    owners = [Owner() for _ in range(n)]
    groups, alone = RowGroups(owners, units, region), [RankPool(units, region) for _ in range(n)]
    sizes = [0, 8] if region else [0, 8, 16, 24]
    patterns = [np.array([8, 0] * 4), np.array([8] * 8), np.array([0, 0, 0, 0, 8, 8, 8, 8])]
    failures, most = 0, 1
    for _ in range(600):
        owned = [k for k in range(12) if any(k in pool for pool in alone)]
        if owned and rng.random() < 0.4:
            key = rng.choice(owned)
            groups.free(key)
            for pool in alone:
                pool.free(key)
        else:
            key = rng.choice([k for k in range(12) if k not in owned] or [None])
            if key is None:
                continue
            rows = rng.choice(patterns) if rng.random() < 0.7 else np.array([rng.choice(sizes) for _ in range(n)])
            fits = all(pool.fits(int(r)) for pool, r in zip(alone, rows))
            assert groups.fits(rows) == fits
            keep = set(rng.sample(owned, len(owned) // 2))
            assert groups.fits_keeping(rows, keep) == all(p.fits_keeping(int(r), keep) for p, r in zip(alone, rows))
            start = groups.allocate(key, rows)
            if not fits:
                assert start is None
                failures += 1
                continue
            expected = [pool.allocate(key, int(r)) or 0 for pool, r in zip(alone, rows)]
            assert start.tolist() == expected
        for owner, pool in zip(owners, alone):
            assert owner.rows.same_rows(pool)
            owner.rows.check()
        assert len(groups.pools) == len({tuple(sorted(pool._owned.items())) for pool in alone})
        most = max(most, len(groups.pools))
    assert (failures > 10 if region is None else failures == 0) and most >= 4  # full, and split into several


# --------------------------------------------------------------------------------------------------
# The model manager with a byte budget
# --------------------------------------------------------------------------------------------------

SPECS = {  # rank, alpha, targets; seeds differ so every adapter has its own weights
    **{f"qv4-{c}": dict(r=4, lora_alpha=8, target_modules=QV) for c in "abcde"},
    "qv8": dict(r=8, lora_alpha=16, target_modules=QV),
    "qv2": dict(r=2, lora_alpha=4, target_modules=QV),
    "all4": dict(r=4, lora_alpha=8, target_modules=ALL_LINEAR),
    "attn8-head": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]),
    "mlp6": dict(r=6, lora_alpha=12, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"],
                 rank_pattern={"down_proj": 2}),
    "embed2": dict(r=2, lora_alpha=2, target_modules=["embed_tokens", "q_proj"]),  # a dense layer beside
    "qv16": dict(r=16, lora_alpha=16, target_modules=QV),
    "qv3": dict(r=3, lora_alpha=6, target_modules=QV),
    "qv9": dict(r=9, lora_alpha=9, target_modules=QV),
}
# every slot owns its rank rounded up to 8 rows: qv2, qv3, qv4-*, qv8 take 8 rows; qv9 and qv16 16
INPUT = torch.randint(3, 128, (8, 5), generator=torch.Generator().manual_seed(1))  # [B, S]


@pytest.fixture(scope="module")
def pool_setup(tmp_path_factory):
    """A tiny Llama, SPECS on disk and loaded, and a PEFT model holding all of them."""
    base = tiny_model("llama")
    root = tmp_path_factory.mktemp("pool")
    dirs = {name: save_peft_adapter(copy.deepcopy(base), root / name, seed=seed, **spec)
            for seed, (name, spec) in enumerate(SPECS.items(), start=1)}
    adapters = {name: load_adapter(directory, name=name) for name, directory in dirs.items()}
    return base, adapters, peft_oracle(base, dirs)


def row_bytes(base, max_lora_rank: int = 8, **kwargs) -> int:
    """Bytes of one rank row across every layer the manager wraps in ``base``."""
    manager = LoRAModelManager(copy.deepcopy(base), LoRAConfig(max_lora_rank=max_lora_rank), **kwargs)
    return sum(LayerSlots.row_bytes(layer.in_features, layer.output_sizes, layer.lora_dtype)
               for layer in manager.layers.values())


def pooled(base, rows: int, *, max_loras: int = 8, max_lora_rank: int = 16, **kwargs):
    """A patched copy of ``base`` and its manager, every pool ``rows`` rank rows by the byte budget."""
    model = copy.deepcopy(base)
    budget = rows * row_bytes(base, **kwargs)
    manager = LoRAModelManager(
        model, LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank, max_gpu_lora_bytes=budget), **kwargs)
    assert manager.pool_units == rows
    return model, manager


def check_outputs(model, manager, oracle, names):
    """A mixed batch, one row per name (None: the base model), equals PEFT row by row."""
    input_ids = INPUT[: len(names)]
    with torch.no_grad():
        expected = oracle(input_ids, adapter_names=[n or "__base__" for n in names]).logits
    manager.set_mapping(manager.token_slots(names, input_ids.shape[1]))
    with torch.no_grad():
        got = model(input_ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    return got


def check_slots(manager, adapters):
    """Every resident adapter's slot holds its weights in every layer, and nothing elsewhere; in a
    pool it owns its rank rounded up to 8 rows, B's columns past the rank zero in its block."""
    owned = {layer: 0 for layer in manager.layers.values()}
    for name in manager.resident():
        slot, adapter = manager.slot_of(name), adapters[name]
        for layer in manager.layers.values():
            weights = [adapter.modules.get(module) for module in layer.slice_names]
            if all(w is None for w in weights):
                assert layer.slots.ranks[slot] == 0 and slot not in getattr(layer, "rank_pool", ()), (name, layer)
                continue
            rank = max(w.rank for w in weights if w is not None)
            assert layer.slots.ranks[slot] == rank, (name, layer)  # the true rank, not the rows
            for (a, b), w in zip(layer.slots.slot_weights(slot), weights):
                assert a.shape[0] == b.shape[1] == rank
                if w is None:
                    assert not a.any() and not b.any(), (name, layer)
                    continue
                assert torch.equal(a[: w.rank], w.lora_a) and torch.equal(b[:, : w.rank], w.lora_b), (name, layer)
                assert not a[w.rank :].any() and not b[:, w.rank :].any()
            owned[layer] += pool_rows(rank)
            _, block = layer.slots.block(layer.slots.rows.start_of(slot), pool_rows(rank))
            assert not block[:, rank:].any(), (name, layer)  # the expand reads the block's whole width
    for layer, rows in owned.items():
        assert layer.slots.rows.units - layer.slots.rows.free_units == rows, layer


def qv_layers(manager):
    return [layer for name, layer in manager.layers.items() if name.endswith(("q_proj", "v_proj"))]


def test_small_adapters_share_the_pool_and_a_large_one_evicts_by_rows(pool_setup):
    """32 rows a layer, 8 slots: four rank-4 adapters at once (8 rows each); a fifth evicts exactly
    the least recently used; a rank-16 one evicts two."""
    base, adapters, oracle = pool_setup
    model, manager = pooled(base, 32)
    for c in "abcd":
        manager.activate(adapters[f"qv4-{c}"])
    assert manager.resident() == ["qv4-a", "qv4-b", "qv4-c", "qv4-d"] and manager.stats.evictions == 0
    for layer in qv_layers(manager):
        assert [layer.slots.rows.start_of(manager.slot_of(f"qv4-{c}")) for c in "abcd"] == [0, 8, 16, 24]
        assert layer.slots.rows.free_units == 0
    assert manager.layers["model.layers.0.mlp.up_proj"].slots.rows.free_units == 32  # untouched
    check_slots(manager, adapters)
    check_outputs(model, manager, oracle, ["qv4-a", "qv4-b", None, "qv4-c", "qv4-d"])

    assert manager.can_place(adapters["qv4-e"])  # by evicting an adapter not in use
    manager.activate(adapters["qv4-e"])
    assert manager.resident() == ["qv4-b", "qv4-c", "qv4-d", "qv4-e"] and manager.stats.evictions == 1
    manager.activate(adapters["qv16"])  # the two least recently used, b and c, are adjacent
    assert manager.resident() == ["qv4-d", "qv4-e", "qv16"] and manager.stats.evictions == 3
    assert all(layer.slots.rows.free_units == 0 for layer in qv_layers(manager))
    assert all(layer.slots.rows.start_of(manager.slot_of("qv16")) == 8 for layer in qv_layers(manager))
    check_slots(manager, adapters)
    check_outputs(model, manager, oracle, ["qv16", "qv4-d", None, "qv4-e", "qv16"])


def test_eviction_goes_on_in_lru_order_until_a_range_is_free(pool_setup):
    """The two least recently used rank-4 adapters own rows apart: evicting both frees 16 rows but
    no range of 16, so a third goes."""
    base, adapters, oracle = pool_setup
    model, manager = pooled(base, 32)
    for c in "abcd":  # rows 0-7, 8-15, 16-23, 24-31
        manager.activate(adapters[f"qv4-{c}"])
    manager.activate(adapters["qv4-a"])  # hits: the order is b, d, a, c now
    manager.activate(adapters["qv4-c"])
    manager.activate(adapters["qv16"])
    assert manager.resident() == ["qv4-c", "qv16"] and manager.stats.evictions == 3
    for layer in qv_layers(manager):
        assert layer.slots.rows.start_of(manager.slot_of("qv16")) == 0  # in the range b and a left
        assert layer.slots.rows.free_units == 8  # d's rows
    check_slots(manager, adapters)
    check_outputs(model, manager, oracle, ["qv4-c", "qv16", None])


def test_a_slot_owns_its_rank_rounded_up_to_8_rows(pool_setup):
    """Rank 3 takes 8 rows and rank 9 takes 16 (``lora_ranks`` keeps the true rank); a rank-3
    adapter written where a rank-16 one was (a freed range reused, then the same slot rewritten)
    leaves its block's B columns past rank 3 zero, though the rank-16 block's bytes lay there."""
    assert POOL_ROW_ALIGN == 8 and [pool_rows(r) for r in (0, 1, 3, 8, 9, 16, 17)] == [0, 8, 8, 8, 16, 16, 24]
    base, adapters, oracle = pool_setup
    model, manager = pooled(base, 32)
    layers = qv_layers(manager)
    weights = {name: [[adapters[name].modules.get(m) for m in layer.slice_names] for layer in layers]
               for name in ("qv3", "qv9", "qv16")}
    for name, units in (("qv3", 8), ("qv9", 16)):
        rows = manager.pool.footprint(adapters[name].modules).rows
        assert set(rows.tolist()) == {0, units} and len(rows[rows > 0]) == len(layers)
    manager.activate(adapters["qv3"])
    manager.activate(adapters["qv9"])
    for layer in layers:
        assert layer.slots.rows.free_units == 32 - 8 - 16
        assert layer.slots.rows.start_of(manager.slot_of("qv3")) == 0
        assert layer.slots.rows.start_of(manager.slot_of("qv9")) == 8
        assert layer.slots.ranks[manager.slot_of("qv3")] == 3 and layer.slots.ranks[manager.slot_of("qv9")] == 9
    check_slots(manager, adapters)
    check_outputs(model, manager, oracle, ["qv9", "qv3", None])

    def block(layer, start, rank):
        """A view of the slot's B block [N, pool_rows(rank)] at ``start``."""
        return layer.slots.block(start, pool_rows(rank))[1]

    # a freed range reused: rank 16 at rows 0-15, freed, then rank 3 at rows 0-7
    assert manager.deactivate("qv3") and manager.deactivate("qv9")
    manager.activate(adapters["qv16"])
    for layer in layers:
        assert layer.slots.rows.start_of(manager.slot_of("qv16")) == 0 and layer.slots.rows.free_units == 16
        assert block(layer, 0, 3)[:, 3:].any()  # the rank-16 block read as a rank-3 one: not zero
    assert manager.deactivate("qv16")
    manager.activate(adapters["qv3"])
    for layer, w in zip(layers, weights["qv3"]):
        assert layer.slots.rows.start_of(manager.slot_of("qv3")) == 0 and layer.slots.rows.free_units == 24
        assert torch.equal(block(layer, 0, 3)[:, :3], w[0].lora_b) and not block(layer, 0, 3)[:, 3:].any()
    check_slots(manager, adapters)
    check_outputs(model, manager, oracle, [None, "qv3"])

    # the same slot rewritten layer by layer: rank 16, then rank 3
    for layer, w16, w3 in zip(layers, weights["qv16"], weights["qv3"]):
        slot = 7
        manager.pool.write(slot, {layer.module_name: w16[0]})
        start = layer.slots.rows.start_of(slot)
        assert start == 8 and layer.slots.rows.free_units == 8 and layer.slots.ranks[slot] == 16
        assert block(layer, start, 3)[:, 3:].any()
        manager.pool.write(slot, {layer.module_name: w3[0]})
        assert layer.slots.rows.start_of(slot) == start and layer.slots.rows.free_units == 16
        assert layer.slots.ranks[slot] == 3 and layer.slots.pool_starts[slot] == start
        assert torch.equal(block(layer, start, 3)[:, :3], w3[0].lora_b) and not block(layer, start, 3)[:, 3:].any()
        (a, b), = layer.slots.slot_weights(slot)
        assert torch.equal(a, w3[0].lora_a) and torch.equal(b, w3[0].lora_b)
        manager.pool.clear(slot)
        assert slot not in layer.slots.rows and layer.slots.rows.free_units == 24


def test_mixed_ranks_and_targets_equal_peft_through_churn(pool_setup):
    """Adapters of ranks 2..16 (8 or 16 rows) over different layers (one with an embedding, one
    with the LM head) activated, evicted, freed and activated again in a shuffled order: every
    slot holds its adapter's weights and a mixed batch equals PEFT after each operation."""
    base, adapters, oracle = pool_setup
    model, manager = pooled(base, 24)
    names = ["qv2", "all4", "attn8-head", "mlp6", "embed2", "qv4-a", "qv8", "qv16", "qv3", "qv9"]
    rng = random.Random(3)
    activated, reactivated, freed = set(), 0, 0
    for step in range(40):
        resident = manager.resident()
        if resident and rng.random() < 0.25:
            name = rng.choice(resident)
            assert manager.deactivate(name)
            freed += 1
        else:
            name = rng.choice(names)
            reactivated += name in activated and name not in resident
            activated.add(name)
            manager.activate(adapters[name])
        check_slots(manager, adapters)
        if step % 3 == 0 or step == 39:
            rows = manager.resident() + [None]
            rng.shuffle(rows)
            check_outputs(model, manager, oracle, rows)
    assert manager.stats.evictions >= 5 and reactivated >= 5 and freed >= 3  # the churn was real
    assert len(manager.resident()) >= 2


def test_held_adapters_are_never_evicted_for_rows(pool_setup):
    base, adapters, oracle = pool_setup
    model, manager = pooled(base, 32)  # four rank-4 adapters fill it: 8 rows each
    names = [f"qv4-{c}" for c in "abcd"]
    for name in names:
        manager.activate(adapters[name])
        manager.hold(name)
    rows = [*names, None]
    before_logits = check_outputs(model, manager, oracle, rows)
    pools = [(layer.slots.rows.free_units, [layer.slots.rows.start_of(s) for s in range(8)])
             for layer in manager.layers.values()]
    buffers = {name: [t.clone() for t in layer.slots.buffers()] for name, layer in manager.layers.items()}
    before = (manager.resident(), [manager.slot_of(n) for n in names], pools, buffers)

    assert all(layer.slots.rows.free_units == 0 for layer in qv_layers(manager))
    assert not manager.can_place(adapters["qv4-e"]) and not manager.can_place(adapters["qv2"])
    with pytest.raises(CacheFullError, match="qv4-e.*no room.*32 rank rows.*max_gpu_lora_bytes") as caught:
        manager.activate(adapters["qv4-e"])
    assert all(name in str(caught.value) for name in names)  # the adapters in use are named
    after = (manager.resident(), [manager.slot_of(n) for n in names],
             [(layer.slots.rows.free_units, [layer.slots.rows.start_of(s) for s in range(8)])
              for layer in manager.layers.values()],
             {name: list(layer.slots.buffers()) for name, layer in manager.layers.items()})
    assert after[:3] == before[:3] and manager.stats.evictions == 0
    for name, tensors in after[3].items():
        assert all(torch.equal(got, was) for got, was in zip(tensors, before[3][name])), name
    assert torch.equal(check_outputs(model, manager, oracle, rows), before_logits)

    # an adapter on other layers only finds its rows free beside them
    assert manager.can_place(adapters["mlp6"])
    manager.activate(adapters["mlp6"])
    assert manager.stats.evictions == 0 and len(manager.resident()) == 5

    manager.release("qv4-b")  # its 8 rows: room for any rank up to 8, not for rank 9 (16 rows)
    assert manager.can_place(adapters["qv4-e"]) and manager.can_place(adapters["qv8"])
    assert not manager.can_place(adapters["qv9"])
    manager.activate(adapters["qv4-e"])  # takes qv4-b's rows, the only ones not in use
    assert manager.resident() == ["qv4-a", "qv4-c", "qv4-d", "mlp6", "qv4-e"] and manager.stats.evictions == 1
    check_slots(manager, adapters)
    check_outputs(model, manager, oracle, ["qv4-e", "mlp6", "qv4-a", None, "qv4-d", "qv4-c"])


def test_rows_in_use_apart_refuse_a_larger_adapter_without_evicting(pool_setup):
    """Held adapters at rows 0-7 and 16-23 leave 16 rows to evict, but no range of 16: nothing is
    evicted for a rank-16 adapter that could not fit anyway."""
    base, adapters, oracle = pool_setup
    model, manager = pooled(base, 32)
    for c in "abcd":  # rows 0-7, 8-15, 16-23, 24-31
        manager.activate(adapters[f"qv4-{c}"])
    manager.hold("qv4-a")
    manager.hold("qv4-c")
    assert not manager.can_place(adapters["qv16"]) and not manager.can_place(adapters["qv9"])
    assert manager.can_place(adapters["qv8"])  # 8 rows: b's or d's
    with pytest.raises(CacheFullError, match="max_gpu_lora_bytes"):
        manager.activate(adapters["qv16"])
    assert manager.resident() == ["qv4-a", "qv4-b", "qv4-c", "qv4-d"] and manager.stats.evictions == 0
    manager.release("qv4-a")
    assert manager.can_place(adapters["qv16"])
    manager.activate(adapters["qv16"])  # a, then b (least recently used first): rows 0-15
    assert manager.resident() == ["qv4-c", "qv4-d", "qv16"] and manager.stats.evictions == 2
    assert all(layer.slots.rows.start_of(manager.slot_of("qv16")) == 0 for layer in qv_layers(manager))
    check_slots(manager, adapters)
    check_outputs(model, manager, oracle, ["qv16", "qv4-c", "qv4-d", None])


def test_a_prefetch_evicts_nothing_it_is_told_to_keep(pool_setup):
    """The engine prefetches the adapters of the oldest queued requests in order, each keeping those
    ahead of it: a later one that does not fit beside them is not copied (nothing evicted)."""
    base, adapters, oracle = pool_setup
    model, manager = pooled(base, 32, max_loras=4)
    manager.activate(adapters["qv4-a"])
    manager.activate(adapters["qv4-b"])  # rows 0-15, neither held
    ahead = {manager.handle(name).id for name in ("qv4-a", "qv4-b")} | {12345}  # not resident: ignored
    assert manager.prefetch(adapters["qv16"], keep=ahead) is not None  # rows 16-31: no eviction needed
    ahead.add(manager.handle("qv16").id)
    assert not manager.can_place(adapters["qv4-c"], keep=ahead) and manager.can_place(adapters["qv4-c"])
    assert manager.prefetch(adapters["qv4-c"], keep=ahead) is None
    assert manager.resident() == ["qv4-a", "qv4-b", "qv16"] and manager.stats.evictions == 0
    assert manager.prefetch(adapters["mlp6"], keep=ahead) is not None  # other layers: room beside them
    ahead.discard(manager.handle("qv4-b").id)
    assert manager.prefetch(adapters["qv4-c"], keep=ahead) is not None  # evicts b, not a: a is kept
    assert manager.resident() == ["qv4-a", "qv16", "mlp6", "qv4-c"] and manager.stats.evictions == 1
    # every slot kept: no room, whatever the rows
    assert not manager.can_place(adapters["qv2"], keep={manager.handle(n).id for n in manager.resident()})
    check_slots(manager, adapters)
    check_outputs(model, manager, oracle, ["qv4-c", "mlp6", None, "qv16", "qv4-a"])


def test_a_budget_below_one_max_rank_adapter_is_refused(pool_setup):
    base, adapters, _ = pool_setup
    per_row = row_bytes(base)
    assert per_row == 5376  # 2 layers x 7 projections, the LM head and the embedding (vocab 128 + 32), float32
    with pytest.raises(ValueError, match=f"max_gpu_lora_bytes: got {8 * per_row - 1}; allowed: at least "
                                         f"{8 * per_row} .*max_lora_rank=8"):
        LoRAModelManager(copy.deepcopy(base), LoRAConfig(max_loras=4, max_lora_rank=8,
                                                         max_gpu_lora_bytes=8 * per_row - 1))
    with pytest.raises(ValueError, match="max_gpu_lora_bytes"):
        LoRAConfig(max_gpu_lora_bytes=0)

    pooled(base, 8, max_loras=4, max_lora_rank=8)  # exactly one adapter of rank 8 everywhere (it asserts 8 rows)
    model = copy.deepcopy(base)
    floor = LoRAModelManager(model, LoRAConfig(max_loras=4, max_lora_rank=8, max_gpu_lora_bytes=9 * per_row - 1))
    assert floor.pool_units == 8  # whole rows only
    for layer in floor.layers.values():  # every layer pooled, the embedding too
        assert layer.slots.rows.units == 8
        assert layer.slots.lora_a.shape == (8, 1, layer.in_features)
        assert layer.slots.lora_b.shape == (8, layer.out_features)
    floor.activate(adapters["attn8-head"])
    floor.activate(adapters["embed2"])  # evicts it: q_proj holds 8 rows only
    assert floor.resident() == ["embed2"]

    # fewer wrapped layers: the same bytes hold more rows
    narrow = row_bytes(base, target_modules=QV)
    assert narrow == 2 * (256 + 192)
    _, qv_only = pooled(base, 16, target_modules=QV)
    assert all(layer.slots.rows.units == 16 for layer in qv_only.layers.values())

    # a max_lora_rank off the alignment: its adapter owns 16 rows, so 12 or 15 rows are too few
    for rows in (12, 15):
        with pytest.raises(ValueError, match=f"allowed: at least {16 * per_row} .*max_lora_rank=12"):
            LoRAModelManager(copy.deepcopy(base), LoRAConfig(max_loras=4, max_lora_rank=12,
                                                             max_gpu_lora_bytes=rows * per_row))
    _, rank12 = pooled(base, 16, max_loras=4, max_lora_rank=12)
    rank12.activate(adapters["qv9"])  # rank 9: 16 rows, the whole pool
    assert all(layer.slots.rows.free_units == 0 for layer in qv_layers(rank12))


def test_without_a_budget_every_pool_holds_max_loras_adapters_of_max_rank(pool_setup):
    base, adapters, _ = pool_setup
    manager = LoRAModelManager(copy.deepcopy(base), LoRAConfig(max_loras=3, max_lora_rank=8))
    assert manager.pool_units == 24
    assert all(layer.slots.rows.units == layer.slots.lora_a.shape[0] == layer.slots.lora_b.shape[0] == 24
               for layer in manager.layers.values())
    for name in ["attn8-head", "qv8", "all4"]:
        manager.activate(adapters[name])
    assert manager.stats.evictions == 0 and manager.can_place(adapters["qv2"])

    # a max_lora_rank off the alignment: each slot owns 8 rows, not 4
    small = LoRAModelManager(copy.deepcopy(base), LoRAConfig(max_loras=3, max_lora_rank=4))
    assert small.pool_units == 3 * pool_rows(4) == 24
    for name in ["qv4-a", "qv3", "all4"]:
        small.activate(adapters[name])
    assert small.stats.evictions == 0 and small.resident() == ["qv4-a", "qv3", "all4"]
    assert all(layer.slots.rows.free_units == 0 for layer in qv_layers(small))
    check_slots(small, adapters)


# --------------------------------------------------------------------------------------------------
# The scheduler's room question
# --------------------------------------------------------------------------------------------------

_arrivals = itertools.count()
_handles: dict[str, AdapterHandle] = {}


def handle(name: str) -> AdapterHandle:
    if name not in _handles:
        _handles[name] = AdapterHandle(len(_handles) + 1, name, f"digest-{name}", None, 8, 1024)
    return _handles[name]


def request(name: str, max_tokens: int = 3) -> Sequence:
    return Sequence(request_id=f"r{next(_arrivals)}", prompt=None, prompt_token_ids=[5] * 4,
                    params=SamplingParams(max_tokens=max_tokens), arrival=next(_arrivals),
                    lora_request=LoRARequest(name, sum(map(ord, name))), handle=handle(name))


def scheduler(max_loras: int, has_room_for) -> Scheduler:
    return make_scheduler(rows=16, budget=64, max_loras=max_loras, has_room=has_room_for)


def test_no_room_keeps_a_request_waiting_in_order_while_in_slot_adapters_run():
    room = {"big": False}
    asked = []

    def has_room_for(h):
        asked.append(h.name)
        return room.get(h.name, True)

    s = scheduler(4, has_room_for)
    for name in ("a", "d", "e"):  # three of four slots in use, for a while
        s.add(request(name, max_tokens=20))
    advance(s)
    big, small, more_a = request("big"), request("small"), request("a")
    for q in (big, small, more_a):
        s.add(q)
    asked.clear()
    ran = advance(s)
    # a slot is free, but no room for big's rows; small needs a slot too and waits behind it (FIFO)
    assert big not in ran and small not in ran and more_a in ran
    assert s.waiting == [big, small] and "big" in asked
    assert not s.draining  # d and e free their rows by themselves: nothing to drain
    for _ in range(3):
        ran = advance(s)
        assert big not in ran and small not in ran
    room["big"] = True
    ran = advance(s)
    assert big in ran and small not in ran  # big took the last slot; small waits for one to free
    while small not in ran:
        ran = advance(s)
        assert s.has_work()


def test_a_free_slot_without_room_marks_a_victim_draining():
    s = scheduler(4, lambda h: h.name != "big")
    s.add(request("a", max_tokens=20))
    advance(s)
    big, more_a = request("big"), request("a")
    s.add(big)
    s.add(more_a)
    ran = advance(s)
    # 3 slots free, but big's rows need a's: a drains (its queued request waits behind big)
    assert s.draining == {handle("a").id} and big not in ran and more_a not in ran

    roomy = scheduler(4, lambda h: True)  # the same queue with room: nothing drains, both run
    roomy.add(request("a", max_tokens=20))
    advance(roomy)
    big2, more_a2 = request("big"), request("a")
    roomy.add(big2)
    roomy.add(more_a2)
    assert {big2, more_a2} <= set(advance(roomy)) and not roomy.draining


# --------------------------------------------------------------------------------------------------
# The engine: more adapters than the budget holds at max rank
# --------------------------------------------------------------------------------------------------

ENGINE_ADAPTERS = [  # (rank, targets): small ones first (8 rows each), so admission can run several at once
    (2, QV), (3, QV), (2, ["q_proj", "k_proj", "v_proj", "o_proj"]), (4, ["down_proj"]), (3, ALL_LINEAR),
    (2, QV), (5, ["k_proj", "o_proj"]), (16, ALL_LINEAR), (6, QV), (4, ALL_LINEAR), (12, ["up_proj", "down_proj"]),
    (16, ALL_LINEAR),
]
PROMPT = [(5 * i) % 120 + 3 for i in range(7)]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def test_an_engine_serves_many_mixed_adapters_in_a_budget_for_two_at_max_rank(make_adapter):
    """12 adapters of ranks 2..16 over 8 slots and pools of 32 rows: several small ones (8 rows
    each) run in one step, the rank-16 ones take turns, every request gives what its adapter gives
    alone, and each adapter is copied to the GPU once (a prefetch never evicts one placed for a
    request ahead of it)."""
    paths = [make_adapter(f"mixed{i}", seed=200 + i, r=r, lora_alpha=2 * r, target_modules=targets)
             for i, (r, targets) in enumerate(ENGINE_ADAPTERS)]
    budget = 2 * 16 * row_bytes(tiny_llama())  # room for 2 adapters of rank 16 on every layer
    eng = LLMEngine(tiny_llama(), max_loras=8, max_lora_rank=16, max_gpu_lora_bytes=budget, max_cpu_loras=12,
                    max_num_seqs=16, max_model_len=32)
    assert eng.lora_manager.pool_units == 32
    ready = []
    all_ready = threading.Event()

    def listen(event):
        ready.append(event.name)
        if len(ready) == len(paths):
            all_ready.set()

    eng.add_event_listener(listen)
    for i, path in enumerate(paths):
        eng.add_request(f"req{i}", {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest(f"mixed{i}", i + 1, str(path)))
    eng.add_request("base", {"prompt_token_ids": PROMPT}, GREEDY)
    assert all_ready.wait(30)  # every adapter in the CPU tier: the first step sees the whole queue

    steps = []  # the adapters of every step's batch
    schedule = eng.scheduler.schedule

    def watched():
        batch = schedule()
        steps.append({q.handle.name for q, _ in batch.chunks if q.handle is not None})
        return batch

    eng.scheduler.schedule = watched
    finished = step_to_end(eng, max_steps=500)
    assert set(finished) == {f"req{i}" for i in range(len(paths))} | {"base"}
    # small adapters ran together on one layer, where 2 of max rank fill its pool
    on_q_proj = {f"mixed{i}" for i, (_, targets) in enumerate(ENGINE_ADAPTERS) if "q_proj" in targets}
    assert max(len(step & on_q_proj) for step in steps) > 2
    # admission (once the first step's prefetch placed them) in arrival order up to the first
    # adapter with no room: mixed5 (rank 2) needs 8 rows
    # of the fused q/k/v pool, where mixed0..4 (ranks 2..3, 8 rows each) leave none; none behind
    # it jumps ahead, not even mixed10, which touches no q/k/v and would fit
    assert next(step for step in steps if step) == {f"mixed{i}" for i in range(5)}
    stats = eng.lora_manager.stats
    assert stats.evictions > 0 and stats.loads == len(paths)  # prefetched or placed at admission: once each
    assert finished["base"] == peft_greedy(None, PROMPT, 5)
    for i, path in enumerate(paths):
        assert finished[f"req{i}"] == peft_greedy(path, PROMPT, 5), i


# -- found in review: pins that leave no room, fragmentation, eviction that frees nothing --------


def test_requests_pinned_adapters_leave_no_room_for_fail_and_the_queue_moves_on(pool_setup):
    base, adapters, _ = pool_setup
    _, manager = pooled(base, 32)  # 32 rows, 8 slots
    for c in "abcd":  # rows 0-7, 8-15, 16-23, 24-31
        manager.activate(adapters[f"qv4-{c}"])
    manager.hold("qv4-a")
    manager.hold("qv4-c")  # pinned: 16 rows left, but no 16 in a row
    by_name = {"big": adapters["qv16"], "small": adapters["qv2"]}
    pinned_ids = {manager.handle(name).id for name in ("qv4-a", "qv4-c")}
    assert not manager.fits_beside(by_name["big"], pinned_ids) and manager.fits_beside(by_name["small"], pinned_ids)
    s = make_scheduler(rows=16, budget=64, max_loras=8,
                       has_room=lambda h: manager.can_place(by_name[h.name]),
                       fits_beside=lambda h, pinned: manager.fits_beside(by_name[h.name], pinned_ids))
    big, small = request("big"), request("small")
    s.add(big)
    s.add(small)
    scheduled = step(s)
    assert [q for q, _ in scheduled.chunks] == [small]  # the request that could never run failed; the next runs
    assert scheduled.failed == [big] and isinstance(big.error, CacheFullError)
    assert "pinned to the GPU" in str(big.error) and "max_gpu_lora_bytes" in str(big.error)


def test_the_default_pool_gives_every_slot_a_max_rank_region_so_nothing_fragments(pool_setup):
    base, adapters, _ = pool_setup
    manager = LoRAModelManager(copy.deepcopy(base), LoRAConfig(max_loras=2, max_lora_rank=16))
    assert manager.pool_units == 32 and all(layer.slots.rows.region == 16 for layer in manager.layers.values())
    manager.activate(adapters["qv4-a"])
    manager.activate(adapters["qv16"])
    manager.deactivate("qv4-a")
    manager.hold("qv16")  # in use; the other slot is free, and so is its whole region
    assert manager.can_place(adapters["qv9"])
    manager.activate(adapters["qv9"])  # best fit over shared rows left 8 + 8 apart: refused
    assert sorted(manager.resident()) == ["qv16", "qv9"]


def test_eviction_for_rows_spares_adapters_that_hold_none_of_the_rows_needed(pool_setup):
    base, adapters, _ = pool_setup
    _, manager = pooled(base, 16, max_loras=8)
    manager.activate(adapters["mlp6"])  # MLP layers only
    manager.activate(adapters["qv16"])  # every q/v row
    manager.activate(adapters["qv8"])  # needs q/v rows: only qv16's eviction frees any
    assert sorted(manager.resident()) == ["mlp6", "qv8"] and manager.stats.evictions == 1


def test_a_write_with_no_room_raises_leaves_the_slot_empty_and_the_others_as_they_were():
    from torch import nn

    from loramux.engine.layers.linear import LinearWithLoRA
    from loramux.registry import LoRAModuleWeights

    def weights(rank):
        return [LoRAModuleWeights(torch.randn(rank, 8), torch.randn(6, rank), 1.0)]

    config = LoRAConfig(max_loras=3, max_lora_rank=16, max_gpu_lora_bytes=40 * (8 + 6) * 4)
    layer = LinearWithLoRA(nn.Linear(8, 6, bias=False), "p", config)
    pool_of(layer, config)  # 40 shared rows: 0-7, 8-23, 24-39 below
    assert layer.slots.rows.units == 40
    for slot, rank in ((0, 8), (1, 16), (2, 16)):
        set_lora(layer, slot, weights(rank))
    others = [[t.clone() for t in layer.slots.slot_weights(slot)[0]] for slot in (1, 2)]
    with pytest.raises(RuntimeError, match="no 16 free rows"):
        set_lora(layer, 0, weights(16))  # its own 8 rows freed still leave no 16 in a row
    # a write replaces what the slot held: it is empty now, and its rows free
    assert 0 not in layer.slots.rows and layer.slots.host_ranks[0] == 0 and int(layer.slots.ranks[0]) == 0
    assert layer.slots.rows.free_units == 8
    for slot, before in zip((1, 2), others):
        assert all(torch.equal(a, b) for a, b in zip(layer.slots.slot_weights(slot)[0], before))
    set_lora(layer, 0, weights(8))  # and it takes an adapter that fits again
    assert layer.slots.rows.start_of(0) == 0 and layer.slots.host_ranks[0] == 8


def test_room_answers_are_kept_only_while_the_adapters_in_use_stay_the_same(pool_setup):
    """`can_place` keeps its answer per handle until a hold or a release (the rows in use cannot
    move meanwhile): the scheduler asks every step an adapter waits."""
    from dataclasses import replace

    from loramux.registry.handle import memory_handle

    base, adapters, _ = pool_setup
    with_handles = {name: replace(a, handle=memory_handle(a, name)) for name, a in adapters.items()}
    _, manager = pooled(base, 32)
    for c in "abcd":  # rows 0-7, 8-15, 16-23, 24-31
        manager.activate(with_handles[f"qv4-{c}"])
    manager.hold("qv4-a")
    manager.hold("qv4-c")
    big = with_handles["qv16"]
    assert not manager.can_place(big) and not manager.can_place(big)  # the second answer is the kept one
    manager.release("qv4-a")
    assert manager.can_place(big)  # rows 0-15 once a and b are evicted
    manager.hold("qv4-a")
    assert not manager.can_place(big)
    manager.release("qv4-c")
    assert manager.can_place(big)  # rows 16-31 once c and d are evicted


def test_a_kept_answer_goes_when_an_adapter_kept_moves(pool_setup):
    """The answer for an adapter kept by prefetch (``keep=``, not held) must not outlive a move of
    that adapter's rows: any change to the slot table drops the kept answers."""
    from dataclasses import replace

    from loramux.registry.handle import memory_handle

    base, adapters, _ = pool_setup
    named = {name: replace(a, handle=memory_handle(a, name)) for name, a in adapters.items()}
    _, manager = pooled(base, 32)
    for name in ("qv4-a", "qv4-b", "qv4-c", "qv4-d"):  # rows 0-7, 8-15, 16-23, 24-31
        manager.activate(named[name])
    manager.hold("qv4-a")
    keep = {named["qv4-c"].handle.id}
    assert not manager.can_place(named["qv16"], keep=keep)  # a and c leave 8 + 8 apart
    manager.deactivate("qv4-c")
    manager.activate(named["qv4-e"])  # takes c's rows 16-23
    manager.deactivate("qv4-b")
    manager.activate(named["qv4-c"])  # c again, now at 8-15: a and c leave 16-31 whole
    assert all(layer.slots.rows.start_of(manager.slot_of("qv4-c")) == 8 for layer in qv_layers(manager))
    assert manager.can_place(named["qv16"], keep=keep)


@pytest.mark.parametrize("rows", [None, 24], ids=["regions", "shared"])
def test_freeing_a_slot_clears_every_layer(pool_setup, rows):
    """The pool clears a slot of every layer in one batch (`AdapterWeightPool.clear`): every
    scale, rank and pool range of the slot goes, in one zeroing call per dtype, and the slot,
    written again, equals PEFT."""
    base, adapters, oracle = pool_setup
    if rows is None:
        model = copy.deepcopy(base)
        manager = LoRAModelManager(model, LoRAConfig(max_loras=8, max_lora_rank=16))
    else:
        model, manager = pooled(base, rows)
    slot = manager.activate(adapters["all4"])
    touched = [layer for layer in manager.layers.values() if layer.slots.host_ranks[slot]]
    assert len(touched) > 2
    calls = []
    foreach_zero = torch._foreach_zero_
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "_foreach_zero_", lambda group: calls.append(len(group)) or foreach_zero(group))
        assert manager.deactivate("all4")
    assert calls == [len(touched), len(touched)]  # the scales (float32), then the ranks (int32)
    for layer in manager.layers.values():
        assert layer.slots.host_ranks[slot] == 0 and layer.slots.ranks[slot] == 0 and not layer.slots.scales[slot].any()
        assert slot not in layer.slots.rows
        layer.slots.rows.check()
    manager.activate(adapters["all4"])
    check_slots(manager, adapters)
    check_outputs(model, manager, oracle, ["all4", None])

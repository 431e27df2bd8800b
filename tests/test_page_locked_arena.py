"""The CPU tier's page-locked arena (on the CPU its segments are pageable; the bookkeeping is the
same): a piece is handed out again only once nothing references it and the copies fenced before
it was released have run; a full arena falls back to pageable memory, counted; the tier's
evictions and failed loads give their pieces back."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from loramux.errors import CacheFullError, IncompatibleAdapterError, InvalidAdapterError
from loramux.registry import LoRAConfig, LoRARequest, Registry, load_adapter
from loramux.registry.page_locked_arena import PIECE_ALIGNMENT, PageLockedArena, segment_sizes

pytestmark = pytest.mark.usefixtures("clean_plugin_env")

KIB = 1024


class Fence:
    """A copy on a stream, finished when the test says so (a CUDA event's ``query``)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def span(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.untyped_storage().data_ptr()
    return start, start + tensor.untyped_storage().nbytes()


def test_segments_are_the_largest_powers_of_two_in_the_size():
    assert segment_sizes(10 * 10**9) == [8 << 30, 1 << 30, 256 << 20, 64 << 20]  # ~4 MiB left out
    assert segment_sizes(8 << 30) == [8 << 30]
    assert sum(segment_sizes(3 * KIB)) == 3 * KIB
    with pytest.raises(ValueError, match="an int >= 512"):
        PageLockedArena(100, pinned=False)


def test_a_piece_is_a_view_of_the_arena_of_the_size_asked():
    arena = PageLockedArena(64 * KIB, pinned=False)
    piece = arena.allocate(1000)
    assert piece.dtype == torch.uint8 and piece.numel() == 1000 and arena.owns(piece)
    assert piece.untyped_storage().nbytes() == 1000  # its own storage: slot writes stage exactly it
    stats = arena.stats
    assert (stats.in_use_bytes, stats.pieces, stats.allocations, stats.fallbacks) == (1024, 1, 1, 0)
    piece.fill_(7)
    assert arena.allocate(0).numel() == 0 and arena.stats.allocations == 1  # nothing to carve


def test_a_referenced_piece_is_never_handed_out_again():
    arena = PageLockedArena(8 * KIB, pinned=False)
    pieces = [arena.allocate(2 * KIB) for _ in range(4)]  # the whole arena
    kept = pieces[1][100:200].view(torch.int16)  # a view alone keeps the piece
    storage = pieces[2].untyped_storage()  # so does a storage
    as_numpy = pieces[3].numpy()  # and a numpy array over it
    del pieces
    taken = [arena.allocate(2 * KIB) for _ in range(3)]  # only piece 0 came back
    assert sum(arena.owns(t) for t in taken) == 1 and arena.stats.fallbacks == 2
    live = [span(kept), (storage.data_ptr(), storage.data_ptr() + storage.nbytes()),
            (as_numpy.ctypes.data, as_numpy.ctypes.data + as_numpy.nbytes)]
    new = span(next(t for t in taken if arena.owns(t)))
    assert all(new[1] <= start or end <= new[0] for start, end in live)
    del kept, storage, as_numpy, taken
    assert arena.stats.in_use_bytes == 0
    assert arena.allocate(8 * KIB).numel() == 8 * KIB and arena.stats.fallbacks == 2  # merged whole again


def test_random_churn_never_hands_out_memory_that_is_still_referenced():
    rng = random.Random(0)
    arena = PageLockedArena(256 * KIB, pinned=False)
    live: list[torch.Tensor] = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live)))
        else:
            piece = arena.allocate(rng.randrange(1, 40 * KIB))
            if arena.owns(piece):
                live.append(piece[rng.randrange(piece.numel()):])  # keep only a view of it
        spans = sorted(span(t) for t in live)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    stats = arena.stats
    assert stats.allocations > 500 and stats.fallbacks > 0
    assert stats.in_use_bytes == sum(-(-(e - s) // PIECE_ALIGNMENT) * PIECE_ALIGNMENT for s, e in map(span, live))


def test_a_released_piece_waits_for_the_copies_fenced_before_it():
    arena = PageLockedArena(4 * KIB, pinned=False)
    piece = arena.allocate(4 * KIB)
    copy = Fence()
    arena.fence(copy)  # a copy from arena memory may still read it
    del piece
    assert not arena.owns(arena.allocate(4 * KIB)) and arena.stats.in_use_bytes == 4 * KIB
    copy.done = True
    assert arena.owns(arena.allocate(4 * KIB))
    arena.fence(finished := Fence())
    finished.done = True  # copies that already ran hold nothing up
    assert arena.owns(arena.allocate(4 * KIB))


def test_a_full_arena_falls_back_to_pageable_memory_and_counts_it():
    arena = PageLockedArena(4 * KIB, pinned=False)
    held = arena.allocate(3 * KIB)
    big = arena.allocate(2 * KIB)  # 1 KiB is free: no room
    assert not arena.owns(big) and big.numel() == 2 * KIB
    stats = arena.stats
    assert (stats.fallbacks, stats.fallback_bytes, stats.in_use_bytes) == (1, 2 * KIB, 3 * KIB)
    assert arena.owns(arena.allocate(KIB)) and held.numel() == 3 * KIB


def test_freed_neighbours_merge_so_a_larger_piece_fits_again():
    arena = PageLockedArena(6 * KIB, pinned=False)  # segments of 4 and 2 KiB
    a, b, c = arena.allocate(2 * KIB), arena.allocate(2 * KIB), arena.allocate(2 * KIB)
    del a, c
    assert not arena.owns(arena.allocate(4 * KIB))  # two free 2 KiB pieces, not neighbours
    del b
    assert arena.owns(arena.allocate(4 * KIB))


# -- the registry and the loader carve their buffers from it --------------------------------------


def arena_registry(arena: PageLockedArena, **config) -> Registry:
    return Registry(LoRAConfig(max_loras=1, **config), resolvers=[], host_memory=arena)


def test_loads_read_into_the_arena_and_the_tiers_evictions_give_the_pieces_back(make_adapter):
    arena = PageLockedArena(1 << 20, pinned=False)
    registry = arena_registry(arena, max_cpu_loras=1)
    first = registry.get(LoRARequest("a", 1, str(make_adapter("arena-a"))))
    tensors = [t for w in first.modules.values() for t in (w.lora_a, w.lora_b)]
    assert all(arena.owns(t) for t in tensors) and len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    one_adapter = arena.stats.in_use_bytes
    assert one_adapter >= first.nbytes
    del first, tensors
    registry.get(LoRARequest("b", 2, str(make_adapter("arena-b"))))  # evicts "a" from the tier
    assert arena.stats.in_use_bytes == one_adapter and arena.stats.pieces == 1
    registry.unregister("b")
    assert arena.stats.in_use_bytes == 0


def test_a_cast_and_a_pickle_are_packed_into_the_arena(make_adapter, tmp_path):
    arena = PageLockedArena(1 << 20, pinned=False)
    path = make_adapter("arena-cast")
    cast = load_adapter(path, LoRAConfig(lora_dtype="float16"), host_memory=arena)
    assert all(arena.owns(w.lora_a) and w.lora_a.dtype == torch.float16 for w in cast.modules.values())
    from safetensors.torch import load_file

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((path / "adapter_config.json").read_text())
    torch.save(load_file(path / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    adapter = load_adapter(pickled, host_memory=arena)
    assert all(arena.owns(w.lora_b) for w in adapter.modules.values())
    assert torch.equal(adapter.modules["model.layers.0.self_attn.q_proj"].lora_a,
                       load_adapter(path).modules["model.layers.0.self_attn.q_proj"].lora_a)


def test_a_full_arena_still_loads_the_adapter_in_pageable_memory(make_adapter):
    arena = PageLockedArena(PIECE_ALIGNMENT, pinned=False)
    adapter = arena_registry(arena).get(LoRARequest("a", 1, str(make_adapter("arena-full"))))
    reference = load_adapter(make_adapter("arena-full"))
    assert not any(arena.owns(w.lora_a) for w in adapter.modules.values()) and arena.stats.fallbacks == 1
    for name, weights in reference.modules.items():
        assert torch.equal(adapter.modules[name].lora_a, weights.lora_a)


def corrupt_copy(path, tmp_path, how: str):
    import shutil

    copy = tmp_path / how
    shutil.copytree(path, copy)
    weights = copy / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    if how == "truncated":
        data = data[:-8]
    else:  # the last float32 of the file is NaN
        data[-4:] = bytes.fromhex("0000c07f")
    weights.write_bytes(bytes(data))
    return copy


@pytest.mark.parametrize("failure", ["truncated", "nan", "validate", "too-big", "rank"])
def test_a_failed_load_gives_its_piece_back_while_its_error_lives(make_adapter, tmp_path, failure):
    arena = PageLockedArena(1 << 20, pinned=False)
    path = make_adapter("arena-fail", r=8)
    config: dict = {}
    validate = None
    if failure in ("truncated", "nan"):
        path = corrupt_copy(path, tmp_path, failure)
    elif failure == "too-big":
        config = dict(max_cpu_lora_bytes=1024, max_pinned_lora_bytes=1024)
    elif failure == "rank":
        config = dict(max_lora_rank=4)

    def refuse(adapter):
        raise IncompatibleAdapterError("does not fit.", adapter=adapter.name)

    if failure == "validate":
        validate = refuse
    registry = Registry(LoRAConfig(max_loras=1, **config), resolvers=[], host_memory=arena, validate=validate)
    gc.disable()  # nothing but reference counting may give the piece back
    try:
        with pytest.raises((InvalidAdapterError, IncompatibleAdapterError, CacheFullError)) as caught:
            registry.get(LoRARequest("bad", 1, str(path)))
        assert arena.stats.allocations == 1
        assert arena.stats.in_use_bytes == 0, f"the error ({caught.value}) still holds the load's buffer"
    finally:
        gc.enable()


# -- the engine reserves it at start (CUDA) ------------------------------------------------------


def test_the_engine_keeps_a_registrys_own_arena_and_fences_its_slot_writes_on_it():
    from conftest import tiny_llama

    from loramux.engine.llm_engine import LLMEngine

    arena = PageLockedArena(1 << 20, pinned=False)
    registry = Registry(LoRAConfig(max_loras=1, max_lora_rank=8), resolvers=[], host_memory=arena)
    engine = LLMEngine(tiny_llama(), max_loras=1, max_lora_rank=8, max_num_seqs=2, max_model_len=32,
                       registry=registry)
    assert engine.registry.host_memory is arena and engine.lora_manager.on_host_copies == arena.fence
    engine.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="page-locking succeeds where CUDA is present")
def test_without_page_locked_memory_the_arena_serves_pageable_memory_never_pinning_per_load(caplog):
    from loramux.engine.engine_setup import _host_memory
    from loramux.registry.host_memory import PAGEABLE

    arena = PageLockedArena(1 << 20, in_background=True)  # the host refuses: no CUDA here
    assert arena.wait() is arena and not arena.pinned and arena.stats.capacity_bytes == 0
    assert "could not page-lock" in caplog.text and "--max-pinned-lora-bytes" in caplog.text
    piece = arena.allocate(4096)
    assert not piece.is_pinned() and arena.stats.fallbacks == 1
    assert _host_memory(LoRAConfig(max_pinned_lora_bytes=0), cuda=True) is PAGEABLE  # none reserved
    assert _host_memory(LoRAConfig(), cuda=False) is PAGEABLE


def test_an_arena_page_locked_beside_the_start_serves_once_ready_and_its_error_reaches_wait(monkeypatch):
    """Page-locking 8 GiB takes seconds: a thread of its own does it while the engine compiles;
    a fence before then is nothing to wait for, an allocation waits for it, and an error there
    reaches the engine's thread in `wait`."""
    import threading

    from loramux.registry import page_locked_arena

    release, threads = threading.Event(), []
    sizes = page_locked_arena.segment_sizes

    def slow_sizes(nbytes):
        threads.append(threading.current_thread())
        release.wait(timeout=10)
        return sizes(nbytes)

    monkeypatch.setattr(page_locked_arena, "segment_sizes", slow_sizes)
    arena = PageLockedArena(1 << 20, pinned=False, in_background=True)
    arena.fence(object())  # nothing allocated yet: nothing a copy could read
    release.set()
    assert arena.wait() is arena and threads[0] is not threading.main_thread()
    assert arena.waited_seconds >= 0 and arena.reserve_seconds > 0
    piece = arena.allocate(1000)
    assert arena.owns(piece) and arena.stats.allocations == 1 and arena.stats.capacity_bytes == 1 << 20

    def failing_sizes(nbytes):
        raise MemoryError("no host memory")

    monkeypatch.setattr(page_locked_arena, "segment_sizes", failing_sizes)
    broken = PageLockedArena(1 << 20, pinned=False, in_background=True)
    with pytest.raises(MemoryError, match="no host memory"):
        broken.wait()

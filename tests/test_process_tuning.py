"""What the engine sets for the process when it starts serving: a short GIL switch interval (a lower
one set by the user stays) and, on CUDA, the garbage collector's heap frozen after a collection that
also frees what an earlier engine froze."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
from conftest import tiny_llama

from loramux.engine.process_tuning import SERVING_SWITCH_INTERVAL_S, prepare_process_for_serving


@pytest.fixture
def default_interval():
    sys.setswitchinterval(0.005)  # Python's default
    yield
    sys.setswitchinterval(0.005)


class Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_the_engine_shortens_the_switch_interval_when_it_starts_serving(default_interval):
    from loramux.engine.llm_engine import LLMEngine

    LLMEngine(tiny_llama(), enable_lora=True, max_loras=1, max_num_seqs=2, max_model_len=32)
    assert sys.getswitchinterval() == pytest.approx(SERVING_SWITCH_INTERVAL_S) and SERVING_SWITCH_INTERVAL_S < 0.005
    sys.setswitchinterval(0.0001)
    prepare_process_for_serving(freeze_gc=False)
    assert sys.getswitchinterval() == pytest.approx(0.0001)  # the user's shorter one stays


def test_freezing_collects_first_and_an_earlier_freeze_is_undone(default_interval):
    dropped = Node()
    gone = weakref.ref(dropped)
    del dropped
    try:
        prepare_process_for_serving(freeze_gc=True)
        assert gone() is None  # garbage is collected before the heap is frozen
        assert gc.get_freeze_count() > 0
        frozen = Node()
        frozen_gone = weakref.ref(frozen)
        gc.freeze()  # as if an earlier engine had frozen it ...
        del frozen  # ... and dropped it since
        gc.collect()
        assert frozen_gone() is not None  # out of the collector's sight while frozen
        prepare_process_for_serving(freeze_gc=True)  # a new engine starts
        assert frozen_gone() is None
    finally:
        gc.unfreeze()

"""Adapter memory bounded by bytes: by default no count binds the GPU tier (``max_loras`` is an
optional cap), the pool's rows bound which adapters share a step, exhaustion makes requests wait,
each tier reports its pressure, and a cold adapter holds up no request behind it."""

from __future__ import annotations

import threading

import pytest
from conftest import peft_greedy, step_to_end, tiny_llama

from loramux import LoRARequest, SamplingParams
from loramux.engine.adapters.lifecycle import PREFETCH_PER_STEP
from loramux.engine.adapters.lora_model import LoRAModelManager
from loramux.engine.core.sequence import SequenceStatus
from loramux.engine.layers.layer_slots import LayerSlots
from loramux.engine.layers.weight_pool import CPU_LORA_BYTES, MAX_LORA_SLOTS
from loramux.engine.llm_engine import LLMEngine
from loramux.errors import CacheFullError
from loramux.kernels.pool import POOL_ROW_ALIGN, pool_rows
from loramux.registry import LoRAConfig, Registry
from loramux.registry.cpu_cache import CPUAdapterCache
from loramux.serving.metrics import Metrics

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
PROMPT = [(11 * i) % 120 + 3 for i in range(6)]


def row_bytes(manager: LoRAModelManager) -> int:
    return sum(LayerSlots.row_bytes(layer.in_features, layer.output_sizes, layer.lora_dtype)
               for layer in manager.layers.values())


@pytest.fixture(scope="module")
def many_adapters(make_adapter):
    """24 q/v adapters of rank 8 for `tiny_llama()` (8 pool rows each)."""
    return [make_adapter(f"many{i}", seed=300 + i) for i in range(24)]


def watch_steps(eng: LLMEngine) -> list[set[str]]:
    """The adapters of every scheduled step's batch, as the engine steps."""
    steps, schedule = [], eng.scheduler.schedule

    def watched():
        batch = schedule()
        steps.append({seq.handle.name for seq, _ in batch.chunks if seq.handle is not None})
        return batch

    eng.scheduler.schedule = watched
    return steps


def add_all(eng: LLMEngine, names_paths: list[tuple[str, object]]) -> None:
    """One request per (adapter name, path), every adapter read into host memory first, so the
    first step sees the whole queue."""
    for i, (name, path) in enumerate(names_paths):
        request = LoRARequest(name, i + 1, str(path))
        eng.add_lora(request)
        eng.add_request(f"req{i}", {"prompt_token_ids": PROMPT}, GREEDY, request)


# -- configuration ---------------------------------------------------------------------------------


def test_the_default_config_binds_no_count_and_an_explicit_cap_keeps_its_meaning():
    default = LoRAConfig()
    assert default.max_loras is None and default.max_cpu_loras is None  # bytes alone bound both tiers
    assert CPUAdapterCache(default.max_cpu_loras, default.max_cpu_lora_bytes).max_loras is None
    capped = LoRAConfig(max_loras=4)
    assert capped.max_cpu_loras == 4
    with pytest.raises(ValueError, match="max_cpu_loras: got 2; allowed: an int >= max_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match=r"LoRAConfig.max_loras: got 0; allowed: an int >= 1"):
        LoRAConfig(max_loras=0)


def test_the_default_pool_is_sized_by_bytes_and_its_slots_follow_from_its_rows():
    manager = LoRAModelManager(tiny_llama(), LoRAConfig(max_lora_rank=16))
    row = row_bytes(manager)
    # on CPU: CPU_LORA_BYTES, at most what MAX_LORA_SLOTS adapters of max_lora_rank can use
    budget = min(CPU_LORA_BYTES, MAX_LORA_SLOTS * pool_rows(16) * row)
    assert manager.pool_units == budget // row and manager.capacity_bytes == manager.pool_units * row
    slots = min(manager.pool_units // POOL_ROW_ALIGN, MAX_LORA_SLOTS)
    assert manager.num_slots == slots > 1 and manager.context.num_slots == slots
    assert all(layer.slots.rows.region is None and layer.slots.ranks.shape == (slots,)
               for layer in manager.layers.values())
    # an explicit cap: that many slots, each a fixed region of max_lora_rank rows (as before)
    capped = LoRAModelManager(tiny_llama(), LoRAConfig(max_loras=3, max_lora_rank=16))
    assert capped.num_slots == 3 and capped.pool_units == 3 * pool_rows(16)
    # a byte budget without a cap: rows shared by rank, one slot per smallest adapter's rows
    shared = LoRAModelManager(tiny_llama(), LoRAConfig(max_lora_rank=16, max_gpu_lora_bytes=40 * row))
    assert shared.pool_units == 40 and shared.num_slots == 40 // POOL_ROW_ALIGN


# -- the scheduler batches by memory ----------------------------------------------------------------


def test_with_defaults_24_distinct_adapters_share_a_step_and_equal_peft(many_adapters):
    """No max_loras: 24 distinct adapters run in one batch and in as many steps as 24 requests of
    one adapter (on an idle engine every copy to the GPU tier runs at once, none held back to keep
    a step short: `PREFETCH_PER_STEP` binds only beside a step)."""
    def run(paths) -> tuple[dict, list[set[str]]]:
        eng = LLMEngine(tiny_llama(), max_lora_rank=8, max_num_seqs=24, max_model_len=32)
        add_all(eng, [(path.name, path) for path in paths])
        steps = watch_steps(eng)
        return step_to_end(eng, max_steps=50), steps

    distinct, distinct_steps = run(many_adapters)
    one, one_steps = run([many_adapters[0]] * 24)
    assert len(distinct) == 24 > PREFETCH_PER_STEP and len(distinct_steps) == len(one_steps)
    assert max(len(step) for step in distinct_steps) == 24  # all in one batch: no count bound
    assert len(distinct) == 24 and all(tokens for tokens in one.values())
    for i in range(0, len(many_adapters), 5):  # a spread of them (each oracle run costs a PEFT model)
        assert distinct[f"req{i}"] == peft_greedy(many_adapters[i], PROMPT, GREEDY.max_tokens), i


def test_an_explicit_max_loras_still_caps_the_adapters_of_a_step(many_adapters):
    eng = LLMEngine(tiny_llama(), max_loras=2, max_cpu_loras=6, max_lora_rank=8, max_num_seqs=6,
                    max_model_len=32)
    add_all(eng, [(path.name, path) for path in many_adapters[:6]])
    steps = watch_steps(eng)
    finished = step_to_end(eng, max_steps=200)
    assert len(finished) == 6 and max(len(step) for step in steps) == 2
    assert eng.router_stats().max_lora == 2


def test_a_full_pool_makes_requests_wait_not_fail(many_adapters):
    """Rows for 3 rank-8 adapters (with no cap the slots could hold more): 8 distinct adapters
    take turns, at most 3 in a step, none fails, and each gives what it gives alone."""
    probe = LoRAModelManager(tiny_llama(), LoRAConfig(max_lora_rank=8, max_gpu_lora_bytes=1 << 20))
    eng = LLMEngine(tiny_llama(), max_lora_rank=8, max_gpu_lora_bytes=3 * 8 * row_bytes(probe), max_num_seqs=8,
                    max_model_len=32)
    assert eng.lora_manager.pool_units == 24 and eng.lora_manager.num_slots == 3
    add_all(eng, [(path.name, path) for path in many_adapters[:8]])
    steps = watch_steps(eng)
    finished = step_to_end(eng, max_steps=300)  # a failed request fails step_to_end
    assert len(finished) == 8 and max(len(step) for step in steps) == 3
    assert eng.lora_manager.stats.evictions > 0
    for i in (0, 7):
        assert finished[f"req{i}"] == peft_greedy(many_adapters[i], PROMPT, GREEDY.max_tokens)


def test_an_adapter_that_can_never_fit_beside_the_pinned_ones_fails_naming_the_budget(many_adapters):
    probe = LoRAModelManager(tiny_llama(), LoRAConfig(max_lora_rank=8, max_gpu_lora_bytes=1 << 20))
    eng = LLMEngine(tiny_llama(), max_lora_rank=8, max_gpu_lora_bytes=2 * 8 * row_bytes(probe), max_num_seqs=4,
                    max_model_len=32)
    for i in range(2):  # their rows fill the pool, for good
        eng.add_lora(LoRARequest(f"pinned{i}", i + 1, str(many_adapters[i])))
        eng.pin_lora(f"pinned{i}")
    eng.add_request("never", {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest("other", 3, str(many_adapters[2])))
    eng.add_request("pinned", {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest("pinned0", 1, str(many_adapters[0])))
    outputs = {}
    for _ in range(50):
        if not eng.has_unfinished_requests():
            break
        outputs.update({out.request_id: out for out in eng.step() if out.finished})
    error = outputs["never"].error
    assert isinstance(error, CacheFullError) and "max_gpu_lora_bytes" in str(error) and "'other'" in str(error)
    assert outputs["pinned"].error is None  # the rest carry on
    assert outputs["pinned"].outputs[0].token_ids == peft_greedy(many_adapters[0], PROMPT, GREEDY.max_tokens)


def test_a_host_warm_adapter_runs_at_once_while_a_cold_one_ahead_of_it_still_loads(many_adapters):
    """The cold adapter's request came first; it waits for its read alone. The host-warm one
    behind it is copied beside the next step and admitted the step after."""
    release = threading.Event()

    class SlowRegistry(Registry):
        def _load(self, name, **kwargs):  # the read of a load: the cold adapter's only
            if name == "cold":
                release.wait(10)
            return super()._load(name, **kwargs)

    eng = LLMEngine(tiny_llama(), max_lora_rank=8, max_num_seqs=4, max_model_len=32,
                    registry=SlowRegistry(LoRAConfig(max_lora_rank=8)))
    warm = LoRARequest("warm", 2, str(many_adapters[1]))
    eng.add_lora(warm)  # in host memory
    eng.add_request("cold", {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest("cold", 1, str(many_adapters[0])))
    eng.add_request("warm", {"prompt_token_ids": PROMPT}, GREEDY, warm)
    steps, seen = 0, {}
    while eng._requests["warm"].status is not SequenceStatus.RUNNING:
        eng.step()
        steps += 1
        assert steps <= 2, "the host-warm request waited behind the cold one"
    for _ in range(20):
        seen.update({out.request_id: out for out in eng.step() if out.finished})
        if "warm" in seen:
            break
    assert "warm" in seen and "cold" not in seen and eng._requests["cold"].status is SequenceStatus.LOADING_ADAPTER
    release.set()
    finished = step_to_end(eng, max_steps=100)
    assert seen["warm"].outputs[0].token_ids == peft_greedy(many_adapters[1], PROMPT, GREEDY.max_tokens)
    assert finished["cold"] == peft_greedy(many_adapters[0], PROMPT, GREEDY.max_tokens)


# -- pressure metrics --------------------------------------------------------------------------------


def test_each_tiers_usage_is_reported_beside_the_kv_caches(many_adapters):
    probe = LoRAModelManager(tiny_llama(), LoRAConfig(max_lora_rank=8, max_gpu_lora_bytes=1 << 20))
    eng = LLMEngine(tiny_llama(), max_lora_rank=8, max_gpu_lora_bytes=4 * 8 * row_bytes(probe),
                    max_cpu_lora_bytes=1 << 20, max_num_seqs=4, max_model_len=32)
    assert eng.tier_stats()["gpu"].usage == 0.0 and eng.tier_stats()["cpu"].usage == 0.0
    add_all(eng, [(path.name, path) for path in many_adapters[:3]])
    step_to_end(eng)
    tiers = eng.tier_stats()
    # q/v adapters of rank 8: 8 rows each of the q/k/v pools' 32 (the fullest layers)
    assert tiers["gpu"].usage == 3 * 8 / 32
    assert tiers["cpu"].usage == eng.registry.cache.nbytes / (1 << 20) > 0
    text = Metrics(eng.tier_stats, lambda: 0, lambda: 0, lambda: 0, eng.router_stats).render().decode()
    assert 'loramux_adapter_cache_usage_perc{tier="gpu"} 0.75' in text
    assert f'loramux_adapter_cache_usage_perc{{tier="cpu"}} {tiers["cpu"].usage!r}' in text
    assert 'vllm:kv_cache_usage_perc{model_name=""}' in text


def test_the_cpu_tiers_usage_is_the_fuller_of_its_bytes_and_its_count(make_adapter):
    registry = Registry(LoRAConfig(max_loras=2, max_cpu_lora_bytes=1 << 30), resolvers=[])
    registry.get(LoRARequest("a", 1, str(make_adapter("usage-a"))))
    assert registry.cache.usage == 0.5  # one of two adapters; its bytes are a sliver of 1 GiB

"""One adapter identity in the engine: reload and unload are rebinding, the old handle
retires exactly when its last request ends (an event, no polling), outputs equal PEFT's."""

from __future__ import annotations

import threading

import pytest
from conftest import peft_greedy, tiny_llama

from loramux import LoRARequest, SamplingParams
from loramux.engine.llm_engine import LLMEngine
from loramux.errors import IncompatibleAdapterError, LoRAError
from loramux.registry import LoRAConfig, Registry

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPT = [(3 * i) % 120 + 5 for i in range(11)]


def engine(**kwargs) -> LLMEngine:
    options = dict(max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64)
    options.update(kwargs)
    return LLMEngine(tiny_llama(), **options)


class Recorder:
    """Steps the engine and notes at which step every event and every finish happened."""

    def __init__(self, eng: LLMEngine) -> None:
        self.eng, self.step_no, self.events, self.finished = eng, 0, [], {}
        eng.add_event_listener(lambda event: self.events.append((self.step_no, event)))

    def step(self) -> None:
        self.step_no += 1
        for out in self.eng.step():
            if out.finished:
                assert out.error is None, out.error
                self.finished[out.request_id] = (self.step_no, out.outputs[0].token_ids)

    def until(self, condition, limit: int = 200) -> None:
        for _ in range(limit):
            if condition():
                return
            self.step()
        raise AssertionError("the engine never got there")

    def of_kind(self, kind: str) -> list[tuple[int, object]]:
        return [(n, e) for n, e in self.events if e.kind == kind]


def errors_at_the_end(eng: LLMEngine) -> dict[str, BaseException | None]:
    """Step until every request finished; each one's error (None for a success)."""
    errors = {}
    for _ in range(200):
        errors.update({out.request_id: out.error for out in eng.step() if out.finished})
        if not eng.has_unfinished_requests():
            return errors
    raise AssertionError("the engine never finished its requests")


def test_an_adapters_slot_write_is_worked_out_on_its_loading_thread(make_adapter, monkeypatch):
    """The engine's registry validates a load and works its slot write out on the loading thread
    (`LoRAModelManager.validate_and_prepare`); placing it takes that, and the output is PEFT's."""
    path = make_adapter("prepared", seed=43)
    eng = engine()
    planner = eng.lora_manager.pool._planner
    image, threads = planner.image, []
    monkeypatch.setattr(planner, "image", lambda modules: threads.append(threading.current_thread().name)
                        or image(modules))
    rec = Recorder(eng)
    eng.add_request("a", {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest("prepared", 1, str(path)))
    rec.until(lambda: not eng.has_unfinished_requests())
    assert rec.finished["a"][1] == peft_greedy(path, PROMPT, 10)
    assert len(threads) == 1 and threads[0].startswith("loramux-load"), threads


def test_reload_while_requests_run_old_ones_finish_on_old_weights_new_ones_get_new(make_adapter, monkeypatch):
    old_path, new_path = make_adapter("live-v1", seed=41), make_adapter("live-v2", seed=42)
    eng = engine()
    validated = []
    validate = eng.lora_manager.validate
    monkeypatch.setattr(eng.lora_manager, "validate", lambda a: validated.append(a.name) or validate(a))
    rec = Recorder(eng)
    eng.add_lora(LoRARequest("live", 1, str(old_path)))
    old = eng.lora_handle("live")
    eng.add_request("before", {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest("live", 1))
    rec.until(lambda: eng._requests["before"].output_token_ids)  # running, mid-generation
    eng.add_lora(LoRARequest("live", 2, str(new_path)))  # reload under the same name
    new = eng.lora_handle("live")
    assert new != old and new.digest != old.digest
    assert not rec.of_kind("retired")  # "before" still runs on the old handle
    eng.add_request("after", {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest("live", 2))
    rec.until(lambda: not eng.has_unfinished_requests())
    assert rec.finished["before"][1] == peft_greedy(old_path, PROMPT, 10)
    assert rec.finished["after"][1] == peft_greedy(new_path, PROMPT, 10)
    (retired_at, retired), = rec.of_kind("retired")
    assert retired.handle == old and retired_at == rec.finished["before"][0]  # exactly then
    assert old.id not in eng.registry.cache and eng.lora_manager.slot_of(old.id) is None
    assert eng.lora_manager.slot_of(new.id) is not None  # released, kept resident as a cache
    assert validated == ["live", "live"]  # once per load: at the border, never again on the way to a slot


def test_unload_while_in_use_completes_when_the_last_request_ends(engine_adapters):
    path = engine_adapters["attn"]
    eng = engine()
    rec = Recorder(eng)
    eng.add_lora(LoRARequest("gone", 1, str(path)))
    handle = eng.lora_handle("gone")
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.add_request("short", {"prompt_token_ids": PROMPT[:5]}, short, LoRARequest("gone", 1))
    eng.add_request("long", {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest("gone", 1))
    rec.until(lambda: all(eng._requests[r].output_token_ids for r in ("short", "long")))
    assert eng.remove_lora("gone") is True  # returns at once: no "in use" error, nothing to retry
    assert eng.lora_handle("gone") is None and "gone" not in eng.list_loras()
    assert eng.lora_manager.is_held(handle.id) and handle.id in eng.registry.cache  # still running
    rec.until(lambda: not eng.has_unfinished_requests())
    (retired_at, retired), = rec.of_kind("retired")
    assert retired.handle == handle and retired_at == rec.finished["long"][0] > rec.finished["short"][0]
    assert rec.finished["long"][1] == peft_greedy(path, PROMPT, 10)
    assert eng.lora_manager.resident() == [] and handle.id not in eng.registry.cache
    assert not eng.adapters and eng.registry.cache.num_pinned() == 0
    ready = [e for _, e in rec.of_kind("ready")]
    assert {r for e in ready for r in e.request_ids} == {"short", "long"} and all(e.handle == handle for e in ready)


def test_unloading_an_unused_adapter_retires_it_at_once_and_remove_by_id(engine_adapters):
    eng = engine()
    rec = Recorder(eng)
    eng.add_lora(LoRARequest("idle", 7, str(engine_adapters["mlp"])))
    assert eng.pin_lora(7)  # a user pin is a reference the engine holds...
    handle = eng.lora_handle("idle")
    assert eng.lora_manager.is_held(handle.id) and eng.adapters.references(handle.id) == 1
    assert eng.remove_lora(7) is True  # ...and goes with the name
    assert [e.handle for _, e in rec.of_kind("retired")] == [handle]
    assert eng.lora_manager.resident() == [] and eng.registry.cache.num_pinned() == 0
    assert eng.remove_lora("idle") is False and eng.remove_lora(7) is False


def test_a_pin_moves_to_the_reloaded_weights(make_adapter):
    eng = engine()
    eng.add_lora(LoRARequest("pinned", 1, str(make_adapter("pin-v1", seed=51))))
    eng.pin_lora("pinned")
    old = eng.lora_handle("pinned")
    eng.add_lora(LoRARequest("pinned", 1, str(make_adapter("pin-v2", seed=52))))
    new = eng.lora_handle("pinned")
    assert eng.adapters.pinned() == {new.id} and eng.lora_manager.resident_handles() == [new]
    assert old.id not in eng.registry.cache


@pytest.mark.parametrize("max_cpu_loras", [2, 3])
def test_queued_requests_wait_for_room_in_a_cpu_tier_full_of_adapters_in_use(engine_adapters, max_cpu_loras):
    """Three adapters queued at once over a CPU tier of two: the third waits (not fails) until
    the references of the first ones end, and every output equals PEFT's."""
    eng = engine(max_loras=2, max_cpu_loras=max_cpu_loras, max_num_seqs=2)
    names = ["attn", "all", "mlp"]
    for i, name in enumerate(names):
        eng.add_request(name, {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest(name, i + 1, str(engine_adapters[name])))
    rec = Recorder(eng)
    rec.until(lambda: not eng.has_unfinished_requests())
    for name in names:
        assert rec.finished[name][1] == peft_greedy(engine_adapters[name], PROMPT, 10), name
    assert eng.registry.cache.num_pinned() == 0 and not eng.adapters
    assert eng.registry.cache.stats.load_failures == 0  # a load that waited for room did not fail


def test_a_load_that_finds_the_tier_pinned_by_loads_not_collected_yet_waits(engine_adapters, monkeypatch):
    """Two loads have pinned the whole CPU tier but not handed their adapters to the step loop yet
    (their threads still run) when a third finds no room: it waits for them, it does not fail."""
    import time

    eng = engine(max_loras=2, max_cpu_loras=2, max_num_seqs=2)
    read, release = eng.registry._load, threading.Event()

    def read_then_hold(name, **kwargs):  # inserted and pinned, then the thread lingers
        adapter = read(name, **kwargs)
        if name != "mlp":
            release.wait(5)
        return adapter

    monkeypatch.setattr(eng.registry, "_load", read_then_hold)
    names = ["attn", "all", "mlp"]
    for i, name in enumerate(names[:2]):
        eng.add_request(name, {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest(name, i + 1, str(engine_adapters[name])))
    for _ in range(500):  # both loads have pinned their adapter in the tier
        if eng.registry.cache.num_pinned() == 2:
            break
        time.sleep(0.01)
    eng.add_request("mlp", {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest("mlp", 3, str(engine_adapters["mlp"])))
    rec = Recorder(eng)
    for _ in range(5):  # the third load found the tier busy; the first two are not collected yet
        rec.step()
    release.set()
    rec.until(lambda: not eng.has_unfinished_requests())
    for name in names:
        assert rec.finished[name][1] == peft_greedy(engine_adapters[name], PROMPT, 10), name
    assert not rec.of_kind("failed") and eng.registry.cache.stats.load_failures == 0


def test_requests_for_an_adapter_in_the_cpu_tier_settle_in_the_submitting_thread(engine_adapters, monkeypatch):
    """Only a request whose adapter is not in memory starts a loading thread: once "attn" is in
    the CPU tier, a burst for it settles each load in add_request's thread (its "ready" event
    too), reads nothing, and every output equals PEFT's; no CPU-tier pin is left behind."""
    import threading

    eng = engine()
    reads, ready_threads = [], []
    read = eng.registry._load
    monkeypatch.setattr(eng.registry, "_load", lambda name, **kw: reads.append(threading.current_thread().name)
                        or read(name, **kw))
    eng.add_event_listener(lambda e: e.kind == "ready" and ready_threads.append(threading.current_thread().name))
    request = LoRARequest("attn", 1, str(engine_adapters["attn"]))
    rec = Recorder(eng)
    eng.add_request("first", {"prompt_token_ids": PROMPT}, GREEDY, request)
    rec.until(lambda: not eng.has_unfinished_requests())
    assert reads == ["loramux-load-1"]  # a loading thread read it
    # and said so, unless it ended before add_request's thread asked to hear of it: then that thread
    assert len(ready_threads) == 1 and ready_threads[0] in ("loramux-load-1", "MainThread")
    for i in range(3):
        eng.add_request(f"again{i}", {"prompt_token_ids": PROMPT}, GREEDY, request)
    assert ready_threads[1:] == [threading.current_thread().name] * 3  # settled before add_request returned
    rec.until(lambda: not eng.has_unfinished_requests())
    assert reads == ["loramux-load-1"]  # no second read, no loading thread
    expected = peft_greedy(engine_adapters["attn"], PROMPT, 10)
    assert all(rec.finished[f"again{i}"][1] == expected for i in range(3)) and rec.finished["first"][1] == expected
    assert eng.registry.cache.num_pinned() == 0 and not eng.adapters


def test_a_request_naming_another_path_for_a_resident_name_is_refused_and_the_resident_one_still_serves(make_adapter):
    """The in-memory shortcut answers only for the path the name is registered with: a request
    naming another path goes the reading way and gets its clear error; the resident adapter
    keeps serving, and nothing stays pinned."""
    v1, v2 = make_adapter("moved-v1", seed=43), make_adapter("moved-v2", seed=44)
    eng = engine()
    rec = Recorder(eng)
    eng.add_request("v1", {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest("moved", 1, str(v1)))
    rec.until(lambda: not eng.has_unfinished_requests())
    eng.add_request("v2", {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest("moved", 1, str(v2)))
    eng.add_request("v1-again", {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest("moved", 1, str(v1)))
    errors = errors_at_the_end(eng)
    assert isinstance(errors["v2"], IncompatibleAdapterError) and "already registered" in str(errors["v2"])
    assert errors["v1-again"] is None
    assert rec.finished["v1"][1] == peft_greedy(v1, PROMPT, 10)
    assert eng.registry.cache.num_pinned() == 0


def test_a_check_that_fails_in_the_submitting_thread_fails_only_its_request(engine_adapters, monkeypatch):
    """An engine over a registry it did not build checks every adapter it is handed, the
    in-memory ones too: a failing check there fails that request (a LoRAError naming the
    adapter), unpins the adapter, and a base request beside it completes."""
    eng = engine(registry=Registry(LoRAConfig(max_loras=2, max_lora_rank=8)))
    request = LoRARequest("attn", 1, str(engine_adapters["attn"]))
    rec = Recorder(eng)
    eng.add_request("first", {"prompt_token_ids": PROMPT}, GREEDY, request)
    rec.until(lambda: not eng.has_unfinished_requests())

    def refuse(adapter):
        raise RuntimeError("the slots changed shape")

    monkeypatch.setattr(eng.lora_manager, "validate", refuse)
    eng.add_request("refused", {"prompt_token_ids": PROMPT}, GREEDY, request)
    eng.add_request("base", {"prompt_token_ids": PROMPT}, GREEDY)
    errors = errors_at_the_end(eng)
    assert isinstance(errors["refused"], LoRAError) and "slots changed shape" in str(errors["refused"])
    assert "'attn'" in str(errors["refused"]) and errors["base"] is None
    assert eng.registry.cache.num_pinned() == 0

"""Adapters contending for small tiers wait for room instead of failing.

A tier full of adapters that running requests hold has room again once they finish, so a request
(or a runtime load) that finds no room waits its turn, bounded by its own timeout; only an adapter
that can never fit fails. Driven as vLLM's own test of this does
(`tests/entrypoints/openai/test_lora_adapters.py::test_multiple_lora_adapters`): ten adapters loaded
at once through `/v1/load_lora_adapter` on tiers of two, then three two-prompt completions each,
all concurrent; and the same through `LLM.generate`.
"""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai", reason="the serve extras are not installed: pip install -e .[serve,test]")

from conftest import char_tokenizer, save_peft_adapter, tiny_llama  # noqa: E402
from test_server import Server  # noqa: E402

NUM_ADAPTERS = 10


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("contention")
    model = tiny_llama()
    model.config.bos_token_id, model.config.eos_token_id = 1, 2
    model.save_pretrained(root / "model")
    char_tokenizer().save_pretrained(root / "model")
    adapters = {f"adapter-{i}": save_peft_adapter(model, root / f"adapter-{i}", seed=i) for i in range(NUM_ADAPTERS)}
    return dict(root=root, model=root / "model", adapters=adapters, site=root, release=root / "unused")


@pytest.fixture(scope="module")
def server(workspace):
    server = Server("contention", ["--max-loras", "2", "--max-cpu-loras", "2", "--max-lora-rank", "16",
                                   "--allow-runtime-lora-updating"], workspace)
    try:
        server.wait_until_listening()
        yield server
    finally:
        server.stop()


def test_ten_adapters_loaded_and_used_at_once_on_tiers_of_two_all_succeed(server, workspace):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def load_and_run(name: str) -> list[str]:
        await client.post("load_lora_adapter", cast_to=str,
                          body={"lora_name": name, "lora_path": str(workspace["adapters"]["adapter-0"])})
        texts = []
        for _ in range(3):
            completion = await client.completions.create(model=name, prompt=["Hello there", "Foo bar bazz buzz"],
                                                         max_tokens=5, temperature=0)
            texts += [choice.text for choice in completion.choices]
        return texts

    async def main():
        return await asyncio.gather(*(load_and_run(name) for name in workspace["adapters"]), return_exceptions=True)

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of {NUM_ADAPTERS} adapters failed: {errors[:3]}\n{server.log[-3000:]}"
    assert all(len(texts) == 6 for texts in results)


def test_ten_adapters_over_tiers_of_two_through_llm_generate_all_finish(make_adapter):
    from loramux import LLM, LoRARequest, SamplingParams

    model = tiny_llama()
    paths = [make_adapter(f"gen-{i}", model=model, seed=i) for i in range(NUM_ADAPTERS)]
    llm = LLM(tiny_llama(), max_loras=2, max_cpu_loras=2, max_lora_rank=8, max_num_seqs=8, max_model_len=64)
    requests = [LoRARequest(f"gen-{i}", i + 1, str(path)) for i, path in enumerate(paths) for _ in range(3)]
    outputs = llm.generate([{"prompt_token_ids": [3, 4, 5, 6]}] * len(requests),
                           SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), requests, use_tqdm=False)
    assert [o.error for o in outputs] == [None] * len(requests)
    assert all(len(o.outputs[0].token_ids) == 5 for o in outputs)


def _busy_engine(make_adapter, ready: int = 2, **tiers):
    """An engine whose CPU tier is held by two queued requests' adapters (or as many as fit: the
    ``ready`` loads that succeed). The first step waits for those loads, so both requests are
    queued before either runs: one must not finish (and release its adapter) before the other's
    load ends."""
    import threading

    from loramux import LoRARequest, SamplingParams
    from loramux.engine.llm_engine import LLMEngine

    model = tiny_llama()
    paths = [make_adapter(f"busy-{i}", model=model, seed=i) for i in range(3)]
    engine = LLMEngine(tiny_llama(), max_loras=2, max_cpu_loras=2, max_lora_rank=16, max_num_seqs=4,
                       max_model_len=64, **tiers)
    loaded = threading.Semaphore(0)
    listener = lambda event: event.kind == "ready" and loaded.release()  # noqa: E731
    engine.add_event_listener(listener)
    for i in range(2):
        engine.add_request(f"r{i}", {"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=3, ignore_eos=True),
                           LoRARequest(f"busy-{i}", i + 1, str(paths[i])))
    for _ in range(ready):
        assert loaded.acquire(timeout=30)
    engine.remove_event_listener(listener)
    engine.step()
    while len(engine.adapters.loader):  # their loads end and pin the tier
        engine.step()
    return engine, LoRARequest("busy-2", 3, str(paths[2]))


def test_a_runtime_load_waits_for_room_that_running_requests_release(make_adapter):
    import threading

    from loramux.errors import CacheBusyError

    engine, third = _busy_engine(make_adapter)
    assert engine.registry.cache.num_pinned() == 2
    with pytest.raises(CacheBusyError, match="full of adapters in use"):
        engine.add_lora(third)  # no wait asked: the tier is busy now
    assert engine.lora_handle("busy-2") is None  # nothing bound, nothing lost
    done = threading.Event()
    result = {}

    def load():
        try:
            result["ok"] = engine.add_lora(third, wait_s=30)
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            result["error"] = error
        done.set()

    threading.Thread(target=load).start()
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    assert done.wait(30), "the runtime load never got room"
    assert result == {"ok": True}
    assert engine.lora_handle("busy-2") is not None
    assert all(outputs[f"r{i}"].error is None and len(outputs[f"r{i}"].outputs[0].token_ids) == 3 for i in range(2))


def test_a_runtime_load_waits_for_room_that_other_runtime_loads_release(make_adapter, monkeypatch):
    """Two loads hold the whole CPU tier (each its adapter's pin, until it ends) and no request
    holds it: a third load with a wait waits for them, not fails at once (a server's concurrent
    load_lora_adapter calls got 503 so); with no wait it fails at once, as two loads that only
    wait for each other do, and nothing of theirs is bound."""
    import threading
    import time

    from loramux import LoRARequest
    from loramux.engine.llm_engine import LLMEngine
    from loramux.errors import CacheBusyError

    model = tiny_llama()
    paths = [make_adapter(f"add-{i}", model=model, seed=i) for i in range(5)]
    requests = [LoRARequest(f"add-{i}", i + 1, str(path)) for i, path in enumerate(paths)]
    engine = LLMEngine(tiny_llama(), max_loras=2, max_cpu_loras=2, max_lora_rank=16, max_num_seqs=4, max_model_len=64)
    holding, finish = threading.Semaphore(0), threading.Event()
    rebind = engine.registry.rebind

    def rebind_and_hold(request, **kwargs):  # the first two loads keep their pin until told
        adapter = rebind(request, **kwargs)
        if request.lora_name in ("add-0", "add-1"):
            holding.release()
            assert finish.wait(30)
        return adapter

    monkeypatch.setattr(engine.registry, "rebind", rebind_and_hold)
    holders = [threading.Thread(target=engine.add_lora, args=(request,)) for request in requests[:2]]
    for thread in holders:
        thread.start()
    for _ in holders:
        assert holding.acquire(timeout=30)
    assert engine.registry.cache.num_pinned() == 2
    with pytest.raises(CacheBusyError, match="full of adapters in use"):
        engine.add_lora(requests[2])  # no wait asked
    threading.Timer(0.3, finish.set).start()
    started = time.monotonic()
    assert engine.add_lora(requests[3], wait_s=30)  # waits for the two to end
    assert 0.25 < time.monotonic() - started < 20
    for thread in holders:
        thread.join(30)
    assert [engine.lora_handle(r.lora_name) is not None for r in requests] == [True, True, False, True, False]

    # two loads that wait only for each other (the tier held by user pins): both fail, soon
    assert engine.pin_lora("add-0") and engine.pin_lora("add-3")
    errors, started = [], time.monotonic()

    def load(request):
        try:
            engine.add_lora(request, wait_s=30)
        except CacheBusyError as error:
            errors.append(error)

    waiters = [threading.Thread(target=load, args=(request,)) for request in (requests[2], requests[4])]
    for thread in waiters:
        thread.start()
    for thread in waiters:
        thread.join(30)
    assert len(errors) == 2 and time.monotonic() - started < 10
    assert engine.lora_handle("add-2") is None and engine.lora_handle("add-4") is None


def test_an_adapter_larger_than_the_whole_tier_fails_at_once_however_long_the_load_may_wait(make_adapter):
    import time

    from loramux import LoRARequest
    from loramux.errors import CacheBusyError, CacheFullError

    engine, _ = _busy_engine(make_adapter, ready=1, max_cpu_lora_bytes=10_000)  # one 7 KB rank-8 adapter fits
    big = make_adapter("too-big", model=tiny_llama(), r=16)  # 14 KB
    started = time.monotonic()
    with pytest.raises(CacheFullError) as raised:
        engine.add_lora(LoRARequest("too-big", 9, str(big)), wait_s=30)
    assert not isinstance(raised.value, CacheBusyError)
    assert time.monotonic() - started < 5
    assert engine.lora_handle("too-big") is None

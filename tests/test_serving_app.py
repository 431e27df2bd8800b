"""The HTTP layer in-process, against a small fake engine that keeps the `LLMEngine` contract.

These pin down what does not depend on the model: the OpenAI wire format, error bodies, auth,
the engine thread bridge (aborts, a dead engine), metrics. tests/test_server.py drives the real
server process with the real engine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

uvicorn = pytest.importorskip("uvicorn", reason="the serve extras are not installed: pip install -e .[serve,test]")
pytest.importorskip("fastapi", reason="the serve extras are not installed: pip install -e .[serve,test]")
import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from loramux.engine.core.events import AdapterEvent
from loramux.engine.core.outputs import CompletionOutput, RequestOutput
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.core.stats import RouterStats
from loramux.errors import AdapterNotFoundError, InvalidAdapterError
from loramux.serving import ServerConfig, build_app
from loramux.serving.async_engine import ADD_TURN, AsyncEngine, SubRequest


class FakeTokenizer:
    chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"

    def apply_chat_template(self, messages, *, chat_template, add_generation_prompt, tokenize, **variables):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)

    def __call__(self, text, add_special_tokens=True):
        if isinstance(text, list):
            return SimpleNamespace(input_ids=[[ord(c) for c in item] for item in text])
        return SimpleNamespace(input_ids=[ord(c) for c in text])


class FakeEngine:
    """Echoes ``<adapter>|<prompt>`` one character per step; adapters in ``known`` exist (found by
    a resolver "fake-hub" on demand). Keeps the engine's adapter contract: names bound to handles,
    reload and unload rebind, a handle retires (an event) when its last request ends."""

    max_model_len = 1 << 20
    vocab_size = 0x110000  # every character's code point is a token id
    lora_enabled = True
    max_loading_workers = 4

    def __init__(self, known=("fake-a", "fake-b")):
        self.tokenizer = FakeTokenizer()
        self.known = set(known)
        self.loaded: dict[str, str] = {}
        self.handles: dict[str, SimpleNamespace] = {}  # name -> the handle it is bound to
        self.unbound: dict[int, SimpleNamespace] = {}  # handles that lost their name, still in use
        self.retired: list[int] = []
        self.remove_calls = 0
        self.listeners = []
        self._ids = itertools.count(1)
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()
        self.hang = threading.Event()  # set: step() returns nothing (an adapter "loading")
        self.explode = False

    def _mark(self):
        self.thread_ids.add(threading.get_ident())

    def add_request(self, request_id, prompt, params, lora_request=None, api_request_id=None):
        self._mark()
        if isinstance(prompt, dict):
            prompt_ids = prompt["prompt_token_ids"]
            prompt = "".join(chr(i) for i in prompt_ids)
        else:
            prompt_ids = [ord(c) for c in prompt]
        name = lora_request.lora_name if lora_request else None
        target = "x" * 10**6 if prompt == "forever" else f"{name or 'base'}|{prompt}"
        if name in self.known and name not in self.handles:  # found on demand
            self.handles[name] = SimpleNamespace(id=next(self._ids), name=name, source="fake-hub")
        self.requests[request_id] = dict(prompt=prompt, ids=prompt_ids, params=params, name=name,
                                         target=target, sent=0, handle=self.handles.get(name))

    def has_unfinished_requests(self):
        return bool(self.requests)

    def get_num_unfinished_requests(self):
        return len(self.requests)

    def compile_structured_output(self, spec):
        pass

    def tier_stats(self):
        return {}

    def router_stats(self):
        names = [r["name"] for r in list(self.requests.values()) if r["name"] is not None]
        return RouterStats(0, len(self.requests), [], sorted(set(names)), 2, None)

    def has_scheduled_work(self):
        return bool(self.requests) and not self.hang.is_set()

    def abort_request(self, request_id):
        self._mark()
        r = self.requests.pop(request_id, None)
        if r is not None:
            self.aborted.append(request_id)
            self._ended(r)

    def step(self):
        self._mark()
        if self.explode:
            raise RuntimeError("boom")
        hang = self.hang.is_set()  # requests make no progress; failures still come out
        if hang:
            time.sleep(0.001)
        outputs = []
        for request_id, r in list(self.requests.items()):
            name = r["name"]
            error = None
            if name is not None and r["handle"] is None:
                error = AdapterNotFoundError("no resolver has it.", adapter=name, fix="Check the name.")
            if name == "broken":
                error = InvalidAdapterError("adapter_config.json is not JSON.", adapter=name)
            if error is not None:
                del self.requests[request_id]
                self._emit(AdapterEvent("failed", name, (request_id,), error=error, seconds=0.01))
                outputs.append(RequestOutput(request_id, r["prompt"], r["ids"],
                                             [CompletionOutput(0, "", [], "error")], True, error))
                continue
            if hang:
                continue
            if name is not None and r["sent"] == 0:
                self._emit(AdapterEvent("ready", name, (request_id,), handle=r["handle"], seconds=0.25))
            r["sent"] += 1
            text = r["target"][: r["sent"]]
            reason = None
            if r["sent"] >= r["params"].max_tokens:
                reason = "length"
            elif r["sent"] >= len(r["target"]):
                reason = "stop"
            for stop in r["params"].stop_strings:
                if stop in text:
                    text, reason = text[: text.index(stop)], "stop"
            if reason:
                del self.requests[request_id]
                self._ended(r)
            outputs.append(RequestOutput(request_id, r["prompt"], r["ids"],
                                         [CompletionOutput(0, text, list(range(r["sent"])), reason)],
                                         reason is not None))
        return outputs

    def add_lora(self, lora_request, *, wait_s=0.0):
        name = lora_request.lora_name
        if "invalid" in lora_request.lora_path:
            raise InvalidAdapterError("adapter_config.json is missing.", adapter=name, path=lora_request.lora_path)
        old = self.handles.get(name)
        self.handles[name] = SimpleNamespace(id=next(self._ids), name=name, source="path")
        self.loaded[name] = lora_request.lora_path
        if old is not None:
            self._unbind(old)
        return True

    def remove_lora(self, name_or_id):
        """Unbind and return at once; never raises "in use"."""
        self.remove_calls += 1
        self.loaded.pop(name_or_id, None)
        old = self.handles.pop(name_or_id, None)
        if old is not None:
            self._unbind(old)
        return old is not None

    def lora_handle(self, name):
        return self.handles.get(name)

    def list_loras(self):
        return sorted(self.handles)  # registered, and found on demand

    def add_event_listener(self, listener):
        self.listeners.append(listener)

    def remove_event_listener(self, listener):
        self.listeners.remove(listener)

    def _emit(self, event):
        for listener in list(self.listeners):
            listener(event)

    def _in_use(self, handle):
        return any(r["handle"] is handle for r in list(self.requests.values()))

    def _unbind(self, handle):
        if self._in_use(handle):
            self.unbound[handle.id] = handle
        else:
            self._retire(handle)

    def _ended(self, request):
        handle = request["handle"]
        if handle is not None and handle.id in self.unbound and not self._in_use(handle):
            self._retire(self.unbound.pop(handle.id))

    def _retire(self, handle):
        self.retired.append(handle.id)
        self._emit(AdapterEvent("retired", handle.name, handle=handle))


def make_client(engine=None, **config):
    engine = engine or FakeEngine()
    config.setdefault("served_model_names", ["fake-base"])
    app = build_app(engine, ServerConfig(**config), sampling_params_cls=SamplingParams)
    return engine, TestClient(app)


@pytest.fixture
def fake():
    engine, client = make_client(allow_runtime_lora_updating=True, lora_modules=[("static-a", "/p/a", None)])
    with client:
        yield engine, client


def complete(client, model="fake-base", **body):
    body = {"model": model, "prompt": "hi", "max_tokens": 50, "temperature": 0, **body}
    return client.post("/v1/completions", json=body)


def test_completion_with_base_and_adapter(fake):
    engine, client = fake
    for model in ("fake-base", "fake-a", "static-a"):
        response = complete(client, model)
        assert response.status_code == 200, response.text
        body = response.json()
        expected = "base" if model == "fake-base" else model
        assert body["choices"][0]["text"] == f"{expected}|hi"
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["model"] == model and body["object"] == "text_completion"
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": len(f"{expected}|hi"),
                                 "total_tokens": 2 + len(f"{expected}|hi")}
    assert engine.thread_ids and threading.get_ident() not in engine.thread_ids


def test_n_and_prompt_lists_make_one_choice_each(fake):
    _, client = fake
    body = complete(client, prompt=["ab", "cd"], n=2, max_tokens=3).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["bas"] * 4
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 4
    assert body["usage"]["prompt_tokens"] == 4  # each prompt once, not once per choice


def test_chat_renders_the_template(fake):
    _, client = fake
    response = client.post("/v1/chat/completions", json={
        "model": "fake-a", "messages": [{"role": "user", "content": [{"type": "text", "text": "yo"}]}]})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "fake-a|user: yo\n"}


def _events(response):
    events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streaming_sends_deltas_and_usage(fake):
    _, client = fake
    body = {"model": "fake-b", "prompt": "xy", "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == "fake-b|xy"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(text)

    body = {"model": "fake-base", "messages": [{"role": "user", "content": "q"}], "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        events = _events(response)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "base|user: q\n"
    assert events[0]["object"] == "chat.completion.chunk"


def test_stop_strings_reach_the_engine(fake):
    _, client = fake
    assert complete(client, stop=["|"]).json()["choices"][0]["text"] == "base"


def test_streaming_never_sends_the_start_of_a_stop_string(fake):
    _, client = fake  # the fake's text grows to "base|" before "base|h" is cut back to "base"
    body = {"model": "fake-base", "prompt": "hi", "max_tokens": 50, "stream": True, "stop": ["|h"]}
    with client.stream("POST", "/v1/completions", json=body) as response:
        events = _events(response)
    assert "".join(e["choices"][0]["text"] for e in events) == "base"


def test_unknown_adapter_is_404_with_openai_body_even_when_streaming(fake):
    _, client = fake
    for stream in (False, True):
        response = complete(client, "nobody", stream=stream)
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["param"] == "model" and error["code"] == "model_not_found"
        assert "nobody" in error["message"] and error["type"]
    assert "nobody" not in [m["id"] for m in client.get("/v1/models").json()["data"]]


def test_invalid_adapter_and_names(fake):
    _, client = fake
    response = complete(client, "broken")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_adapter"
    response = complete(client, "../etc")
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


@pytest.mark.parametrize("body, param", [
    ({"model": "fake-base", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "fake-base", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "fake-base"}, "prompt"),
    ({"prompt": "x"}, "model"),
    ({"model": "fake-base", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "fake-base", "prompt": "x", "presence_penalty": 3.0}, "presence_penalty"),
    ({"model": "fake-base", "prompt": "x", "logprobs": 6}, "logprobs"),
    ({"model": "fake-base", "prompt": "x", "min_p": 2}, "min_p"),
])
def test_bad_parameters_are_400_naming_the_field(fake, body, param):
    _, client = fake
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_malformed_json_and_unknown_routes(fake):
    _, client = fake
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and "error" in response.json()
    response = client.post("/v1/chat/completions", json={"model": "fake-base", "messages": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_models_list_base_and_adapters_with_parent(fake):
    _, client = fake
    complete(client, "fake-a")  # found on demand: listed from now on
    cards = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert set(cards) == {"fake-base", "static-a", "fake-a"}
    assert cards["static-a"]["parent"] == "fake-base" and cards["static-a"]["root"] == "/p/a"
    assert cards["fake-a"]["parent"] == "fake-base"
    assert cards["fake-base"]["parent"] is None
    assert client.get("/v1/models/static-a").json()["id"] == "static-a"
    assert client.get("/v1/models/nope").status_code == 404


def test_load_unload_and_inplace(fake):
    engine, client = fake
    response = client.post("/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": "/p/new"})
    assert response.status_code == 200, response.text
    assert engine.loaded["new"] == "/p/new"
    assert complete(client, "new").json()["choices"][0]["text"] == "new|hi"
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": "/p/new2"})
    assert again.status_code == 400 and again.json()["error"]["code"] == "adapter_exists"
    old = engine.handles["new"]
    inplace = client.post("/v1/load_lora_adapter",
                          json={"lora_name": "new", "lora_path": "/p/new2", "load_inplace": True})
    assert inplace.status_code == 200, inplace.text
    # the name is rebound to new weights (a new handle); the old handle, unused, retired at once
    assert engine.loaded == {"static-a": "/p/a", "new": "/p/new2"} and engine.handles["new"] is not old
    assert engine.retired == [old.id]
    assert complete(client, "new").json()["choices"][0]["text"] == "new|hi"
    bad = client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/p/invalid"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert "bad" not in [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "new"}).status_code == 200
    assert "new" not in engine.loaded and engine.remove_calls == 1
    assert complete(client, "new").status_code == 404
    missing = client.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name"


def test_unloading_an_adapter_in_use_retires_it_when_its_last_request_ends(fake, caplog):
    """No polling: the unload answers at once with one remove_lora call, and the server hears of
    the retirement from the engine's event, exactly when the last request ends."""
    engine, client = fake
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "busy", "lora_path": "/p/b"}).status_code == 200
    handle = engine.handles["busy"]
    engine.hang.set()  # requests stay running
    running = ThreadPoolExecutor(1).submit(complete, client, "busy")
    assert wait_for(lambda: any(r["name"] == "busy" for r in list(engine.requests.values())))
    state = client.app.state.loramux
    with caplog.at_level("INFO", logger="loramux.serving"):
        try:
            assert client.post("/v1/unload_lora_adapter", json={"lora_name": "busy"}).status_code == 200
            assert complete(client, "busy").status_code == 404  # gone for new requests at once...
            time.sleep(0.05)
            assert engine.retired == [] and len(state.background) == 1  # ...the running one keeps it
        finally:
            engine.hang.clear()
        assert running.result(timeout=10).json()["choices"][0]["text"] == "busy|hi"
        assert wait_for(lambda: not state.background)  # the awaited event came
    assert engine.retired == [handle.id] and engine.remove_calls == 1
    assert f"handle {handle.id}) left the engine" in caplog.text


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_runtime_updating_is_off_by_default():
    _, client = make_client()
    with client:
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            response = client.post(route, json={"lora_name": "x", "lora_path": "/p"})
            assert response.status_code == 403
            assert "--allow-runtime-lora-updating" in response.json()["error"]["message"]


def test_api_key_guards_v1_only():
    _, client = make_client(api_key="sesame")
    with client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            response = client.get("/v1/models", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200


def test_a_client_that_disconnects_mid_stream_aborts_its_request():
    engine = FakeEngine()
    app = build_app(engine, ServerConfig(["fake-base"]), sampling_params_cls=SamplingParams)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: server.started)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        body = {"model": "fake-base", "prompt": "forever", "max_tokens": 10**6, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
            lines = response.iter_lines()  # kept: a collected iterator would close the connection
            assert next(line for line in lines if line.startswith("data:"))
            time.sleep(0.1)
            assert not engine.aborted and engine.requests
        # the fake never finishes this request on its own: only an abort ends it
        assert wait_for(lambda: len(engine.aborted) == 1 and not engine.requests)
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_intake_adds_the_requests_of_several_http_requests_in_turns():
    """A request of many prompts delays another's start by one turn of adds, not by all of its own;
    one released while it is being added gets no more of its requests added, and those added are
    aborted."""
    engine = FakeEngine()
    added: list[str] = []
    add = engine.add_request

    def slow_add(request_id, *args, **kwargs):
        time.sleep(0.002)
        added.append(request_id)
        add(request_id, *args, **kwargs)

    engine.add_request = slow_add
    params = SamplingParams(max_tokens=1)

    async def scenario():
        bridge = AsyncEngine(engine)
        bridge.start()
        try:
            big = bridge.submit([SubRequest(f"big-{i}", "x", params, api_request_id="big") for i in range(200)])
            small = bridge.submit([SubRequest("small-0", "y", params, api_request_id="small")])
            while not small.finished:
                await small.changes()
            assert added.index("small-0") <= ADD_TURN  # at most one turn of the big one before it
            bridge.release(big)  # its client went away while it was being added
            count = len(added)
            await asyncio.sleep(0.3)
            assert len(added) <= count + ADD_TURN and len(added) < 201
            assert wait_for(lambda: not engine.requests)  # those added were aborted or finished
        finally:
            bridge.stop()

    asyncio.run(scenario())


def test_an_adapter_name_with_lora_off_is_404_and_remembers_nothing():
    engine, client = make_client()
    engine.lora_enabled = False  # an engine built with enable_lora=False
    with client:
        response = complete(client, model="fake-a")
        assert response.status_code == 404, response.text
        assert (response.json()["error"]["code"], response.json()["error"]["param"]) == ("model_not_found", "model")
        assert "--no-enable-lora" in response.json()["error"]["message"]
        assert not engine.requests and [m["id"] for m in client.get("/v1/models").json()["data"]] == ["fake-base"]
        assert complete(client).status_code == 200


def test_a_text_prompt_to_a_model_without_a_tokenizer_is_a_400_and_token_ids_still_work():
    engine = FakeEngine()
    engine.tokenizer = None
    engine, client = make_client(engine)
    with client:
        for add_special_tokens in (True, False):
            response = complete(client, add_special_tokens=add_special_tokens)
            assert response.status_code == 400, response.text
            assert (response.json()["error"]["code"], response.json()["error"]["param"]) == ("no_tokenizer", "prompt")
        assert not engine.requests
        response = complete(client, prompt=[104, 105])
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "base|hi"


def test_dead_engine_fails_requests_and_health():
    engine, client = make_client()
    engine.explode = True
    with client:
        response = complete(client)
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
        assert client.get("/health").status_code == 503
        assert complete(client).status_code == 503


def test_metrics_count_requests_tokens_and_resolutions(fake):
    _, client = fake
    complete(client, "fake-a")
    complete(client, "nobody-1")
    complete(client, "nobody-2")
    text = client.get("/metrics").text
    assert 'loramux_requests_total{endpoint="completions",model="fake-a",status="ok"} 1.0' in text
    assert 'loramux_requests_total{endpoint="completions",model="_unknown",status="error"} 2.0' in text
    assert 'loramux_generation_tokens_total{model="fake-a"} 9.0' in text
    assert 'loramux_adapter_resolutions_total{outcome="found"} 1.0' in text
    assert 'loramux_adapter_resolutions_total{outcome="not_found"} 2.0' in text
    assert "loramux_queue_depth 0.0" in text
    # resolve + load as the engine's "ready" event measured it, under the resolver that found it
    assert 'loramux_adapter_load_seconds_count{kind="on_demand",source="fake-hub"} 1.0' in text
    assert 'loramux_adapter_load_seconds_sum{kind="on_demand",source="fake-hub"} 0.25' in text


def test_a_failed_resolution_answers_before_any_other_requests_token():
    """The real engine, its step stuck in another request's forward: a request for an adapter no
    resolver has still gets its 404, from the engine's "failed" event (sent by the loading
    thread), not from a step."""
    from conftest import tiny_llama

    from loramux.engine.llm_engine import LLMEngine
    from loramux.registry import LoRAConfig, Registry

    engine = LLMEngine(tiny_llama(), max_loras=1, max_lora_rank=8, max_num_seqs=2, max_model_len=64,
                       registry=Registry(LoRAConfig(max_loras=1, max_lora_rank=8), resolvers=[]))
    in_forward, release, resumed = threading.Event(), threading.Event(), threading.Event()
    run = engine.runner.execute_model

    def stuck(batch):
        in_forward.set()
        release.wait(30)
        resumed.set()
        return run(batch)

    engine.runner.execute_model = stuck
    _, client = make_client(engine)
    with client:
        base = ThreadPoolExecutor(1).submit(
            client.post, "/v1/completions", json={"model": "fake-base", "prompt": [5, 6, 7], "max_tokens": 2})
        try:
            assert in_forward.wait(10)
            missing = client.post("/v1/completions", json={"model": "nobody", "prompt": [5, 6], "max_tokens": 2})
            answered_while_stuck = not resumed.is_set()
        finally:
            release.set()
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert answered_while_stuck
        assert base.result(timeout=30).status_code == 200

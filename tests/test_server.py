"""`loramux serve` as a real process (uvicorn on 127.0.0.1, a free port), driven by the official
`openai` client and raw HTTP, with the real engine on a tiny random Llama.

The oracle is the offline `LLM` in this process: a greedy request answered by the server must
equal the same request through `LLM.generate` / `LLM.chat`. Two servers start once per module:
`server` (adapters registered, on demand from a resolver dir and a flaky resolver plugin, runtime
loading on, max_loras=2) and `locked` (API key, no runtime loading, served-model aliases).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the serve extras are not installed: pip install -e .[serve,test]")
import httpx  # noqa: E402

from conftest import char_tokenizer, save_peft_adapter, tiny_llama

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 10
NUM_FS_ADAPTERS = 8
API_KEY = "sesame"

# A resolver plugin that raises for names starting with "raise-" and hangs for "hang-" until the
# file named by $FLAKY_RELEASE exists; installed the way pip installs one (a dist-info dir).
FLAKY_PLUGIN = '''
import os, time
from pathlib import Path
import loramux
from loramux.resolvers.base import Resolver

class FlakyResolver(Resolver):
    name = "flaky"

    def resolve(self, base_model_name, lora_name):
        if lora_name.startswith("raise-"):
            raise RuntimeError("the flaky resolver exploded")
        if lora_name.startswith("hang-"):
            deadline = time.monotonic() + 60
            while not Path(os.environ["FLAKY_RELEASE"]).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return None

@loramux.hookimpl
def register_resolvers(register):
    register(FlakyResolver())
'''


def save_tiny_model(directory: Path, tokenizer=None):
    """Save the tiny Llama (bos 1, eos 2) with ``tokenizer`` (default: the character tokenizer) to
    ``directory``; returns it."""
    model = tiny_llama()
    model.config.bos_token_id, model.config.eos_token_id = 1, 2
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 1, 2
    model.save_pretrained(directory)
    (tokenizer or char_tokenizer()).save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    model = save_tiny_model(root / "model")

    def adapter(directory: Path, seed: int, **kwargs) -> Path:
        return save_peft_adapter(model, directory, seed=seed, **kwargs)

    adapters = {"static-a": adapter(root / "static-a", 1), "runtime-a": adapter(root / "runtime-a", 2),
                "runtime-b": adapter(root / "runtime-b", 3, target_modules=["o_proj", "up_proj"])}
    resolver_dir = root / "resolver"
    for i in range(NUM_FS_ADAPTERS):
        adapters[f"fs-{i}"] = adapter(resolver_dir / f"fs-{i}", 10 + i)
    adapters["late"] = adapter(root / "staging" / "late", 40)
    adapter(resolver_dir / "too-big", 41, r=32)  # above --max-lora-rank 16
    (resolver_dir / "broken").mkdir()
    (resolver_dir / "broken" / "adapter_config.json").write_text("{not json")

    site = root / "site"
    (site / "loramux_flaky-1.0.dist-info").mkdir(parents=True)
    (site / "loramux_flaky-1.0.dist-info" / "METADATA").write_text("Name: loramux-flaky\nVersion: 1.0\n")
    (site / "loramux_flaky-1.0.dist-info" / "entry_points.txt").write_text("[loramux]\nflaky = loramux_flaky\n")
    (site / "loramux_flaky.py").write_text(FLAKY_PLUGIN)
    return dict(root=root, model=root / "model", adapters=adapters, resolver_dir=resolver_dir, site=site,
                release=root / "release-the-hang")


class Server:
    def __init__(self, name: str, args: list[str], workspace: dict, env: dict[str, str] | None = None) -> None:
        self.log_path = workspace["root"] / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(workspace["site"])]),
               "FLAKY_RELEASE": str(workspace["release"]), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               **(env or {})}
        env.pop("LORAMUX_PLUGINS", None)
        model_args = []  # no model: the embedded one (converted once into the real cache dir)
        if workspace.get("model") is not None:
            env["LORAMUX_CACHE_DIR"] = str(workspace["root"] / "cache")
            model_args = [str(workspace["model"]), "--max-model-len", "128"]
        command = [sys.executable, "-m", "loramux.cli", "serve", *model_args, "--port", "0",
                   "--disable-uvicorn-access-log", *args]
        self.process = subprocess.Popen(command, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
                                        env=env, cwd=workspace["root"])
        self.url = ""

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def wait_until_listening(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(r"Listening on (http://127\.0\.0\.1:\d+)", self.log)
            if match:
                self.url = match[1]
                return
            if self.process.poll() is not None:
                pytest.fail(f"the server exited with {self.process.returncode}:\n{self.log}")
            time.sleep(0.1)
        pytest.fail(f"the server did not start in {timeout} s:\n{self.log}")

    def __enter__(self) -> "Server":
        try:
            self.wait_until_listening()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def servers(workspace):
    adapters = workspace["adapters"]
    main = Server("main", [
        "--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", "16",
        "--lora-modules", f"static-a={adapters['static-a']}",
        "--lora-resolver-dir", str(workspace["resolver_dir"]), "--lora-resolver", "filesystem", "flaky",
        "--allow-runtime-lora-updating", "--served-model-name", "tiny",
    ], workspace)
    json_module = json.dumps({"name": "json-a", "path": str(adapters["static-a"]), "base_model_name": "tiny"})
    locked = Server("locked", ["--api-key", API_KEY, "--served-model-name", "tiny", "tiny-alias",
                               "--lora-modules", json_module], workspace)
    try:
        main.wait_until_listening()
        locked.wait_until_listening()
        yield {"main": main, "locked": locked}
    finally:
        workspace["release"].touch()
        main.stop()
        locked.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers["main"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as http_client:
        yield http_client


@pytest.fixture(scope="module")
def offline(workspace):
    """``offline(prompts, adapter_names, chat=False, **sampling)`` -> texts, through `LLM`."""
    from loramux import LLM, LoRARequest, SamplingParams

    llm = LLM(str(workspace["model"]), max_loras=2, max_cpu_loras=4, max_model_len=128)
    ids = {name: i for i, name in enumerate(workspace["adapters"], start=1)}

    def run(prompts, adapters, *, chat=False, max_tokens=MAX_TOKENS, **sampling):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, **sampling)
        if isinstance(adapters, (str, type(None))):
            adapters = [adapters] * len(prompts)
        loras = [None if name is None else LoRARequest(name, ids[name], str(workspace["adapters"][name]))
                 for name in adapters]
        if chat:
            outputs = [llm.chat(prompt, params, lora, use_tqdm=False)[0] for prompt, lora in zip(prompts, loras)]
        else:
            outputs = llm.generate(prompts, params, loras, use_tqdm=False)
        return [output.outputs[0].text for output in outputs]

    return run


def metric(http_client: httpx.Client, line_start: str, default: float | None = None) -> float:
    """The value of the first /metrics line starting with ``line_start`` (``default`` if none)."""
    for line in http_client.get("/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    if default is None:
        pytest.fail(f"no metric {line_start!r} in /metrics")
    return default


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


# ---------------------------------------------------------------------------------------------
# Models, completions, chat, streaming
# ---------------------------------------------------------------------------------------------


def test_models_lists_base_and_adapters_with_parent(client, server):
    models = {model.id: model for model in client.models.list().data}
    assert {"tiny", "static-a"} <= set(models)
    assert models["static-a"].parent == "tiny" and models["tiny"].parent is None
    assert "Adapters: static-a" in server.log
    assert "filesystem (root" in server.log and "flaky" in server.log  # resolvers logged in order


def test_completions_equal_offline_llm(client, offline):
    prompts = ["Hello there", "The capital of France is", "abc"]
    for model, adapter in (("tiny", None), ("static-a", "static-a")):
        expected = offline(prompts, adapter)
        for prompt, text in zip(prompts, expected):
            response = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert response.choices[0].text == text
            assert response.model == model
            assert response.usage.completion_tokens == MAX_TOKENS or response.choices[0].finish_reason == "stop"
    # a batch of prompts in one request: one choice each, in order
    response = client.completions.create(model="static-a", prompt=prompts, max_tokens=MAX_TOKENS, temperature=0)
    assert [choice.text for choice in response.choices] == offline(prompts, "static-a")


def test_chat_equals_offline_llm(client, offline):
    messages = [{"role": "user", "content": "Say something."}]
    for model, adapter in (("tiny", None), ("static-a", "static-a")):
        response = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0)
        assert response.choices[0].message.content == offline([messages], adapter, chat=True)[0]
        assert response.choices[0].message.role == "assistant"


def test_streaming_equals_offline_llm(client, offline):
    stream = client.completions.create(model="static-a", prompt="Stream me", max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == offline(["Stream me"], "static-a")[0]
    assert chunks[-1].usage.completion_tokens > 0 and chunks[-1].choices == []
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # really incremental

    messages = [{"role": "user", "content": "Stream a chat."}]
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text == offline([messages], None, chat=True)[0]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_strings_and_max_tokens(client, offline):
    full = offline(["Stop test"], "static-a", max_tokens=20)[0]
    stop = full[3:5]
    response = client.completions.create(model="static-a", prompt="Stop test", max_tokens=20, temperature=0,
                                         stop=[stop])
    assert response.choices[0].text == offline(["Stop test"], "static-a", max_tokens=20, stop=[stop])[0]
    assert stop not in response.choices[0].text and response.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="static-a", prompt="Stop test", max_tokens=20, temperature=0,
                                       stop=[stop], stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == response.choices[0].text


# ---------------------------------------------------------------------------------------------
# Adapters on demand, loaded and unloaded at runtime
# ---------------------------------------------------------------------------------------------


def test_on_demand_resolution_from_the_resolver_dir(client, workspace, offline):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="hi", max_tokens=MAX_TOKENS, temperature=0)
    shutil.copytree(workspace["adapters"]["late"], workspace["resolver_dir"] / "late")
    response = client.completions.create(model="late", prompt="hi", max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].text == offline(["hi"], "late")[0]
    models = {model.id: model for model in client.models.list().data}
    assert models["late"].parent == "tiny"


def test_load_unload_and_inplace_reload(client, http, workspace, offline):
    adapters = workspace["adapters"]
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": str(adapters["runtime-a"])})
    assert response.status_code == 200, response.text
    ask = dict(model="rt", prompt="Runtime", max_tokens=MAX_TOKENS, temperature=0)
    assert client.completions.create(**ask).choices[0].text == offline(["Runtime"], "runtime-a")[0]
    assert "rt" in [model.id for model in client.models.list().data]

    again = http.post("/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": str(adapters["runtime-b"])})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"

    inplace = http.post("/v1/load_lora_adapter",
                        json={"lora_name": "rt", "lora_path": str(adapters["runtime-b"]), "load_inplace": True})
    assert inplace.status_code == 200, inplace.text
    assert client.completions.create(**ask).choices[0].text == offline(["Runtime"], "runtime-b")[0]

    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "rt"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(**ask)
    assert "rt" not in [model.id for model in client.models.list().data]
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "rt"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"


def test_load_errors(http, workspace):
    for path, status, code in ((workspace["root"] / "nowhere", 404, "model_not_found"),
                               (workspace["resolver_dir"] / "broken", 400, "invalid_adapter"),
                               (workspace["resolver_dir"] / "too-big", 400, None)):
        response = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(path)})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["param"] == "lora_path" and "bad" in error["message"]
        assert code is None or error["code"] == code
    missing = http.post("/v1/load_lora_adapter", json={"lora_name": "bad"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"


def test_unloading_an_adapter_in_use_lets_running_requests_finish(client, http, workspace, offline):
    path = str(workspace["adapters"]["runtime-a"])
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "busy", "lora_path": path}).status_code == 200
    long = dict(prompt="Keep going", max_tokens=100, temperature=0, extra_body={"ignore_eos": True})
    stream = client.completions.create(model="busy", stream=True, **long)
    pieces = [next(stream).choices[0].text]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "busy"}).status_code == 200
    with pytest.raises(openai.NotFoundError):  # new requests no longer see it...
        client.completions.create(model="busy", prompt="x", max_tokens=2)
    pieces += [chunk.choices[0].text for chunk in stream if chunk.choices]  # ...the running one finishes
    assert "".join(pieces) == offline(["Keep going"], "runtime-a", max_tokens=100, ignore_eos=True)[0]
    # once it finished, the adapter leaves the engine and the name can be loaded again
    assert wait_for(lambda: http.post("/v1/load_lora_adapter",
                                      json={"lora_name": "busy", "lora_path": path}).status_code == 200)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_unknown_adapter_is_404_with_openai_error_body(client, http):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "x"}])
    assert caught.value.code == "model_not_found" and caught.value.param == "model"
    response = http.post("/v1/completions", json={"model": "no-such-adapter", "prompt": "x", "stream": True})
    assert response.status_code == 404
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "no-such-adapter" in error["message"] and "filesystem" in error["message"]


def test_invalid_adapters_are_400_with_the_reason(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="broken", prompt="x", max_tokens=2)
    assert caught.value.code == "invalid_adapter" and "adapter_config.json" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="too-big", prompt="x", max_tokens=2)
    assert "32" in caught.value.message and "16" in caught.value.message  # rank vs --max-lora-rank
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="../escape", prompt="x", max_tokens=2)
    assert caught.value.param == "model"


def test_malformed_requests_are_400_naming_the_field(client, http):
    response = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": ',
                         headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    for body, field in (({"model": "tiny", "prompt": "x", "temperature": "hot"}, "temperature"),
                        ({"model": "tiny", "prompt": "x", "max_tokens": -1}, "max_tokens"),
                        ({"model": "tiny"}, "prompt"),
                        ({"model": "tiny", "messages": [{"content": "no role"}]}, "messages[0].role")):
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = http.post(route, json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field and field in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert caught.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError):  # longer than max_model_len: the engine refuses it
        client.completions.create(model="tiny", prompt="y" * 200, max_tokens=2)
    for token_ids in ([5, 128], [5, -1]):  # ids the model cannot embed are refused, not run
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="tiny", prompt=token_ids, max_tokens=2)
        assert caught.value.param == "prompt"
    assert client.completions.create(model="tiny", prompt=[5, 127], max_tokens=2).choices[0].finish_reason
    assert http.get("/health").json() == {"status": "ok"}


def test_a_raising_or_hanging_resolver_blocks_nothing_else(server, http, offline):
    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as ahttp:
            hanging = asyncio.create_task(ahttp.post("/v1/completions", json={"model": "hang-1", "prompt": "x"}))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            raised = await ahttp.post("/v1/completions", json={"model": "raise-1", "prompt": "x"})
            answers = await asyncio.gather(*[
                ahttp.post("/v1/completions", json={"model": model, "prompt": "Meanwhile",
                                                    "max_tokens": MAX_TOKENS, "temperature": 0})
                for model in ("tiny", "static-a")])
            elapsed = time.monotonic() - started
            assert not hanging.done()
            with pytest.raises(httpx.ReadTimeout):  # a client that gives up on a hanging load
                await ahttp.post("/v1/completions", json={"model": "hang-2", "prompt": "x"}, timeout=0.5)
            return hanging, raised, answers, elapsed

    hanging, raised, answers, elapsed = asyncio.run(scenario())
    assert raised.status_code == 502
    assert "flaky" in raised.json()["error"]["message"] and "exploded" in raised.json()["error"]["message"]
    assert [a.json()["choices"][0]["text"] for a in answers] == offline(["Meanwhile"] * 2, [None, "static-a"])
    assert elapsed < 10
    assert hanging.cancelled() or not hanging.done()
    # the abandoned requests are no longer waiting in the engine
    assert wait_for(lambda: metric(http, "loramux_engine_requests") == 0)


def test_a_client_that_disconnects_mid_stream_frees_its_sequence(server, http):
    cancelled = 'loramux_requests_total{endpoint="completions",model="tiny",status="cancelled"}'
    before = metric(http, cancelled, default=0.0)
    body = {"model": "tiny", "prompt": "Go on", "max_tokens": 110, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=30) as own:
        with own.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
    assert wait_for(lambda: metric(http, cancelled, default=0.0) == before + 1)
    assert wait_for(lambda: metric(http, "loramux_engine_requests") == 0)


# ---------------------------------------------------------------------------------------------
# Load: many adapters, few slots
# ---------------------------------------------------------------------------------------------


def test_64_concurrent_requests_across_8_adapters_with_2_slots(server, offline):
    names = [f"fs-{i % NUM_FS_ADAPTERS}" for i in range(64)]
    prompts = [f"Request {i}: tell me" for i in range(64)]
    expected = offline(prompts, names)

    async def ask_all():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        async with client:
            responses = await asyncio.gather(*[
                client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
                for name, prompt in zip(names, prompts)])
        return [response.choices[0].text for response in responses]

    assert asyncio.run(ask_all()) == expected


def test_metrics(http, client):
    """The counters move for what this test asks (it runs alone under pytest-xdist too): every
    filesystem adapter once, through 4 CPU-tier entries and 2 GPU slots, and a name no resolver has."""
    client.completions.create(model="static-a", prompt="count me", max_tokens=3, temperature=0)
    for i in range(NUM_FS_ADAPTERS):
        client.completions.create(model=f"fs-{i}", prompt="hi", max_tokens=1, temperature=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-resolver-has-this", prompt="hi", max_tokens=1)
    text = http.get("/metrics").text
    assert metric(http, 'loramux_requests_total{endpoint="completions",model="static-a",status="ok"}') >= 1
    assert metric(http, 'loramux_generation_tokens_total{model="static-a"}') >= 3
    assert metric(http, 'loramux_adapter_resolutions_total{outcome="found"}') >= NUM_FS_ADAPTERS
    assert metric(http, 'loramux_adapter_resolutions_total{outcome="not_found"}') >= 1
    assert metric(http, 'loramux_adapter_cache_evictions_total{tier="cpu"}') >= 1  # 8 adapters, 4 CPU slots
    assert metric(http, 'loramux_adapters_resident{tier="gpu"}') <= 2
    assert metric(http, 'loramux_adapter_cache_loads_total{tier="gpu"}') >= 1
    assert metric(http, 'loramux_adapter_cache_evictions_total{tier="gpu"}') >= 1  # 8 adapters, 2 slots
    for family in ("loramux_adapter_cache_hits_total", "loramux_adapter_cache_misses_total",
                   "loramux_adapter_cache_loads_total", "loramux_adapter_load_seconds_bucket",
                   "loramux_queue_depth", "loramux_requests_running", "loramux_prompt_tokens_total"):
        assert family in text
    assert http.get("/health").json() == {"status": "ok"}


# ---------------------------------------------------------------------------------------------
# The locked-down server: API key, no runtime loading, several served names
# ---------------------------------------------------------------------------------------------


def test_api_key_is_required_on_v1(servers):
    locked = servers["locked"]
    wrong = openai.OpenAI(base_url=f"{locked.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(f"{locked.url}/v1/models").status_code == 401
    assert httpx.get(f"{locked.url}/health").status_code == 200
    assert httpx.get(f"{locked.url}/metrics").status_code == 200

    right = openai.OpenAI(base_url=f"{locked.url}/v1", api_key=API_KEY, max_retries=0)
    models = {model.id: model for model in right.models.list().data}
    assert set(models) == {"tiny", "tiny-alias", "json-a"} and models["json-a"].parent == "tiny"
    response = right.completions.create(model="tiny-alias", prompt="hi", max_tokens=2)
    assert response.model == "tiny-alias"


def test_runtime_loading_is_off_without_the_flag(servers, workspace):
    locked = servers["locked"]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"lora_name": "x", "lora_path": str(workspace["adapters"]["runtime-a"])}
    for route in ("load_lora_adapter", "unload_lora_adapter"):
        response = httpx.post(f"{locked.url}/v1/{route}", json=body, headers=headers)
        assert response.status_code == 403
        assert "--allow-runtime-lora-updating" in response.json()["error"]["message"]


def test_a_bad_registered_adapter_stops_start_up_with_the_reason(workspace):
    broken = workspace["resolver_dir"] / "broken"
    bad = Server("bad", ["--lora-modules", f"broken={broken}"], workspace)
    assert bad.process.wait(120) == 1
    assert "loramux: error: adapter 'broken'" in bad.log and "adapter_config.json" in bad.log
    assert "Listening" not in bad.log

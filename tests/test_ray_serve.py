"""loramux on a local Ray Serve cluster: 2 replicas of the embedded model with its demo adapters,
driven by the `openai` client through Ray's HTTP proxy.

The oracle is the single-process server (``build_app`` on one engine, in this process): a greedy
request must get the same answer from the Ray deployment. The cluster starts once for the module
(about 40 s on 2 cores: Ray itself, then two replicas loading the model side by side); the test
that kills a replica runs last. Skipped, with the reason, where Ray cannot start.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai", reason="the serve extras are not installed: pip install -e .[serve,test]")
import httpx  # noqa: E402

serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'loramux[ray]'")
import ray  # noqa: E402

from loramux.serving.ray import build_application  # noqa: E402
from loramux.serving.ray.replica import COLD_LOAD_HEADER, REPLICA_HEADER  # noqa: E402
from loramux.serving.server import demo_adapters  # noqa: E402

APP = "loramux-test"
MAX_TOKENS = 8
PROMPTS = ["The capital of France is", "Write a haiku about the sea:"]
DEMO = [name for name, _, _ in demo_adapters()]
BASE = "SmolLM2-135M-Instruct"
ON_DEMAND = ["pirate-fs-0", "pirate-fs-1", "json-fs-0"]  # copies of demo adapters, found in a resolver dir


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def resolver_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-adapters")
    paths = dict((name, path) for name, path, _ in demo_adapters())
    for name in ON_DEMAND:
        shutil.copytree(paths[name.split("-")[0]], root / name)
    shutil.copytree(paths["capitals"], root / "capitals-runtime")
    return root


@pytest.fixture(scope="module")
def cluster(resolver_dir):
    """The Ray deployment's base URL."""
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 namespace="loramux-tests")
    except Exception as error:  # noqa: BLE001 - any failure to start means: no Ray here
        pytest.skip(f"Ray could not start a local cluster on this machine: {error!r}")
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_application({
            "num_replicas": 2, "replica_num_cpus": 0.5, "allow_runtime_lora_updating": True,
            "lora_resolver_dir": str(resolver_dir), "max_num_seqs": 8,
        }), name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def single_server(resolver_dir):
    """An ``openai`` client for the single-process server on the same settings (the oracle)."""
    from fastapi.testclient import TestClient

    from loramux.serving.app import build_app
    from loramux.serving.ray.config import parse_serve_args
    from loramux.serving.server import build_engine

    args = parse_serve_args({"allow_runtime_lora_updating": True, "max_num_seqs": 8})
    engine, config = build_engine(args)
    with TestClient(build_app(engine, config)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)


def _complete(client, model: str, prompt: str, **extra):
    return client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                       temperature=0, **extra)


def _replicas(cluster) -> dict[str, list[str]]:
    """Each replica's /v1/models ids, found by asking until both replicas answered."""
    seen: dict[str, list[str]] = {}
    with httpx.Client(base_url=cluster, timeout=30) as http:
        for _ in range(60):
            response = http.get("/v1/models")
            seen[response.headers[REPLICA_HEADER]] = [m["id"] for m in response.json()["data"]]
            if len(seen) == 2:
                break
    assert len(seen) == 2, f"only replica(s) {sorted(seen)} answered 60 unrouted requests"
    return seen


# ---------------------------------------------------------------------------------------------


def test_answers_equal_the_single_process_server(client, single_server):
    for model in [BASE, *DEMO]:
        for prompt in PROMPTS:
            expected = single_server.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                        temperature=0).choices[0].text
            assert _complete(client, model, prompt).parse().choices[0].text == expected, (model, prompt)
        messages = [{"role": "user", "content": PROMPTS[0]}]
        expected = single_server.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                         temperature=0).choices[0].message.content
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0)
        assert answer.choices[0].message.content == expected, model
        assert answer.model == model
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected


def test_models_lists_the_base_model_and_the_demo_adapters(client):
    assert {m.id for m in client.models.list().data} >= {BASE, *DEMO}


def test_errors_are_the_single_servers(client, single_server):
    for api in (client, single_server):
        with pytest.raises(openai.NotFoundError, match="no-such-adapter"):
            api.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            api.completions.create(model=BASE, prompt="hi", max_tokens=-1)


def test_requests_for_one_adapter_land_on_one_replica_and_load_once(client):
    served_by: dict[str, set[str]] = {}
    cold: dict[str, list[str]] = {}
    for name in ON_DEMAND:  # the first request of each: a cold load on the replica with fewest adapters
        response = _complete(client, name, PROMPTS[0])
        served_by[name], cold[name] = {response.headers[REPLICA_HEADER]}, [response.headers[COLD_LOAD_HEADER]]
        time.sleep(1.0)  # the replica tells Ray's routers what it holds (pushed, not instant)
    for _ in range(3):
        for name in ON_DEMAND:
            response = _complete(client, name, PROMPTS[1])
            served_by[name].add(response.headers[REPLICA_HEADER])
            cold[name].append(response.headers[COLD_LOAD_HEADER])
    assert all(len(replicas) == 1 for replicas in served_by.values()), served_by
    assert cold == {name: ["1", "0", "0", "0"] for name in ON_DEMAND}
    assert len(set().union(*served_by.values())) == 2, f"new adapters did not go to the emptier replica: {served_by}"


def test_load_and_unload_apply_to_every_replica(client, cluster, resolver_dir):
    with httpx.Client(base_url=cluster, timeout=60) as http:
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "capitals-rt",
                                                          "lora_path": str(resolver_dir / "capitals-runtime")})
        assert loaded.status_code == 200, loaded.text
        assert all("capitals-rt" in models for models in _replicas(cluster).values())
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "capitals-rt", "lora_path": "/nowhere"})
        assert again.status_code == 400 and "load_inplace" in again.text  # the single server's answer
        assert _complete(client, "capitals-rt", PROMPTS[0]).parse().choices[0].text == \
            _complete(client, "capitals", PROMPTS[0]).parse().choices[0].text
        unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "capitals-rt"})
        assert unloaded.status_code == 200, unloaded.text
        assert not any("capitals-rt" in models for models in _replicas(cluster).values())
        missing = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(resolver_dir / "none")})
        assert missing.status_code == 404 and "none" in missing.text


def test_a_replica_killed_mid_traffic_loses_no_request_that_had_not_started_streaming(client, single_server):
    """Half the requests stream: a stream the dying replica had started may break; nothing else may."""
    expected = {name: single_server.completions.create(model=name, prompt=PROMPTS[1], max_tokens=16,
                                                       temperature=0).choices[0].text for name in DEMO}
    replica_names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["name"].startswith(f"SERVE_REPLICA::{APP}#LoramuxReplica#")]
    assert len(replica_names) == 2, replica_names
    started = threading.Event()

    def ask(index: int) -> tuple[str, str | None, str, float]:
        """(adapter, text or None if a started stream broke, replica, finished at)."""
        name = DEMO[index % len(DEMO)]
        started.set()
        if index % 2:  # streamed: may break only once it has sent something
            chunks = []
            with client.completions.with_streaming_response.create(
                    model=name, prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True) as response:
                try:
                    for chunk in response.parse():
                        chunks.append(chunk.choices[0].text if chunk.choices else "")
                except (openai.APIError, httpx.HTTPError):
                    assert chunks, f"request {index} failed before it streamed anything"
                    return name, None, response.headers[REPLICA_HEADER], time.monotonic()
            return name, "".join(chunks), response.headers[REPLICA_HEADER], time.monotonic()
        response = client.completions.with_raw_response.create(model=name, prompt=PROMPTS[1], max_tokens=16,
                                                               temperature=0)
        return name, response.parse().choices[0].text, response.headers[REPLICA_HEADER], time.monotonic()

    victim = replica_names[0]
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(ask, i) for i in range(24)]
        started.wait(10)
        time.sleep(1.5)  # requests are queued and running on both replicas
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=False)
        killed_at = time.monotonic()
        answers = [future.result() for future in futures]  # raises if any request was lost
    assert all(text == expected[name] for name, text, _, _ in answers if text is not None)
    assert all(text is not None for index, (_, text, _, _) in enumerate(answers) if index % 2 == 0)
    after = [replica for _, text, replica, finished in answers if finished > killed_at + 0.5 and text is not None]
    assert after, "every request finished before the kill: the test killed an idle replica"
    assert victim.rsplit("#", 1)[1] not in after

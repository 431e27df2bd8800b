"""What a hostile client sends, against a real `loramux serve` process (a tiny Llama on CPU): each
one is answered as documented, while a normal request sent beside it keeps its latency, and the
server ends where it started (health, the running gauges, its memory).

Each test is one kind of abuse, scaled to CI time: many prompts in one request, formats that cost
much to compile or keep, a prompt of megabytes, max_tokens beyond the context, an adapter source
that never answers, values of the wrong type or range, a body nested thousands deep.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the serve extras are not installed: pip install -e .[serve,test]")
import httpx  # noqa: E402
from conftest import save_peft_adapter  # noqa: E402
from test_server import Server, metric, save_tiny_model, wait_for  # noqa: E402

MAX_PROMPTS = 300
CACHE_BYTES = 8 * 2**20
LIMITS = {"compile_timeout": 2, "cache_bytes": CACHE_BYTES, "max_depth": 16, "max_enum_values": 200,
          "max_choices": 200}
FETCH_TIMEOUT = 2.0
NORMAL = {"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
# A request beside the abuse may take twice its time alone, and this much more for a busy CI box
SLACK_S = 0.5


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("abuse")
    model = save_tiny_model(root / "model")
    adapter = save_peft_adapter(model, root / "quick", seed=3)
    (root / "site").mkdir()
    return dict(root=root, model=root / "model", adapter=adapter, site=root / "site", release=root / "release")


@pytest.fixture(scope="module")
def silent_hub():
    """A Hugging Face Hub endpoint that takes connections and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture(scope="module")
def server(workspace, silent_hub):
    with Server("abuse", [
        "--served-model-name", "tiny", "--max-num-seqs", "4", "--max-prompts-per-request", str(MAX_PROMPTS),
        "--structured-outputs-limits", json.dumps(LIMITS), "--allow-runtime-lora-updating",
        "--lora-fetch-timeout", str(FETCH_TIMEOUT),
    ], workspace, env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": silent_hub}) as process:
        yield process


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def start(server, http):
    """The server's state after warming up: its memory, to compare the end with."""
    for _ in range(3):
        assert http.post("/v1/completions", json=NORMAL).status_code == 200
    assert http.post("/v1/completions", json={**NORMAL, "guided_choice": ["yes", "no"]}).status_code == 200
    return {"rss": rss_bytes(server)}


def rss_bytes(server: Server) -> int:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024


def normal_seconds(http: httpx.Client) -> float:
    started = time.monotonic()
    response = http.post("/v1/completions", json=NORMAL)
    assert response.status_code == 200, response.text
    return time.monotonic() - started


def beside_normal(http: httpx.Client, method: str, route: str, *, lead: float = 0.2, **kwargs):
    """Send the abuse; ``lead`` seconds later a normal request, whose latency must stay within
    twice its latency alone (measured just before), plus `SLACK_S`. Returns the abuse's response
    and seconds, and that bound."""
    alone = statistics.median(normal_seconds(http) for _ in range(3))
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        abuse = pool.submit(http.request, method, route, **kwargs)
        time.sleep(lead)
        beside = normal_seconds(http)
        response = abuse.result()
        seconds = time.monotonic() - started
    bound = 2 * alone + SLACK_S
    assert beside <= bound, f"a normal request took {beside:.2f} s beside the abuse, {alone:.2f} s alone"
    return response, seconds, bound


def assert_error(response: httpx.Response, status: int, code: str, param: str | None, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    for word in words:
        assert word in error["message"], error
    assert ".cc:" not in error["message"] and "/project/" not in error["message"], error


# ---------------------------------------------------------------------------------------------
# Many prompts in one request
# ---------------------------------------------------------------------------------------------


def test_a_request_of_many_prompts_does_not_hold_up_another(http, start):
    prompts = [f"Prompt number {i} says" for i in range(MAX_PROMPTS)]
    # the normal request comes once the engine holds all of them: first come, first served, it would
    # wait for the rest
    lead = 0.5
    response, seconds, bound = beside_normal(http, "POST", "/v1/completions", lead=lead,
                                             json={"model": "tiny", "prompt": prompts, "max_tokens": 8, "ignore_eos": True})
    assert response.status_code == 200
    assert [choice["index"] for choice in response.json()["choices"]] == list(range(MAX_PROMPTS))
    assert seconds - lead > bound  # long enough that waiting behind it would break the bound


def test_more_prompts_than_the_limit_are_a_400_naming_it(http, start):
    response, _, _ = beside_normal(http, "POST", "/v1/completions",
                                json={"model": "tiny", "prompt": ["x"] * (MAX_PROMPTS + 1), "max_tokens": 1})
    assert_error(response, 400, "invalid_parameter", "prompt", f"{MAX_PROMPTS + 1} prompts", str(MAX_PROMPTS),
                 "--max-prompts-per-request")


# ---------------------------------------------------------------------------------------------
# Structured outputs: bounded work and memory
# ---------------------------------------------------------------------------------------------


def nested_schema(depth: int, tag: str = "k") -> dict:
    schema: dict = {"type": "string"}
    for level in range(depth):
        schema = {"type": "object", "properties": {f"{tag}{level}": schema}, "required": [f"{tag}{level}"]}
    return schema


def test_formats_over_a_size_limit_are_400s_naming_it(http, start):
    for field, value, limit in (
        ("guided_json", nested_schema(450), "max_depth=16"),
        ("guided_json", {"enum": [f"value {i}" for i in range(50_000)]}, "max_bytes=65536"),
        ("guided_json", {"enum": [f"value {i}" for i in range(300)]}, "max_enum_values=200"),
        ("guided_choice", [f"choice {i}" for i in range(100_000)], "max_bytes=65536"),
        ("guided_choice", [f"choice {i}" for i in range(300)], "max_choices=200"),
        ("guided_regex", "a" * 70_000, "max_bytes=65536"),
    ):
        response, seconds, _ = beside_normal(http, "POST", "/v1/completions", json={**NORMAL, field: value}, lead=0.05)
        assert_error(response, 400, "structured_output_limit", field, limit)
        assert seconds < 1 + SLACK_S  # refused before any compile


def test_a_format_that_compiles_too_long_is_stopped_at_the_time_limit(http, start):
    # 26 s to compile on a 2-core machine with the tiny model's 128 tokens ({1,3000}: 2 s, as long as the limit)
    slow = {"type": "string", "pattern": "(ab|cd){1,10000}"}
    body = {**NORMAL, "response_format": {"type": "json_schema", "json_schema": {"name": "slow", "schema": slow}}}
    response, seconds, _ = beside_normal(http, "POST", "/v1/completions", json=body)
    assert_error(response, 400, "structured_output_limit", "response_format", "compile_timeout=2 s")
    assert seconds < LIMITS["compile_timeout"] + 3
    again, seconds, _ = beside_normal(http, "POST", "/v1/completions", json=body, lead=0.05)
    assert_error(again, 400, "structured_output_limit", "response_format", "compile_timeout=2 s")
    assert seconds < 1  # remembered: refused at once
    assert http.post("/v1/completions", json={**NORMAL, "guided_regex": "[ab]+"}).status_code == 200


def test_distinct_schemas_stay_within_the_grammar_cache(server, http, start):
    for i in range(20):
        response, _, _ = beside_normal(http, "POST", "/v1/completions", lead=0.05,
                                    json={**NORMAL, "guided_json": nested_schema(7, tag=f"s{i}_")})
        assert response.status_code == 200, response.text
    assert rss_bytes(server) - start["rss"] < CACHE_BYTES + 100 * 2**20


def test_a_bad_regex_is_a_400_without_the_grammar_engines_source_paths(http, start):
    response, _, _ = beside_normal(http, "POST", "/v1/completions", json={**NORMAL, "guided_regex": "("}, lead=0.05)
    assert_error(response, 400, "unsupported_schema", "guided_regex", "parenthesis")


def test_json_object_output_is_json_on_one_line(http, start):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 40,
            "temperature": 0, "response_format": {"type": "json_object"}}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    text = choice["message"]["content"]
    assert text.startswith("{") and "\n" not in text
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


# ---------------------------------------------------------------------------------------------
# Length before work
# ---------------------------------------------------------------------------------------------


def test_a_prompt_of_megabytes_is_refused_before_tokenizing(http, start):
    response, seconds, _ = beside_normal(http, "POST", "/v1/completions", json={**NORMAL, "prompt": "x" * 2_000_000},
                                      lead=0.05)
    assert_error(response, 400, "context_length_exceeded", "prompt", "2000000 bytes", "128 tokens")
    assert seconds < 1 + SLACK_S
    # under the byte bound but over the context: tokenized, then refused naming the token count
    response = http.post("/v1/completions", json={**NORMAL, "prompt": "y" * 200})
    assert_error(response, 400, "context_length_exceeded", "prompt", "200 tokens", "128")
    response = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "user", "content": "z" * 2_000_000}]})
    assert_error(response, 400, "context_length_exceeded", "messages", "2000000 bytes")


def test_max_tokens_beyond_the_context_is_a_400_naming_both_numbers(http, start):
    for max_tokens in (10**9, 10**30):
        response, _, _ = beside_normal(http, "POST", "/v1/completions", json={**NORMAL, "max_tokens": max_tokens},
                                    lead=0.05)
        assert_error(response, 400, "context_length_exceeded", "max_tokens", str(max_tokens), "128")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}
    assert_error(http.post("/v1/chat/completions", json=chat), 400, "context_length_exceeded",
                 "max_completion_tokens", "1000", "128")
    chat.pop("max_completion_tokens")  # none given: the rest of the context
    assert http.post("/v1/chat/completions", json=chat).json()["choices"][0]["finish_reason"]


# ---------------------------------------------------------------------------------------------
# Types, ranges and the body
# ---------------------------------------------------------------------------------------------


def test_values_of_the_wrong_type_or_range_are_400s_naming_the_field(http, start):
    for field, value in (("max_tokens", "10"), ("max_tokens", True), ("stream", "yes"), ("temperature", "0"),
                         ("n", 2.0), ("seed", 2**70), ("seed", -(2**63) - 1)):
        response, _, _ = beside_normal(http, "POST", "/v1/completions", json={**NORMAL, field: value}, lead=0.05)
        assert_error(response, 400, "invalid_parameter", field, field)
    assert http.post("/v1/completions", json={**NORMAL, "seed": 2**63 - 1}).status_code == 200
    response = http.post("/v1/completions", json={**NORMAL, "stop": 5})
    assert_error(response, 400, "invalid_parameter", "stop", "stop")


def test_a_body_nested_thousands_deep_is_a_400_invalid_json(http, start):
    body = '{"model": "tiny", "prompt": ' + "[" * 5000 + "]" * 5000 + "}"
    response, _, _ = beside_normal(http, "POST", "/v1/completions", content=body,
                                headers={"content-type": "application/json"}, lead=0.05)
    assert_error(response, 400, "invalid_json", None, "JSON")


# ---------------------------------------------------------------------------------------------
# Adapter sources
# ---------------------------------------------------------------------------------------------


def test_an_adapter_source_that_never_answers_fails_alone_in_bounded_time(http, workspace, start):
    def load_another() -> tuple[httpx.Response, float]:
        time.sleep(0.3)  # while the silent source holds its load
        started = time.monotonic()
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "quick", "lora_path": str(workspace["adapter"])})
        return loaded, time.monotonic() - started

    with ThreadPoolExecutor(1) as pool:
        another = pool.submit(load_another)
        response, seconds, _ = beside_normal(http, "POST", "/v1/load_lora_adapter",
                                          json={"lora_name": "none", "lora_path": "hf://org/none"})
        loaded, load_seconds = another.result()
    assert_error(response, 502, "adapter_download_failed", "lora_path")
    message = response.json()["error"]["message"]  # the Hub's client gave up first, or the fetch timeout came
    assert "the Hub could not be reached" in message or "did not answer within 2 s" in message, message
    assert seconds < FETCH_TIMEOUT + 1
    assert loaded.status_code == 200 and load_seconds < FETCH_TIMEOUT  # not queued behind the silent source
    assert http.post("/v1/completions", json={**NORMAL, "model": "quick"}).status_code == 200


# ---------------------------------------------------------------------------------------------
# Afterwards
# ---------------------------------------------------------------------------------------------


def test_the_server_is_back_where_it_started(server, http, start):
    assert http.get("/health").json() == {"status": "ok"}
    assert wait_for(lambda: metric(http, "loramux_engine_requests") == 0)
    assert metric(http, "vllm:num_requests_running") == 0 and metric(http, "vllm:num_requests_waiting") == 0
    assert metric(http, "loramux_requests_running") == 0 and metric(http, "loramux_queue_depth") == 0
    assert rss_bytes(server) - start["rss"] < CACHE_BYTES + 100 * 2**20
    assert normal_seconds(http) < 5

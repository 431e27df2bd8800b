"""The OpenAI API features evaluation harnesses and real clients use, through a real `loramux
serve` process and the official `openai` client: logprobs (chat, completions with echo, vLLM's
prompt_logprobs), structured outputs (response_format, guided_*), penalties, and the latency and
router metrics. The oracle is the offline engine in this process on the same tiny model."""

from __future__ import annotations

import json
import math
import re

import pytest

openai = pytest.importorskip("openai", reason="the serve extras are not installed: pip install -e .[serve,test]")
jsonschema = pytest.importorskip("jsonschema", reason="the serve extras are not installed: pip install -e .[serve,test]")
import httpx  # noqa: E402
from conftest import save_peft_adapter
from test_server import Server, metric, save_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "legs": {"type": "integer", "minimum": 0,
                                                                         "maximum": 8},
                   "kind": {"enum": ["cat", "dog"]}},
    "required": ["name", "legs", "kind"],
    "additionalProperties": False,
}


def tiny_workspace(root, tokenizer=None) -> dict:
    """The tiny Llama and ``tokenizer`` (default: the character tokenizer) saved under ``root``,
    with a PEFT adapter "style" for it."""
    model = save_tiny_model(root / "model", tokenizer)
    adapter = save_peft_adapter(model, root / "style", seed=7)
    site = root / "site"
    site.mkdir()
    return dict(root=root, model=root / "model", adapter=adapter, site=site, release=root / "release")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return tiny_workspace(tmp_path_factory.mktemp("serving_api"))


@pytest.fixture(scope="module")
def server(workspace):
    with Server("api", ["--max-loras", "1", "--lora-modules", f"style={workspace['adapter']}",
                        "--served-model-name", "tiny", "--dtype", "float32"], workspace) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as http_client:
        yield http_client


@pytest.fixture(scope="module")
def offline(workspace):
    """``offline(prompt, adapter, **sampling) -> RequestOutput`` through the in-process engine."""
    from loramux import LLM, LoRARequest, SamplingParams

    llm = LLM(str(workspace["model"]), max_loras=1, max_model_len=128, dtype="float32")

    def run(prompt, adapter=None, **sampling):
        lora = None if adapter is None else LoRARequest(adapter, 1, str(workspace["adapter"]))
        return llm.generate([prompt], SamplingParams(**sampling), lora, use_tqdm=False)[0]

    run.tokenizer = llm.get_tokenizer()
    return run


def test_chat_logprobs_and_top_logprobs_equal_the_engine(client, offline):
    messages = [{"role": "user", "content": "Score me."}]
    response = client.chat.completions.create(model="style", messages=messages, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    tokenizer = offline.tokenizer
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = offline({"prompt_token_ids": tokenizer(prompt, add_special_tokens=False).input_ids}, "style",
                       temperature=0, max_tokens=6, logprobs=3).outputs[0]
    assert len(content) == len(expected.token_ids) == 6
    for item, token, entry in zip(content, expected.token_ids, expected.logprobs):
        assert item.token == tokenizer.decode([token]) and item.bytes == list(item.token.encode())
        assert item.logprob == pytest.approx(entry[token].logprob, abs=1e-5)
        assert len(item.top_logprobs) == 3
        ranked = sorted((lp for lp in entry.values() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [t.logprob for t in item.top_logprobs] == pytest.approx([lp.logprob for lp in ranked], abs=1e-5)
        assert item.top_logprobs[0].logprob >= item.logprob - 1e-6  # greedy: the chosen one is the best

    stream = client.chat.completions.create(model="style", messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [item for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for item in chunk.choices[0].logprobs.content]
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in content]


def test_completions_echo_logprobs_score_the_prompt(client, offline):
    """What evaluation harnesses send: echo, logprobs, max_tokens 0 -> the prompt's log-likelihood."""
    prompt = "The cat sat"
    response = client.completions.create(model="style", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = response.choices[0]
    ids = offline.tokenizer(prompt).input_ids
    expected = offline(prompt, "style", temperature=0, max_tokens=1, prompt_logprobs=2).prompt_logprobs
    assert choice.text == prompt and response.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    for position in range(1, len(ids)):
        assert logprobs.token_logprobs[position] == pytest.approx(expected[position][ids[position]].logprob, abs=1e-5)
        assert len(logprobs.top_logprobs[position]) >= 2
    assert math.isclose(sum(logprobs.token_logprobs[1:]), sum(expected[p][ids[p]].logprob
                                                              for p in range(1, len(ids))), abs_tol=1e-4)
    assert logprobs.text_offset[:2] == [0, len(logprobs.tokens[0])]

    # echo with generation: the prompt's entries, then the generated tokens'
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=0,
                                         temperature=0)
    generated = offline(prompt, None, temperature=0, max_tokens=3)
    assert response.choices[0].text == prompt + generated.outputs[0].text
    assert len(response.choices[0].logprobs.tokens) == len(ids) + 3

    raw = client.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                    extra_body={"prompt_logprobs": 1}).model_dump()
    prompt_logprobs = raw["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    assert str(ids[1]) in prompt_logprobs[1] and "rank" in prompt_logprobs[1][str(ids[1])]


def test_json_schema_requests_always_validate(client):
    """20 choices, greedy and sampled, of a random model: every one parses and validates."""
    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    answers = []
    for temperature, n in ((0.0, 1), (1.0, 16), (0.7, 3)):
        response = client.chat.completions.create(
            model="style", messages=[{"role": "user", "content": "A pet?"}], response_format=response_format,
            max_tokens=80, temperature=temperature, n=n, seed=3)
        answers += [choice.message.content for choice in response.choices]
    for answer in answers:
        jsonschema.validate(json.loads(answer), SCHEMA)
    assert len(set(answers)) > 1  # sampled: not all the same

    obj = client.completions.create(model="tiny", prompt="{", max_tokens=60, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].text.startswith("{")


def test_guided_regex_and_choice(client):
    choice = client.completions.create(model="tiny", prompt="Pick:", max_tokens=10, temperature=1.0, seed=1,
                                       extra_body={"guided_choice": ["red", "green", "blue"]})
    assert choice.choices[0].text in ("red", "green", "blue")
    regex = client.completions.create(model="tiny", prompt="Code:", max_tokens=10, temperature=1.0, seed=2,
                                      extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", regex.choices[0].text)


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}},
     "response_format", "'not'"),
    ({"guided_json": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}, "guided_json", "'if'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "one structured-output format"),
])
def test_unsupported_formats_are_400_naming_the_feature(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body=extra)
    assert caught.value.body["param"] == param and words in caught.value.body["message"]


def test_penalties_and_logit_bias_equal_the_engine(client, offline):
    sampling = dict(presence_penalty=1.5, frequency_penalty=0.5, max_tokens=12, temperature=0)
    extra = {"repetition_penalty": 1.3, "min_tokens": 4, "min_p": 0.1}
    response = client.completions.create(model="style", prompt="Repeat repeat", **sampling, extra_body=extra)
    expected = offline("Repeat repeat", "style", **sampling, **extra, ignore_eos=False)
    assert response.choices[0].text == expected.outputs[0].text
    plain = offline("Repeat repeat", "style", max_tokens=12, temperature=0)
    assert expected.outputs[0].token_ids != plain.outputs[0].token_ids  # the penalties changed something

    token = offline.tokenizer("Z", add_special_tokens=False).input_ids[0]
    biased = client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0,
                                       logit_bias={str(token): 100})
    assert biased.choices[0].text == "ZZZZ"
    for field, value in (("logit_bias", {"100000": 1}), ("allowed_token_ids", [100000])):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="tiny", prompt="hi", max_tokens=4, extra_body={field: value})
        assert caught.value.body["param"] == field and "token id 100000" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"


def test_latency_histograms_and_router_gauges(client, http):
    client.chat.completions.create(model="style", messages=[{"role": "user", "content": "time me"}], max_tokens=5,
                                   temperature=0)
    for name in ("loramux_time_to_first_token_seconds", "loramux_inter_token_latency_seconds",
                 "loramux_e2e_request_latency_seconds"):
        assert metric(http, f'{name}_count{{model="style"}}') >= 1, name
    assert metric(http, 'loramux_inter_token_latency_seconds_count{model="style"}') >= 4
    assert metric(http, 'vllm:num_requests_running{model_name="tiny"}') == 0
    assert metric(http, 'vllm:num_requests_waiting{model_name="tiny"}') == 0
    assert 0 <= metric(http, 'vllm:kv_cache_usage_perc{model_name="tiny"}') <= 1
    text = http.get("/metrics").text
    info = re.search(r'^vllm:lora_requests_info\{(.*)\} (\S+)$', text, re.MULTILINE)
    assert info is not None, text
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info[1]))
    assert labels == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert float(info[2]) > 1.6e9  # the time it was read, as vLLM reports it


def test_prefix_cache_queries_and_hits_in_metrics(client, http):
    before_hits = metric(http, 'loramux_prefix_cache_hits_total{model_name="tiny"}')
    before_queries = metric(http, 'loramux_prefix_cache_queries_total{model_name="tiny"}')
    prompt = "The same system prompt, shared by both requests of this test."  # 3 full 16-token blocks
    for _ in range(2):  # one after the other: the second finds the first's blocks
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    hits = metric(http, 'loramux_prefix_cache_hits_total{model_name="tiny"}') - before_hits
    queries = metric(http, 'loramux_prefix_cache_queries_total{model_name="tiny"}') - before_queries
    assert hits >= 16 and queries >= 2 * 16 and hits <= queries

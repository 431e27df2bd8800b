"""vLLM's extra request fields against a real `loramux serve` process: every field of vLLM's list is
honoured (checked here against the offline engine or by its effect) or refused by name with a 400,
and documented in docs/sampling.md; and vLLM's ``structured_outputs`` in all its forms."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

openai = pytest.importorskip("openai", reason="the serve extras are not installed: pip install -e .[serve,test]")
from test_sampling_params import _table  # noqa: E402
from test_server import metric  # noqa: E402
# the server and clients of test_server_api, on test_server_compat's workspace
from test_server_api import client, http, server  # noqa: E402,F401
from test_server_compat import offline, workspace  # noqa: E402,F401

# vLLM's extra parameters, as vllm-project/vllm declares them at commit
# 002032ee2b18e1f7bd924ec47b62504ba3866063 between the "--8<-- [start:...]" / "[end:...]" markers that
# docs/serving/openai_compatible_server.md shows as the extra parameters:
# vllm/entrypoints/openai/completion/protocol.py (completion-sampling-params, completion-extra-params)
VLLM_COMPLETION_EXTRA_PARAMS = [
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "truncation_side", "allowed_token_ids", "prompt_logprobs", "logprob_token_ids",
    "bad_words",
    "prompt_embeds", "add_special_tokens", "response_format", "structured_outputs", "priority", "request_id",
    "session_id", "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start",
    "return_token_offsets", "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params",
    "vllm_xargs", "repetition_detection", "thinking_token_budget", "stream_interval",
]
# vllm/entrypoints/openai/chat_completion/protocol.py (chat-completion-sampling-params, -extra-params)
VLLM_CHAT_EXTRA_PARAMS = [
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "truncation_side", "prompt_logprobs", "logprob_token_ids", "allowed_token_ids",
    "bad_words",
    "echo", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents", "chat_template",
    "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs", "structured_outputs", "priority",
    "request_id", "session_id", "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start",
    "return_token_offsets", "return_prompt_text", "return_mm_kwargs", "cache_salt", "kv_transfer_params",
    "ec_transfer_params", "vllm_xargs", "repetition_detection", "stream_interval",
]
WALK = [("completions", f) for f in VLLM_COMPLETION_EXTRA_PARAMS] + [("chat", f) for f in VLLM_CHAT_EXTRA_PARAMS]

ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
BASE = {"completions": {"model": "tiny", "prompt": "The cat", "max_tokens": 6, "temperature": 0},
        "chat": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}}
LONG = {"completions": {"prompt": "A long prompt, to fill a cache block or two."},
        "chat": {"messages": [{"role": "user", "content": "A long message, to fill a cache block or two."}]}}
OPEN_REPLY = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
              "add_generation_prompt": False, "continue_final_message": True}

# refused: a value asking for what loramux does not do, and one asking for nothing (accepted)
REFUSED = {
    "use_beam_search": (True, False), "watermarking": (True, False), "length_penalty": (2.0, 1.0),
    "spaces_between_special_tokens": (False, True), "truncate_prompt_tokens": (3, None),
    "truncation_side": ("left", None), "logprob_token_ids": ([5], None), "bad_words": (["x"], []),
    "prompt_embeds": ("AAAA", None), "priority": (1, 0), "routed_experts_prompt_start": (1, 0),
    "return_token_offsets": (True, False), "return_mm_kwargs": (False, True), "kv_transfer_params": ({"a": 1}, None),
    "ec_transfer_params": ({"a": 1}, None), "vllm_xargs": ({"a": 1}, None),
    "repetition_detection": ({"max_pattern_size": 2, "min_count": 2}, None), "thinking_token_budget": (10, -1),
    "chat_template": ("{{ messages }}", None), "media_io_kwargs": ({"video": {}}, None),
    "mm_processor_kwargs": ({"a": 1}, None),
}

# honoured sampling fields: the value and the rest of the request that makes its effect show;
# the answer must equal the offline engine's with the same SamplingParams
SAMPLING = {
    "top_k": lambda base: (1, {"temperature": 1.0, "seed": 3}),
    "min_p": lambda base: (0.9, {"temperature": 1.0, "seed": 3}),
    "repetition_penalty": lambda base: (2.0, {"max_tokens": 12}),
    "stop_token_ids": lambda base: ([base["token_ids"][2]], {}),
    "include_stop_str_in_output": lambda base: (True, {"stop": [base["text"][2:4]]}),
    "ignore_eos": lambda base: (True, {"logit_bias": {"2": 100}}),
    "min_tokens": lambda base: (3, {"logit_bias": {"2": 100}}),
    "skip_special_tokens": lambda base: (False, {"logit_bias": {"1": 100}}),
    "allowed_token_ids": lambda base: ([5, 6, 7], {"temperature": 1.0, "seed": 2}),
}


@dataclass
class Ask:
    """Posts requests to one endpoint of the server; `offline` runs its base request in the engine."""

    http: object
    endpoint: str
    engine: Callable

    def __call__(self, **fields) -> dict:
        response = self.http.post(ROUTES[self.endpoint], json={**BASE[self.endpoint], "return_token_ids": True,
                                                               **fields})
        assert response.status_code == 200, response.text
        body = response.json()
        choice = body["choices"][0]
        text = choice["text"] if self.endpoint == "completions" else choice["message"]["content"]
        return {**body, "text": text, "token_ids": choice["token_ids"], "choice": choice}

    def events(self, **fields) -> list[dict]:
        body = {**BASE[self.endpoint], "stream": True, **fields}
        with self.http.stream("POST", ROUTES[self.endpoint], json=body) as response:
            lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(line) for line in lines[:-1]]

    def prompt_ids(self) -> list[int]:
        """The base request's prompt as the engine takes it."""
        tokenizer = self.engine.tokenizer
        if self.endpoint == "completions":
            return tokenizer(BASE["completions"]["prompt"]).input_ids
        text = tokenizer.apply_chat_template(BASE["chat"]["messages"], add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids

    def offline(self, **sampling):
        """The base request through the offline engine: its completion."""
        sampling = {"max_tokens": 6, "temperature": 0, **sampling}
        return self.engine([{"prompt_token_ids": self.prompt_ids()}], **sampling)[0].outputs[0]


def _check_prompt_logprobs(ask: Ask) -> None:
    body = ask(prompt_logprobs=1)
    listed = body["choice"]["prompt_logprobs"] if ask.endpoint == "completions" else body["prompt_logprobs"]
    assert len(listed) == body["usage"]["prompt_tokens"] and listed[0] is None and None not in listed[1:]


def _check_response_format(ask: Ask) -> None:
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "abc"}}
    assert ask(response_format=tag)["text"] == "abc"


def _check_structured_outputs(ask: Ask) -> None:
    assert ask(structured_outputs={"choice": ["yes", "no"]}, temperature=1.0, seed=1)["text"] in ("yes", "no")


def _check_add_special_tokens(ask: Ask) -> None:
    """Completions lose the BOS without them; chat gets a second one (the template has one)."""
    default = ask()["usage"]["prompt_tokens"]
    flipped = ask(add_special_tokens=ask.endpoint == "chat")["usage"]["prompt_tokens"]
    assert flipped - default == (1 if ask.endpoint == "chat" else -1)


def _check_request_id(ask: Ask) -> None:
    prefix = "cmpl" if ask.endpoint == "completions" else "chatcmpl"
    assert ask(request_id="walk-7")["id"] == f"{prefix}-walk-7"


def _check_session_id(ask: Ask) -> None:
    assert ask(session_id="s-1")["text"] == ask()["text"]  # a routing hint: no effect


def _check_logprob_tokens(ask: Ask) -> None:
    logprobs = {"logprobs": 1} if ask.endpoint == "completions" else {"logprobs": True, "top_logprobs": 1}
    got = ask(return_tokens_as_token_ids=True, **logprobs)["choice"]["logprobs"]
    tokens = got["tokens"] if ask.endpoint == "completions" else [item["token"] for item in got["content"]]
    assert tokens == [f"token_id:{t}" for t in ask()["token_ids"]]


def _check_token_ids(ask: Ask) -> None:
    body = ask()
    prompt_ids = body["choice"]["prompt_token_ids"] if ask.endpoint == "completions" else body["prompt_token_ids"]
    assert (body["token_ids"], prompt_ids) == (ask.offline().token_ids, ask.prompt_ids())


def _check_cache_salt(ask: Ask) -> None:
    hits = 'loramux_prefix_cache_hits_total{model_name="tiny"}'
    plain = ask(**LONG[ask.endpoint])["text"]
    salt = f"salt-{ask.endpoint}"
    for request_salt, finds_blocks in ((salt, False), (salt, True), (salt + "-other", False)):
        before = metric(ask.http, hits)
        assert ask(cache_salt=request_salt, **LONG[ask.endpoint])["text"] == plain
        assert (metric(ask.http, hits) - before >= 16) == finds_blocks


def _check_stream_interval(ask: Ask) -> None:
    events = ask.events(stream_interval=3, return_token_ids=True, max_tokens=8, ignore_eos=True)
    choices = [e["choices"][0] for e in events if e["choices"] and "token_ids" in e["choices"][0]]
    text = "".join(c["text"] if ask.endpoint == "completions" else c["delta"].get("content", "") for c in choices)
    assert text == ask(max_tokens=8, ignore_eos=True)["text"]
    counts = [len(c["token_ids"]) for c in choices]  # the first chunk and the last go at once
    assert sum(counts) == 8 and all(n >= 3 for n in counts[1:-1]) and len(counts) <= 4, counts


def _check_echo(ask: Ask) -> None:
    assert ask(echo=True, **OPEN_REPLY)["text"] == "Hel" + ask(**OPEN_REPLY)["text"]


def _check_generation_prompt(ask: Ask) -> None:
    without = ask(add_generation_prompt=False)["usage"]["prompt_tokens"]
    assert ask()["usage"]["prompt_tokens"] - without == 1 + len("assistant:")  # "<s>" is one token


def _check_continue_final_message(ask: Ask) -> None:
    assert ask(return_prompt_text=True, **OPEN_REPLY)["prompt_text"].endswith("<s>assistant: Hel")
    closed = {**OPEN_REPLY, "continue_final_message": False}
    assert ask(return_prompt_text=True, **closed)["prompt_text"].endswith("<s>assistant: Hel\n")


def _check_documents(ask: Ask) -> None:
    text = ask(return_prompt_text=True, documents=[{"title": "t", "text": "Doc body"}])["prompt_text"]
    assert text.startswith("<s>doc: Doc body\n<s>user: Hi")
    # rendered into the prompt, they count against the context: by their bytes, before tokenizing
    response = ask.http.post(ROUTES["chat"], json={**BASE["chat"], "documents": [{"title": "t", "text": "d" * 10**5}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages") and "bytes" in error["message"]


def _check_template_variables(ask: Ask) -> None:
    text = ask(return_prompt_text=True, chat_template_kwargs={"greeting": "Howdy"})["prompt_text"]
    assert text.startswith("Howdy\n<s>user: Hi")


def _check_prompt_text(ask: Ask) -> None:
    assert ask(return_prompt_text=True)["prompt_text"] == "<s>user: Hi\n<s>assistant:"


CUSTOM: dict[str, Callable[[Ask], None]] = {
    "prompt_logprobs": _check_prompt_logprobs, "response_format": _check_response_format,
    "structured_outputs": _check_structured_outputs, "add_special_tokens": _check_add_special_tokens,
    "request_id": _check_request_id, "session_id": _check_session_id,
    "return_tokens_as_token_ids": _check_logprob_tokens, "return_token_ids": _check_token_ids,
    "cache_salt": _check_cache_salt, "stream_interval": _check_stream_interval, "echo": _check_echo,
    "add_generation_prompt": _check_generation_prompt, "continue_final_message": _check_continue_final_message,
    "documents": _check_documents, "chat_template_kwargs": _check_template_variables,
    "return_prompt_text": _check_prompt_text,
}


def test_the_walk_covers_every_field_once_and_the_docs_list_them():
    fields = set(VLLM_COMPLETION_EXTRA_PARAMS) | set(VLLM_CHAT_EXTRA_PARAMS)
    kinds = [set(REFUSED), set(SAMPLING), set(CUSTOM)]
    assert set.union(*kinds) == fields and sum(map(len, kinds)) == len(fields)
    documented = _table("Request fields")
    assert fields <= set(documented), fields - set(documented)
    for name in REFUSED:
        assert "refused" in documented[name], documented[name]


@pytest.mark.parametrize("endpoint, field", WALK, ids=[f"{e}-{f}" for e, f in WALK])
def test_each_vllm_field_is_honoured_or_refused_by_name(http, offline, endpoint, field):
    ask = Ask(http, endpoint, offline)
    if field in REFUSED:
        asked, nothing = REFUSED[field]
        response = http.post(ROUTES[endpoint], json={**BASE[endpoint], field: asked})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (field, "unsupported_parameter")
        assert error["message"].startswith(f"{field}: not supported by loramux")
        assert ask(**{field: nothing})["text"] == ask()["text"]  # its default asks for nothing
    elif field in SAMPLING:
        value, rest = SAMPLING[field](ask())
        got = ask(**rest, **{field: value})
        expected, without = ask.offline(**rest, **{field: value}), ask.offline(**rest)
        assert (got["text"], got["token_ids"]) == (expected.text, expected.token_ids)
        assert (expected.text, expected.token_ids) != (without.text, without.token_ids)  # it had an effect
    else:
        CUSTOM[field](ask)


# ---------------------------------------------------------------------------------------------
# structured_outputs: every form of vLLM's StructuredOutputsParams
# ---------------------------------------------------------------------------------------------

FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.mark.parametrize("form, check", [
    ({"choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    ({"regex": "[A-Z]{2}-[0-9]{3}"}, lambda text: re.fullmatch("[A-Z]{2}-[0-9]{3}", text)),
    ({"json": FLAG}, lambda text: json.loads(text) in ({"ok": True}, {"ok": False}) and "\n" in text),
    ({"json": json.dumps(FLAG), "disable_any_whitespace": True},
     lambda text: json.loads(text) in ({"ok": True}, {"ok": False}) and "\n" not in text),
    ({"json": FLAG, "disable_additional_properties": True}, lambda text: set(json.loads(text)) == {"ok"}),
    ({"grammar": 'root ::= "yes" | "no" | "maybe"'}, lambda text: text in ("yes", "no", "maybe")),
    ({"json_object": True}, lambda text: text.startswith("{")),
    ({"structural_tag": json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "ok!"}})},
     lambda text: text == "ok!"),
], ids=["choice", "regex", "json", "json-one-line", "json-strict", "grammar", "json_object", "structural_tag"])
def test_structured_outputs_in_every_form(client, form, check):
    for create in (lambda **kw: client.completions.create(prompt="Answer:", **kw).choices[0].text,
                   lambda **kw: client.chat.completions.create(
                       messages=[{"role": "user", "content": "Answer"}], **kw).choices[0].message.content):
        text = create(model="style", max_tokens=40, temperature=1.0, seed=4, extra_body={"structured_outputs": form})
        assert check(text), (form, text)


@pytest.mark.parametrize("extra, words", [
    ({"structured_outputs": {"json": FLAG, "whitespace_pattern": " *"}}, "whitespace_pattern: not supported"),
    ({"structured_outputs": {"backend": "xgrammar", "regex": "a"}}, "unknown key 'backend'"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "set exactly one"),
    ({"structured_outputs": {}}, "set exactly one"),
    ({"structured_outputs": {"regex": "a+"}, "guided_choice": ["a"]}, "one structured-output format"),
    ({"structured_outputs": {"json": {"not": {"type": "string"}}}}, "'not'"),
])
def test_bad_structured_outputs_are_400_naming_the_field(client, extra, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body=extra)
    param = "guided_choice" if "guided_choice" in extra else "structured_outputs"
    assert caught.value.body["param"] == param and words in caught.value.body["message"], caught.value.body

"""What OpenAI clients and evaluation harnesses rely on, against a real `loramux serve` process:
prompt logprobs for every position whatever the prefix cache holds, one choice per stream chunk,
the `openai` client's streaming helpers, an lm-evaluation-harness style scorer over repeated
contexts, and request validation (`stream_options`, 64-bit seeds).

The oracles: the same requests without streaming, the offline `LLM` with prefix caching off in
this process, and transformers + PEFT's `log_softmax` for the adapter.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

openai = pytest.importorskip("openai", reason="the serve extras are not installed: pip install -e .[serve,test]")
from conftest import char_tokenizer  # noqa: E402
from test_engine_outputs import oracle_logprobs  # noqa: E402
from test_server import metric  # noqa: E402
# the server and clients of test_server_api, on this module's workspace
from test_server_api import client, http, server, tiny_workspace  # noqa: E402,F401

# The character tokenizer with a BOS on every text prompt (as Llama's), and a chat template that
# shows vLLM's template inputs: documents and a variable of its own.
CHAT_TEMPLATE = ("{% for d in documents or [] %}<s>doc: {{ d['text'] }}\n{% endfor %}"
                 "{% if greeting %}{{ greeting }}\n{% endif %}"
                 "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
CONTEXTS = ["The quick brown fox jumps over the lazy", "Question: which planet is red? Answer:"]
CONTINUATIONS = [" dog", " cat.", " Mars", " it"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    tokenizer = char_tokenizer()
    tokenizer.add_bos_token = True
    tokenizer.chat_template = CHAT_TEMPLATE
    return tiny_workspace(tmp_path_factory.mktemp("serving_compat"), tokenizer)


@pytest.fixture(scope="module")
def offline(workspace):
    """The cache-off run: ``offline(prompts, adapter=None, **sampling) -> [RequestOutput]``."""
    from loramux import LLM, LoRARequest, SamplingParams

    llm = LLM(str(workspace["model"]), max_loras=1, max_model_len=128, dtype="float32", enable_prefix_caching=False)

    def run(prompts, adapter=None, **sampling):
        lora = None if adapter is None else LoRARequest(adapter, 1, str(workspace["adapter"]))
        return llm.generate(prompts, SamplingParams(**sampling), lora, use_tqdm=False)

    run.tokenizer = llm.get_tokenizer()
    return run


# ---------------------------------------------------------------------------------------------
# Prompt logprobs under prefix caching
# ---------------------------------------------------------------------------------------------


def test_scoring_a_prompt_whose_start_is_cached_scores_every_position(client, http, offline, workspace):
    prompt = "A prompt long enough to fill two cache blocks, scored twice."
    ids = offline.tokenizer(prompt).input_ids
    assert ids[0] == 1 and len(ids) > 32  # a BOS, then two full 16-token blocks and more
    hits = 'loramux_prefix_cache_hits_total{model_name="tiny"}'
    for _ in range(2):  # the second finds the first's blocks: the prefix is cached
        before = metric(http, hits)
        client.completions.create(model="style", prompt=prompt, max_tokens=1, temperature=0)
    assert metric(http, hits) - before >= 32

    expected = oracle_logprobs(workspace["adapter"], ids)  # [T, V]: PEFT's log_softmax
    scores = []
    for _ in range(2):  # scored twice, the cache holding the prefix each time
        before = metric(http, hits)
        response = client.completions.create(model="style", prompt=prompt, max_tokens=0, echo=True, logprobs=2,
                                             extra_body={"prompt_logprobs": 2})
        assert metric(http, hits) == before  # computed in full, not read from the cache
        choice = response.choices[0]
        logprobs = choice.logprobs
        assert choice.text == prompt and len(logprobs.token_logprobs) == len(ids)
        assert logprobs.token_logprobs[0] is None and None not in logprobs.token_logprobs[1:]
        assert None not in logprobs.top_logprobs[1:]
        prompt_logprobs = choice.model_extra["prompt_logprobs"]
        assert prompt_logprobs[0] is None and None not in prompt_logprobs[1:]
        for position in range(1, len(ids)):
            token, row = ids[position], expected[position - 1]
            assert logprobs.token_logprobs[position] == pytest.approx(row[token].item(), abs=1e-4)
            assert prompt_logprobs[position][str(token)]["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
            assert prompt_logprobs[position][str(token)]["rank"] == int((row > row[token]).sum()) + 1
        scores.append(logprobs.token_logprobs)
    assert scores[0] == scores[1]

    # chat: vLLM puts them beside the choices
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=1, extra_body={"prompt_logprobs": 0}).model_dump()
    assert chat["prompt_logprobs"][0] is None and None not in chat["prompt_logprobs"][1:]


# ---------------------------------------------------------------------------------------------
# Streams: one choice per chunk
# ---------------------------------------------------------------------------------------------


def _by_index(chunks, text_of) -> tuple[dict[int, str], dict[int, list]]:
    """Each choice's accumulated text and its finish reasons (one per chunk that had one), as a
    client keying by ``choice.index`` sees them; every chunk carries at most one choice."""
    texts, reasons = defaultdict(str), defaultdict(list)
    for chunk in chunks:
        assert len(chunk.choices) <= 1, chunk
        for choice in chunk.choices:
            assert not reasons[choice.index], "a chunk after the choice's finish_reason"
            texts[choice.index] += text_of(choice) or ""
            if choice.finish_reason is not None:
                reasons[choice.index].append(choice.finish_reason)
    return texts, reasons


def test_completions_stream_one_choice_per_chunk_with_n_and_prompt_lists(client):
    ask = dict(model="style", prompt=["Once upon", "In a land"], n=2, max_tokens=6, temperature=1.0, seed=11)
    full = client.completions.create(**ask)
    chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    texts, reasons = _by_index(chunks[:-1], lambda choice: choice.text)
    assert {i: texts[i] for i in range(4)} == {c.index: c.text for c in full.choices}
    assert len(set(texts.values())) > 1  # the choices differ, so mixing them up would show
    assert {i: reasons[i] for i in range(4)} == {c.index: [c.finish_reason] for c in full.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_chat_stream_one_choice_per_chunk_with_roles_logprobs_and_usage_so_far(client):
    ask = dict(model="style", messages=[{"role": "user", "content": "Tell me"}], n=3, max_tokens=6,
               temperature=1.0, seed=5, logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(
        **ask, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert [c.choices[0].delta.role for c in chunks[:3]] == ["assistant"] * 3
    assert [c.choices[0].index for c in chunks[:3]] == [0, 1, 2]
    texts, reasons = _by_index(chunks[:-1], lambda choice: choice.delta.content)
    assert [texts[i] for i in range(3)] == [c.message.content for c in full.choices]
    assert [reasons[i] for i in range(3)] == [[c.finish_reason] for c in full.choices]
    streamed = defaultdict(list)
    used = defaultdict(list)
    for chunk in chunks[:-1]:
        choice = chunk.choices[0]
        streamed[choice.index] += choice.logprobs.content if choice.logprobs else []
        used[choice.index].append(chunk.usage.completion_tokens)
        assert chunk.usage.prompt_tokens == full.usage.prompt_tokens  # one prompt
    for i, choice in enumerate(full.choices):
        assert [(t.token, t.logprob) for t in streamed[i]] == [(t.token, t.logprob) for t in choice.logprobs.content]
        assert used[i] == sorted(used[i]) and used[i][-1] == len(choice.logprobs.content)
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_openai_stream_helper_accumulates_each_choice(client):
    """``client.chat.completions.stream``: its snapshot keyed by choice index, and the deltas a
    client collects from its events, equal the answer without streaming. (The helper refuses an
    answer cut by max_tokens: a regex ends these.)"""
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Stream it"}], n=2, max_tokens=16,
               temperature=1.0, seed=21, extra_body={"structured_outputs": {"regex": "[a-z]{3,9}[.]"}})
    full = client.chat.completions.create(**ask)
    deltas = defaultdict(str)
    with client.chat.completions.stream(**ask) as stream:
        for event in stream:
            if event.type == "chunk":
                assert len(event.chunk.choices) <= 1
                for choice in event.chunk.choices:
                    deltas[choice.index] += choice.delta.content or ""
        final = stream.get_final_completion()
    assert [c.message.content for c in final.choices] == [c.message.content for c in full.choices]
    assert [deltas[i] for i in range(2)] == [c.message.content for c in full.choices]
    assert [c.finish_reason for c in final.choices] == [c.finish_reason for c in full.choices] == ["stop"] * 2


# ---------------------------------------------------------------------------------------------
# An evaluation harness's loglikelihood
# ---------------------------------------------------------------------------------------------


def harness_loglikelihood(client, tokenizer, model: str, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness' ``loglikelihood`` over an OpenAI completions endpoint: each context +
    continuation as token ids, ``echo``, ``logprobs: 1``, ``max_tokens: 0``; the continuation's
    summed logprob and whether greedy decoding would have written it."""
    prompts, context_lengths = [], []
    for context, continuation in pairs:
        context_ids = tokenizer(context).input_ids
        prompts.append(context_ids + tokenizer(continuation, add_special_tokens=False).input_ids)
        context_lengths.append(len(context_ids))
    response = client.completions.create(model=model, prompt=prompts, echo=True, logprobs=1, max_tokens=0,
                                         temperature=0)
    results = []
    for choice, start in zip(sorted(response.choices, key=lambda c: c.index), context_lengths):
        logprobs = choice.logprobs
        greedy = all(max(top, key=top.get) == token
                     for token, top in zip(logprobs.tokens[start:], logprobs.top_logprobs[start:]))
        results.append((sum(logprobs.token_logprobs[start:]), greedy))
    return results


def test_an_evaluation_harness_scores_repeated_contexts_as_the_cache_off_run(client, offline):
    tokenizer = offline.tokenizer
    pairs = [(context, continuation) for context in CONTEXTS for continuation in CONTINUATIONS]
    prompts = [tokenizer(c).input_ids + tokenizer(x, add_special_tokens=False).input_ids for c, x in pairs]
    expected = []
    for (context, _), prompt, out in zip(pairs, prompts, offline([{"prompt_token_ids": p} for p in prompts], "style",
                                                                  max_tokens=1, prompt_logprobs=1)):
        start = len(tokenizer(context).input_ids)
        entries = [out.prompt_logprobs[i] for i in range(start, len(prompt))]
        expected.append((sum(e[t].logprob for e, t in zip(entries, prompt[start:])),
                         all(e[t].rank == 1 for e, t in zip(entries, prompt[start:]))))
    # in batches as a harness sends them (the later ones find their contexts cached), then one by one
    scored = (harness_loglikelihood(client, tokenizer, "style", pairs[:4])
              + harness_loglikelihood(client, tokenizer, "style", pairs[4:]))
    scored_alone = [harness_loglikelihood(client, tokenizer, "style", [pair])[0] for pair in pairs]
    for got in (scored, scored_alone):
        assert [greedy for _, greedy in got] == [greedy for _, greedy in expected]
        assert [value for value, _ in got] == pytest.approx([value for value, _ in expected], abs=1e-4)


# ---------------------------------------------------------------------------------------------
# Validation as OpenAI and vLLM do it
# ---------------------------------------------------------------------------------------------


def test_stream_options_only_with_stream_and_prompt_logprobs_only_without(client, http):
    for route, body in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        for stream in (False, None):
            request = {"model": "tiny", "max_tokens": 2, **body, "stream_options": {"include_usage": True}}
            if stream is not None:
                request["stream"] = stream
            response = http.post(route, json=request)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "stream_options" and "stream: true" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, stream_options={"include_usage": True})
    assert caught.value.param == "stream_options"
    with pytest.raises(openai.BadRequestError) as caught:  # as vLLM: a stream has no place for them
        client.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert caught.value.param == "prompt_logprobs"
    assert http.get("/health").json() == {"status": "ok"}


def test_seeds_are_signed_64_bit(client, offline):
    for seed in (2**63, 2**63 + 1, -(2**63) - 1, 2**70):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="tiny", prompt="x", max_tokens=2, seed=seed)
        assert caught.value.param == "seed" and "seed" in caught.value.message
    for seed in (2**63 - 1, -(2**63)):  # the edges work, n > 1 included (choice i: seed + i)
        response = client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=1.0, seed=seed,
                                             n=2)
        expected = offline(["abc"], max_tokens=4, temperature=1.0, seed=seed, n=2)[0].outputs
        assert [c.text for c in response.choices] == [c.text for c in expected]

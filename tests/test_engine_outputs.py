"""What the engine hands back beyond tokens: logprobs and prompt logprobs against transformers +
PEFT (the oracle), and structured outputs that always parse and validate."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import char_tokenizer, tiny_llama

from loramux import LoRARequest, SamplingParams, StructuredOutputsParams
from loramux.engine.llm import LLM
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.core.structured_output import UnsupportedStructuredOutput


def oracle_logprobs(adapter_path, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers (+ PEFT) logits over the whole sequence: [T, V]."""
    from peft import PeftModel

    base = tiny_llama()
    model = base if adapter_path is None else PeftModel.from_pretrained(base, adapter_path)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(-1)


def test_logprobs_and_prompt_logprobs_equal_peft(engine_adapters):
    """Greedy and sampled requests, base and two adapters in one batch, chunked prefill, and one
    request asking for nothing beside them."""
    torch.manual_seed(5)
    prompts = [torch.randint(3, 128, (n,)).tolist() for n in (7, 23, 12, 5)]
    names = [None, "all", "attn", "all"]
    ids = {"attn": 1, "all": 2}
    loras = [None if n is None else LoRARequest(n, ids[n], str(engine_adapters[n])) for n in names]
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3),
        SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=0),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, presence_penalty=1.0),
    ]
    llm = LLM(tiny_llama(), max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64,
              max_num_batched_tokens=16, dtype="float32")
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)
    for name, prompt, param, out in zip(names, prompts, params, outputs):
        completion = out.outputs[0]
        full = prompt + completion.token_ids
        expected = oracle_logprobs(None if name is None else engine_adapters[name], full)  # [T, V]
        if param.logprobs is None:
            assert completion.logprobs is None and out.prompt_logprobs is None
            continue
        assert len(completion.logprobs) == len(completion.token_ids)
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = expected[len(prompt) - 1 + step]
            assert token in entry
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(param.logprobs)
            for rank, (value, top_token) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
                assert entry[top_token].logprob == pytest.approx(value, abs=1e-4)
                assert entry[top_token].rank in (rank, entry[top_token].rank)  # ties keep the chosen token's
            assert len(entry) in (param.logprobs, param.logprobs + 1)
        if param.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for position in range(1, len(prompt)):
            entry = out.prompt_logprobs[position]
            row = expected[position - 1]
            assert entry[prompt[position]].logprob == pytest.approx(row[prompt[position]].item(), abs=1e-4)
            assert len(entry) >= max(1, param.prompt_logprobs)
            for top_token in row.topk(param.prompt_logprobs).indices.tolist():
                assert entry[top_token].logprob == pytest.approx(row[top_token].item(), abs=1e-4)


def test_prompt_logprobs_of_a_prompt_whose_start_is_cached_equal_peft(engine_adapters):
    """The same prompt scored twice, its first two blocks in the prefix cache (a plain request
    put them there, and a plain request finds them again after): every position is scored, the
    same both times and as PEFT's log_softmax, for the base model and an adapter."""
    torch.manual_seed(9)
    prompt = torch.randint(3, 128, (37,)).tolist()
    llm = LLM(tiny_llama(), max_loras=1, max_lora_rank=8, max_model_len=64, dtype="float32")
    stats = llm.llm_engine.block_manager.stats
    for name in (None, "all"):
        lora = None if name is None else LoRARequest(name, 1, str(engine_adapters[name]))
        expected = oracle_logprobs(None if name is None else engine_adapters[name], prompt)  # [T, V]
        plain = SamplingParams(temperature=0, max_tokens=1)
        llm.generate({"prompt_token_ids": prompt}, plain, lora, use_tqdm=False)
        scored = []
        for _ in range(2):
            hits = stats.hits
            scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
            out = llm.generate({"prompt_token_ids": prompt}, scoring, lora, use_tqdm=False)[0]
            assert stats.hits == hits  # computed in full
            assert out.prompt_logprobs[0] is None and None not in out.prompt_logprobs[1:]
            for position in range(1, len(prompt)):
                token, row = prompt[position], expected[position - 1]
                assert out.prompt_logprobs[position][token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            scored.append(out.prompt_logprobs)
        assert scored[0] == scored[1]
        hits = stats.hits
        llm.generate({"prompt_token_ids": prompt}, plain, lora, use_tqdm=False)
        assert stats.hits - hits == 32  # the prefix was cached all along


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def text_engine():
    model = tiny_llama()
    model.config.bos_token_id, model.config.eos_token_id = 1, 2
    return LLMEngine(model, tokenizer=char_tokenizer(), enable_lora=False, max_num_seqs=52, max_model_len=192)


def run_all(engine: LLMEngine, requests: list[tuple[str, SamplingParams]]) -> list:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[str(i)] for i in range(len(requests))]


def test_50_structured_requests_always_parse_and_validate(text_engine):
    """A random model: without the grammar its output is noise; with it every answer validates."""
    spec = StructuredOutputsParams(json=SCHEMA)
    requests = [("Describe a pet: ", SamplingParams(temperature=0 if i < 10 else 1.0, seed=i, max_tokens=150,
                                                     structured_outputs=spec)) for i in range(50)]
    requests.append(("Describe a pet: ", SamplingParams(temperature=1.0, seed=1, max_tokens=30)))  # unconstrained
    outputs = run_all(text_engine, requests)
    for out in outputs[:-1]:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        pytest.importorskip("jsonschema", reason="pip install jsonschema (a test extra)").validate(json.loads(completion.text), SCHEMA)
    with pytest.raises(ValueError):
        json.loads(outputs[-1].outputs[0].text)


def test_regex_choice_and_json_object(text_engine):
    requests = [
        ("a", SamplingParams(temperature=1.0, seed=1, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"))),
        ("b", SamplingParams(temperature=1.0, seed=2, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))),
        ("c", SamplingParams(temperature=0, max_tokens=60, min_tokens=3,
                             structured_outputs=StructuredOutputsParams(json_object=True))),
    ]
    regex, choice, obj = (out.outputs[0] for out in run_all(text_engine, requests))
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex.text), regex.text
    assert choice.text in ("yes", "no", "maybe")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # a random model may write a long object; the grammar still kept it a valid prefix
        assert obj.text.startswith("{")


@pytest.mark.parametrize("schema, feature", [
    ({"type": "string", "not": {"const": "a"}}, "'not'"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "'if'"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"$ref": "https://example.com/schema.json"}, "remote '\\$ref'"),
    ({"type": "object", "properties": {"a": {"type": "nonsense"}}}, "nonsense"),
])
def test_unsupported_schema_features_are_refused_by_name(text_engine, schema, feature):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    with pytest.raises(UnsupportedStructuredOutput, match=feature):
        text_engine.add_request("bad", "x", params)
    assert not text_engine.has_unfinished_requests()


def test_logit_bias_outside_the_vocabulary_is_refused(text_engine):
    with pytest.raises(ValueError, match="logit_bias names token id 500"):
        text_engine.add_request("bias", "x", SamplingParams(logit_bias={500: 1.0}))

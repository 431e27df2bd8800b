"""`SamplingParams` as vLLM's: every vLLM field is in docs/sampling.md's table with what loramux
does with it, and the fields whose meaning vLLM defines behave so through `LLM.generate`: ``n``
samples per prompt, ``top_k`` 0 or -1 for none, ``max_tokens=None`` until the context is full,
``best_of`` refused, 64-bit seeds, ``allowed_token_ids``, ``detokenize``."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from conftest import char_tokenizer, tiny_llama

from loramux import LLM, SamplingParams
from loramux.engine.sampling_params import SEED_RANGE

REPO = Path(__file__).resolve().parents[1]

# vLLM's SamplingParams fields: vllm-project/vllm, vllm/sampling_params.py (class SamplingParams),
# commit 00388f6573ccfcffad607b8c9ecdf341a4669ceb, less its internal ones (output_text_buffer_length
# and the underscored); best_of, use_beam_search, length_penalty, early_stopping,
# truncate_prompt_tokens, guided_decoding and logits_processors from its earlier releases.
VLLM_SAMPLING_PARAMS = [
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "prompt_logprob_token_ids", "prompt_logprob_start", "logprob_token_ids", "flat_logprobs",
    "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "output_kind", "stream_interval", "skip_clone", "structured_outputs", "logit_bias", "allowed_token_ids",
    "extra_args", "bad_words", "skip_reading_prefix_cache", "thinking_token_budget", "repetition_detection",
    "routed_experts_prompt_start", "trace_decode_token_ids",
    "best_of", "use_beam_search", "length_penalty", "early_stopping", "truncate_prompt_tokens", "guided_decoding",
    "logits_processors",
]


def _table(heading: str) -> dict[str, str]:
    """docs/sampling.md's table under ``heading``: first column (a field name) -> the row."""
    text = (REPO / "docs" / "sampling.md").read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return {m[1]: m[0] for m in re.finditer(r"^\| `(\w+)` \|.*$", text, re.M)}


def test_the_docs_table_has_every_vllm_field_and_every_field_of_ours():
    rows = _table("SamplingParams")
    ours = {f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")}
    assert set(VLLM_SAMPLING_PARAMS) | ours == set(rows), set(rows) ^ (set(VLLM_SAMPLING_PARAMS) | ours)
    for name in set(VLLM_SAMPLING_PARAMS) - ours:  # vLLM's fields we lack: a clear error, as the table says
        assert "refused" in rows[name], rows[name]
        with pytest.raises(TypeError, match=name):
            SamplingParams(**{name: 1})


@pytest.fixture(scope="module")
def llm():
    model = tiny_llama()
    model.config.bos_token_id, model.config.eos_token_id = 1, 2
    return LLM(model, tokenizer=char_tokenizer(), enable_lora=False, max_num_seqs=8, max_model_len=24)


PROMPT = {"prompt_token_ids": [5, 9, 11, 4, 7]}


def tokens(llm, params, prompt=PROMPT):
    return [c.token_ids for c in llm.generate(prompt, params, use_tqdm=False)[0].outputs]


def test_n_gives_n_completions_per_prompt_each_seeded_as_vllm(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([PROMPT, {"prompt_token_ids": [3, 3]}], params, use_tqdm=False)
    assert [len(out.outputs) for out in outputs] == [3, 3]
    assert [c.index for c in outputs[0].outputs] == [0, 1, 2]
    samples = [c.token_ids for c in outputs[0].outputs]
    # sample i is the request seeded seed + i (vLLM's rule), whatever runs beside it
    assert samples == [tokens(llm, dataclasses.replace(params, n=1, seed=7 + i))[0] for i in range(3)]
    assert len({tuple(s) for s in samples}) == 3
    assert outputs[0].prompt_token_ids == PROMPT["prompt_token_ids"] and outputs[0].finished
    assert tokens(llm, SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True)) == [
        tokens(llm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]] * 2
    with pytest.raises(ValueError, match=r"SamplingParams.n=2.*one request per sample"):
        llm.llm_engine.add_request("x", PROMPT, SamplingParams(n=2))
    assert not llm.llm_engine.has_unfinished_requests()


def test_top_k_0_and_minus_1_keep_every_token(llm):
    sampled = [tokens(llm, SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, **k))
               for k in ({}, {"top_k": 0}, {"top_k": -1}, {"top_k": 128})]
    assert sampled[0] == sampled[1] == sampled[2] == sampled[3]
    assert SamplingParams().top_k == 0  # vLLM's default
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)


def test_max_tokens_none_runs_until_the_context_is_full(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 24 - 5 and out.outputs[0].finish_reason == "length"
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens \(3\)"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_best_of_beyond_n_is_refused_by_name():
    assert SamplingParams(n=2, best_of=2).best_of == 2
    with pytest.raises(ValueError, match=r"best_of: got 3 with n=1.*logprobs=0"):
        SamplingParams(best_of=3)


def test_seeds_take_64_bits_and_samples_wrap_past_the_top(llm):
    low, high = SEED_RANGE
    assert (low, high) == (-(2**63), 2**64 - 1)
    for seed in (low, 2**63 + 1, high):
        assert len(tokens(llm, SamplingParams(seed=seed, max_tokens=3, ignore_eos=True))[0]) == 3
    for seed in (low - 1, high + 1, 1.5, True):
        with pytest.raises(ValueError, match="SamplingParams.seed"):
            SamplingParams(seed=seed)
    assert SamplingParams(seed=high, n=2).for_sample(1).seed == 0
    assert SamplingParams(seed=-1).seed is None  # vLLM's: -1 is no seed
    assert SamplingParams(seed=high, n=2, temperature=1.0, max_tokens=2).for_sample(1).n == 1
    assert len(tokens(llm, SamplingParams(seed=high, n=2, max_tokens=3, ignore_eos=True))) == 2


def test_allowed_token_ids_and_detokenize(llm):
    allowed = [7, 9, 40]
    for out in tokens(llm, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=8, allowed_token_ids=allowed)):
        assert set(out) <= set(allowed) and out
    with pytest.raises(ValueError, match="allowed_token_ids names token id 500"):
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[500]), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    text = llm.generate("abc", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    bare = llm.generate("abc", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False),
                        use_tqdm=False)[0]
    assert text.outputs[0].text and bare.outputs[0].text == ""
    assert bare.outputs[0].token_ids == text.outputs[0].token_ids
    with pytest.raises(ValueError, match="detokenize=False"):
        SamplingParams(stop=["x"], detokenize=False)


def test_prompt_logprobs_skip_the_prefix_cache_unless_told_otherwise():
    assert SamplingParams(prompt_logprobs=1).skip_reading_prefix_cache is True
    assert SamplingParams().skip_reading_prefix_cache is False
    assert SamplingParams(skip_reading_prefix_cache=True).skip_reading_prefix_cache is True
    with pytest.raises(ValueError, match="cached positions unscored"):
        SamplingParams(prompt_logprobs=1, skip_reading_prefix_cache=False)

"""An engine gives back what it holds when it is closed, left (`with`) or dropped (`del`).

No reference cycle or thread keeps an engine alive: its last reference going away closes it
(loads stop, tensor-parallel workers exit, device memory is released), as closing it does; a
closed engine refuses work with a clear error. The GPU twin builds 8B-shaped engines in a loop.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
from conftest import tiny_llama

from loramux import LLM, EngineClosedError, LoRARequest, SamplingParams
from loramux.registry import Registry

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _used(llm: LLM, adapter) -> None:
    """Requests on the base model and on an adapter, run to the end."""
    outputs = llm.generate([{"prompt_token_ids": [3, 4, 5]}] * 2, PARAMS,
                           [None, LoRARequest("a", 1, str(adapter))], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]


def loading_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("loramux-load")}


def test_dropping_the_last_reference_frees_the_engine_without_a_collection(make_adapter):
    adapter = make_adapter("a")
    others = loading_threads()  # other registries' (they end when their owners go)
    llm = LLM(tiny_llama(), max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64)
    _used(llm, adapter)
    engine = weakref.ref(llm.llm_engine)
    parts = [weakref.ref(p) for p in (llm.llm_engine.model, llm.llm_engine.lora_manager, llm.llm_engine.scheduler,
                                      llm.llm_engine.adapters, llm.llm_engine.kv_cache)]
    gc.collect()
    gc.disable()  # reference counts alone: nothing may wait for the cycle collector
    try:
        del llm
        assert engine() is None
        assert [p() is None for p in parts] == [True] * len(parts)
    finally:
        gc.enable()
    assert not loading_threads() - others  # its own ended with it


def test_a_registry_that_outlives_the_engine_does_not_keep_it(make_adapter):
    adapter = make_adapter("a")
    registry = Registry()
    llm = LLM(tiny_llama(), max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64, registry=registry)
    _used(llm, adapter)
    model = weakref.ref(llm.llm_engine.model)
    del llm
    gc.collect()
    assert model() is None
    assert "a" in registry.list()  # the registry itself carries on


def test_with_block_closes_and_a_closed_engine_refuses_work_clearly(make_adapter):
    adapter = make_adapter("a")
    with LLM(tiny_llama(), max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64) as llm:
        _used(llm, adapter)
        assert not llm.llm_engine.closed
    assert llm.llm_engine.closed and llm.llm_engine.kv_cache is None and llm.llm_engine.runner.kv is None
    llm.close()  # idempotent
    llm.llm_engine.close()
    with pytest.raises(EngineClosedError, match="is closed.*Build a new LLM"):
        llm.generate([{"prompt_token_ids": [3, 4]}], PARAMS, use_tqdm=False)
    with pytest.raises(EngineClosedError):
        llm.llm_engine.step()


def test_closing_frees_the_weights_of_a_model_the_engine_loaded_and_leaves_a_given_one(tmp_path):
    """A closed engine the caller still holds keeps no weights of a model it loaded (the next
    engine sizes its KV cache from what is free); a model passed in is its owner's, untouched."""
    from conftest import char_tokenizer

    tiny_llama().save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    with LLM(str(tmp_path), max_num_seqs=2, max_model_len=32) as loaded:
        loaded.generate([{"prompt_token_ids": [3, 4]}], PARAMS, use_tqdm=False)
        model = loaded.llm_engine.model
        assert sum(p.numel() for p in model.parameters()) > 0
    assert sum(t.numel() for t in [*model.parameters(), *model.buffers()]) == 0
    given = tiny_llama()
    numel, embeddings = sum(p.numel() for p in given.parameters()), given.get_input_embeddings().weight.clone()
    with LLM(given, enable_lora=False, max_num_seqs=2, max_model_len=32) as llm:
        llm.generate([{"prompt_token_ids": [3, 4]}], PARAMS, use_tqdm=False)
    # its owner's, whole (the engine fused its sibling projections in place: the same weights)
    assert sum(p.numel() for p in given.parameters()) == numel and given.get_input_embeddings().weight.equal(embeddings)


def test_closing_mid_generation_fails_the_caller_and_leaves_no_thread(make_adapter):
    adapter = make_adapter("a")
    llm = LLM(tiny_llama(), max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=50, ignore_eos=True),
                       LoRARequest("a", 1, str(adapter)))
    engine.step()
    llm.close()
    with pytest.raises(EngineClosedError):
        engine.step()
    assert not [t for t in threading.enumerate() if t.name.startswith("loramux-load") and t.is_alive()
                and not t.daemon]


@pytest.mark.gpu
@pytest.mark.whole_gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_three_8b_engines_in_turn_at_ninety_percent_without_running_out_of_memory():
    """Each engine takes 90% of the GPU (weights, adapter pools, graphs, KV cache); each is only
    deleted, never closed, before the next one is built."""
    import torch

    free_before = torch.cuda.mem_get_info()[0]
    for round_ in range(3):
        llm = LLM("llama-3.1-8b", load_format="dummy", gpu_memory_utilization=0.9, max_loras=4, max_lora_rank=16,
                  max_num_seqs=8, max_model_len=256, max_num_batched_tokens=256, cuda_graph_sizes=[8])
        outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, PARAMS, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 4 for o in outputs), round_
        del llm, outputs
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.mem_get_info()[0] > free_before - 2 * 2**30  # within 2 GiB of where it started


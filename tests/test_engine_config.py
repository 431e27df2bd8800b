"""`EngineConfig`: one validated dataclass for the engine's options."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from conftest import tiny_llama

from loramux import LoRARequest, SamplingParams
from loramux.engine.config import EngineConfig
from loramux.engine.llm import LLM
from loramux.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SMALL = dict(max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32)


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(max_num_seqs=0), ValueError, "max_num_seqs: got 0; allowed: an int >= 1"),
        (dict(max_model_len=-3), ValueError, "max_model_len: got -3; allowed: an int >= 1"),
        (dict(max_num_batched_tokens=2.5), ValueError, "max_num_batched_tokens: got 2.5; allowed: an int >= 1"),
        (dict(max_num_seqs=8, max_num_batched_tokens=4), ValueError,
         "max_num_batched_tokens=4 must be >= max_num_seqs=8"),
        (dict(block_size=24), ValueError, "block_size: got 24; allowed: a power of two >= 8"),
        (dict(gpu_memory_utilization=0), ValueError, "gpu_memory_utilization: got 0; allowed: a number in"),
        (dict(gpu_memory_utilization=True), ValueError, "gpu_memory_utilization: got True"),
        (dict(num_gpu_blocks_override=0), ValueError, "num_gpu_blocks_override: got 0"),
        (dict(load_format="safetensors"), ValueError, "load_format: got 'safetensors'; allowed: 'auto'"),
        (dict(seed="7"), ValueError, "seed: got '7'; allowed: an int or None"),
        (dict(max_loading_workers=0), ValueError, "max_loading_workers: got 0"),
        (dict(max_graph_tokens=0), ValueError, "max_graph_tokens: got 0; allowed: an int >= 1"),
        (dict(max_graph_tokens=True), ValueError, "max_graph_tokens: got True"),
        (dict(cuda_graph_sizes=[]), ValueError, "cuda_graph_sizes: got []; allowed: None (the default sizes) or"),
        (dict(cuda_graph_sizes=[64, 1]), ValueError, "cuda_graph_sizes: got [64, 1]; allowed"),
        (dict(cuda_graph_sizes=[True, 8]), ValueError, "cuda_graph_sizes: got [True, 8]"),
        (dict(cuda_graph_sizes=[8.0]), ValueError, "cuda_graph_sizes: got [8.0]"),
        (dict(cuda_graph_sizes="64"), ValueError, "cuda_graph_sizes: got '64'"),
        (dict(cuda_graph_sizes=64), ValueError, "cuda_graph_sizes: got 64"),
        (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size: got 0; allowed: an int >= 1"),
        (dict(max_loras=0), ValueError, "max_loras"),
        (dict(max_lora_rank=4096), ValueError, "max_lora_rank"),
        (dict(enable_lora=False, lora_modules={"a": "/x"}), ValueError, "lora_modules were given but enable_lora=False"),
    ],
)
def test_each_bad_option_is_refused_naming_the_value(options, error, message):
    with pytest.raises(error, match=re.escape(message)):
        EngineConfig(**options)


def test_tensor_parallel_needs_a_model_the_workers_can_load():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs the model as a name, a dir"):
        EngineConfig(tiny_llama(), tensor_parallel_size=2)


def test_an_unknown_keyword_names_the_closest_option():
    with pytest.raises(TypeError, match="unknown engine option 'max_lora'; did you mean 'max_loras'"):
        EngineConfig.from_kwargs(None, max_lora=4)
    with pytest.raises(TypeError, match="unknown engine option 'max_lora'; did you mean 'max_loras'"):
        LLMEngine(tiny_llama(), max_lora=4)
    with pytest.raises(TypeError, match="unknown engine option 'zzz'; the options are model, enable_lora"):
        LLM(tiny_llama(), zzz=1)


def test_config_and_keywords_are_not_mixed():
    with pytest.raises(TypeError, match="either config=EngineConfig"):
        LLMEngine(tiny_llama(), config=EngineConfig())


def test_worker_config_drops_the_drivers_objects():
    config = EngineConfig("some/model", registry=object(), tokenizer=object(), lora_modules={"a": "/x"})
    worker = config.for_worker()
    assert (worker.registry, worker.tokenizer, worker.lora_modules) == (None, None, None)
    assert worker.model == "some/model" and config.registry is not None


def test_keywords_and_config_build_the_same_engine(engine_adapters):
    from_kwargs = LLMEngine(tiny_llama(), **SMALL)
    from_config = LLMEngine(config=EngineConfig(tiny_llama(), **SMALL))
    assert from_kwargs.config == dataclasses.replace(from_config.config, model=from_kwargs.model)
    lora = LoRARequest("attn", 1, str(engine_adapters["attn"]))
    outputs = []
    for engine in (from_kwargs, from_config):
        engine.add_request("base", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
        engine.add_request("lora", {"prompt_token_ids": [5, 6, 7]}, GREEDY, lora)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        outputs.append(done)
        engine.close()
    assert outputs[0] == outputs[1] and outputs[0]["base"] != outputs[0]["lora"]


def test_device_defaults_are_resolved_once_in_place_at_setup():
    config = EngineConfig(tiny_llama().to(torch.float64), enable_lora=False)
    assert config.max_num_seqs is None and config.max_model_len is None and config.device is None
    engine = LLMEngine(config=config)
    assert engine.config is config  # the one object the engine's parts read
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.max_shared_prefill_tokens) == (16, 1024, 8)
    assert config.async_scheduling is False  # a CPU forward returns once computed: nothing to overlap
    assert config.max_model_len == 128 and config.device == torch.device("cpu")  # the model's, on the CPU
    assert engine.runner.config is config and engine.scheduler.max_num_seqs == 16
    engine.close()


def test_resolving_checks_the_rules_again_with_the_defaults_filled_in():
    config = EngineConfig(max_num_batched_tokens=8)  # fine alone: max_num_seqs is not known yet
    with pytest.raises(ValueError, match="max_num_batched_tokens=8 must be >= max_num_seqs=16"):
        config.resolve(torch.device("cpu"), 128)


def test_serve_builds_an_engine_config_with_the_tensor_parallel_flag(monkeypatch):
    from loramux.cli import build_parser
    from loramux.serving import server

    built = []

    class Recorder:
        model_name = "recorded"

        def __init__(self, *, config):
            built.append(config)

    monkeypatch.setattr("loramux.engine.llm_engine.LLMEngine", Recorder)
    args = build_parser().parse_args(["serve", "some/model", "-tp", "2", "--max-num-seqs", "8", "--no-enable-lora",
                                      "--cuda-graph-sizes", "128", "64", "192"])
    server.build_engine(args)
    (config,) = built
    assert isinstance(config, EngineConfig)
    assert (config.model, config.tensor_parallel_size, config.max_num_seqs) == ("some/model", 2, 8)
    assert config.cuda_graph_sizes == [64, 128, 192]
    server.build_engine(build_parser().parse_args(["serve", "m"]))
    assert built[-1].cuda_graph_sizes is None  # the default sizes
    long_form = build_parser().parse_args(["serve", "m", "--tensor-parallel-size", "4"])
    assert long_form.tensor_parallel_size == 4 and build_parser().parse_args(["serve"]).tensor_parallel_size == 1

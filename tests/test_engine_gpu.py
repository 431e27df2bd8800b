"""The engine on CUDA (Triton kernels, pinned-buffer transfers, SDPA on the GPU) against the CPU
oracle. Run on the GPU machine: ``pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch
from conftest import peft_greedy, tiny_llama

from loramux import LoRARequest, SamplingParams
from loramux.engine.llm import LLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_mixed_batch_on_cuda_matches_the_cpu_oracle(engine_adapters):
    names = [None, "attn", "all", "mlp", "attn", None, "all", "mlp"]
    ids = {"attn": 1, "all": 2, "mlp": 3}
    requests = [None if n is None else LoRARequest(n, ids[n], str(engine_adapters[n])) for n in names]
    generator = torch.Generator().manual_seed(1)
    batch = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (5, 17, 3, 9, 30, 1, 4, 12)]
    llm = LLM(
        tiny_llama().cuda(), max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16
    )
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, lora_request=requests, use_tqdm=False)
    for name, prompt, out in zip(names, batch, outputs):
        path = None if name is None else engine_adapters[name]
        assert out.outputs[0].token_ids == peft_greedy(path, prompt, 10), name


def test_seeded_sampling_on_cuda_is_reproducible():
    llm = LLM(tiny_llama().cuda(), enable_lora=False, max_num_seqs=4, max_model_len=32)
    params = SamplingParams(temperature=0.9, top_p=0.8, top_k=30, max_tokens=8, seed=7, ignore_eos=True)
    prompt = {"prompt_token_ids": [4, 8, 15, 16, 23, 42]}
    first = llm.generate([prompt, prompt], [params, SamplingParams(max_tokens=8)], use_tqdm=False)[0]
    second = llm.generate(prompt, params, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids

"""The engine on CUDA (Triton kernels, pinned-buffer transfers, SDPA on the GPU) against the CPU
oracle. Run on the GPU machine: ``pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_greedy_matches_peft, peft_greedy, resident_requests, tiny_llama

from loramux import LoRARequest, SamplingParams
from loramux.engine.worker.cuda_graphs import LORA, LORA_SMALL_GEMMS
from loramux.engine.layers import side_stream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def LLM(*args, **kwargs):  # noqa: N802 - loramux's LLM with a small KV cache
    """By default an engine takes 90% of the GPU for KV blocks, and the engines of earlier tests
    may not be garbage yet: a few hundred blocks is all these tiny models need."""
    from loramux.engine.llm import LLM as _LLM

    kwargs.setdefault("num_gpu_blocks_override", 512)
    return _LLM(*args, **kwargs)


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


@pytest.mark.parametrize("names", [[None, "attn", "all", "mlp"], ["all", "all", "all"]], ids=["mixed", "one adapter"])
def test_a_long_eager_prefill_with_adapters_matches_the_cpu_oracle(names, engine_adapters, gemm_onto_delta_calls):
    """Eager steps of more than 256 tokens run each projection's base GEMM onto the delta the Triton
    expand stored (`BaseLayerWithLoRA._delta_then_gemm`), zeroed first or not."""
    ids = {"attn": 1, "all": 2, "mlp": 3}
    requests = [None if n is None else LoRARequest(n, ids[n], str(engine_adapters[n])) for n in names]
    generator = torch.Generator().manual_seed(1)
    batch = [torch.randint(3, 128, (100,), generator=generator).tolist() for _ in names]
    llm = LLM(tiny_llama().cuda(), max_loras=3, max_lora_rank=8, max_num_seqs=4, max_model_len=128,
              max_num_batched_tokens=512, enforce_eager=True)
    requests = resident_requests(llm, names, engine_adapters, {"attn": 1, "all": 2, "mlp": 3})
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], SamplingParams(temperature=0, max_tokens=10,
                           ignore_eos=True), lora_request=requests, use_tqdm=False)
    assert gemm_onto_delta_calls, "no step ran the GEMM onto its delta"
    for name, prompt, out in zip(names, batch, outputs):
        path = None if name is None else engine_adapters[name]
        assert_greedy_matches_peft(path, prompt, out.outputs[0].token_ids, name)


def test_seeded_sampling_on_cuda_is_reproducible():
    """A seeded request draws from its own generator: the same tokens whatever its neighbour
    samples. (Same batch size: kernels may sum in another order for another size.)"""
    llm = LLM(tiny_llama().cuda(), enable_lora=False, max_num_seqs=4, max_model_len=32)
    params = SamplingParams(temperature=0.9, top_p=0.8, top_k=30, max_tokens=8, seed=7, ignore_eos=True)
    prompt = {"prompt_token_ids": [4, 8, 15, 16, 23, 42]}
    other = {"prompt_token_ids": [9, 9, 9]}
    first = llm.generate([prompt, other], [params, SamplingParams(max_tokens=8)], use_tqdm=False)[0]
    second = llm.generate([prompt, other], [params, SamplingParams(temperature=0.5, max_tokens=8, seed=1)],
                          use_tqdm=False)[0]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def _greedy(llm, prompts, requests, max_tokens=12):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=requests, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("big_gemms", [False, True], ids=["small GEMMs", "big gate_up, embedding, LM head"])
def test_decode_graphs_match_eager_and_the_oracle(engine_adapters, big_gemms, monkeypatch):
    """Decode steps replayed from CUDA graphs (padded buckets, adapters swapped between replays in
    slots captured with other adapters) give the eager engine's and PEFT's greedy tokens. With big
    GEMMs (the threshold lowered so this model's gate_up, embedding and LM head are big), steps of
    adapters that leave them alone ("attn", "mlp": down only) replay the third variant."""
    if big_gemms:
        monkeypatch.setattr(side_stream, "BIG_GEMM_WEIGHTS", 32 * 128)
    names = [None, "attn", "all", "mlp", "attn", None, "all", "mlp", "all"]
    ids = {"attn": 1, "all": 2, "mlp": 3}
    requests = [None if n is None else LoRARequest(n, ids[n], str(engine_adapters[n])) for n in names]
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (5, 17, 3, 9, 30, 1, 4, 12, 6)]
    runs = {}
    for eager in (True, False):
        llm = LLM(tiny_llama().cuda(), max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64,
                  max_num_batched_tokens=16, enforce_eager=eager)
        runner = llm.llm_engine.runner
        captured = runner.num_graphs
        steps, run = [0], runner.execute_model
        runner.execute_model = lambda batch: steps.__setitem__(0, steps[0] + 1) or run(batch)
        variants = []
        if not eager:
            replay = runner.graphs.replay
            runner.graphs.replay = lambda inputs: variants.append(inputs.variant) or replay(inputs)
        runs[eager] = _greedy(llm, prompts, requests)
        if not eager:
            assert (LORA_SMALL_GEMMS in variants) is big_gemms and LORA in variants
        assert runner.use_graphs is not eager and runner.compiled is not eager
        if not eager:  # (2, 4, 8, 16 tokens) x (base, LoRA), all captured at start, none while serving;
            # prefill chunks and mixed steps replay them too (16 tokens = max_num_batched_tokens)
            assert captured == (12 if big_gemms else 8) and runner.num_graphs == captured and runner.graph_steps > 10
            assert runner.graph_steps == steps[0]
            # the graphs above max_num_seqs (4) write their logits into one tensor
            outputs = {T: {logits.data_ptr() for (size, _), (_, logits) in runner.graphs._graphs.items() if size == T}
                       for T in runner.graph_sizes}
            assert outputs[8] == outputs[16] == {runner.graphs._shared_logits.data_ptr()}
            assert len(outputs[2] | outputs[4]) == len(runner.graphs.variants) * 2
    assert runs[False] == runs[True]
    for name, prompt, tokens in zip(names, prompts, runs[False]):
        path = None if name is None else engine_adapters[name]
        expected = peft_greedy(path, prompt, 12)  # stops at EOS; the engine ignores it here
        assert tokens[: len(expected)] == expected, name


def test_decode_graphs_bf16_base_and_lora_match_eager(engine_adapters):
    """bf16, many sequences (buckets 16 and 20 with padding), base-only and all-LoRA batches.

    The compiled forward keeps fused elementwise chains in float32 where eager rounds to bf16 after
    every op, and a random tiny model is full of near-ties, so sequences may part late. Each one that
    does must part at a near-tie of the eager run: the compiled run's token is the eager run's second
    choice there, within a bf16 rounding of the first. A wrong row, slot or block table parts at once
    and by a wide margin."""
    prompts = [[(7 * i + j) % 120 + 3 for j in range(3 + i % 5)] for i in range(19)]
    request = LoRARequest("all", 2, str(engine_adapters["all"]))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    runs = {}
    for eager in (True, False):
        llm = LLM(tiny_llama().to("cuda", torch.bfloat16), max_loras=1, max_lora_rank=8, max_num_seqs=20,
                  max_model_len=48, max_graph_tokens=20, enforce_eager=eager)
        runs[eager] = [
            [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                lora_request=lora, use_tqdm=False)]
            for lora in (None, request)
        ]
        if not eager:
            assert llm.llm_engine.runner.graph_steps >= 30 and llm.llm_engine.runner.num_graphs == 2 * 5
        llm.llm_engine.close()
    for graph_run, eager_run in zip(runs[False], runs[True]):
        for graph, eager in zip(graph_run, eager_run):
            assert graph.token_ids[:4] == eager.token_ids[:4]
            parted = next((k for k, (g, e) in enumerate(zip(graph.token_ids, eager.token_ids)) if g != e), None)
            if parted is None:
                continue
            top = eager.logprobs[parted]
            chosen = graph.token_ids[parted]
            assert chosen in top, (parted, chosen, top)
            assert top[eager.token_ids[parted]].logprob - top[chosen].logprob < 0.1, (parted, top)


def test_churn_with_graphs_loads_running_and_new_shapes_equals_eager(make_adapter):
    """The capture race: many more adapters than CPU tier and slots, loads on background threads
    (pinning host memory) while new batch shapes appear. Every request completes, with the eager
    engine's tokens, and no graph is captured after start."""
    import random

    adapters = {f"c{i}": make_adapter(f"c{i}", seed=200 + i) for i in range(24)}
    rng = random.Random(5)
    trace = []
    for i in range(60):
        name = rng.choice([None, *adapters]) if i % 5 else None
        lora = None if name is None else LoRARequest(name, int(name[1:]) + 1, str(adapters[name]))
        trace.append((f"r{i}", [rng.randrange(3, 128) for _ in range(rng.randint(2, 30))], lora, rng.randint(0, 3)))
    runs = {}
    for eager in (True, False):
        engine = LLM(tiny_llama().cuda(), max_loras=4, max_lora_rank=8, max_cpu_loras=6, max_num_seqs=12,
                     max_model_len=64, enforce_eager=eager, compilation=False).llm_engine
        captured = engine.runner.num_graphs
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        pending, finished = list(trace), {}
        for _ in range(5000):
            if pending:  # 0-3 arrivals per step: batch sizes keep changing while loads run
                for _ in range(pending[0][3]):
                    if pending:
                        request_id, prompt, lora, _ = pending.pop(0)
                        engine.add_request(request_id, {"prompt_token_ids": prompt}, params, lora)
                if pending and pending[0][3] == 0:
                    request_id, prompt, lora, _ = pending.pop(0)
                    engine.add_request(request_id, {"prompt_token_ids": prompt}, params, lora)
            for out in engine.step():
                if out.finished:
                    assert out.error is None, out.error
                    finished[out.request_id] = out.outputs[0].token_ids
            if not pending and not engine.has_unfinished_requests():
                break
        assert len(finished) == len(trace)
        assert engine.runner.num_graphs == captured
        runs[eager] = finished
    assert runs[False] == runs[True]


def test_async_scheduling_equals_sync_with_graphs(engine_adapters, monkeypatch):
    """Replayed graphs whose decodes take their input ids from the last step's sampled tokens on
    the device (async scheduling) give the synchronous loop's outputs token for token: stop tokens
    that drop a row already launched, max_tokens, seeded sampling with logprobs, a penalty (whose
    steps wait for the tokens), adapters and base rows; and PEFT's greedy tokens."""
    from conftest import char_tokenizer
    from test_async_scheduling import prompts, serve, summary

    from loramux.engine.llm_engine import LLMEngine

    attn = LoRARequest("attn", 1, str(engine_adapters["attn"]))
    everything = LoRARequest("all", 2, str(engine_adapters["all"]))
    p = prompts(9, 30, 5, 14, 21, 7, 40, seed=5)
    greedy = dict(temperature=0, ignore_eos=True)
    requests = [
        ("stop-token", p[0], SamplingParams(max_tokens=12, stop_token_ids=[peft_greedy(None, p[0], 4)[3]], **greedy),
         None),
        ("all", p[1], SamplingParams(max_tokens=12, **greedy), everything),
        ("length", p[2], SamplingParams(max_tokens=9, **greedy), attn),
        ("seeded", p[3], SamplingParams(temperature=0.8, seed=7, max_tokens=10, logprobs=3, ignore_eos=True), attn),
        ("penalised", p[4], SamplingParams(repetition_penalty=1.5, max_tokens=10, **greedy), everything),
        ("eos", p[5], SamplingParams(temperature=0, max_tokens=30), None),
        ("long", p[6], SamplingParams(max_tokens=20, **greedy), attn),
    ]
    results, fills = {}, []
    for async_scheduling in (False, True):
        engine = LLMEngine(tiny_llama().cuda(), max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=96,
                           max_num_batched_tokens=16, tokenizer=char_tokenizer(), num_gpu_blocks_override=512,
                           async_scheduling=async_scheduling)
        fill = engine.runner.fill_pending
        monkeypatch.setattr(engine.runner, "fill_pending", lambda *a, _fill=fill: fills.append(1) or _fill(*a))
        results[async_scheduling] = summary(serve(engine, requests))
        assert engine.runner.graph_steps > 10
    # a stop's dropped row changes a step's batch, so the GPU may sum in another order: the
    # tokens are the same, the logprobs the same to rounding
    logprobs = {mode: {rid: out[4] for rid, out in results[mode].items()} for mode in results}
    assert {rid: out[:4] for rid, out in results[True].items()} == {rid: out[:4] for rid, out in results[False].items()}
    for rid, steps in logprobs[True].items():
        assert (steps is None) == (logprobs[False][rid] is None)
        for entry, expected in zip(steps or [], logprobs[False][rid] or []):
            assert entry.keys() == expected.keys()
            for token, (rank, logprob) in entry.items():
                assert rank == expected[token][0]
                assert logprob == pytest.approx(expected[token][1], abs=1e-4)
    assert len(fills) > 10
    assert results[True]["stop-token"][2] == "stop" and len(results[True]["stop-token"][0]) == 4
    assert results[True]["length"][0] == peft_greedy(engine_adapters["attn"], p[2], 9)
    assert results[True]["all"][0] == peft_greedy(engine_adapters["all"], p[1], 12)


def test_the_default_pool_on_cuda_is_a_tenth_of_the_gpu_and_serves_many_adapters_in_one_graph(make_adapter):
    """No max_loras: the pool takes its default bytes (10% of the GPU, at most what 256 adapters
    of max_lora_rank use), its slots follow, and 12 distinct adapters decode together in the
    step graphs captured at start, each as PEFT gives it."""
    from loramux.engine.layers.weight_pool import MAX_LORA_SLOTS, default_gpu_lora_bytes
    from loramux.kernels.pool import POOL_ROW_ALIGN

    paths = [make_adapter(f"gpu-many{i}", seed=400 + i) for i in range(12)]
    llm = LLM(tiny_llama().cuda(), max_lora_rank=8, max_num_seqs=12, max_model_len=64)
    manager = llm.llm_engine.lora_manager
    row = manager.pool.row_bytes
    budget = min(default_gpu_lora_bytes(manager.device), MAX_LORA_SLOTS * 8 * row)
    assert manager.pool_units == budget // row
    assert manager.num_slots == min(manager.pool_units // POOL_ROW_ALIGN, MAX_LORA_SLOTS)
    names = [f"gpu-many{i}" for i in range(12)]
    requests = resident_requests(llm, names, dict(zip(names, paths)), {name: i + 1 for i, name in enumerate(names)})
    graphs = llm.llm_engine.runner.num_graphs
    prompt = [5, 9, 14, 20, 27]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * 12, params, lora_request=requests, use_tqdm=False)
    assert llm.llm_engine.runner.num_graphs == graphs  # nothing captured while serving
    for path, out in zip(paths, outputs):
        assert_greedy_matches_peft(path, prompt, out.outputs[0].token_ids, path.name)

"""The paged engine on CPU: preemption, prefix caching keyed by adapter content, fused sibling
projections, and a churn trace with many more adapters than tiers."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from conftest import peft_greedy, step_to_end, tiny_llama, tiny_model

from loramux import LoRARequest, SamplingParams
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.worker.siblings import SiblingSlice, fuse_siblings

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(engine: LLMEngine, requests, max_steps: int = 2000, *, loaded_first: bool = False) -> dict[str, list[int]]:
    """Add ``(id, prompt, lora_request)`` and step to the end; the generated tokens per id.
    ``loaded_first``: the first step waits until every adapter is in host memory, so admission
    does not depend on when loads finish (each adapter takes its GPU slot a step before its
    requests start): a tight KV pool then preempts in every run, not in some."""
    names = {lora.lora_name for _, _, lora in requests if lora is not None} if loaded_first else set()
    ready, all_ready = set(), threading.Event()

    def listen(event):
        if event.kind == "ready":
            ready.add(event.name)
            if ready == names:
                all_ready.set()

    if names:
        engine.add_event_listener(listen)
    for request_id, prompt, lora in requests:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, GREEDY, lora)
    assert not names or all_ready.wait(30)
    finished = step_to_end(engine, max_steps=max_steps)
    assert not engine.has_unfinished_requests()
    return finished


def mixed_requests(adapters, n: int, seed: int, lengths=(3, 40)):
    rng = random.Random(seed)
    names = [None, *adapters]
    out = []
    for i in range(n):
        name = names[i % len(names)]
        prompt = [rng.randrange(3, 128) for _ in range(rng.randint(*lengths))]
        lora = None if name is None else LoRARequest(name, names.index(name), str(adapters[name]))
        out.append((f"r{i}", prompt, lora))
    return out


def engine(dtype: torch.dtype = torch.float32, **kwargs) -> LLMEngine:
    options = dict(max_loras=2, max_lora_rank=8, max_num_seqs=6, max_model_len=64, max_num_batched_tokens=32)
    options.update(kwargs)
    return LLMEngine(tiny_llama().to(dtype), **options)


def test_forced_preemption_gives_the_same_greedy_tokens(engine_adapters):
    # float64: the two runs batch differently (preempted sequences are recomputed in other
    # batches), and in float32 a near-tie between two logits of this random model can flip once
    # in many runs
    requests = mixed_requests(engine_adapters, 10, seed=1)
    roomy = run(engine(torch.float64, max_cpu_loras=3), requests, loaded_first=True)
    # 12 usable blocks of 16 tokens for 6 sequences of up to 52 tokens: decodes run out of blocks
    tight = engine(torch.float64, num_gpu_blocks_override=13, enable_prefix_caching=False, max_cpu_loras=3)
    assert run(tight, requests, loaded_first=True) == roomy
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.num_free_blocks == 12  # nothing leaked



def test_prefix_cache_hits_give_the_same_tokens_as_misses(engine_adapters):
    system = [(7 * i) % 120 + 3 for i in range(40)]  # a shared 40-token "system prompt"
    requests = [(f"r{i}", system + [10 + i, 20 + i], lora) for i, lora in enumerate(
        [None, None, LoRARequest("attn", 1, str(engine_adapters["attn"])), None,
         LoRARequest("attn", 1, str(engine_adapters["attn"]))]
    )]
    # one at a time, so later requests find the earlier blocks; float64, as the preemption test says
    cached = engine(torch.float64, max_num_seqs=1)
    uncached = engine(torch.float64, max_num_seqs=1, enable_prefix_caching=False)
    assert run(cached, requests) == run(uncached, requests)
    stats = cached.block_manager.stats
    # base r1 and r3 hit base r0's two full blocks; adapter r4 hits r2's, never the base blocks
    assert stats.hits == 3 * 32 and uncached.block_manager.stats.hits == 0
    expected = peft_greedy(engine_adapters["attn"], requests[4][1], 12)
    assert run(cached, [("again", requests[4][1], requests[4][2])])["again"][: len(expected)] == expected


def test_a_reloaded_adapter_never_reuses_the_old_weights_blocks(make_adapter):
    old, new = make_adapter("v1", seed=21), make_adapter("v2", seed=22)
    prompt = [(5 * i) % 120 + 3 for i in range(40)]
    eng = engine(max_num_seqs=1)
    first = run(eng, [("a", prompt, LoRARequest("same", 1, str(old)))])["a"]
    eng.remove_lora("same")
    hits = eng.block_manager.stats.hits
    second = run(eng, [("b", prompt, LoRARequest("same", 2, str(new)))])["b"]
    assert eng.block_manager.stats.hits == hits  # same name, other content: no block reused
    for tokens, path in ((first, old), (second, new)):
        expected = peft_greedy(path, prompt, 12)  # stops at EOS; the engine ignores it here
        assert tokens[: len(expected)] == expected


# The churn fleet: ranks and target sets differ, so a GPU slot is refilled by adapters of other
# shapes (a slice a previous adapter wrote and the next one lacks must not leak into its output).
CHURN_KINDS = (
    dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    dict(r=2, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    dict(r=4, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"]),
    dict(r=6, lora_alpha=12, target_modules=["down_proj"]),
)


CHURN_PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)  # a stale slice shows at once


def reference_greedy(adapter_path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The eager reference for the churn trace: transformers (+ PEFT) in float64, no KV cache, no
    paging, no batching, argmax over the full logits at every step, past EOS as ``ignore_eos``."""
    from peft import PeftModel

    model = tiny_llama().double()
    if adapter_path is not None:
        model = PeftModel.from_pretrained(model, adapter_path).double()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_new_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outputs.append(ids[len(prompt):])
    return outputs


def test_churn_with_many_more_adapters_than_tiers(make_adapter, monkeypatch):
    """Churn on the CPU: 12 adapters of four kinds (ranks 2-8; q/v, q/k/v/o, all seven, MLP
    only) over 2 GPU slots and 3 CPU entries, power-law popularity then each adapter once, requests
    arriving over many steps while adapter loads run beside the loop (slowed, so they overlap decode steps) and batch
    shapes keep changing. Every request completes with the eager float64 reference's tokens."""
    adapters = {f"c{i}": make_adapter(f"c{i}", seed=100 + i, **CHURN_KINDS[i % len(CHURN_KINDS)]) for i in range(12)}
    rng = random.Random(3)
    names = [None, *adapters]
    popularity = [1.0 / (i + 1) for i in range(len(names))]  # hot adapters stay, cold ones churn
    requests = []
    for i, name in enumerate(rng.choices(names, weights=popularity, k=30)):
        lora = None if name is None else LoRARequest(name, names.index(name), str(adapters[name]))
        requests.append((f"r{i}", [rng.randrange(3, 128) for _ in range(rng.randint(2, 20))], lora))
    assert len({lora.lora_name for _, _, lora in requests if lora}) > 5  # more than both tiers hold
    # then every adapter once: the tiers hold 3 of the 6+ used so far, so 3+ of them are read again
    for name in adapters:
        lora = LoRARequest(name, names.index(name), str(adapters[name]))
        requests.append((f"r{len(requests)}", [rng.randrange(3, 128) for _ in range(rng.randint(2, 20))], lora))

    eng = engine(torch.float64, max_loras=2, max_cpu_loras=3, max_num_seqs=5)
    load_spans, decoding_spans = [], []  # (start, end) of each adapter load and each step that decoded
    read = eng.registry._load

    def slow_read(*args, **kwargs):  # a disk read's worth of delay: loads overlap decode steps
        start = time.perf_counter()
        try:
            time.sleep(0.02)
            return read(*args, **kwargs)
        finally:
            load_spans.append((start, time.perf_counter()))

    monkeypatch.setattr(eng.registry, "_load", slow_read)
    finished, pending = {}, list(requests)
    batch_sizes = set()
    for _ in range(3000):
        for _ in range(rng.randint(0, 2)):  # arrivals over time
            if pending:
                request_id, prompt, lora = pending.pop(0)
                eng.add_request(request_id, {"prompt_token_ids": prompt}, CHURN_PARAMS, lora)
        start = time.perf_counter()
        outputs = eng.step()
        decoded = sum(1 for out in outputs if out.outputs[0].token_ids)
        batch_sizes.add(decoded)
        if decoded:
            decoding_spans.append((start, time.perf_counter()))
        for out in outputs:
            if out.finished:
                assert out.error is None, out.error
                finished[out.request_id] = out.outputs[0].token_ids
        if not pending and not eng.has_unfinished_requests():
            break
    assert len(finished) == len(requests)
    # the trace really churned: loads beside decoding steps, varied batches, evictions from both
    # tiers, and adapters read from disk again after leaving the CPU tier
    beside_loads = sum(any(s < le and ls < e for ls, le in load_spans) for s, e in decoding_spans)
    assert beside_loads >= 3 and len(batch_sizes) >= 4, (beside_loads, len(load_spans), batch_sizes)
    cpu = eng.registry.cache.stats
    assert cpu.evictions > 0 and eng.lora_manager.stats.evictions > 0
    assert cpu.loads > len({lora.lora_name for _, _, lora in requests if lora}), cpu

    by_adapter: dict[str | None, list[tuple[str, list[int]]]] = {}
    for request_id, prompt, lora in requests:
        by_adapter.setdefault(lora and lora.lora_name, []).append((request_id, prompt))
    for name, group in by_adapter.items():
        expected = reference_greedy(adapters.get(name), [prompt for _, prompt in group], CHURN_PARAMS.max_tokens)
        for (request_id, _), tokens in zip(group, expected):
            assert finished[request_id] == tokens, (request_id, name)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma"])
def test_fused_siblings_equal_the_separate_projections(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        expected = model(ids).logits
        fused = fuse_siblings(model)
        assert len(fused) == 2 * model.config.num_hidden_layers  # q/k/v and gate/up per layer
        attn = model.model.layers[0].self_attn
        assert isinstance(attn.k_proj, SiblingSlice) and attn.k_proj.weight.shape == (attn.k_proj.out_features, 32)
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_siblings_are_left_alone_when_they_cannot_fuse():
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    attn.k_proj = torch.nn.Linear(32, 16, bias=True)  # the others have no bias
    names = fuse_siblings(model)
    assert "model.layers.0.self_attn.q_proj.siblings.fused" not in names
    assert isinstance(attn.q_proj, torch.nn.Linear) and isinstance(model.model.layers[0].mlp.up_proj, SiblingSlice)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(block_size=12), "block_size: got 12; allowed: a power of two >= 8"),
        (dict(block_size=4), "block_size: got 4; allowed: a power of two >= 8"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization: got 1.5; allowed: a number in \\(0, 1\\]"),
        (dict(num_gpu_blocks_override=0), "num_gpu_blocks_override: got 0"),
        (dict(num_gpu_blocks_override=3, max_model_len=64), "room for 3 blocks of 16 tokens, but one sequence of "
         "max_model_len=64 needs 4 \\(plus one scratch block\\)"),
    ],
)
def test_bad_kv_cache_options_are_refused_with_the_fix(options, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(tiny_llama(), enable_lora=False, **options)
    # a good engine still builds and runs in the same process
    assert run(LLMEngine(tiny_llama(), enable_lora=False, max_model_len=64), [("ok", [5, 6, 7], None)])["ok"]


def test_an_adapter_is_validated_once_on_its_way_to_a_slot(engine_adapters, monkeypatch):
    eng = engine()
    calls = []
    validate = eng.lora_manager.validate
    monkeypatch.setattr(eng.lora_manager, "validate", lambda adapter: calls.append(adapter.name) or validate(adapter))
    prompt = [5, 9, 14, 3]
    out = run(eng, [("a", prompt, LoRARequest("all", 2, str(engine_adapters["all"])))])["a"]
    expected = peft_greedy(engine_adapters["all"], prompt, 12)
    assert out[: len(expected)] == expected
    assert calls == ["all"]  # the registry's, at the border; not the engine's or the slot's again


@pytest.mark.parametrize(
    "lora_kwargs",
    [
        dict(target_modules=["k_proj", "v_proj"]),  # two of the three q/k/v siblings
        dict(target_modules=["gate_proj"]),  # one of gate/up
        dict(target_modules=["q_proj", "k_proj", "up_proj"], rank_pattern={"k_proj": 2, "up_proj": 6}),
    ],
    ids=["k+v", "gate only", "ranks differ per sibling"],
)
def test_fused_groups_with_adapters_on_some_siblings_equal_peft(make_adapter, lora_kwargs):
    """q/k/v and gate/up are one fused layer each; adapters trained on the separate projections
    fill some of its slices (others empty, ranks differing per slice) and give PEFT's tokens."""
    path = make_adapter(seed=31, r=4, lora_alpha=8, **lora_kwargs)
    eng = engine(max_lora_rank=8)
    attn = eng.model.model.layers[0].self_attn
    assert isinstance(attn.k_proj, SiblingSlice)  # the engine really runs the fused layout
    prompts = {f"p{i}": [(11 * i + 7 * j) % 120 + 3 for j in range(5 + 3 * i)] for i in range(3)}
    out = run(eng, [(k, p, LoRARequest("a", 1, str(path))) for k, p in prompts.items()])
    for key, prompt in prompts.items():
        expected = peft_greedy(path, prompt, 12)
        assert out[key][: len(expected)] == expected, key

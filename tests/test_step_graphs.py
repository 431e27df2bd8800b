"""Step graphs' inputs on the CPU: the forward a graph captures, fed from its padded static inputs,
gives the eager step's logits for decodes, prefill chunks and mixed steps, with and without
adapters (the LM head's included). The capture itself needs CUDA (tests/test_engine_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import step_to_end, tiny_llama

from loramux import LoRARequest, SamplingParams
from loramux.engine.worker.cuda_graphs import BASE, LORA, LORA_SMALL_GEMMS, StepGraphs, graph_token_sizes
from loramux.engine.layers import side_stream
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.worker.model_runner import StepShape
from loramux.engine.core.step_outputs import SchedulerOutput


def test_graph_token_sizes_cover_decodes_then_quarters_of_powers_of_two():
    assert graph_token_sizes(64, 512) == [2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256,
                                          320, 384, 448, 512]
    assert graph_token_sizes(48, 300) == [2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 300]
    assert graph_token_sizes(100, 160) == [2, 4, 8, 16, 32, 48, 64, 80, 96, 100, 112, 128, 160]
    assert graph_token_sizes(4, 16) == [2, 4, 8, 16]
    assert graph_token_sizes(64, 64) == graph_token_sizes(64, 1) == [2, 4, 8, 16, 32, 48, 64]


@pytest.mark.parametrize("max_num_seqs", [4, 64, 256])
def test_a_step_pads_by_less_than_a_quarter_of_its_tokens_past_16(max_num_seqs):
    """A compute-bound step pays for its padding tokens: less than max(16, t / 4) of them."""
    sizes = graph_token_sizes(max_num_seqs, 4096)
    assert sizes[-1] == 4096 and sizes == sorted(set(sizes))
    for t in range(1, 4097):
        padded = next(T for T in sizes if T >= t)
        assert padded - t < max(16, t / 4), (t, padded)


@pytest.fixture(scope="module")
def head_adapter(make_adapter):
    """An adapter on the LM head too: its rows need the logits rows' own slots."""
    return make_adapter("head", seed=21, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"])


@pytest.mark.parametrize("big_gemms", [False, True], ids=["small GEMMs", "big gate_up, embedding, LM head"])
def test_graph_forward_equals_the_eager_step(engine_adapters, head_adapter, big_gemms, monkeypatch):
    """Every variant a step may replay equals the eager step. With big GEMMs (the threshold lowered
    so this model's gate_up, embedding and LM head are big, as gate_up and down are at 8B), steps
    whose adapters all leave those layers alone (q/v) take the variant that runs them base-only."""
    if big_gemms:
        monkeypatch.setattr(side_stream, "BIG_GEMM_WEIGHTS", 32 * 128)
    engine = LLMEngine(tiny_llama(), max_loras=3, max_lora_rank=8, max_num_seqs=4, max_model_len=64,
                       max_num_batched_tokens=16)
    runner = engine.runner
    assert runner.graphs is None  # the CPU runs eagerly: this test feeds the graphs' forward by hand
    graphs = StepGraphs(runner, graph_token_sizes(4, 16))
    big = {name for name, layer in runner.lora_manager.layers.items() if layer.big_gemm}
    assert (graphs.variants == (BASE, LORA, LORA_SMALL_GEMMS)) is big_gemms
    assert all(name.endswith(("mlp.gate_proj.siblings.fused", "embed_tokens", "lm_head")) for name in big)
    assert bool(big) is big_gemms
    adapters = {"attn": engine_adapters["attn"], "all": engine_adapters["all"], "head": head_adapter}
    requests = [None, "head", "all", None, "attn", "head", "all", None, "head"]
    if big_gemms:  # steps of q/v adapters alone, then with adapters on gate_up or the LM head beside them
        requests = ["attn", None, "attn", "attn", "all", "attn", None, "head", "attn"]
    generator = torch.Generator().manual_seed(3)
    for i, name in enumerate(requests):
        prompt = torch.randint(3, 128, (int(torch.randint(1, 23, (1,), generator=generator)),), generator=generator)
        lora = None if name is None else LoRARequest(name, 1 + list(adapters).index(name), str(adapters[name]))
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt.tolist()},
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), lora)

    eager_logits = []
    sample = runner._sample
    runner._sample = lambda seqs, logits, ranks_ran: eager_logits.append(logits.clone()) or sample(seqs, logits, ranks_ran)
    run = runner.execute_model
    seen = {"mixed": 0, "unsampled chunk": 0, "lora": 0, "padded": 0}
    if big_gemms:
        seen.update({LORA: 0, LORA_SMALL_GEMMS: 0, "skip checked": 0})

    outputs = {}  # the tensor each graph size returns

    def checked_run(batch: SchedulerOutput):
        assert graphs.fits(batch)  # every step of this engine fits the 16-token graph
        sampled = [seq for seq, n in batch.chunks if seq.num_computed + n == seq.num_tokens]
        inputs = graphs.step_inputs(batch.chunks)
        graphs._load(inputs)
        # the LoRA variant, which must give base rows exactly the base model, and the step's own
        by_variant = {}
        for variant in (LORA, inputs.variant):
            logits = graphs.forward_fn(inputs.num_tokens, variant)()
            outputs.setdefault(inputs.num_tokens, set()).add(logits.data_ptr())
            by_variant[variant] = logits[: len(sampled)].clone()
        names = {seq.lora_request.lora_name for seq, _ in batch.chunks if seq.lora_request is not None}
        small = bool(names) and big_gemms and names <= {"attn"}
        assert inputs.variant == (BASE if not names else LORA_SMALL_GEMMS if small else LORA), (names, inputs.variant)
        if inputs.variant in seen:
            seen[inputs.variant] += 1
        if big_gemms and any(seq.lora_name == "all" for seq in sampled):  # the variant skips: it drops "all"'s gate_up delta
            by_variant["skipping gate_up"] = graphs.forward_fn(inputs.num_tokens, LORA_SMALL_GEMMS)()[: len(sampled)].clone()
            seen["skip checked"] += 1
        eager_logits.clear()
        result = run(batch)  # eager; writes the same K/V the graph forward wrote
        if sampled:
            skipping = by_variant.pop("skipping gate_up", None)
            for logits in by_variant.values():
                torch.testing.assert_close(logits, eager_logits[0], rtol=1e-4, atol=1e-4)
            assert skipping is None or not torch.allclose(skipping, eager_logits[0], rtol=1e-4, atol=1e-4)
        prefills = [n for _, n in batch.chunks if n > 1]
        seen["mixed"] += bool(prefills) and len(prefills) < len(batch.chunks)
        seen["unsampled chunk"] += len(sampled) < len(batch.chunks)
        seen["lora"] += bool(inputs.active_slots)
        seen["padded"] += inputs.num_tokens > batch.num_tokens
        return result

    runner.execute_model = checked_run
    finished = step_to_end(engine)
    assert len(finished) == len(requests) and all(len(t) == 6 for t in finished.values())
    assert all(count > 0 for count in seen.values()), seen
    # the graphs above max_num_seqs (4) return one tensor, whatever the size and variant
    shared = set().union(*(ptrs for T, ptrs in outputs.items() if T > 4))
    assert 16 in outputs and shared == {graphs._shared_logits.data_ptr()}
    assert all(shared.isdisjoint(ptrs) for T, ptrs in outputs.items() if T <= 4)


def test_graphs_do_not_take_prompt_logprob_steps_or_oversized_ones():
    engine = LLMEngine(tiny_llama(), enable_lora=False, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32)
    graphs = StepGraphs(engine.runner, graph_token_sizes(4, 16))
    engine.add_request("plain", {"prompt_token_ids": list(range(3, 19))}, SamplingParams(max_tokens=1))
    engine.add_request("scored", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=1, prompt_logprobs=1))
    engine.add_request("long", {"prompt_token_ids": list(range(3, 23))}, SamplingParams(max_tokens=1))
    seqs = dict(engine._requests)  # Sequence by request id
    assert graphs.fits(SchedulerOutput([(seqs["plain"], 16)]))
    assert not graphs.fits(SchedulerOutput([(seqs["plain"], 16), (seqs["scored"], 3)]))  # prompt logprobs
    assert not graphs.fits(SchedulerOutput([(seqs["long"], 20)]))  # more tokens than the largest graph
    assert not graphs.fits(SchedulerOutput([]))


def test_cuda_graph_sizes_replace_the_default_sizes():
    """Given sizes are sorted, deduplicated and capped at the step's token budget; a step pads to
    the smallest that holds it, and larger steps are not the graphs'."""
    engine = LLMEngine(tiny_llama(), enable_lora=False, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=24,
                       cuda_graph_sizes=(12, 4, 4, 100))
    runner = engine.runner
    assert engine.config.cuda_graph_sizes == [4, 12, 100]
    assert runner.graph_sizes == [4, 12, 24] and runner.max_graph_tokens == 24
    default = LLMEngine(tiny_llama(), enable_lora=False, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=24)
    assert default.runner.graph_sizes == graph_token_sizes(4, 24)
    graphs = StepGraphs(runner, runner.graph_sizes)
    padded = []
    run = runner.execute_model
    runner.execute_model = lambda batch: padded.append(
        (batch.num_tokens, graphs.step_inputs(batch.chunks).num_tokens)) or run(batch)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for request_id, prompt_len in (("a", 3), ("b", 10), ("c", 20)):
        engine.add_request(request_id, {"prompt_token_ids": list(range(3, 3 + prompt_len))}, params)
        engine.step()
    assert padded == [(3, 4), (11, 12), (22, 24)]


def test_the_runner_records_each_steps_shape():
    """`ModelRunner.last_step`: sequences, tokens, prompt tokens and the tokens the forward ran."""
    engine = LLMEngine(tiny_llama(), enable_lora=False, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": list(range(3, 13))}, params)
    engine.step()  # a's prompt
    assert engine.runner.last_step == StepShape(1, 10, 10, 10, graph=False)
    engine.add_request("b", {"prompt_token_ids": list(range(5, 10))}, params)
    engine.step()  # a decodes, b's prompt
    assert engine.runner.last_step == StepShape(2, 6, 5, 6, graph=False)
    engine.step()  # both decode
    assert engine.runner.last_step == StepShape(2, 2, 0, 2, graph=False)


def test_the_manager_knows_which_slots_leave_the_big_gemms_alone(engine_adapters, monkeypatch):
    """Per slot, from the adapter's pool footprint: q/v leaves gate_up alone, every projection does
    not; an empty slot, or one freed since, counts as touching them (the full LoRA graph serves it)."""
    monkeypatch.setattr(side_stream, "BIG_GEMM_WEIGHTS", 32 * 128)  # gate_up, embedding, LM head
    engine = LLMEngine(tiny_llama(), max_loras=3, max_lora_rank=8, max_num_seqs=4, max_model_len=64)
    manager = engine.runner.lora_manager
    assert manager.has_big_gemms
    slots = {name: manager.activate(engine.registry.get(LoRARequest(name, i + 1, str(engine_adapters[name]))))
             for i, name in enumerate(("attn", "all"))}
    assert manager.leaves_big_gemms([slots["attn"]]) and not manager.leaves_big_gemms([slots["all"]])
    assert not manager.leaves_big_gemms([slots["attn"], slots["all"]])
    free = ({0, 1, 2} - set(slots.values())).pop()
    assert not manager.leaves_big_gemms([free])
    manager.deactivate("attn")
    assert not manager.leaves_big_gemms([slots["attn"]])

"""The sampler's logit processors against plain reference implementations (a Python loop per row
and per token, the rules as vLLM / OpenAI / transformers state them), and its fast path."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from loramux import SamplingParams
from loramux.engine.worker import penalties, sampler as sampler_module
from loramux.engine.worker.sampler import Sampler

V = 50
EOS = 2


def seq(params: SamplingParams, prompt: list[int], output: list[int], generator=None):
    return SimpleNamespace(params=params, prompt_token_ids=prompt, output_token_ids=output, generator=generator,
                           grammar=None, output_logprobs=[],
                           num_output_tokens=len(output))


def reference_penalties(logits, prompt, output, presence, frequency, repetition):
    out = logits.clone()
    for token in range(len(out)):
        value = out[token].item()
        if token in prompt or token in output:
            value = value / repetition if value > 0 else value * repetition
        count = output.count(token)
        value -= frequency * count + presence * (count > 0)
        out[token] = value
    return out


def histories(seed: int, rows: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, V, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist(),
             torch.randint(0, V, (int(torch.randint(0, 15, (1,), generator=g)),), generator=g).tolist())
            for _ in range(rows)]


def test_penalties_match_the_reference():
    torch.manual_seed(0)
    logits = torch.randn(6, V) * 3
    hist = histories(1, 6)
    settings = [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.3), (1.5, -0.5, 0.8), (-1.0, 2.0, 2.0), (0, 0, 1)]
    got = penalties.apply_penalties(
        logits, [p for p, _ in hist], [o for _, o in hist],
        torch.tensor([s[0] for s in settings]), torch.tensor([s[1] for s in settings]),
        torch.tensor([s[2] for s in settings]))
    for row, ((prompt, output), setting) in enumerate(zip(hist, settings)):
        expected = reference_penalties(logits[row], prompt, output, *setting)
        torch.testing.assert_close(got[row], expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[5], logits[5])  # no penalty: untouched


def test_sampler_applies_each_processor_only_to_its_row():
    """One batch, five requests with different processors (greedy, so the argmax shows the effect)."""
    torch.manual_seed(1)
    logits = torch.randn(5, V)
    hist = histories(2, 5)
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.3),
        SamplingParams(temperature=0, logit_bias={7: 100.0, 9: -5.0}),
        SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[11], max_tokens=8),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, presence_penalty=2.0),
    ]
    seqs = [seq(p, prompt, output[:2] if i == 2 else output) for i, (p, (prompt, output)) in enumerate(zip(params, hist))]
    logits[2, EOS] = logits[2, 11] = 50.0  # min_tokens must hold both back
    out = Sampler(torch.device("cpu"), seed=0, eos_token_ids=[EOS])(logits, seqs).token_ids.tolist()

    expected = []
    for i, (s, (prompt, output)) in enumerate(zip(seqs, hist)):
        row = logits[i].clone()
        p = s.params
        for token, bias in (p.logit_bias or {}).items():
            row[token] += bias
        if len(s.output_token_ids) < p.min_tokens:
            for token in [EOS] + p.stop_token_ids:
                row[token] = -math.inf
        row = reference_penalties(row, s.prompt_token_ids, s.output_token_ids, p.presence_penalty,
                                  p.frequency_penalty, p.repetition_penalty)
        expected.append(int(row.argmax()))
    assert out == expected
    assert out[1] == 7 and out[2] not in (EOS, 11)
    assert out[3] == int(logits[3].argmax())


def test_min_p_matches_the_reference():
    torch.manual_seed(2)
    logits = torch.randn(4, V) * 2
    min_p = torch.tensor([0.0, 0.05, 0.3, 1.0])
    got = penalties.apply_min_p(logits, min_p)
    for row in range(4):
        probs = logits[row].softmax(-1)
        keep = [t for t in range(V) if probs[t] >= min_p[row] * probs.max()]
        assert [t for t in range(V) if got[row, t] > -math.inf] == keep
    assert (got[3] > -math.inf).sum() == 1  # min_p=1 keeps the top token only


def test_min_p_sampling_never_draws_a_dropped_token():
    torch.manual_seed(3)
    logits = torch.randn(1, V).repeat(64, 1)
    params = SamplingParams(temperature=1.0, min_p=0.5, seed=None)
    tokens = Sampler(torch.device("cpu"), seed=0)(logits, [seq(params, [1], []) for _ in range(64)]).token_ids
    probs = logits[0].softmax(-1)
    allowed = {t for t in range(V) if probs[t] >= 0.5 * probs.max()}
    assert set(tokens.tolist()) <= allowed and len(allowed) < V


def test_plain_batches_take_the_fast_path(monkeypatch):
    """No request asks for a processor or logprobs: none of their code runs."""
    def boom(*args, **kwargs):
        raise AssertionError("a processor ran for a batch that asked for none")

    for name in ("apply_penalties", "apply_logit_bias", "block_tokens", "apply_grammar_masks", "token_logprobs"):
        monkeypatch.setattr(sampler_module, name, boom)
    logits = torch.randn(3, V)
    seqs = [seq(SamplingParams(temperature=0), [1], [4, 4]) for _ in range(3)]
    out = Sampler(torch.device("cpu"), seed=0)(logits, seqs)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist() and out.logprobs is None
    with pytest.raises(AssertionError, match="a processor ran"):
        Sampler(torch.device("cpu"), seed=0)(logits, [seq(SamplingParams(temperature=0, presence_penalty=1.0), [1], [4])])


@pytest.mark.parametrize("kwargs, message", [
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={5: 500.0}), "logit_bias"),
    (dict(logprobs=21), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(structured_outputs={"json": {}}), "structured_outputs"),
])
def test_bad_sampling_params_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_structured_outputs_params_take_exactly_one_format():
    from loramux import StructuredOutputsParams

    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a+", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    assert StructuredOutputsParams(json={"b": 1}).key() == StructuredOutputsParams(json='{"b": 1}').key()
    # property order is part of the format (the grammar writes properties in schema order)
    assert StructuredOutputsParams(json={"b": 1, "a": 2}).key() != StructuredOutputsParams(json={"a": 2, "b": 1}).key()

"""xgrammar vs llguidance on this machine: the per-request and per-token costs loramux pays.

    python benchmarks/structured_output_engines.py        # CPU; on a GPU box the masks are applied there

For the embedded model's tokenizer (SmolLM2, 49,152 tokens) it measures, for each engine:
tokenizer setup (once per server), compiling three JSON schemas and a regex (once per distinct
request format), and filling + applying one next-token mask per token while a fixed valid JSON
document is fed through the matcher (every step of every structured request). Results go to
stdout as JSON; docs/serving.md records them with the machine named.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer  # noqa: E402

from loramux.engine.model_loader import default_model_path  # noqa: E402

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "city": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "location": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                     "required": ["lat", "lon"]},
        "kind": {"enum": ["capital", "town", "village"]}}, "required": ["city", "tags", "location", "kind"]},
    "choices": {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                                  "confidence": {"type": "number"}},
                "required": ["answer", "confidence"]},
}
DOCUMENT = {"city": "Tokyo", "tags": ["large", "coastal", "capital city"], "location": {"lat": 35.68, "lon": 139.69},
            "kind": "capital"}
REGEX = r"\d{3}-\d{4}"


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    return (time.perf_counter() - start) / repeat, out


def bench_xgrammar(tokenizer, vocab: int, tokens: list[int]) -> dict:
    import xgrammar as xgr

    setup, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab,
                                                                 stop_token_ids=[tokenizer.eos_token_id]))
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    compile_s = {name: timed(lambda s=s: compiler.compile_json_schema(json.dumps(s), any_whitespace=False))[0]
                 for name, s in SCHEMAS.items()}
    compile_s["regex"] = timed(lambda: compiler.compile_regex(REGEX))[0]
    grammar = compiler.compile_json_schema(json.dumps(SCHEMAS["nested"]), any_whitespace=False)
    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    logits = torch.zeros(1, vocab)
    per_token = []
    for token in tokens:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        per_token.append(time.perf_counter() - start)
        assert matcher.accept_token(token), "the document does not match the schema"
    return {"tokenizer_setup_s": setup, "compile_s": compile_s, "mask_per_token_us": _stats(per_token)}


def bench_llguidance(tokenizer, vocab: int, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    setup, lltok = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab))

    def compile_schema(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                 defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        return llguidance.LLMatcher(lltok, grammar)

    compile_s = {name: timed(lambda s=s: compile_schema(s))[0] for name, s in SCHEMAS.items()}
    compile_s["regex"] = timed(lambda: llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_regex(REGEX)))[0]
    matcher = compile_schema(SCHEMAS["nested"])
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    logits = torch.zeros(1, vocab)
    per_token = []
    for token in tokens:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
        per_token.append(time.perf_counter() - start)
        assert matcher.consume_token(token), matcher.get_error()
    return {"tokenizer_setup_s": setup, "compile_s": compile_s, "mask_per_token_us": _stats(per_token)}


def _stats(seconds: list[float]) -> dict:
    us = sorted(s * 1e6 for s in seconds)
    return {"median": round(us[len(us) // 2], 1), "p90": round(us[int(len(us) * 0.9)], 1), "max": round(us[-1], 1),
            "mean": round(sum(us) / len(us), 1), "n": len(us)}


def main() -> None:
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    vocab = len(tokenizer)
    tokens = tokenizer(json.dumps(DOCUMENT), add_special_tokens=False).input_ids
    results = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
               "tokenizer": "SmolLM2-135M-Instruct", "vocab": vocab}
    for name, bench in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        results[name] = bench(tokenizer, vocab, tokens)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

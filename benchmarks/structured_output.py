"""What structured output costs: the grammar engine's work per server, per request format and
per token, for xgrammar (what loramux uses) and, where it is installed, llguidance.

    PYTHONPATH=. python benchmarks/structured_output.py          # the host's CPU (masks are filled there)

For the embedded model's tokenizer (SmolLM2, 49,152 tokens), per engine: tokenizer setup (once per
server), compiling three JSON schemas and a regex (once per distinct request format), and filling
and applying one next-token mask per token while a fixed valid JSON document is fed through the
matcher (every step of every structured request). A mask that takes long stalls every request of
the batch, so the tail (p99, max) matters as much as the median.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer  # noqa: E402

from benchmarks import stats  # noqa: E402
from benchmarks._common import RESULTS_DIR, write_result  # noqa: E402
from loramux.engine.worker.model_loader import default_model_path  # noqa: E402

TITLE = "Structured output"

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
        if not matcher.accept_token(token):
            raise RuntimeError("the document does not match the schema")
    return {"version": importlib.metadata.version("xgrammar"), "tokenizer_setup_s": setup, "compile_s": compile_s,
            "mask_per_token_us": stats.summary(per_token, scale=1e6, digits=1)}


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
        if not matcher.consume_token(token):
            raise RuntimeError(matcher.get_error())
    return {"version": importlib.metadata.version("llguidance"), "tokenizer_setup_s": setup,
            "compile_s": compile_s, "mask_per_token_us": stats.summary(per_token, scale=1e6, digits=1)}


ENGINES = {"xgrammar": bench_xgrammar, "llguidance": bench_llguidance}


def main(argv=None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for structured_output.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    vocab = len(tokenizer)
    tokens = tokenizer(json.dumps(DOCUMENT), add_special_tokens=False).input_ids
    result = {"tokenizer": "SmolLM2-135M-Instruct", "vocab": vocab, "document_tokens": len(tokens), "engines": {}}
    for name, bench in ENGINES.items():
        if importlib.util.find_spec(name) is not None:  # llguidance is optional: measured where installed
            result["engines"][name] = bench(tokenizer, vocab, tokens)
    print(markdown(result))
    device = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return write_result(args.out / "structured_output.json", "structured_output", device, result, argv)


def markdown(result: dict) -> str:
    lines = [f"{result['tokenizer']}'s {result['vocab']:,}-token vocabulary; a nested schema, one mask per token while "
             f"a {result.get('document_tokens', '')}-token document is fed through", "",
             "| engine | tokenizer setup (s) | compile a schema (ms) | mask per token, p50 (µs) | p90 | p99 | max |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in result["engines"].items():
        mask = r["mask_per_token_us"]
        compile_ms = [1e3 * s for s in r["compile_s"].values()]
        p99 = "" if mask.get("p99") is None else f"{mask['p99']:.0f}"
        lines.append(f"| {name} {r.get('version', '')} | {r['tokenizer_setup_s']:.2f} | {min(compile_ms):.1f}-"
                     f"{max(compile_ms):.1f} | {mask['p50']:.0f} | {mask['p90']:.0f} | {p99} | {mask['max']:.0f} |")
    return "\n".join(lines) + "\n"


#: JSON stem -> (heading, renderer, the command that measures it), for benchmarks/report.py
SECTIONS = {"structured_output": ("", markdown, "PYTHONPATH=. python benchmarks/structured_output.py")}
GPU = False  # the masks are filled on the host's CPU: its page is measured there

if __name__ == "__main__":
    main()

"""Every maintained benchmark runs on the CPU in its smallest mode and its results page renders
from the JSON it wrote; every import any benchmark or tool makes, at module level or inside a
function (GPU-only paths included), resolves, so a renamed helper fails here and not on the GPU."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the benchmarks package lives beside tests/
sys.path.insert(0, str(ROOT / "scripts"))  # the tools import each other as top-level modules

from benchmarks import report  # noqa: E402

SCRIPTS = sorted(p for folder in ("benchmarks", "scripts") for p in (ROOT / folder).glob("*.py"))
OPTIONAL = {"matplotlib", "llguidance"}  # the bench extra; measured where installed


def imports_of(path: Path):
    """(line, module, names) of every import statement in the file, however deep in it."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.lineno, node.module, tuple(alias.name for alias in node.names)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_import_of_every_benchmark_and_tool_resolves(path):
    missing = []
    for line, module, names in imports_of(path):
        if module.split(".")[0] in OPTIONAL and importlib.util.find_spec(module.split(".")[0]) is None:
            continue
        try:
            imported = importlib.import_module(module)
        except ImportError as error:
            missing.append(f"line {line}: {module}: {error}")
            continue
        missing += [f"line {line}: {module} has no {name!r}" for name in names
                    if not hasattr(imported, name) and importlib.util.find_spec(f"{module}.{name}") is None]
    assert not missing, missing


def test_the_report_knows_every_maintained_benchmark_and_refuses_others(tmp_path):
    pages = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if re.search(r"^SECTIONS = ", p.read_text(), re.M)}
    assert set(report.BENCHMARKS) == pages
    from benchmarks import throughput

    page = report.render_page("throughput", tmp_path)  # nothing measured in tmp_path
    text = page.read_text()
    assert text.startswith("# Throughput\n") and text.count("Not yet measured on a GPU") == len(throughput.SECTIONS)
    assert "`PYTHONPATH=. python benchmarks/throughput.py -tp 2`" in text
    with pytest.raises(SystemExit, match="no maintained benchmark 'latency'; the benchmarks are throughput"):
        report.render_page("latency", tmp_path)


def rendered(name: str, results: Path) -> str:
    """The page of ``name`` from the JSON in ``results``, after checking the JSON's header."""
    document = json.loads((results / f"{name}.json").read_text())
    assert document["benchmark"] == name and document["device"].startswith("CPU")
    assert document["command"].startswith(f"PYTHONPATH=. python benchmarks/{name}.py ")
    text = report.render_page(name, results).read_text()
    assert f"**{document['device']}**, commit `{document['commit']}`" in text and document["command"] in text
    return text


def test_throughput_smoke(tmp_path):
    from benchmarks import throughput

    throughput.main(["--num-requests", "3", "--prompt-len", "6", "--output-len", "3", "--prefill-len", "8",
                     "--adapters", "1,2", "--flow-requests", "5", "--flow-output-len", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "throughput.json").read_text())["result"]
    runs = {r["scenario"]: r for r in result["runs"]}
    assert list(runs) == ["base (LoRA disabled)", "base via LoRA engine", "1 adapter (all 7)", "2 adapters (all 7)",
                          "1 adapter (q/v)", "2 adapters (q/v)"]
    # every request generated its tokens, and every full-batch decode step was timed
    assert all(r["generated_tokens"] == 3 * 3 and r["decode_steps_timed"] == 2 for r in runs.values())
    assert runs["2 adapters (q/v)"]["adapter_bytes"] == 2 * runs["1 adapter (q/v)"]["adapter_bytes"] > 0
    flow = result["flow"]["runs"]
    assert [r["scenario"] for r in flow] == [
        "base (LoRA disabled)", "base via LoRA engine, before adapter traffic", "1 adapter (q/v)", "2 adapters (q/v)",
        "base via LoRA engine, after adapter traffic"]
    assert all(r["generated_tokens"] == 5 * 2 for r in flow) and flow[0]["tokens_vs_base"] is None
    assert set(result["ttft_ms"]) == {"base", "adapter in host memory, not in a slot", "resident adapter",
                                      "cold adapter (disk)"}
    text = rendered("throughput", tmp_path)
    assert "| 2 adapters (all 7) | 8 |" in text and "| base via LoRA engine, after adapter traffic |" in text
    assert "## Tensor parallelism" in text and "Not yet measured on a GPU" in text


def test_throughput_tensor_parallel_smoke(tmp_path):
    """``-tp 2`` on the CPU (gloo, a worker process): TP=1 and TP=2 serve the batch with 0, 1 and
    32 adapters, and the page's tensor-parallel section shows both sizes and the targets."""
    from benchmarks import throughput
    from benchmarks._common import TINY_CONFIG

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"model_type": "llama", **TINY_CONFIG}))
    throughput.main(["-tp", "2", "--model", str(config), "--num-requests", "2", "--prompt-len", "6", "--output-len", "2",
                     "--ranks", "8", "--out", str(tmp_path)])
    document = json.loads((tmp_path / "throughput_tp.json").read_text())
    runs = document["result"]["runs"]
    assert [(r["tp"], r["adapters"]) for r in runs] == [(tp, n) for tp in (1, 2) for n in (0, 1, 32)]
    assert all(r["generated_tokens"] == 2 * 2 for r in runs) and document["device"].startswith("2 x CPU")
    assert set(document["result"]["targets"]["step_ratio"]) == {f"TP=2 / TP=1, {n} adapters" for n in (0, 1, 32)}
    text = report.render_page("throughput", tmp_path).read_text()
    assert "| TP=2, 32 adapters |" in text and text.count("Not yet measured on a GPU") == 3  # one GPU, the flow, FP8


def test_throughput_fp8_smoke(tmp_path):
    """``-q fp8`` on the CPU (the FP8 reference path): the model in its dtype and in FP8 serve the
    batch with 0, 1 and 32 adapters; FP8 holds half the projection bytes of bfloat16."""
    from benchmarks import throughput
    from benchmarks._common import TINY_CONFIG

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"model_type": "llama", **TINY_CONFIG}))
    throughput.main(["-q", "fp8", "--model", str(config), "--dtype", "bfloat16", "--num-requests", "2",
                     "--prompt-len", "6", "--output-len", "2", "--ranks", "8", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "throughput_fp8.json").read_text())["result"]
    assert [(r["variant"], r["adapters"]) for r in result["runs"]] == [(v, n) for v in ("bfloat16", "FP8") for n in (0, 1, 32)]
    assert all(r["generated_tokens"] == 2 * 2 for r in result["runs"])
    assert result["memory"]["FP8"]["weight_bytes"] < result["memory"]["bfloat16"]["weight_bytes"]
    text = report.render_page("throughput", tmp_path).read_text()
    assert "## FP8 base model" in text and "| FP8, 1 adapter |" in text and "- FP8 (rank 0): weights" in text


def test_many_adapters_smoke(tmp_path):
    """Both popularities over 6 adapters, tiers smaller than that: every request served, TTFT by tier,
    the mixed steps with their read bytes (no copy bandwidth on the CPU: no floor), and the page."""
    from benchmarks import many_adapters

    many_adapters.main(["--adapters", "6", "--popularity", "zipf,uniform", "--num-requests", "6",
                        "--saturated-requests", "4", "--warm-replays", "1", "--cold-alone", "1", "--disk-probe-mb", "8",
                        "--max-loras", "2", "--max-cpu-loras", "3", "--max-num-seqs", "3", "--max-num-batched-tokens", "8",
                        "--prompt-len", "5", "--output-len", "3", "--out", str(tmp_path), "--adapter-dir", str(tmp_path)])
    report_ = json.loads((tmp_path / "many_adapters.json").read_text())["result"]
    results = report_["results"]
    assert [(r["popularity"], r["adapters"]) for r in results] == [("zipf", 6), ("uniform", 6)]
    assert all(r["failed"] == 0 and r["requests"] == 6 and r["saturated_requests"] == 4 for r in results)
    # more adapters than the tiers hold: the tiers churned, and some requests found theirs only on disk
    uniform = results[1]
    assert uniform["cpu_evictions"] > 0 and uniform["ttft_by_tier"]["disk"]["requests"] > 0
    assert sum(t["requests"] for t in uniform["host_warm_poisson"]["ttft_by_tier"].values()) == 6
    assert uniform["poisson_steps"]["point_ms_total"]["lora.place"] > 0 and "mixed" in uniform["poisson_steps"]
    # 3 of 4 prompts of 5 tokens at once in 8-token steps: the second step chunks two and decodes one
    mixed = uniform["saturated_warm_steps"]["mixed"]
    assert mixed["forwards"] > 0 and mixed["adapters_p50"] >= 1 and mixed["ms_p50"] > 0 and mixed["read_mb_p50"] > 0
    assert report_["copy_bandwidth_GBps"] is None and mixed["vs_floor_p50"] is None
    assert set(report_["targets"]) >= {"zipf: no_failed_requests", "uniform: no_failed_requests",
                                       "cold_ttft_at_most_read_plus_10ms_alone"}
    alone = report_["cold_alone"]["each"][0]  # the load beside its file's own read and the registry's part
    assert 0 < alone["file_read_ms"] and 0 < alone["registry_load_ms"] <= alone["load_ms"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("many-adapters-")] == []  # files cleaned up
    text = rendered("many_adapters", tmp_path)
    assert "| uniform | 6 |" in text and "- zipf: no_failed_requests: **met**" in text
    assert "- zipf: n2000_no_failed_request: not measured" in text  # a run without N = 2,000 does not pass it
    assert f"| uniform N=6 host-warm burst | {uniform['saturated_warm_steps']['steps']} |" in text
    assert "| uniform | 6 | host-warm |" in text
    warm_steps = uniform["host_warm_poisson"]["steps"]  # the first replay's: the same arrivals, no loading
    assert warm_steps["steps"] > 0 and warm_steps["mixed"]["forwards"] >= 0
    assert f"| uniform N=6 host-warm Poisson | {warm_steps['steps']} |" in text


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_forward_reads_the_output_table_whole_and_the_input_embedding_by_its_rows(tied):
    """The floors' weight bytes: every parameter but an input embedding table of its own (a lookup
    reads only its tokens' rows); the same through an engine's LoRA wrappers and from the config
    alone (which leaves out the norms)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks._common import forward_weight_bytes
    from benchmarks.throughput import per_rank_bytes
    from loramux.engine.llm_engine import LLMEngine

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config).eval()
    table = model.get_input_embeddings().weight.nbytes
    weights = forward_weight_bytes(model)
    assert weights == sum(p.nbytes for p in model.parameters()) - (0 if tied else table)
    norms = sum(p.nbytes for name, p in model.named_parameters() if "norm" in name)
    assert per_rank_bytes(config, torch.float32, 1, 0) == weights - norms
    engine = LLMEngine(model, enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=2, max_model_len=16)
    try:
        assert forward_weight_bytes(engine.model) == weights
    finally:
        engine.close()


def test_cold_load_smoke(tmp_path):
    from benchmarks import cold_load

    cold_load.main(["--repeats", "1", "--disk-probe-mb", "8", "--dir", str(tmp_path), "--out", str(tmp_path)])
    result = json.loads((tmp_path / "cold_load.json").read_text())["result"]
    stages = {"raw_read", "resolve", "read", "loader_checks", "engine_validate", "digest_wait", "registry_get"}
    assert set(result["ms_best_of_n"]["disk"]) == set(result["ms_best_of_n"]["page_cache"]) == stages  # no GPU: no copy
    assert result["adapter_bytes"] > 13e6 and result["ms_floor_disk"] > 0
    assert "| registry_get: the whole load through the registry |" in rendered("cold_load", tmp_path)


def test_kernels_smoke(tmp_path):
    from benchmarks import kernels

    kernels.main(["--smoke", "--only", "qkv", "--no-vllm", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "kernels.json").read_text())["result"]
    assert [(r["layer"], r["T"], r["adapters"]) for r in result["rows"]] == [
        ("qkv", 1, 1), ("qkv", 1, 4), ("qkv", 16, 1), ("qkv", 16, 4)]
    assert all(r["err_shrink_ours"] < 1e-3 and r["err_expand_ours"] < 1e-2 for r in result["rows"])
    assert all("graph_shrink_us" in r and "vllm_shrink_us" not in r for r in result["rows"])
    text = rendered("kernels", tmp_path)
    assert "vLLM not measured" in text and "| qkv | 16 | 16 | 4 |" in text


def test_structured_output_smoke(tmp_path):
    from benchmarks import structured_output

    structured_output.main(["--out", str(tmp_path)])
    result = json.loads((tmp_path / "structured_output.json").read_text())["result"]
    xgrammar = result["engines"]["xgrammar"]
    assert set(xgrammar["compile_s"]) == {"flat", "nested", "choices", "regex"}
    assert xgrammar["mask_per_token_us"]["n"] == result["document_tokens"]  # a mask for every token of the document
    assert "| xgrammar " in rendered("structured_output", tmp_path)

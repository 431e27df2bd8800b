"""The `loramux serve` flags: vLLM's names and forms, parsed without starting anything."""

from __future__ import annotations

import pytest

from loramux.cli import build_parser

from conftest import setenv


def parse(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_listen_on_localhost_8000_with_lora_on():
    args = parse()
    assert (args.model, args.host, args.port) == (None, "127.0.0.1", 8000)
    assert args.enable_lora and not args.allow_runtime_lora_updating and args.api_key is None
    assert args.lora_modules == [] and args.max_loras is None and args.max_lora_rank == 16


def test_vllm_style_flags():
    chat = '{"name": "chat", "path": "s3://b/chat", "base_model_name": "org/model"}'
    args = parse("org/model", "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "8",
                 "--lora-modules", "sql=/a/sql", chat,
                 "--lora-resolver", "filesystem", "s3", "--lora-resolver-dir", "/adapters",
                 "--api-key", "k", "--allow-runtime-lora-updating", "--served-model-name", "m", "alias",
                 "--no-enable-lora")
    assert args.model == "org/model" and (args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (4, 64, 8)
    assert args.lora_modules == [("sql", "/a/sql", None), ("chat", "s3://b/chat", "org/model")]
    assert args.lora_resolver == ["filesystem", "s3"] and args.lora_resolver_dir == "/adapters"
    assert args.api_key == "k" and args.allow_runtime_lora_updating and not args.enable_lora
    assert args.served_model_name == ["m", "alias"]


def test_environment_defaults(monkeypatch):
    setenv(monkeypatch, "LORAMUX_API_KEY", "from-env")
    setenv(monkeypatch, "LORAMUX_ALLOW_RUNTIME_LORA_UPDATING", "1")
    args = parse()
    assert args.api_key == "from-env" and args.allow_runtime_lora_updating


@pytest.mark.parametrize("spec", ["no-equals-sign", "=path", "name=", '{"name": "x"}', "{not json"])
def test_bad_lora_modules_are_refused_with_the_form_to_use(spec, capsys):
    with pytest.raises(SystemExit) as caught:
        parse("--lora-modules", spec)
    assert caught.value.code == 2
    assert "--lora-modules" in capsys.readouterr().err


def test_kv_cache_and_compilation_flags_reach_the_engine(tmp_path):
    from loramux.serving.server import build_engine

    args = parse("--block-size", "32", "--num-gpu-blocks-override", "70", "--no-enable-prefix-caching",
                 "--enforce-eager", "--no-compilation", "--gpu-memory-utilization", "0.5", "--no-enable-lora")
    assert (args.block_size, args.num_gpu_blocks_override, args.gpu_memory_utilization) == (32, 70, 0.5)
    assert not args.enable_prefix_caching and args.enforce_eager and not args.compilation
    engine, _ = build_engine(args)
    assert engine.kv_cache.block_size == 32 and engine.kv_cache.num_blocks == 70
    assert not engine.block_manager.enable_prefix_caching and engine.config.gpu_memory_utilization == 0.5
    assert not engine.runner.compiled and not engine.runner.use_graphs
    assert parse().enable_prefix_caching and parse().compilation and parse().block_size == 16


def test_request_bounds_flags():
    from loramux.engine.core.structured_output import StructuredOutputLimits

    defaults = parse()
    assert defaults.max_prompts_per_request == 2048 and defaults.structured_outputs_limits is None
    assert defaults.lora_fetch_timeout is None  # the environment's, else 60 s
    args = parse("--max-prompts-per-request", "64", "--lora-fetch-timeout", "2.5", "--structured-outputs-limits",
                 '{"compile_timeout": 10, "cache_bytes": "512MiB", "max_depth": 20}')
    assert args.max_prompts_per_request == 64 and args.lora_fetch_timeout == 2.5
    assert args.structured_outputs_limits == StructuredOutputLimits(compile_timeout=10, cache_bytes=512 * 2**20,
                                                                    max_depth=20)


@pytest.mark.parametrize("spec, problem", [('{"max_deep": 3}', "unknown max_deep"), ("[1]", "not an object"),
                                           ('{"compile_timeout": 0}', "compile_timeout"), ("{oops", "not valid JSON")])
def test_bad_structured_outputs_limits_are_refused_naming_the_problem(spec, problem, capsys):
    with pytest.raises(SystemExit):
        parse("--structured-outputs-limits", spec)
    assert problem in capsys.readouterr().err


def test_quantization_fp8_reaches_the_engine_and_other_methods_are_refused(tmp_path, capsys):
    from conftest import char_tokenizer, tiny_llama, setenv

    from loramux.engine.quantization import Fp8Linear
    from loramux.serving.server import build_engine

    tiny_llama().save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    args = parse(str(tmp_path), "--quantization", "fp8", "--device", "cpu", "--max-model-len", "64")
    assert args.quantization == "fp8" and parse(str(tmp_path), "-q", "fp8").quantization == "fp8"
    assert parse().quantization is None
    engine, _ = build_engine(args)
    assert sum(isinstance(m, Fp8Linear) for m in engine.model.modules()) == 8  # fused q/k/v, gate/up; o, down
    with pytest.raises(SystemExit) as caught:
        parse("-q", "int8")
    assert caught.value.code == 2 and "--quantization: invalid choice: 'int8'" in capsys.readouterr().err


def test_each_flag_comes_from_a_documented_field_with_the_fields_default(capsys):
    """The serve flags are generated from EngineConfig and ServerConfig: every flagged field has a
    doc (its help) and the flag's default is the field's (max_loras and the environment's defaults
    aside), so parsing no flag builds the configs' own defaults."""
    from dataclasses import MISSING

    from loramux.engine.config import EngineConfig
    from loramux.flags import field_docs, flag_values, flagged_fields
    from loramux.serving.config import ServerConfig

    args = parse()
    with pytest.raises(SystemExit):
        parse("--help")
    help_text = " ".join(capsys.readouterr().out.split())
    for cls in (EngineConfig, ServerConfig):
        docs = field_docs(cls)
        for field, spec in flagged_fields(cls):
            assert docs[field.name].split()[0] in help_text, field.name
            default = field.default_factory() if field.default is MISSING else field.default
            if field.name not in ("max_loras", "api_key", "allow_runtime_lora_updating"):
                assert getattr(args, spec.dest or field.name) == default, field.name
    assert EngineConfig(**flag_values(EngineConfig, args)) == EngineConfig()
    assert ServerConfig(**flag_values(ServerConfig, args)) == ServerConfig()
    assert "--max-num-batched-tokens N" in help_text and "(default: 16)" in help_text

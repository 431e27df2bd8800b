"""The ``loramux serve`` flags, named as vLLM names them (``vllm serve --help``).

Kept apart from the server so that building the CLI parser imports neither FastAPI nor torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re

__all__ = ["add_serve_arguments", "parse_byte_size", "parse_byte_size_or_zero", "parse_lora_module",
           "parse_structured_output_limits"]

API_KEY_ENV = "LORAMUX_API_KEY"
# OpenAI's own bound on a list input (embeddings' 2,048 inputs); the engine takes the requests of
# one API request in turns with others', so a long list slows only itself.
DEFAULT_MAX_PROMPTS_PER_REQUEST = 2048
RUNTIME_UPDATING_ENV = "LORAMUX_ALLOW_RUNTIME_LORA_UPDATING"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


_BYTE_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)b?|b)?\s*$", re.IGNORECASE)


def parse_byte_size(text: str, *, minimum: int = 1) -> int:
    """``1073741824``, ``512MiB``, ``8GiB``, ``2GB``, ``1.5G`` -> bytes (``KiB``: 1024, ``KB``: 1000)."""
    match = _BYTE_SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size in bytes; write e.g. 8GiB, 512MiB, 2GB or 1073741824")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    size = int(float(number) * base ** ("kmgt".index(unit.lower()) + 1 if unit else 0))
    if size < minimum:
        raise argparse.ArgumentTypeError(f"{text!r} is less than {minimum} byte{'s' * (minimum != 1)}")
    return size


def parse_byte_size_or_zero(text: str) -> int:
    """`parse_byte_size`, where 0 (turning a reservation off) is allowed too."""
    return parse_byte_size(text, minimum=0)


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}`` -> (name, path, base)."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: not valid JSON ({error})") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise argparse.ArgumentTypeError(
                f"--lora-modules {text!r}: the JSON form needs string fields \"name\" and \"path\" "
                "(and optionally \"base_model_name\")")
        base = spec.get("base_model_name")
        return spec["name"], spec["path"], str(base) if base else None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(
            f"--lora-modules {text!r}: expected NAME=PATH or a JSON object "
            "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    return name, path, None


def parse_structured_output_limits(text: str):
    """``{"compile_timeout": 10, "cache_bytes": "512MiB", ...}`` -> ``StructuredOutputLimits``:
    the limits given, the defaults for the rest (sizes as numbers or as ``512MiB``)."""
    from dataclasses import fields

    from loramux.engine.structured_output import StructuredOutputLimits

    try:
        given = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"--structured-outputs-limits {text!r}: not valid JSON ({error})") from None
    names = [f.name for f in fields(StructuredOutputLimits)]
    unknown = sorted(set(given) - set(names)) if isinstance(given, dict) else ["(not an object)"]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"--structured-outputs-limits {text!r}: unknown {', '.join(unknown)}; the limits are {', '.join(names)}")
    for name in ("cache_bytes", "max_bytes"):
        if isinstance(given.get(name), str):
            given[name] = parse_byte_size(given[name])
    try:
        return StructuredOutputLimits(**given)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--structured-outputs-limits: {error}") from None


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` flags to ``parser`` (the resolver flags are the CLI's shared ones)."""
    parser.add_argument(
        "model", nargs="?", default=None, metavar="MODEL",
        help="a Hugging Face model id or local model dir (with --load-format dummy, also a shipped "
        "config name); default: the embedded SmolLM2-135M-Instruct, with its demo adapters registered")
    parser.add_argument(
        "--served-model-name", nargs="+", metavar="NAME",
        help="the names clients use for the base model (the first is echoed in responses); "
        "default: MODEL as given, or the embedded model's name")

    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one "
                      "(default: %(default)s)")
    http.add_argument(
        "--api-key", default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on every /v1 route (env {API_KEY_ENV})")
    http.add_argument(
        "--allow-runtime-lora-updating", action="store_true", default=_env_flag(RUNTIME_UPDATING_ENV),
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter; without it they answer "
        f"403 (env {RUNTIME_UPDATING_ENV}=1)")
    http.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                      help="a Jinja chat template (or a file holding one) replacing the tokenizer's")
    http.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS_PER_REQUEST, metavar="N",
                      help="the most prompts one /v1/completions request may give; more is a 400 "
                      "(default: %(default)s)")
    http.add_argument("--structured-outputs-limits", type=parse_structured_output_limits, default=None,
                      metavar="JSON",
                      help="what one structured-output format may cost, e.g. '{\"compile_timeout\": 10, "
                      "\"cache_bytes\": \"512MiB\"}'; keys: compile_timeout (seconds, default 5), cache_bytes "
                      "(compiled grammars kept, default 256MiB), max_bytes (a format's text, default 64KiB), "
                      "max_depth (a schema's nesting, default 64), max_enum_values (default 1000), "
                      "max_choices (default 1000); a format over one is a 400 naming it")
    http.add_argument("--uvicorn-log-level", default="info",
                      choices=["critical", "error", "warning", "info", "debug", "trace"])
    http.add_argument("--disable-uvicorn-access-log", action="store_true", help="do not log every request")

    lora = parser.add_argument_group("LoRA")
    lora.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=True,
                      help="serve LoRA adapters (default: on)")
    lora.add_argument("--max-loras", type=int, default=None, metavar="N",
                      help="adapters resident on the GPU and usable in one step (GPU slots); default 1, "
                      "or with the embedded model as many as it has demo adapters")
    lora.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                      help="the largest adapter rank (default: %(default)s)")
    lora.add_argument("--max-cpu-loras", type=int, default=None, metavar="C",
                      help="adapters kept loaded in host memory (default: --max-loras)")
    lora.add_argument("--max-cpu-lora-bytes", type=parse_byte_size, default=None, metavar="SIZE",
                      help="bytes of adapter weights kept in host memory, e.g. 8GiB (default: 10%% "
                      "of the host's memory); the CPU tier keeps at most --max-cpu-loras adapters "
                      "and at most this many bytes")
    lora.add_argument("--max-gpu-lora-bytes", type=parse_byte_size, default=None, metavar="SIZE",
                      help="GPU memory for the weights of resident adapters, e.g. 8GiB, shared by "
                      "rank (a rank-8 adapter takes an eighth of a rank-64 one); raise --max-loras "
                      "with it so more small adapters fit (default: room for --max-loras adapters "
                      "of --max-lora-rank)")
    lora.add_argument("--max-pinned-lora-bytes", type=parse_byte_size_or_zero, default=None, metavar="SIZE",
                      help="page-locked host memory reserved at start (CUDA) for the adapters in host "
                      "memory, e.g. 4GiB: loads carve from it, so nothing is page-locked while serving, "
                      "and take pageable memory when it is full (default: --max-cpu-lora-bytes, at most "
                      "8GiB; 0: none)")
    lora.add_argument("--lora-dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"],
                      help="adapter weight dtype (default: the model's)")
    lora.add_argument(
        "--lora-modules", nargs="+", action="extend", type=parse_lora_module, default=[], metavar="SPEC",
        help="adapters to serve from the start: NAME=PATH, or JSON "
        "'{\"name\": \"sql\", \"path\": \"/adapters/sql\", \"base_model_name\": \"...\"}'")
    lora.add_argument(
        "--lora-resolver", nargs="+", action="extend", default=[], metavar="NAME",
        help="resolvers to ask for adapters not registered, in this order (like --lora-resolvers "
        "A,B); `loramux plugins --all` lists them")

    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="model dtype (default: float32 on CPU, bfloat16 on GPU)")
    engine.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: CUDA if present)")
    engine.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="shard the model over N GPUs of this host, one process each (NCCL; gloo on "
                        "CPU); the engine and its adapter tiers run once (default: %(default)s)")
    engine.add_argument("--max-num-seqs", type=int, default=None, help="sequences running at once")
    engine.add_argument("--max-model-len", type=int, default=None, help="prompt plus output tokens")
    engine.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="'dummy': random weights from the model's config (benchmarks)")
    engine.add_argument("-q", "--quantization", default=None, choices=["fp8"],
                        help="'fp8': the projections' weights quantized to FP8 as they load (per output "
                        "channel; activations per token), half the weight bytes, FP8 GEMMs on GPUs of compute "
                        "capability 8.9+; adapters run on top in the model's dtype. A checkpoint saved in FP8 "
                        "loads as FP8 without it (default: the checkpoint as saved)")
    engine.add_argument("--seed", type=int, default=0, help="seed for sampling (default: %(default)s)")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default: %(default)s)")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION",
                        help="share of the GPU for weights, LoRA slots, activations and the KV cache; the "
                        "KV blocks take what is left (default: %(default)s)")
    engine.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N",
                        help="allocate exactly N KV blocks, on any device")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV blocks of a shared prompt prefix, keyed by the adapter's content "
                        "(default: on)")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="launch each step before reading the last one's tokens back, so the host's work "
                        "between steps overlaps the GPU's (default: on; off under tensor parallelism)")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="no torch.compile and no CUDA graphs (on CUDA both are on by default)")
    engine.add_argument("--compilation", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile the forward on CUDA; --no-compilation keeps CUDA graphs "
                        "without compiling (faster start)")
    engine.add_argument("--max-graph-tokens", type=int, default=4096, metavar="N",
                        help="steps of up to N tokens (decodes, short prompts, mixed steps) replay CUDA "
                        "graphs captured at start; larger ones run eagerly (default: %(default)s)")
    engine.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="T",
                        help="the padded token counts to capture step graphs for, in place of the "
                        "default (2, 4, 8, steps of 16 up to --max-num-seqs, then powers of two up to "
                        "--max-graph-tokens); a step replays the smallest graph that holds it")

    ray = parser.add_argument_group("Ray Serve (pip install 'loramux[ray]'; docs/ray.md)")
    ray.add_argument("--ray", action="store_true",
                     help="serve with replicas on a Ray cluster, each request routed to a replica holding "
                     "its adapter")
    ray.add_argument("--num-replicas", type=int, default=1, metavar="N",
                     help="with --ray: engine replicas (default: %(default)s)")
    ray.add_argument("--ray-address", default=None, metavar="ADDRESS",
                     help="with --ray: the cluster to join (default: $RAY_ADDRESS, else a new local one)")
    ray.add_argument("--replica-num-cpus", type=float, default=1, metavar="C",
                     help="with --ray: CPUs reserved per replica (default: %(default)s)")
    ray.add_argument("--replica-num-gpus", type=float, default=None, metavar="G",
                     help="with --ray: GPUs reserved per replica (default: 1 if the cluster has GPUs)")

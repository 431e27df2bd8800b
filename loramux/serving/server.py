"""``loramux serve``: build the engine from the flags, log what is served, run uvicorn."""

from __future__ import annotations

import argparse
import importlib.resources
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import prometheus_client
import uvicorn

from loramux.serving.options import DEFAULT_MAX_PROMPTS_PER_REQUEST
from loramux.serving.state import ServerConfig

if TYPE_CHECKING:
    from loramux.resolvers.settings import ResolverSettings

__all__ = ["build_engine", "configure_logging", "demo_adapters", "describe", "serve"]

logger = logging.getLogger("loramux.serving")


def demo_adapters() -> list[tuple[str, str, str | None]]:
    """The demo adapters shipped for the embedded model (``loramux/data/adapters/<name>/``)."""
    root = importlib.resources.files("loramux") / "data" / "adapters"
    if not root.is_dir():
        return []
    return [(entry.name, str(entry), None) for entry in sorted(root.iterdir(), key=lambda e: e.name)
            if entry.is_dir() and (entry / "adapter_config.json").is_file()]


def _chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value).expanduser()
    return path.read_text() if "{" not in value and path.is_file() else value


class _Server(uvicorn.Server):
    """uvicorn, telling ``on_listening`` the real port once it accepts connections (``--port 0``)."""

    def __init__(self, config: uvicorn.Config, on_listening: Callable[[int], None]) -> None:
        super().__init__(config)
        self._on_listening = on_listening

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit and self.servers and self.servers[0].sockets:
            self._on_listening(self.servers[0].sockets[0].getsockname()[1])


def configure_logging() -> None:
    package_logger = logging.getLogger("loramux")
    if not package_logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)


def describe(engine: Any, config: ServerConfig) -> None:
    names = ", ".join(config.served_model_names)
    logger.info("Base model %s, served as: %s (max_model_len %s)", engine.model_name, names, engine.max_model_len)
    if engine.lora_manager is None:
        logger.info("LoRA is disabled (--no-enable-lora): only the base model is served")
        return
    adapters = [f"{name} ({path})" for name, path, _ in config.lora_modules]
    logger.info("Adapters: %s", "; ".join(adapters) if adapters else "none registered")
    resolvers = [resolver.describe() for resolver in engine.registry.name_resolvers]
    logger.info("Resolvers for adapters named on demand, in order: %s",
                "; ".join(resolvers) if resolvers else
                "none (set --lora-resolver-dir DIR, or install a resolver plugin)")
    schemes = sorted({f"{s}:// ({r.name})" for r in engine.registry.resolvers for s in r.schemes})
    if schemes:
        logger.info("Adapter URIs fetched: %s", ", ".join(schemes))
    logger.info("Runtime adapter loading: %s; API key: %s",
                "on (/v1/load_lora_adapter, /v1/unload_lora_adapter)" if config.allow_runtime_lora_updating
                else "off (--allow-runtime-lora-updating)",
                "required" if config.api_key else "none")


def build_engine(
    args: argparse.Namespace, resolver_settings: ResolverSettings | None = None
) -> tuple[Any, ServerConfig]:
    """The engine and the server settings the ``loramux serve`` flags in ``args`` describe.

    Shared by ``loramux serve`` and every Ray Serve replica (``loramux.serving.ray``).

    :param resolver_settings: where the resolvers look and in which order; default: from the
        ``--lora-resolver-dir`` / ``--lora-resolver`` flags in ``args`` and the environment.
    """
    from loramux.cli import resolver_settings as settings_from_flags
    from loramux.engine.config import EngineConfig
    from loramux.engine.llm_engine import LLMEngine

    if resolver_settings is None:
        resolver_settings = settings_from_flags(args)

    embedded = args.model is None
    modules = (demo_adapters() if embedded and args.enable_lora else []) + list(args.lora_modules)
    modules = list({name: (name, path, base) for name, path, base in modules}.values())  # a later NAME wins
    max_loras = args.max_loras or (max(1, len(modules)) if embedded else 1)
    logger.info("Loading %s ...", args.model or "the embedded default model")
    engine_config = EngineConfig(
        args.model, enable_lora=args.enable_lora, max_loras=max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, max_cpu_lora_bytes=args.max_cpu_lora_bytes,
        max_gpu_lora_bytes=args.max_gpu_lora_bytes, max_pinned_lora_bytes=args.max_pinned_lora_bytes,
        resolver_settings=resolver_settings, lora_dtype=args.lora_dtype, dtype=args.dtype, device=args.device,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, load_format=args.load_format,
        quantization=getattr(args, "quantization", None),
        seed=args.seed, block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override, enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager, compilation=args.compilation, max_graph_tokens=args.max_graph_tokens,
        cuda_graph_sizes=args.cuda_graph_sizes, async_scheduling=args.async_scheduling,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        structured_output_limits=getattr(args, "structured_outputs_limits", None))
    engine = LLMEngine(config=engine_config)
    config = ServerConfig(
        served_model_names=args.served_model_name or [args.model or engine.model_name],
        api_key=args.api_key,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        lora_modules=modules,
        chat_template=_chat_template(args.chat_template),
        max_prompts_per_request=getattr(args, "max_prompts_per_request", DEFAULT_MAX_PROMPTS_PER_REQUEST),
    )
    return engine, config


def serve(args: argparse.Namespace, resolver_settings: ResolverSettings | None = None) -> int:
    """Run the server until interrupted; returns the exit status (see `build_engine`)."""
    configure_logging()
    prometheus_client.disable_created_metrics()  # no *_created series: they double /metrics for nothing
    from loramux.serving.ray.launch import check_ray_flags, serve_on_ray  # imports Ray only to use it

    check_ray_flags(args)
    if getattr(args, "ray", False):
        return serve_on_ray(args)
    from loramux.serving.app import build_app

    engine, config = build_engine(args, resolver_settings)
    app = build_app(engine, config)  # loads the registered adapters: a bad one stops here
    describe(engine, config)

    def listening(port: int) -> None:
        host = f"[{args.host}]" if ":" in args.host else args.host
        logger.info("Listening on http://%s:%d (OpenAI base_url: http://%s:%d/v1)", host, port, host, port)

    uvicorn_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log, timeout_graceful_shutdown=5)
    _Server(uvicorn_config, listening).run()
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    return 0

"""``loramux serve``: build the engine from the flags, log what is served, run uvicorn."""

from __future__ import annotations

import argparse
import importlib.resources
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import prometheus_client
import uvicorn

from loramux.flags import flag_values
from loramux.serving.config import ServerConfig

if TYPE_CHECKING:
    from loramux.engine.llm_engine import LLMEngine
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


def describe(engine: LLMEngine, config: ServerConfig) -> None:
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
) -> tuple[LLMEngine, ServerConfig]:
    """The engine and the server settings the ``loramux serve`` flags in ``args`` describe.

    Shared by ``loramux serve`` and every Ray Serve replica (``loramux.serving.ray``).

    :param resolver_settings: where the resolvers look and in which order; default: from the
        ``--lora-resolver-dir`` / ``--lora-resolver`` flags in ``args`` and the environment.
    """
    from loramux.engine.config import EngineConfig
    from loramux.engine.llm_engine import LLMEngine
    from loramux.resolvers.settings import resolver_settings as settings_from_flags

    config = ServerConfig(**flag_values(ServerConfig, args))
    embedded = args.model is None
    modules = (demo_adapters() if embedded and args.enable_lora else []) + config.lora_modules
    config.lora_modules = list({name: (name, path, base) for name, path, base in modules}.values())  # a later NAME wins
    options = flag_values(EngineConfig, args)
    engine_config = EngineConfig(args.model, **options,
                                 resolver_settings=resolver_settings or settings_from_flags(args))
    logger.info("Loading %s ...", args.model or "the embedded default model")
    engine = LLMEngine(config=engine_config)
    if not config.served_model_names:
        config.served_model_names = [args.model or engine.model_name]
    return engine, config


def serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted; returns the exit status (see `build_engine`)."""
    configure_logging()
    prometheus_client.disable_created_metrics()  # no *_created series: they double /metrics for nothing
    from loramux.serving.app import build_app

    engine, config = build_engine(args)
    app = build_app(engine, config)  # loads the registered adapters: a bad one stops here
    describe(engine, config)

    def listening(port: int) -> None:
        host = f"[{config.host}]" if ":" in config.host else config.host
        logger.info("Listening on http://%s:%d (OpenAI base_url: http://%s:%d/v1)", host, port, host, port)

    uvicorn_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
        access_log=not config.disable_uvicorn_access_log, timeout_graceful_shutdown=5)
    _Server(uvicorn_config, listening).run()
    engine.close()
    return 0

"""The ``loramux serve`` flags, named as vLLM names them (``vllm serve --help``).

Generated from the fields of `EngineConfig`, `ServerConfig` and `RayConfig` (:mod:`loramux.flags`),
so each option's default and help are written once, on its field. Building the parser imports
neither FastAPI nor uvicorn.
"""

from __future__ import annotations

import argparse

from loramux.engine.config import EngineConfig
from loramux.flags import add_flags, option_names
from loramux.resolvers.settings import add_resolver_arguments
from loramux.serving.config import ServerConfig
from loramux.serving.ray.options import RAY_GROUP, RayConfig

__all__ = ["add_serve_arguments"]


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` flags to ``parser``."""
    parser.add_argument(
        "model", nargs="?", default=None, metavar="MODEL",
        help="a Hugging Face model id or local model dir (with --load-format dummy, also a shipped "
        "config name); default: the embedded SmolLM2-135M-Instruct, with its demo adapters registered")
    names = {**option_names(EngineConfig), **option_names(ServerConfig), **option_names(RayConfig)}
    groups = {name: parser.add_argument_group(name) for name in ("HTTP", "LoRA", "engine")}
    add_flags(parser, ServerConfig, groups=groups, flag_names=names)
    groups["LoRA"].add_argument(
        "--lora-resolver", nargs="+", action="extend", default=[], metavar="NAME",
        help="resolvers to ask for adapters not registered, in this order (like --lora-resolvers "
        "A,B); `loramux plugins --all` lists them")
    add_flags(parser, EngineConfig, groups=groups, flag_names=names)
    ray = groups[RAY_GROUP] = parser.add_argument_group(RAY_GROUP)
    ray.add_argument("--ray", action="store_true",
                     help="serve with replicas on a Ray cluster, each request routed to a replica holding "
                     "its adapter")
    add_flags(parser, RayConfig, groups=groups, flag_names=names)
    ray.add_argument("--ray-address", default=None, metavar="ADDRESS",
                     help="with --ray: the cluster to join (default: $RAY_ADDRESS, else a new local one)")
    add_resolver_arguments(parser)

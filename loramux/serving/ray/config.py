"""A loramux application for Ray Serve, built from settings: ``build_application(args)``.

A Ray Serve config file names it as its ``import_path`` and passes the settings as ``args``:
every ``loramux serve`` option by its long name with underscores (``max_cpu_loras: 8``,
``lora_resolver_dir: /adapters``, ``lora_modules: ["sql=/adapters/sql"]``), plus the Ray ones in
:data:`RAY_SETTINGS`. ``loramux serve --ray`` builds the same application from its flags.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from loramux.serving.ray.options import RAY_SETTINGS, RayConfig

__all__ = ["RAY_SETTINGS", "build_application", "parse_serve_args"]

_NOT_SETTINGS = {"func", "command", "ray", "ray_address", "host", "port"}  # the CLI's, not the app's


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # a config file's mistake is an error, not an exit
        raise ValueError(message)


def _serve_parser() -> argparse.ArgumentParser:
    from loramux.serving.options import add_serve_arguments

    parser = _Parser(prog="loramux serve")
    add_serve_arguments(parser)
    return parser


def _lora_module(value: Any) -> tuple[str, str, str | None]:
    from loramux.serving.config import parse_lora_module

    if isinstance(value, (tuple, list)) and len(value) in (2, 3):
        return (str(value[0]), str(value[1]), value[2] if len(value) == 3 else None)
    text = json.dumps(value) if isinstance(value, dict) else value
    if not isinstance(text, str):
        raise ValueError(f"lora_modules: {value!r} is not NAME=PATH nor {{name: ..., path: ...}}")
    return parse_lora_module(text)


def parse_serve_args(settings: dict[str, Any]) -> argparse.Namespace:
    """The ``loramux serve`` options ``settings`` gives, the rest at their defaults.

    :raises ValueError: for a name that is no ``loramux serve`` option (the message lists them).
    """
    args = _serve_parser().parse_args([])
    known = set(vars(args))
    for name, value in settings.items():
        if name in RAY_SETTINGS or name in _NOT_SETTINGS:
            continue
        if name not in known:
            options = ", ".join(sorted(known - _NOT_SETTINGS - set(RAY_SETTINGS)))
            raise ValueError(f"unknown loramux setting {name!r}; the settings are the `loramux serve` options "
                             f"with underscores: {options}, and the Ray ones: {', '.join(RAY_SETTINGS)}")
        if name == "lora_modules":
            value = [_lora_module(item) for item in (value or [])]
        elif name in ("served_model_name", "lora_resolver") and isinstance(value, str):
            value = [value]
        setattr(args, name, value)
    return args


def build_application(args: dict[str, Any]) -> Any:
    """The Ray Serve application (an ingress bound to the replicas) for these settings.

    The ``import_path`` of a Ray Serve config file: ``loramux.serving.ray:build_application``.
    """
    import ray
    from ray import serve

    from loramux.serving.ray.directory import AdapterDirectory
    from loramux.serving.ray.ingress import LoramuxIngress
    from loramux.serving.ray.replica import LoramuxReplica

    settings = dict(args or {})
    serve_args = parse_serve_args(settings)  # fail here, not in every replica
    replica_settings = {k: v for k, v in settings.items() if k not in RAY_SETTINGS and k not in _NOT_SETTINGS}
    deployment = RayConfig(**{k: v for k, v in settings.items() if k in RAY_SETTINGS and v is not None})
    has_gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    num_replicas = deployment.num_replicas
    actor_options = {"num_cpus": float(deployment.replica_num_cpus),
                     "num_gpus": float(1 if has_gpus else 0) if deployment.replica_num_gpus is None
                     else float(deployment.replica_num_gpus)}
    max_ongoing = int(deployment.max_ongoing_requests or serve_args.max_num_seqs or 16)

    directory = None
    if serve_args.allow_runtime_lora_updating:
        directory = serve.deployment(AdapterDirectory, name="LoramuxAdapterDirectory", num_replicas=1,
                                     ray_actor_options={"num_cpus": 0}).bind()
    replicas = serve.deployment(
        LoramuxReplica, name="LoramuxReplica", num_replicas=num_replicas, max_ongoing_requests=max_ongoing,
        ray_actor_options=actor_options,
        health_check_period_s=5, graceful_shutdown_timeout_s=10,
    ).bind(replica_settings, directory)
    return serve.deployment(LoramuxIngress, name="LoramuxIngress", ray_actor_options={"num_cpus": 0},
                            max_ongoing_requests=max(1000, 4 * max_ongoing * num_replicas),
                            ).bind(replicas, bool(deployment.adapter_affinity))

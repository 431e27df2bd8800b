"""A loramux application for Ray Serve, built from settings: ``build_application(args)``.

A Ray Serve config file names it as its ``import_path`` and passes the settings as ``args``:
every ``loramux serve`` option by its long name with underscores (``max_cpu_loras: 8``,
``lora_resolver_dir: /adapters``, ``lora_modules: ["sql=/adapters/sql"]``), plus the Ray ones in
:data:`RAY_SETTINGS`. ``loramux serve --ray`` builds the same application from its flags.
"""

from __future__ import annotations

from typing import Any

from loramux.serving.ray.options import RAY_SETTINGS, RayConfig
from loramux.serving.ray.serve_args import NOT_SETTINGS, parse_serve_args

__all__ = ["RAY_SETTINGS", "build_application", "parse_serve_args"]

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
    replica_settings = {k: v for k, v in settings.items() if k not in RAY_SETTINGS and k not in NOT_SETTINGS}
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

"""`RayConfig`: how ``loramux serve --ray`` (or a Ray Serve config file) deploys the replicas.

The settings that shape the Ray deployments rather than each replica's engine, each declared
once: its default, its doc and, for some, its flag (:mod:`loramux.flags`). Light: building the
CLI's parser imports it, and not Ray.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loramux.flags import field_docs, flag

__all__ = ["RAY_GROUP", "RAY_SETTINGS", "RayConfig"]

RAY_GROUP = "Ray Serve (pip install 'loramux[ray]'; docs/ray.md)"


@dataclass
class RayConfig:
    """The deployment's settings (``build_application``'s, besides the ``loramux serve`` options)."""

    num_replicas: int = flag(1, metavar="N", group=RAY_GROUP)
    """With --ray: engine replicas (a config file's deployments: section may set autoscaling_config
    instead)."""
    replica_num_cpus: float = flag(1.0, metavar="C", group=RAY_GROUP)
    """With --ray: CPUs Ray reserves per replica."""
    replica_num_gpus: float | None = flag(None, metavar="G", group=RAY_GROUP)
    """With --ray: GPUs Ray reserves per replica (default: 1 if the cluster has GPUs, else 0)."""
    max_ongoing_requests: int | None = None
    """Requests a replica takes at once before Ray routes elsewhere (default: max_num_seqs, or 16)."""
    adapter_affinity: bool = True
    """Route a request to a replica holding its adapter."""

    def __post_init__(self) -> None:
        for name, whole in (("num_replicas", True), ("replica_num_cpus", False), ("replica_num_gpus", False),
                            ("max_ongoing_requests", True)):
            value = getattr(self, name)
            if value is None:
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or value < (1 if name == "num_replicas" else 0) or (whole and value != int(value)):
                raise ValueError(f"{name} must be a {'whole ' if whole else ''}number of at least "
                                 f"{1 if name == 'num_replicas' else 0}, got {value!r}")

    @classmethod
    def defaults(cls) -> dict[str, object]:
        return {f.name: f.default for f in dataclasses.fields(cls)}


#: the deployment settings, with their docs (a config file's ``args`` may hold them)
RAY_SETTINGS: dict[str, str] = {f.name: field_docs(RayConfig).get(f.name, "") for f in dataclasses.fields(RayConfig)}

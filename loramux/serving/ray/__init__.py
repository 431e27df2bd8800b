"""loramux replicas on a Ray cluster (``pip install 'loramux[ray]'``): see docs/ray.md.

``build_application(settings)`` is the Ray Serve application (config files name it as their
``import_path``: ``loramux.serving.ray:build_application``); ``loramux serve --ray`` deploys it
from the CLI's flags. Each replica runs one engine behind the single server's own app; requests
are routed to the replica that holds their adapter by Ray Serve's model multiplexing.
"""

from __future__ import annotations

from loramux.serving.ray.config import RAY_SETTINGS, build_application, parse_serve_args

__all__ = ["RAY_SETTINGS", "build_application", "parse_serve_args"]

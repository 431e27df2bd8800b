"""``loramux serve --ray``: the same flags, served by replicas on a Ray cluster.

Connects to the cluster ``--ray-address`` names (or ``RAY_ADDRESS``; with neither, starts one on
this machine), starts Ray Serve's HTTP proxy on ``--host``/``--port`` and deploys
:func:`loramux.serving.ray.config.build_application` until interrupted.
"""

from __future__ import annotations

import argparse
import logging
import signal

__all__ = ["APP_NAME", "check_ray_flags", "serve_on_ray", "settings_from_args"]

logger = logging.getLogger("loramux.serving")

APP_NAME = "loramux"


def settings_from_args(args: argparse.Namespace) -> dict:
    """The application settings (``build_application``'s ``args``) the CLI flags give."""
    from loramux.serving.ray.serve_args import NOT_SETTINGS
    from loramux.serving.ray.options import RAY_SETTINGS

    defaults = vars(_default_args())
    settings = {name: value for name, value in vars(args).items()
                if name not in NOT_SETTINGS and (name in RAY_SETTINGS or value != defaults.get(name))}
    return {name: value for name, value in settings.items() if value is not None}


def _default_args() -> argparse.Namespace:
    from loramux.serving.ray.serve_args import parse_serve_args

    return parse_serve_args({})


def check_ray_flags(args: argparse.Namespace) -> None:
    """Without ``--ray``, a Ray flag would be ignored: say so instead.

    :raises ValueError: naming the Ray flags given without ``--ray``.
    """
    from loramux.flags import option_names
    from loramux.serving.ray.options import RayConfig

    defaults = RayConfig.defaults()
    given = [name for field, name in option_names(RayConfig).items() if getattr(args, field) != defaults[field]]
    if args.ray_address is not None:
        given.append("--ray-address")
    if given and not args.ray:
        raise ValueError(f"{', '.join(given)} only apply with --ray (replicas on a Ray cluster); add --ray, "
                         "or leave them out")


def serve_on_ray(args: argparse.Namespace) -> int:
    """Deploy the application on Ray Serve and wait until interrupted; returns the exit status."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("--ray needs Ray Serve: pip install 'loramux[ray]'") from None
    from loramux.serving.ray.config import build_application

    def stop(signum: int, frame: object) -> None:  # a service manager's stop, like Ctrl-C: shut Ray down
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    settings = settings_from_args(args)
    application = build_application(settings)  # a bad setting stops here, before Ray starts
    ray.init(address=args.ray_address, namespace="loramux")
    serve.start(http_options={"host": args.host, "port": args.port})
    host = f"[{args.host}]" if ":" in args.host else args.host
    logger.info("Deploying %d replica(s) on Ray; OpenAI base_url: http://%s:%d/v1 once they are ready",
                settings.get("num_replicas", 1), host, args.port)
    try:
        serve.run(application, name=APP_NAME, route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    except RuntimeError as error:  # e.g. a replica that cannot start: a bad --lora-modules path
        raise ValueError(f"{error} (each replica's own error is in the log above)") from None
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0

"""`parse_serve_args`: the ``loramux serve`` options a Ray Serve config file (or ``--ray``) gives,
as the namespace the CLI would parse; each replica builds its engine from it."""

from __future__ import annotations

import argparse
import json
from typing import Any

from loramux.serving.config import parse_lora_module
from loramux.serving.ray.options import RAY_SETTINGS

__all__ = ["NOT_SETTINGS", "parse_serve_args"]

NOT_SETTINGS = {"func", "command", "ray", "ray_address", "host", "port"}  # the CLI's, not the app's


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # a config file's mistake is an error, not an exit
        raise ValueError(message)


def _serve_parser() -> argparse.ArgumentParser:
    # at call time: loramux.serving.options reads RayConfig from loramux.serving.ray, whose package
    # imports this module
    from loramux.serving.options import add_serve_arguments

    parser = _Parser(prog="loramux serve")
    add_serve_arguments(parser)
    return parser


def _lora_module(value: Any) -> tuple[str, str, str | None]:
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
        if name in RAY_SETTINGS or name in NOT_SETTINGS:
            continue
        if name not in known:
            options = ", ".join(sorted(known - NOT_SETTINGS - set(RAY_SETTINGS)))
            raise ValueError(f"unknown loramux setting {name!r}; the settings are the `loramux serve` options "
                             f"with underscores: {options}, and the Ray ones: {', '.join(RAY_SETTINGS)}")
        if name == "lora_modules":
            value = [_lora_module(item) for item in (value or [])]
        elif name in ("served_model_name", "lora_resolver") and isinstance(value, str):
            value = [value]
        setattr(args, name, value)
    return args

"""The ``loramux`` command.

Each subcommand is one parser block in :func:`build_parser` and one ``cmd_<name>(args) -> int``
function. Heavy imports happen inside the command functions, so ``loramux --help`` stays quick.
A :class:`~loramux.errors.LoRAError` (or a bad setting, ``ValueError``) reaching :func:`main` is
printed as one line, ``loramux: error: ...``, with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

__all__ = ["build_parser", "main"]


# -------------------------------------------------------------------------------------------------
# The parser
# -------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from loramux.version import __version__
    from loramux.resolvers.settings import add_resolver_arguments
    from loramux.serving.options import add_serve_arguments

    parser = argparse.ArgumentParser(
        prog="loramux", description="Serve many LoRA adapters on one shared base model."
    )
    parser.add_argument("--version", action="version", version=f"loramux {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    # -- loramux plugins ---------------------------------------------------------------------------
    command = commands.add_parser(
        "plugins",
        help="list installed plugins, their versions and the hooks they implement",
        description="List the installed loramux plugins (entry-point group 'loramux'), their "
        "versions and hooks, and any that failed to load or are left out by LORAMUX_PLUGINS.",
    )
    command.add_argument("--all", action="store_true", help="include loramux's built-in plugins")
    command.add_argument("--json", action="store_true", help="print JSON")
    command.set_defaults(func=cmd_plugins)

    # -- loramux inspect ---------------------------------------------------------------------------
    command = commands.add_parser(
        "inspect",
        help="find an adapter (by name, path or URI), check it and describe it",
        description="Find an adapter through the resolvers (or at a path or URI), load and "
        "validate it, and print its rank, alpha, targets and size, or what is wrong with it. "
        "Exit status 1 if it cannot be found or is invalid.",
    )
    command.add_argument(
        "adapter",
        metavar="NAME_OR_PATH",
        help="an adapter name (asked of the resolvers), a local directory (an existing one wins "
        "over a name; start a path with ./ to be explicit), or a URI (s3://..., hf://org/repo)",
    )
    command.add_argument(
        "--model",
        metavar="MODEL",
        help="the base model: resolvers may group adapters by it, and the adapter must have been "
        "trained for it",
    )
    command.add_argument(
        "--max-lora-rank", type=int, metavar="R", help="also check the rank is at most R"
    )
    command.add_argument("--json", action="store_true", help="print JSON")
    add_resolver_arguments(command)
    command.set_defaults(func=cmd_inspect)

    # -- loramux serve -----------------------------------------------------------------------------
    command = commands.add_parser(
        "serve",
        help="serve the model and its adapters over an OpenAI-compatible HTTP API",
        description="Serve a base model and any number of LoRA adapters over HTTP, OpenAI style: "
        "a request's 'model' names the base model or an adapter; adapters not registered are "
        "found on demand through the resolvers. See docs/serving.md.",
    )
    add_serve_arguments(command)
    command.set_defaults(func=cmd_serve)

    return parser


def main(argv: list[str] | None = None) -> int:
    """The console script ``loramux``."""
    from loramux import envs
    from loramux.errors import LoRAError

    try:
        envs.current()  # read once, now: a value it does not understand is a one-line error
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (LoRAError, ValueError) as error:
        print(f"loramux: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


# -------------------------------------------------------------------------------------------------
# loramux plugins
# -------------------------------------------------------------------------------------------------


def cmd_plugins(args: argparse.Namespace) -> int:
    from loramux.plugins import list_plugins, plugin_errors

    plugins = list_plugins(include_builtins=args.all)
    shown = {plugin.error for plugin in plugins if plugin.error}
    for error in plugin_errors():
        if str(error) not in shown:
            print(f"loramux: warning: {error}", file=sys.stderr)
    if args.json:
        print(json.dumps([asdict(plugin) for plugin in plugins], indent=2))
        return 0
    if not plugins:
        print("No plugins installed. (`loramux plugins --all` lists the built-in ones too.)")
        return 0
    for plugin in plugins:
        version = f" {plugin.version}" if plugin.version else ""
        tag = " [built-in]" if plugin.builtin else ""
        if plugin.status == "loaded":
            print(f"{plugin.name}{version}{tag}")
            print(f"  hooks: {', '.join(plugin.hooks) or '(none)'}")
        elif plugin.status == "blocked":
            print(f"{plugin.name}{version}{tag}: not loaded (not in LORAMUX_PLUGINS)")
        else:
            print(f"{plugin.name}{version}{tag}: FAILED")
            print(f"  {plugin.error}")
    return 0


# -------------------------------------------------------------------------------------------------
# loramux inspect
# -------------------------------------------------------------------------------------------------


def _request_for(text: str):
    """A name goes to the resolvers; an existing path, a ``./``-style path or a URI is read."""
    from loramux.registry import LoRARequest

    if "://" in text:
        name = text.split("://", 1)[1].rstrip("/").rsplit("/", 1)[-1].split("@")[0] or text
        return LoRARequest(name, 1, text)
    path = Path(text).expanduser()
    if path.exists() or text.startswith(("/", "./", "../", "~", ".\\")) or text in (".", ".."):
        return LoRARequest(path.resolve().name or "adapter", 1, str(path))
    return LoRARequest(text, 1)


def cmd_inspect(args: argparse.Namespace) -> int:
    from loramux.errors import LoRAError
    from loramux.registry import LoRAConfig, Registry, load_adapter
    from loramux.resolvers.settings import resolver_settings

    request = _request_for(args.adapter)
    report: dict = {"name": request.lora_name, "source": request.lora_path or None}
    try:
        registry = Registry(base_model_name=args.model, resolver_settings=resolver_settings(args))
        location = registry.locate(request)
        report.update(resolver=location.resolver, path=str(location.path))
        config = LoRAConfig(max_lora_rank=args.max_lora_rank) if args.max_lora_rank else None
        adapter = load_adapter(
            location.path, config, name=request.lora_name, base_model_name=args.model
        )
    except LoRAError as error:
        report.update(valid=False, error=str(error))
        _print_report(report, args.json)
        return 1
    ranks = sorted({weights.rank for weights in adapter.modules.values()})
    first = next(iter(adapter.modules.values()))
    targets = adapter.target_modules
    report.update(
        valid=True,
        error=None,
        base_model=adapter.base_model_name,
        rank=adapter.rank,
        ranks=ranks,
        lora_alpha=adapter.lora_alpha,
        target_modules=targets if isinstance(targets, str) else sorted(targets),
        modules=len(adapter.modules),
        parameters=adapter.num_parameters,
        bytes=adapter.nbytes,
        dtype=str(first.lora_a.dtype).removeprefix("torch."),
    )
    _print_report(report, args.json)
    return 0


def _print_report(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    found = report.get("resolver") or ("local path" if report.get("path") else None)
    rows = [
        ("adapter", report["name"]),
        ("source", report.get("source")),
        ("found by", found),
        ("directory", report.get("path")),
    ]
    if report["valid"]:
        ranks = report["ranks"]
        rank = str(report["rank"]) + (
            f" (modules: {', '.join(map(str, ranks))})" if len(ranks) > 1 else ""
        )
        targets = report["target_modules"]
        rows += [
            ("base model", report["base_model"] or "(not recorded)"),
            ("rank", rank),
            ("lora_alpha", report["lora_alpha"]),
            ("targets", targets if isinstance(targets, str) else ", ".join(targets)),
            ("modules", report["modules"]),
            ("parameters", f"{report['parameters']:,}"),
            ("bytes", f"{report['bytes']:,} ({report['dtype']})"),
            ("valid", "yes"),
        ]
    else:
        rows.append(("valid", f"no: {report['error']}"))
    for label, value in rows:
        if value is not None:
            print(f"{label:<11} {value}")


# -------------------------------------------------------------------------------------------------
# loramux serve
# -------------------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from loramux.serving.ray.launch import check_ray_flags

    check_ray_flags(args)
    if args.ray:
        from loramux.serving.ray.launch import serve_on_ray  # imports Ray only to use it

        return serve_on_ray(args)
    from loramux.serving.server import serve

    return serve(args)


if __name__ == "__main__":
    sys.exit(main())

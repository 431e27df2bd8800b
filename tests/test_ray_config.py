"""The Ray Serve application's settings and the in-process HTTP call, without starting Ray.

tests/test_ray_serve.py runs the application on a real local cluster.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi", reason="the serve extras are not installed: pip install -e .[serve,test]")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import StreamingResponse  # noqa: E402

from loramux.cli import build_parser
from loramux.serving.ray.asgi_call import HTTPRequest, ResponseStart, call_asgi
from loramux.serving.ray.config import parse_serve_args
from loramux.serving.ray.directory import AdapterDirectory
from loramux.serving.ray.launch import settings_from_args


def test_settings_are_the_serve_options_with_their_defaults():
    args = parse_serve_args({"max_cpu_loras": 8, "lora_resolver_dir": "/adapters", "served_model_name": "base",
                             "num_replicas": 3})
    assert (args.max_cpu_loras, args.lora_resolver_dir, args.served_model_name) == (8, "/adapters", ["base"])
    assert args.max_lora_rank == 16 and args.enable_lora is True  # untouched defaults


def test_lora_modules_take_every_form_the_cli_takes():
    args = parse_serve_args({"lora_modules": ["sql=/a/sql", {"name": "chat", "path": "/a/chat",
                                                              "base_model_name": "m"}, ["x", "/a/x"]]})
    assert args.lora_modules == [("sql", "/a/sql", None), ("chat", "/a/chat", "m"), ("x", "/a/x", None)]


@pytest.mark.parametrize("bad", ["no-equals-sign", {"name": "only-a-name"}, 42])
def test_a_bad_lora_module_is_an_error_naming_it(bad):
    with pytest.raises(ValueError, match="lora_modules|--lora-modules"):
        parse_serve_args({"lora_modules": [bad]})


def test_an_unknown_setting_is_an_error_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown loramux setting 'max_cpu_lora'.*max_cpu_loras.*adapter_affinity"):
        parse_serve_args({"max_cpu_lora": 8})


def test_cli_flags_become_settings():
    args = build_parser().parse_args(["serve", "--ray", "--num-replicas", "2", "--max-cpu-loras", "4",
                                      "--lora-modules", "sql=/a/sql", "--port", "9000"])
    settings = settings_from_args(args)
    assert settings["num_replicas"] == 2 and settings["max_cpu_loras"] == 4
    assert settings["lora_modules"] == [("sql", "/a/sql", None)]
    assert "port" not in settings and "ray" not in settings  # the CLI's own, not the replicas'
    assert parse_serve_args(settings).lora_modules == [("sql", "/a/sql", None)]


@pytest.mark.parametrize("name, value", [("num_replicas", 0), ("num_replicas", "two"), ("replica_num_cpus", -1),
                                         ("max_ongoing_requests", 1.5)])
def test_bad_ray_settings_are_errors_naming_them(name, value):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'loramux[ray]'")
    from loramux.serving.ray import build_application

    with pytest.raises(ValueError, match=name):
        build_application({name: value})


def test_the_application_builds_without_a_cluster():
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'loramux[ray]'")
    from ray.serve import Application

    from loramux.serving.ray import build_application

    assert isinstance(build_application({"num_replicas": 2, "allow_runtime_lora_updating": True}), Application)


def test_the_directory_gives_each_names_latest_change_once():
    directory = AdapterDirectory()
    directory.record("a", "/a1")
    directory.record("b", "/b")
    directory.record("a", None)  # unloaded
    version, changes = directory.changes_since(0)
    assert version == 3 and [(c.name, c.path) for c in changes] == [("b", "/b"), ("a", None)]
    assert directory.changes_since(3) == (3, [])


# -- the in-process HTTP call -------------------------------------------------------------------

app = FastAPI()
seen: dict[str, bool] = {}


@app.post("/echo")
async def echo(request: Request) -> dict:
    return {"got": (await request.json())["x"]}


@app.get("/stream")
async def stream(request: Request) -> StreamingResponse:
    async def chunks():
        try:
            for i in range(1000):
                yield f"chunk {i}\n"
                await asyncio.sleep(0.01)
        finally:
            seen["closed"] = True
    return StreamingResponse(chunks(), media_type="text/plain")


@app.get("/boom")
async def boom() -> None:
    raise RuntimeError("boom")


async def _collect(request: HTTPRequest, limit: int | None = None) -> list:
    items = []
    stream = call_asgi(app, request)
    async for item in stream:
        items.append(item)
        if limit is not None and len(items) == limit:
            break
    await stream.aclose()
    return items


def test_a_json_answer_comes_back_whole():
    items = asyncio.run(_collect(HTTPRequest("POST", "/echo", b"", [(b"content-type", b"application/json")],
                                             b'{"x": 7}')))
    assert isinstance(items[0], ResponseStart) and items[0].status == 200
    assert items[0].header("Content-Type") == "application/json"
    assert b"".join(items[1:]) == b'{"got":7}'


def test_closing_a_stream_early_ends_the_apps_generator():
    seen.clear()
    items = asyncio.run(_collect(HTTPRequest("GET", "/stream"), limit=4))
    assert items[1:] == [b"chunk 0\n", b"chunk 1\n", b"chunk 2\n"]
    assert seen == {"closed": True}


def test_an_app_that_raises_gives_a_whole_500():
    items = asyncio.run(_collect(HTTPRequest("GET", "/boom")))
    assert items[0].status == 500 and b"".join(items[1:]).lower() == b"internal server error"


def test_an_app_that_raises_without_answering_gives_a_500():
    async def silent_app(scope, receive, send):
        raise RuntimeError("no answer")

    async def collect():
        return [item async for item in call_asgi(silent_app, HTTPRequest("GET", "/"))]

    items = asyncio.run(collect())
    assert items[0].status == 500 and b"internal server error" in b"".join(items[1:])


def test_the_documented_config_file_builds():
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'loramux[ray]'")
    import importlib
    from pathlib import Path

    import yaml
    from ray.serve import Application

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "docs" / "ray-serve.yaml").read_text())
    (app,) = config["applications"]
    module, _, name = app["import_path"].partition(":")
    assert isinstance(getattr(importlib.import_module(module), name)(app["args"]), Application)


def test_ray_flags_without_ray_are_an_error_naming_them(capsys):
    from loramux.cli import main

    assert main(["serve", "--num-replicas", "2", "--replica-num-gpus", "1"]) == 1
    assert "--num-replicas, --replica-num-gpus only apply with --ray" in capsys.readouterr().err

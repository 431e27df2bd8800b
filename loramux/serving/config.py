"""`ServerConfig`: what the HTTP layer needs beyond the engine, each option declared once.

Like `loramux.engine.config.EngineConfig`, each field carries its default, its doc and its
``loramux serve`` flag (:mod:`loramux.flags`). Light on purpose: building the CLI's parser
imports this, and neither FastAPI nor uvicorn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loramux import envs
from loramux.flags import flag

__all__ = ["LoRAModule", "ServerConfig", "parse_lora_module"]

#: an adapter served from the start: (name, path, base model name or None)
LoRAModule = tuple[str, str, "str | None"]


def parse_lora_module(text: str) -> LoRAModule:
    """``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}`` -> (name, path, base)."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--lora-modules {text!r}: not valid JSON ({error})") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise ValueError(
                f"--lora-modules {text!r}: the JSON form needs string fields \"name\" and \"path\" "
                "(and optionally \"base_model_name\")")
        base = spec.get("base_model_name")
        return spec["name"], spec["path"], str(base) if base else None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(
            f"--lora-modules {text!r}: expected NAME=PATH or a JSON object "
            "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    return name, path, None


def read_chat_template(value: str | None) -> str | None:
    """A Jinja template as given, or the text of the file it names."""
    if value is None:
        return None
    path = Path(value).expanduser()
    return path.read_text() if "{" not in value and path.is_file() else value


@dataclass
class ServerConfig:
    """The HTTP server's settings (``build_app(engine, config)``)."""

    served_model_names: list[str] = flag([], "--served-model-name", dest="served_model_name", nargs="+",
                                         metavar="NAME")
    """The names clients use for the base model; the first is echoed in responses (default: MODEL
    as given, or the embedded model's name)."""
    api_key: str | None = flag(None, flag_default=lambda: envs.current().api_key, group="HTTP")
    """Require 'Authorization: Bearer KEY' on every /v1 route (env LORAMUX_API_KEY)."""
    allow_runtime_lora_updating: bool = flag(
        False, flag_default=lambda: envs.current().allow_runtime_lora_updating, group="HTTP")
    """Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter; without it they answer 403
    (env LORAMUX_ALLOW_RUNTIME_LORA_UPDATING=1)."""
    lora_modules: list[LoRAModule] = flag([], type=parse_lora_module, nargs="+", action="extend", metavar="SPEC",
                                          group="LoRA")
    """Adapters to serve from the start: NAME=PATH, or JSON '{"name": "sql", "path": "/adapters/sql",
    "base_model_name": "..."}'."""
    chat_template: str | None = flag(None, metavar="FILE_OR_TEMPLATE", group="HTTP")
    """A Jinja chat template (or a file holding one) replacing the tokenizer's."""
    max_model_len: int | None = None
    """Shown in /v1/models, and bounds prompts and ``max_tokens`` (default: the engine's)."""
    # OpenAI's own bound on a list input (embeddings' 2,048): the engine takes one API request's
    # prompts in turns with others', so a long list slows only itself
    max_prompts_per_request: int = flag(2048, metavar="N", group="HTTP")
    """The most prompts one /v1/completions request may give; more is a 400."""
    host: str = flag("127.0.0.1", group="HTTP")
    """Address to listen on."""
    port: int = flag(8000, group="HTTP")
    """Port to listen on; 0 picks a free one."""
    uvicorn_log_level: str = flag("info", choices=("critical", "error", "warning", "info", "debug", "trace"),
                                  group="HTTP")
    """uvicorn's log level."""
    disable_uvicorn_access_log: bool = flag(False, group="HTTP")
    """Do not log every request."""

    def __post_init__(self) -> None:
        self.chat_template = read_chat_template(self.chat_template)

"""Every failure becomes an OpenAI-style error body with the right HTTP status.

``{"error": {"message", "type", "param", "code"}}``, the envelope OpenAI's clients parse into
their ``APIStatusError`` subclasses. loramux's own errors (``loramux.errors``) keep their message,
which already names the adapter, the file and the fix.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loramux.errors import (
    AdapterDownloadError,
    AdapterNotFoundError,
    CacheFullError,
    IncompatibleAdapterError,
    InvalidAdapterError,
    LoRAError,
    PluginError,
)
from loramux.serving.protocol import ErrorBody, ErrorResponse

__all__ = ["APIError", "EngineDeadError", "error_response", "from_lora_error", "install_error_handlers"]

logger = logging.getLogger(__name__)

# status -> OpenAI's error type for it
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "internal_server_error",
    502: "api_error",
    503: "service_unavailable_error",
}

# loramux error class -> (status, code); the first matching class wins (subclasses first).
_LORA_ERRORS: list[tuple[type[LoRAError], int, str]] = [
    (AdapterNotFoundError, 404, "model_not_found"),
    (InvalidAdapterError, 400, "invalid_adapter"),
    (IncompatibleAdapterError, 400, "incompatible_adapter"),
    (AdapterDownloadError, 502, "adapter_download_failed"),
    (PluginError, 502, "adapter_source_failed"),
    (CacheFullError, 503, "adapter_cache_full"),
    (LoRAError, 400, "adapter_error"),
]


class APIError(Exception):
    """An error with its HTTP status, raised anywhere below a route and answered as JSON."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        error = ErrorBody(message=self.message, type=_TYPES.get(self.status, "api_error"),
                          param=self.param, code=self.code)
        return ErrorResponse(error=error).model_dump()


class EngineDeadError(RuntimeError):
    """The engine's step loop raised; the server can no longer generate."""


def from_lora_error(error: LoRAError, *, param: str | None = "model") -> APIError:
    """The API error for a loramux error: 404 not found, 400 invalid, 502 source failed, 503 full."""
    for cls, status, code in _LORA_ERRORS:
        if isinstance(error, cls):
            return APIError(status, str(error), param=param, code=code)
    raise AssertionError("LoRAError is the last entry")  # pragma: no cover


def to_api_error(error: BaseException) -> APIError:
    """Any exception met while serving a request, as the API error a client sees."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, LoRAError):
        return from_lora_error(error)
    if isinstance(error, EngineDeadError):
        return APIError(503, str(error), code="engine_dead")
    if isinstance(error, ValueError):  # the engine refusing a prompt or a sampling parameter
        return APIError(400, str(error), code="invalid_request")
    logger.error("Unexpected error while serving a request", exc_info=error)  # the details stay in the log
    return APIError(500, f"internal error ({type(error).__name__}); the server's log has the details",
                    code="internal_error")


# FastAPI's own errors: an unknown route or method
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


# The member of a union pydantic tried, in an error's location ("str", "list[int]", "ChatMessage"):
# not a field, so not part of the field's name.
_UNION_MEMBER = re.compile(r"^(?:str|int|float|bool|none|[A-Z]\w*)$|\[")


def _field_name(location: tuple) -> str:
    # ("body", "messages", 0, "content") -> "messages[0].content"; the "body"/"query" prefix goes.
    parts = [str(part) for part in location[1:]] if location and location[0] in ("body", "query") else []
    name = ""
    for part in parts or [str(p) for p in location]:
        if _UNION_MEMBER.search(part):
            continue
        name += f"[{part}]" if part.isdigit() else (f".{part}" if name else part)
    return name


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body", code="invalid_request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    field = _field_name(tuple(first.get("loc", ())))
    if first.get("type") == "missing":
        message = f"{field}: a required field is missing"
    else:
        message = f"{field}: {first.get('msg')} (got {first.get('input')!r})"
    if len(errors) > 1:
        message += f"; and {len(errors) - 1} more problem(s)"
    return APIError(400, message, param=field or None, code="invalid_parameter")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error, including FastAPI's own (validation, 404 route, 405), OpenAI-style."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return error_response(exc, headers)

    @app.exception_handler(LoRAError)
    async def _lora_error(request: Request, exc: LoRAError) -> JSONResponse:
        return error_response(from_lora_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI could not read the body: json.loads raised (a body nested
            # deeper than Python's recursion limit), or it is not UTF-8
            error = APIError(400, "the request body could not be parsed as JSON (is it nested too deeply, or "
                             "not UTF-8?)", code="invalid_json")
        else:  # a route that does not exist (404), a method it does not take (405)
            error = APIError(exc.status_code, str(exc.detail), code=_HTTP_CODES.get(exc.status_code))
        return error_response(error, exc.headers)

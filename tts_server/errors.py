"""Every error the API returns, and the one place that turns exceptions into responses.

Body shape (OpenAI-compatible, so its SDK shows our messages):
    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}, "request_id": ...}
Messages name the field and the limit; they never carry stack traces, paths or secrets.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("tts_server")


class ApiError(Exception):
    status = 500
    type = "server_error"
    code = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}


class BadRequest(ApiError):
    status, type, code = 400, "invalid_request_error", "invalid_json"


class Unauthorized(ApiError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class Forbidden(ApiError):
    status, type, code = 403, "permission_error", "forbidden"


class NotFound(ApiError):
    status, type, code = 404, "not_found_error", "not_found"


class BodyTimeout(ApiError):
    status, type, code = 408, "invalid_request_error", "body_timeout"


class PayloadTooLarge(ApiError):
    status, type, code = 413, "invalid_request_error", "body_too_large"


class Conflict(ApiError):
    status, type, code = 409, "invalid_request_error", "conflict"


class InvalidField(ApiError):
    status, type, code = 422, "invalid_request_error", "invalid_value"


class Overloaded(ApiError):
    status, type, code = 429, "rate_limit_error", "server_overloaded"


class NotReady(ApiError):
    status, type, code = 503, "service_unavailable", "not_ready"


class RequestTimeout(ApiError):
    status, type, code = 504, "timeout_error", "request_timeout"


class EngineFailure(ApiError):
    status, type, code = 500, "server_error", "synthesis_failed"


def request_id_of(request: Request) -> str:
    return getattr(request.state, "request_id", "") or ""


def error_body(status: int, message: str, type_: str, code: str, param: str | None, request_id: str) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": type_, "param": param, "code": code},
        "request_id": request_id,
    }


def error_response(exc: ApiError, request_id: str) -> JSONResponse:
    body = error_body(exc.status, exc.message, exc.type, exc.code, exc.param, request_id)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def _loc(err: dict[str, Any]) -> str:
    parts = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]
    return ".".join(parts)


def describe_validation_errors(errors: list[dict[str, Any]], allowed: list[str] | None = None) -> tuple[str, str]:
    """(message, param) for pydantic errors: 'field: what is wrong', at most three of them."""
    parts = []
    for err in errors[:3]:
        loc, kind, msg = _loc(err), err.get("type", ""), err.get("msg", "invalid value")
        if kind == "extra_forbidden":
            msg = "unknown field" + (f" (allowed: {', '.join(allowed)})" if allowed else "")
        elif kind == "missing":
            msg = "field required"
        elif kind == "json_invalid":
            msg = f"body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})"
        msg = msg.removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    if len(errors) > 3:
        parts.append(f"and {len(errors) - 3} more")
    return "; ".join(parts), _loc(errors[0]) if errors else ""


def validation_error(exc: ValidationError, allowed: list[str] | None = None) -> ApiError:
    errors = exc.errors(include_url=False)
    message, param = describe_validation_errors(errors, allowed)
    if errors and errors[0].get("type") == "json_invalid":
        return BadRequest(message)
    if errors and errors[0].get("type") == "model_type" and not _loc(errors[0]):
        return BadRequest("body must be a JSON object")
    return InvalidField(message, param=param or None)


def allowed_methods(request: Request) -> str:
    """Every method some route serves at this path, from the app's `state.route_methods` ((path regex, methods)
    pairs, set by the app factory): Starlette's own 405 names only the first matching route's, and the voice
    routes serve GET and POST at one path from two routes."""
    path = request.scope.get("path", "")
    methods: set[str] = set()
    for regex, route_methods in getattr(request.app.state, "route_methods", ()):
        if regex.match(path):
            methods |= route_methods
    if "GET" in methods:
        methods.add("HEAD")  # answered as GET without the body (RequestContextMiddleware)
    return ", ".join(sorted(methods))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc, request_id_of(request))

    @app.exception_handler(RequestValidationError)
    async def _fastapi_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        return error_response(InvalidField(message, param=param or None), request_id_of(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed")}
        type_, code = kinds.get(exc.status_code, ("invalid_request_error", "http_error"))
        body = error_body(exc.status_code, str(exc.detail), type_, code, None, request_id_of(request))
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            headers["Allow"] = allowed_methods(request)
        return JSONResponse(body, status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        rid = request_id_of(request)
        logger.error("unhandled error in request %s", rid, exc_info=exc)
        failure = EngineFailure(f"internal error (request id {rid})", code="internal_error")
        return error_response(failure, rid)

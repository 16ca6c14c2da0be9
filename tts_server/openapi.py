"""The OpenAPI schema says what the server really answers: the error shape for every status a route can return
(with the X-Request-Id header), the audio media types, the probes' 503 bodies. The property-based API fuzzing in
tests/test_api_fuzz.py checks every response against this schema.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from .audio_encoding import FORMATS
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE


class _ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(BaseModel):
    """The one error shape (OpenAI's): every 4xx and 5xx response of the API has it."""

    model_config = ConfigDict(extra="forbid")
    error: _ErrorDetail
    request_id: str


COMPONENT_REF = "#/components/schemas/{model}"  # where a model's schema references the models it nests
_REQUEST_ID = {"X-Request-Id": {"required": True, "schema": {"type": "string", "minLength": 1}}}
# Statuses each kind of route can answer with the error shape (docs/api.md, "Errors").
_COMMON = ("400", "401", "404", "405", "408", "413", "429", "431", "503")
_SYNTHESIS = (*_COMMON, "422", "500", "504")
_PROBE_BODY = {
    "type": "object",
    "required": ["status"],
    "properties": {"status": {"type": "string"}},
}


def _media(types: list[str], schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {t: {"schema": schema or {}} for t in types}


def _audio_types(names: list[str]) -> list[str]:
    return sorted({FORMATS[n].media_type for n in names if n in FORMATS})


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "headers": _REQUEST_ID,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }


def _document(schema: dict[str, Any]) -> dict[str, Any]:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template=COMPONENT_REF)
    components.update(components["ErrorResponse"].pop("$defs", {}))
    for operations in schema.get("paths", {}).values():  # the models a body nests, as components
        for operation in operations.values():
            for media in operation.get("requestBody", {}).get("content", {}).values():
                components.update(media.get("schema", {}).pop("$defs", {}))
    audio = {
        # With "stream": true, /synthesize answers as /synthesize/stream does (f32le among its formats).
        "/synthesize": _audio_types(["wav", "pcm", "mp3", "flac", "opus", "aac", "f32le"]),
        "/synthesize/stream": _audio_types(["f32le", "pcm", "wav"]),
        "/v1/audio/speech": [*_audio_types(["mp3", "opus", "aac", "flac", "wav", "pcm"]), "text/event-stream"],
    }
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            ok = responses.setdefault("200", {"description": "OK"})
            ok.setdefault("headers", {}).update(_REQUEST_ID)
            if path in audio:
                ok["content"] = _media(audio[path])
            elif path == "/metrics":
                ok["content"] = _media([METRICS_CONTENT_TYPE.split(";")[0]])
            statuses = _SYNTHESIS if path in audio else _COMMON
            if path.startswith("/v1/audio/voices"):  # voice management: off (403), name taken (409), bad clip (422)
                statuses = (*_COMMON, "403", "409", "422")
            for status in statuses:
                responses.setdefault(status, _error("error (see docs/api.md, Errors)"))
            if path in ("/health", "/ready"):  # probes answer 503 with their status, not an error
                responses["503"] = {
                    "description": "not ready / engine dead",
                    "headers": _REQUEST_ID,
                    "content": _media(["application/json"], _PROBE_BODY),
                }
    return schema


def install(app: FastAPI) -> None:
    """Replace app.openapi with the documented version (built once, like FastAPI's own)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(build())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

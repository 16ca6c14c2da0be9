"""HTTP routes: /synthesize, /synthesize/stream, /v1/audio/speech, /speakers, /languages, /health, /ready, /metrics.

Bodies are parsed here (not by FastAPI) so that malformed JSON, wrong types and unknown fields all get the
same error shape, whatever the content type the client sent; a synthesis route then makes one call into the service
(tts_server/service.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from . import service
from .errors import BadRequest, NotReady, validation_error
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .openapi import COMPONENT_REF
from .runtime import Runtime
from .schemas import SpeechRequest, StreamRequest, SynthesisOptions, SynthesizeRequest, allowed_fields

logger = logging.getLogger("tts_server")

router = APIRouter()
M = TypeVar("M", bound=BaseModel)

PUBLIC_PATHS = ("/health", "/ready", "/metrics")
ROUTES = (
    "/synthesize",
    "/synthesize/stream",
    "/v1/audio/speech",
    "/v1/models",
    "/speakers",
    "/languages",
    *PUBLIC_PATHS,
)


def runtime_of(request: Request) -> Runtime:
    runtime = getattr(request.app.state, "runtime", None)
    if runtime is None:
        raise NotReady("server is starting; retry later", headers={"Retry-After": "1"})
    return runtime


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A route's JSON body; the models it nests are referenced as components (tts_server/openapi.py moves them there
    from the schema's `$defs`)."""
    schema = model.model_json_schema(ref_template=COMPONENT_REF)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


async def parse_body(request: Request, model: type[M]) -> M:
    raw = await request.body()
    if not raw.strip():
        raise BadRequest("request body is empty; send a JSON object", code="empty_body")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e, allowed_fields(model)) from None


# --- the seed's API ---------------------------------------------------------------------------------
@router.post("/synthesize", openapi_extra=_body_schema(SynthesizeRequest), response_class=Response)
async def synthesize(request: Request) -> Response:
    """The whole utterance as one file (wav by default); `"stream": true` answers as /synthesize/stream does."""
    runtime = runtime_of(request)
    body = await parse_body(request, SynthesizeRequest)
    if body.stream:
        return await service.stream(request, runtime, service.as_stream_request(body))
    return await service.file(request, runtime, body)


@router.post("/synthesize/stream", openapi_extra=_body_schema(StreamRequest), response_class=StreamingResponse)
async def synthesize_stream(request: Request) -> Response:
    """Chunked raw audio as it is decoded: float32 LE mono 24 kHz by default."""
    runtime = runtime_of(request)
    body = await parse_body(request, StreamRequest)
    return await service.stream(request, runtime, body)


# --- OpenAI-compatible ----------------------------------------------------------------------------------
@router.post("/v1/audio/speech", openapi_extra=_body_schema(SpeechRequest), response_class=StreamingResponse)
async def openai_speech(request: Request) -> Response:
    """OpenAI `audio.speech.create`: `voice` is a speaker id; audio streams as it is generated (flac and wav, whose
    headers state the length, are sent whole unless `stream_format` is `sse`)."""
    runtime = runtime_of(request)
    body = await parse_body(request, SpeechRequest)
    return await service.speech(request, runtime, body)


@router.get("/v1/models")
async def openai_models(request: Request) -> dict[str, Any]:
    runtime = runtime_of(request)
    model = {"id": runtime.settings.served_model_name, "object": "model", "created": 0, "owned_by": "qwen3-tts-server"}
    return {"object": "list", "data": [model]}


# --- voices and operations ------------------------------------------------------------------------------
@router.get("/speakers")
async def speakers(request: Request) -> dict[str, Any]:
    """Usable voices now in the profiles directory, with width and source file."""
    runtime = runtime_of(request)
    found = await anyio.to_thread.run_sync(runtime.voices.list_speakers)
    return {"speakers": [s.as_dict() for s in found], "count": len(found)}


@router.get("/languages")
async def languages(request: Request) -> dict[str, Any]:
    """What a synthesis body's `language` takes (any case): the served model's languages, 'Auto' among them."""
    runtime = runtime_of(request)
    return {
        "languages": [name.capitalize() for name in runtime.engine.languages],
        "default": SynthesisOptions.model_fields["language"].default,
    }


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Liveness: 200 while the process can serve or is draining; 503 if the engine has died."""
    runtime: Runtime | None = getattr(request.app.state, "runtime", None)
    if runtime is None:
        return JSONResponse({"status": "starting", "ready": False})
    status = "draining" if runtime.draining else ("ok" if runtime.engine.ready else "engine_dead")
    if runtime.recovering:
        status = "restarting"  # alive: the supervisor is replacing a failed engine (tts_server/recovery.py)
    body = {
        "status": status,
        "ready": runtime.ready,
        "model": runtime.model_summary(),
        "backend": runtime.settings.backend,
        "speakers": len(runtime.voices),
        "running": runtime.engine.num_running,
        "waiting": runtime.engine.num_waiting,
        "admitted": runtime.admission.active,
        "uptime_s": round(time.monotonic() - runtime.started_at, 1),
        "engine_restarts": runtime.engine_restarts,
        "engine": runtime.engine_description(),  # everything the engine says of itself, for debugging
    }
    return JSONResponse(body, status_code=200 if runtime.alive else 503)


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 when the engine is loaded and warm and the server is not draining, else 503."""
    runtime: Runtime | None = getattr(request.app.state, "runtime", None)
    if runtime is not None and runtime.ready:
        return JSONResponse({"status": "ready"})
    if runtime is None:
        status = "starting"
    elif runtime.draining:
        status = "draining"
    else:
        status = "engine_not_ready"
    return JSONResponse({"status": status}, status_code=503, headers={"Retry-After": "1"})


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    runtime = runtime_of(request)
    return Response(runtime.metrics.render(), media_type=METRICS_CONTENT_TYPE)

"""The FastAPI app factory. A lifespan owns the runtime (engine + voices) unless one is handed in."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.routing import WebSocketRoute

from qwen_tts.engine_api import Engine

from . import docs, openapi
from .errors import Forbidden, install_error_handlers
from .heap import freeze_startup_heap, thaw_and_collect
from .inline_reference import INLINE_REFERENCE_PATHS
from .inline_reference import body_limit_bytes as inline_body_limit_bytes
from .logs import configure_logging
from .middleware import (
    ApiKeyMiddleware,
    BodyLimit,
    BodyLimitMiddleware,
    JsonCORSMiddleware,
    RequestContextMiddleware,
    UploadBudget,
)
from .realtime import WS_PATH, SessionCounts, SpeechSocket
from .routes import PUBLIC_PATHS, ROUTES, router
from .runtime import Runtime
from .settings import ServerSettings, load_settings
from .voice_routes import VOICE_ROUTES, VOICES_PATH, upload_body_limit
from .voice_routes import router as voice_router
from .web import WEB_PATHS
from .web import router as web_router

# Seconds past a request's own deadlines before the server-wide one cuts it (the route's error goes out first).
DEADLINE_GRACE_S = 5.0

EXPOSED_HEADERS = [
    "X-Request-Id",
    "X-Audio-Duration",
    "X-Latency",
    "X-Sample-Rate",
    "X-Finish-Reason",
    "X-Audio-Format",
    "X-Time-To-First-Audio",
    "X-Voice-Mode",
    "Retry-After",
]


def create_app(
    settings: ServerSettings | None = None,
    *,
    runtime: Runtime | None = None,
    engine: Engine | None = None,
    freeze_heap: bool = False,
) -> FastAPI:
    """Build the app. With `runtime` the caller owns the engine's lifecycle; otherwise the lifespan starts
    one from `settings` (or `engine`, for tests) and stops it, draining for TTS_DRAIN_TIMEOUT, on shutdown.

    `freeze_heap`: once the lifespan's engine is up, freeze the heap out of full garbage collections, and thaw it
    when the engine stops (heap.py; `serve` does the same around its own start-up)."""
    if settings is None:
        settings = runtime.settings if runtime is not None else load_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned: Runtime | None = None
        if app.state.runtime is None:
            # Under plain uvicorn (no root handler yet): our startup lines visible too, in TTS_LOG_FORMAT.
            configure_logging(settings.log_level, settings.log_format, force=False)
            owned = app.state.runtime = await Runtime.start(settings, engine=engine)
            if freeze_heap:
                freeze_startup_heap()
        try:
            yield
        finally:
            if owned is not None:
                await owned.stop(drain_timeout=settings.drain_timeout)
                if freeze_heap:
                    thaw_and_collect()

    app = FastAPI(
        title="Qwen3-TTS voice-cloning server",
        version="0.1.0",
        summary="Text + voice id -> speech, for Qwen3-TTS-12Hz Base checkpoints.",
        lifespan=lifespan,
        docs_url=None,  # docs.install serves /docs and /redoc from packaged assets, not a CDN
        redoc_url=None,
    )
    app.state.runtime = runtime
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(voice_router)  # /v1/audio/voices, /v1/models/{id}
    app.include_router(web_router)  # the page at /
    app.router.routes.append(WebSocketRoute(WS_PATH, SpeechSocket()))  # the WebSocket speech session (realtime.py)
    app.state.ws_sessions = SessionCounts()
    docs.install(app)  # /docs, /redoc and their assets, offline
    # A malformed multipart body is the client's error, answered 400 and logged once by the access line; the parser's
    # own ERROR lines would let any client write to the error log.
    logging.getLogger("python_multipart").setLevel(logging.CRITICAL)
    # For the Allow header of a 405 (errors.allowed_methods): every route's path pattern and methods.
    app.state.route_methods = [
        (route.path_regex, set(route.methods))
        for route in (*router.routes, *voice_router.routes, *web_router.routes, *app.router.routes)
        if getattr(route, "path_regex", None) is not None and getattr(route, "methods", None)
    ]
    openapi.install(app)  # error shape and media types in the schema (fuzzed against in the tests)

    def count_response(route: str, status: int) -> None:
        rt: Runtime | None = app.state.runtime
        if rt is not None:
            rt.metrics.requests.labels(route, str(status)).inc()

    # add_middleware wraps: the last added is the outermost.
    # An upload's clip may be larger than any JSON body, but only where uploads are on; where they are off, the route's
    # refusal comes before any of the body is read.
    upload_limit = {VOICES_PATH: upload_body_limit(settings)} if settings.voice_upload else {}
    if settings.inline_reference:  # a synthesis body may then carry a clip (base64)
        reason = "TTS_MAX_BODY_BYTES plus the base64 of a clip of TTS_VOICE_UPLOAD_MAX_SECONDS, at most 30 s"
        inline = BodyLimit(inline_body_limit_bytes(settings), reason, param="reference.audio")
        upload_limit |= dict.fromkeys(INLINE_REFERENCE_PATHS, inline)
    uploads_off = Forbidden(
        "voice upload and delete are disabled on this server (an operator enables them with TTS_VOICE_UPLOAD=true)",
        code="voice_management_disabled",
    )
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        timeout=settings.body_timeout,
        per_path=upload_limit,
        budget=UploadBudget(settings.voice_upload_inflight_bytes),
        refused={} if settings.voice_upload else {VOICES_PATH: uploads_off},
        retry_after=settings.retry_after,
    )
    keys = [k.get_secret_value() for k in settings.api_keys]
    # A browser cannot set headers on a WebSocket: there the key may come as the session's first message instead.
    app.add_middleware(ApiKeyMiddleware, keys=keys, public=(*PUBLIC_PATHS, *WEB_PATHS), token_paths=(WS_PATH,))
    if settings.cors_origins:
        app.add_middleware(
            JsonCORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
            expose_headers=EXPOSED_HEADERS,
            max_age=600,
        )
    websocket_paths = {route.path for route in app.router.routes if isinstance(route, WebSocketRoute)}
    app.add_middleware(
        RequestContextMiddleware,
        on_response=count_response,
        routes=(*ROUTES, *VOICE_ROUTES, *WEB_PATHS, WS_PATH),
        # The floor under every route's own deadline: a body may take TTS_BODY_TIMEOUT, the work TTS_REQUEST_TIMEOUT.
        timeout=settings.body_timeout + settings.request_timeout + DEADLINE_GRACE_S,
        websocket_paths=websocket_paths,
    )
    return app

"""`python inference_server.py`: read the settings, start the runtime, serve with uvicorn, drain on SIGTERM.

The runtime starts before uvicorn so that any startup failure is one clear log line and a non-zero exit
(uvicorn's lifespan would print a traceback). SIGTERM flips readiness to 503, stops accepting connections,
lets in-flight requests finish for up to TTS_DRAIN_TIMEOUT, cancels the rest, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from types import FrameType

import torch
import uvicorn

from inference_config import ENV_PREFIX, ServerSettings, SettingsError, load_settings

from . import faults
from .app import create_app
from .heap import freeze_startup_heap
from .http_server import ConnectionLimits, uvicorn_options
from .recovery import EXIT_ENGINE_FAILED, EngineSupervisor
from .runtime import Runtime, StartupError

logger = logging.getLogger("tts_server")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that marks the runtime as draining the moment a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, runtime: Runtime):
        super().__init__(config)
        self.runtime = runtime

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.runtime.begin_drain()
        super().handle_exit(sig, frame)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def torch_threads(settings: ServerSettings) -> int:
    """The intra-op thread count the server runs torch with (see ServerSettings.torch_threads)."""
    if settings.torch_threads is not None:
        return settings.torch_threads
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, len(os.sched_getaffinity(0)) - 1) if hasattr(os, "sched_getaffinity") else 1


def warn_if_open(settings: ServerSettings) -> None:
    """An address others can reach, and no keys: anyone there can use every voice (docs/security.md)."""
    loopback = settings.host in ("localhost", "::1") or settings.host.startswith("127.")
    if not loopback and not settings.api_keys:
        logger.warning(
            "listening on %s with no API keys: anyone who can reach port %d can synthesize with every voice; "
            "set TTS_API_KEYS, or TTS_HOST=127.0.0.1 behind a proxy that authenticates",
            settings.host,
            settings.port,
        )
    if settings.voice_upload and not settings.api_keys:
        logger.warning(
            "TTS_VOICE_UPLOAD is on with no API keys: anyone who can reach port %d can add and delete voices; "
            "set TTS_API_KEYS",
            settings.port,
        )


async def serve(settings: ServerSettings) -> int:
    warn_if_open(settings)
    torch.set_num_threads(torch_threads(settings))
    logger.info("torch intra-op threads: %d", torch.get_num_threads())
    try:
        runtime = await Runtime.start(settings, fault_hook=faults.hook(settings.fault_file))
    except StartupError as e:
        logger.error("startup failed: %s", e)
        return 1
    app = create_app(settings, runtime=runtime)
    limits = ConnectionLimits(
        header_timeout=settings.header_timeout,
        keep_alive_timeout=settings.keep_alive_timeout,
        max_header_bytes=settings.max_header_bytes,
        max_connections=settings.max_connections,
        max_connections_per_client=settings.max_connections_per_client,
        retry_after=settings.retry_after,
        on_refusal=lambda reason: runtime.metrics.rejections.labels(reason).inc(),
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # our logging.basicConfig handles uvicorn's loggers too
        log_level=settings.log_level,
        access_log=False,  # RequestContextMiddleware logs one line per request, with its id
        timeout_graceful_shutdown=settings.drain_timeout,
        loop="asyncio",
        **uvicorn_options(limits),  # header/keep-alive timeouts, header size, connection caps (http_server.py)
    )
    server = DrainingServer(config, runtime)
    fatal: list[str] = []

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        runtime.begin_drain()
        server.should_exit = True

    supervisor = EngineSupervisor(
        runtime,
        on_fatal,
        restart_delay=settings.engine_restart_delay,
        max_restarts=settings.engine_max_restarts,
    )
    supervisor.start()
    config.load()  # uvicorn's own imports and app wrapping, so that they are part of the frozen startup heap
    freeze_startup_heap()
    try:
        await server.serve()
    finally:
        await supervisor.stop()
        await runtime.stop(drain_timeout=0.0)  # uvicorn has already waited for in-flight requests
    if fatal:
        return EXIT_ENGINE_FAILED
    return 0 if server.started else 1


def _ignore(sig: int, frame: FrameType | None) -> None:
    """uvicorn re-raises the shutdown signal after its graceful exit; absorbing it makes the exit code 0."""


def main(argv: list[str] | None = None) -> int:
    fields = ", ".join(ENV_PREFIX + name.upper() for name in ServerSettings.model_fields)
    parser = argparse.ArgumentParser(
        prog="inference_server.py",
        description="Qwen3-TTS voice-cloning HTTP server. Configured by environment variables: " + fields,
        epilog="See docs/api.md. With no TTS_MODEL_PATH the built-in tiny demo checkpoint is served.",
    )
    parser.parse_args(argv)
    try:
        settings = load_settings()
    except SettingsError as e:
        print(e, file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _ignore)
    try:
        return asyncio.run(serve(settings))
    except KeyboardInterrupt:
        return 0

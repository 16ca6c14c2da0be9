"""Serve: bind the port, start the runtime, serve with uvicorn, drain on SIGTERM (`qwen3-tts-server`, tts_server/cli.py).

The port is bound first: a port in use is one `startup failed:` line and exit 1 before any model is loaded. The
runtime starts before uvicorn so that any startup failure is one clear log line and a non-zero exit (uvicorn's
lifespan would print a traceback); uvicorn then serves on the bound socket, and once it accepts, one INFO line sums up
what is served where. SIGTERM flips readiness to 503, stops accepting connections, lets in-flight requests finish for
up to TTS_DRAIN_TIMEOUT, cancels the rest, and exits 0. With TTS_API_PROCESSES=N the engine runs in its own process
and N processes serve HTTP on the bound port (processes.py), with the same exit statuses.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
from types import FrameType

import torch
import uvicorn

from . import faults
from .app import create_app
from .heap import freeze_startup_heap
from .http_server import ConnectionLimits, uvicorn_options
from .logs import configure_logging
from .realtime import PROTOCOL_SIZE_FACTOR
from .recovery import EXIT_ENGINE_FAILED, EngineSupervisor
from .runtime import Runtime, StartupError
from .settings import ServerSettings

EXIT_STARTUP_FAILED = 1  # the port, the model, the voices: one `startup failed:` line says which

logger = logging.getLogger("tts_server")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that marks the runtime as draining the moment a shutdown signal arrives, and logs the start-up
    summary once it accepts connections."""

    def __init__(self, config: uvicorn.Config, runtime: Runtime, summary: str):
        super().__init__(config)
        self.runtime = runtime
        self.summary = summary

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            logger.info("%s", self.summary)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.runtime.begin_drain()
        super().handle_exit(sig, frame)


def bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of `host` at `port`, not yet listening (a connection during the model load is
    refused, not left waiting). StartupError naming the port where it is taken (see also `listen`)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StartupError(f"cannot listen on {host}: {e.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):  # as asyncio's create_server binds a host
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise _bind_error(e, host, port) from None
    return sockets


def listen(sockets: list[socket.socket], host: str, port: int, backlog: int) -> None:
    """Start listening. Two servers may both bind a port that neither listens on yet; the second to listen fails
    here, with the same line as a taken port at `bind`."""
    try:
        for sock in sockets:
            sock.listen(backlog)
    except OSError as e:
        raise _bind_error(e, host, port) from None


def _bind_error(e: OSError, host: str, port: int) -> StartupError:
    if e.errno == errno.EADDRINUSE:
        return StartupError(f"port {port} on {host} is in use")
    return StartupError(f"cannot listen on {host} port {port}: {e.strerror or e}")


def listen_url(sockets: list[socket.socket]) -> str:
    """http://HOST:PORT of the first socket, as bound (the port the system gave for port 0)."""
    host, port = sockets[0].getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def startup_summary(settings: ServerSettings, runtime: Runtime, url: str) -> str:
    """The one line an operator reads to know what is served where (the engine's full description: DEBUG logs and
    /health's `engine`)."""
    info = runtime.engine.model_info
    return (
        f"serving model={info.get('name', settings.model_path)} backend={settings.backend} "
        f"device={runtime.engine.device} dtype={info.get('dtype', '?')} voices={len(runtime.voices)} "
        f"listen={url} auth={'on' if settings.api_keys else 'off'}"
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
            "set TTS_API_KEYS or TTS_API_KEYS_FILE, or TTS_HOST=127.0.0.1 behind a proxy that authenticates",
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
    try:
        sockets = bind(settings.host, settings.port)
    except StartupError as e:
        logger.error("startup failed: %s", e)
        return EXIT_STARTUP_FAILED
    warn_if_open(settings)
    try:
        if settings.api_processes:
            from .processes import supervise  # the engine in its own process, N front-ends (processes.py)

            return await supervise(settings, sockets)
        return await _serve(settings, sockets)
    finally:
        for sock in sockets:
            sock.close()


async def _serve(settings: ServerSettings, sockets: list[socket.socket]) -> int:
    torch.set_num_threads(torch_threads(settings))
    logger.info("torch intra-op threads: %d", torch.get_num_threads())
    try:
        runtime = await Runtime.start(settings, fault_hook=faults.hook(settings.fault_file))
    except StartupError as e:
        logger.error("startup failed: %s", e)
        return EXIT_STARTUP_FAILED
    return await serve_runtime(settings, runtime, sockets)


async def serve_runtime(
    settings: ServerSettings, runtime: Runtime, sockets: list[socket.socket], *, supervise: bool = True
) -> int:
    """Serve the app over a started runtime on `sockets` until SIGTERM or SIGINT, then stop the runtime. `supervise`:
    restart a dead engine in process (recovery.py); an API front-end (processes.py) leaves that to the engine
    process."""
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
        log_config=None,  # our root handler (logs.configure_logging) formats uvicorn's loggers too
        log_level=settings.log_level,
        access_log=False,  # RequestContextMiddleware logs one line per request, with its id
        timeout_graceful_shutdown=settings.drain_timeout,
        loop="asyncio",
        **uvicorn_options(limits),  # header/keep-alive timeouts, header size, connection caps (http_server.py)
        # WebSockets (realtime.py): the implementation whose sends wait while the client does not read (the session's
        # send deadline then cuts it), a message size cap, and no compression (audio does not compress; a session's
        # JSON is small).
        ws="websockets-sansio",
        ws_max_size=settings.ws_max_message_bytes * PROTOCOL_SIZE_FACTOR,
        ws_per_message_deflate=False,
    )
    try:
        listen(sockets, settings.host, settings.port, config.backlog)
    except StartupError as e:
        logger.error("startup failed: %s", e)
        await runtime.stop(drain_timeout=0.0)
        return EXIT_STARTUP_FAILED
    server = DrainingServer(config, runtime, startup_summary(settings, runtime, listen_url(sockets)))
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
    if supervise:
        supervisor.start()
    config.load()  # uvicorn's own imports and app wrapping, so that they are part of the frozen startup heap
    freeze_startup_heap()
    try:
        await server.serve(sockets=sockets)
    finally:
        await supervisor.stop()
        await runtime.stop(drain_timeout=0.0)  # uvicorn has already waited for in-flight requests
    if fatal:
        return EXIT_ENGINE_FAILED
    return 0 if server.started else EXIT_STARTUP_FAILED


def _ignore(sig: int, frame: FrameType | None) -> None:
    """uvicorn re-raises the shutdown signal after its graceful exit; absorbing it makes the exit code 0."""


def run(settings: ServerSettings) -> int:
    """Configure logging, serve until SIGTERM or SIGINT, and return the exit status (docs/api.md: 0, 1, 3)."""
    configure_logging(settings.log_level, settings.log_format)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _ignore)
    try:
        return asyncio.run(serve(settings))
    except KeyboardInterrupt:
        return 0

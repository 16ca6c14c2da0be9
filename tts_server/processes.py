"""TTS_API_PROCESSES=N: one engine process and N API front-end processes, as vLLM splits its API server from its
engine core.

The process `qwen3-tts-server` starts is the supervisor: it binds the port (a port in use is still one `startup
failed:` line and exit 1), starts the engine process (the real engine, its in-process restarts, recovery.py, and the
channel's host, engine_host.py, on a Unix socket in a private directory), listens once that process is ready, and
starts N front-ends. Each front-end is the whole HTTP app over a `RemoteEngine` (remote_engine.py) and accepts on the
shared listening socket. Admission (429 past TTS_MAX_CONCURRENT + TTS_MAX_QUEUE) is one count in shared memory, so
it holds over all front-ends together.

Shutdown: SIGTERM or SIGINT (to the supervisor, or to the whole group as Ctrl-C sends it) drains every front-end as
one process drains (in-flight requests finish for up to TTS_DRAIN_TIMEOUT); the engine process finishes what they
still hold, then stops; exit 0. Failures: the engine process dying (killed, or exiting 3 after a fault it cannot
recover from in process) fails the requests in flight in every front-end as an engine failure (a 500 in the error
shape, or a cut stream) and turns /ready to 503 (/health: `restarting`); the supervisor starts a new engine process
after TTS_ENGINE_RESTART_DELAY and the front-ends reconnect to it. Past TTS_ENGINE_MAX_RESTARTS within the hour, or if
the new one cannot start, the server stops its front-ends and exits 3; a front-end dying ends it the same way.
Startup failures exit 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.sharedctypes import Synchronized

import torch

from . import faults
from .engine_host import EngineHost
from .heap import freeze_startup_heap
from .logs import configure_logging
from .recovery import EXIT_ENGINE_FAILED, EngineSupervisor
from .remote_engine import RemoteEngine
from .runtime import Admission, Runtime, StartupError
from .settings import ServerSettings

logger = logging.getLogger("tts_server")
EXIT_STARTUP_FAILED = 1
_POLL_S = 0.05
_STOP_GRACE_S = 10.0
_PARENT_POLL_S = 0.5  # past the drain timeout, before a child that has not exited is killed


class SharedAdmission(Admission):
    """The admission count in shared memory: one limit over every front-end process."""

    def __init__(self, limit: int, count: Synchronized):
        super().__init__(limit)
        self._count = count

    def try_acquire(self) -> bool:
        with self._count.get_lock():
            if self._count.value >= self.limit:
                return False
            self._count.value += 1
            return True

    def release(self) -> None:
        with self._count.get_lock():
            self._count.value = max(0, self._count.value - 1)

    @property
    def active(self) -> int:  # type: ignore[override]
        return int(self._count.value)

    @active.setter
    def active(self, value: int) -> None:  # Admission.__init__ sets 0; the shared count starts there already
        pass


def _follow_parent(parent: int) -> asyncio.Task:
    """Stop this child (as SIGTERM would) if the supervisor dies without stopping it: orphans would keep the port."""

    async def watch() -> None:
        while os.getppid() == parent:
            await asyncio.sleep(_PARENT_POLL_S)
        logger.error("the supervisor process is gone; stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    return asyncio.get_running_loop().create_task(watch(), name="follow-parent")


# --- the engine process -------------------------------------------------------------------------------------------
def engine_main(settings: ServerSettings, path: str, ready: Connection) -> None:
    """The engine process: start the runtime, serve the channel, report ready, run until drained or fatal."""
    configure_logging(settings.log_level, settings.log_format)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until the loop's handlers are in place
    from .serve import torch_threads

    torch.set_num_threads(torch_threads(settings))
    raise SystemExit(asyncio.run(_engine(settings, path, ready)))


async def _engine(settings: ServerSettings, path: str, ready: Connection) -> int:
    loop = asyncio.get_running_loop()
    parent = os.getppid()
    stop = asyncio.Event()
    # The speaker encoder belongs to the front-ends (they enroll uploads); this process needs only the engine.
    own = settings.model_copy(update={"voice_upload": False})
    try:
        runtime = await Runtime.start(own, fault_hook=faults.hook(settings.fault_file))
    except StartupError as e:
        logger.error("startup failed: %s", e)
        return EXIT_STARTUP_FAILED
    host = EngineHost(runtime)
    server = await asyncio.start_unix_server(host.connected, path=path)
    fatal: list[str] = []

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        host.begin_drain()
        stop.set()

    supervisor = EngineSupervisor(
        runtime, on_fatal, restart_delay=settings.engine_restart_delay, max_restarts=settings.engine_max_restarts
    )
    supervisor.start()
    drain_began: list[float] = []

    def on_signal() -> None:
        if not drain_began:
            drain_began.append(time.monotonic())
        host.begin_drain()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    follow = _follow_parent(parent)
    freeze_startup_heap()
    ready.send("ready")
    try:
        while not stop.is_set():
            await asyncio.sleep(_POLL_S)
            if drain_began and (
                not host.connections or time.monotonic() - drain_began[0] > settings.drain_timeout + _STOP_GRACE_S
            ):
                break
    finally:
        follow.cancel()
        await supervisor.stop()
        server.close()
        await host.close()
        await runtime.stop(drain_timeout=0.0)
    return EXIT_ENGINE_FAILED if fatal else 0


# --- an API front-end process ---------------------------------------------------------------------------------------
def front_end_main(
    settings: ServerSettings, sockets: list[socket.socket], path: str, count: Synchronized, index: int
) -> None:
    """An API front-end: the app over a RemoteEngine, serving the shared listening sockets until SIGTERM."""
    configure_logging(settings.log_level, settings.log_format)
    from .serve import _ignore

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _ignore)  # as `serve.run`: uvicorn's own handlers drain; the exit status is ours
    torch.set_num_threads(1)  # a front-end runs no model
    raise SystemExit(asyncio.run(_front_end(settings, sockets, path, count, index)))


async def _front_end(
    settings: ServerSettings, sockets: list[socket.socket], path: str, count: Synchronized, index: int
) -> int:
    from .serve import serve_runtime

    parent = os.getppid()
    engine = RemoteEngine(path)
    try:
        deadline = time.monotonic() + settings.stage_init_timeout
        while True:  # the engine process may be being replaced (a front-end starts while it restarts)
            try:
                await engine.connect()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(RemoteEngine.reconnect_s)
        runtime = await Runtime.start(settings, engine=engine)
    except (StartupError, OSError) as e:
        logger.error("startup failed: front-end %d: %s", index, e)
        return EXIT_STARTUP_FAILED
    runtime.admission = SharedAdmission(settings.max_concurrent + settings.max_queue, count)
    follow = _follow_parent(parent)  # uvicorn's handler turns the SIGTERM into a drain
    try:
        return await serve_runtime(settings, runtime, sockets, supervise=False)
    finally:
        follow.cancel()


# --- the supervisor -------------------------------------------------------------------------------------------------
async def supervise(settings: ServerSettings, sockets: list[socket.socket]) -> int:
    """Run the engine process and the front-ends until a signal or a failure; the exit status (0, 1 or 3)."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    private = tempfile.mkdtemp(prefix="qwen3-tts-")  # mode 0700: only this user reaches the engine's socket
    children = Children(settings, os.path.join(private, "engine.sock"), stopping)
    try:
        return await children.run(sockets)
    finally:
        await children.stop()
        shutil.rmtree(private, ignore_errors=True)


class Children:
    """The engine process and the front-ends: started, watched, the engine process replaced when it dies (up to
    TTS_ENGINE_MAX_RESTARTS within the hour, after TTS_ENGINE_RESTART_DELAY), all stopped at the end."""

    def __init__(self, settings: ServerSettings, path: str, stopping: asyncio.Event):
        self.settings = settings
        self.path = path
        self.stopping = stopping
        self.ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each: no CUDA state or threads inherited
        self.engine: BaseProcess | None = None
        self.front_ends: list[BaseProcess] = []
        self._restarts: list[float] = []

    async def run(self, sockets: list[socket.socket]) -> int:
        from .serve import listen

        if not await self._start_engine():
            return 0 if self.stopping.is_set() else EXIT_STARTUP_FAILED  # the engine logged `startup failed:`
        try:
            listen(sockets, self.settings.host, self.settings.port, 2048)
        except StartupError as e:
            logger.error("startup failed: %s", e)
            return EXIT_STARTUP_FAILED
        count = self.ctx.Value("q", 0)
        for i in range(self.settings.api_processes):
            args = (self.settings, sockets, self.path, count, i)
            proc = self.ctx.Process(target=front_end_main, args=args, name=f"tts-api-{i}")
            proc.start()
            self.front_ends.append(proc)
        logger.info("API front-end process pids: %s", " ".join(str(p.pid) for p in self.front_ends))
        return await self._watch()

    async def _start_engine(self) -> bool:
        """Start an engine process and wait until it serves the channel; False if it exited first (or a signal)."""
        ready_out, ready_in = self.ctx.Pipe(duplex=False)
        engine = self.engine = self.ctx.Process(
            target=engine_main, args=(self.settings, self.path, ready_in), name="tts-engine"
        )
        engine.start()
        ready_in.close()
        logger.info("engine process pid %d", engine.pid)
        try:
            while not ready_out.poll():
                if engine.exitcode is not None or self.stopping.is_set():
                    return False
                await asyncio.sleep(_POLL_S)
            ready_out.recv()
            return True
        finally:
            ready_out.close()

    async def _watch(self) -> int:
        while not self.stopping.is_set():
            await asyncio.sleep(_POLL_S)
            for proc in self.front_ends:
                if proc.exitcode is not None:
                    logger.critical(
                        "API front-end %s exited with %s; exiting with status %d",
                        proc.name,
                        _describe_exit(proc.exitcode),
                        EXIT_ENGINE_FAILED,
                    )
                    return EXIT_ENGINE_FAILED
            assert self.engine is not None
            code = self.engine.exitcode
            if code is None:
                continue
            if code == 0:
                logger.info("the engine process stopped; stopping the front-ends")
                return 0
            if not await self._replace_engine(code):
                return EXIT_ENGINE_FAILED
        return 0

    async def _replace_engine(self, code: int) -> bool:
        """A new engine process for one that died; False (the server then exits 3) past the restart limit."""
        reason = f"the engine process exited with {_describe_exit(code)}"
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < 3600.0]
        if len(self._restarts) >= self.settings.engine_max_restarts:
            logger.critical(
                "%s; %d restarts within the hour already; exiting with status %d",
                reason,
                len(self._restarts),
                EXIT_ENGINE_FAILED,
            )
            return False
        self._restarts.append(now)
        logger.error("%s; in-flight requests were failed; starting a new one", reason)
        await asyncio.sleep(self.settings.engine_restart_delay)
        if self.stopping.is_set():
            return True
        if not await self._start_engine():
            if self.stopping.is_set():
                return True
            logger.critical("the new engine process failed to start; exiting with status %d", EXIT_ENGINE_FAILED)
            return False
        logger.info("engine process replaced (%d restart(s) in the last hour); ready again", len(self._restarts))
        return True

    async def stop(self) -> None:
        """Drain the front-ends (SIGTERM), then the engine process; kill what outlives the drain timeout."""
        groups = [self.front_ends, [self.engine] if self.engine is not None else []]
        for group in groups:
            live = [p for p in group if p.pid is not None and p.exitcode is None]
            for proc in live:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)  # type: ignore[arg-type]
            deadline = time.monotonic() + self.settings.drain_timeout + _STOP_GRACE_S
            while any(p.exitcode is None for p in live) and time.monotonic() < deadline:
                await asyncio.sleep(_POLL_S)
            for proc in live:
                if proc.exitcode is None:
                    logger.warning("%s did not stop within the drain timeout; killing it", proc.name)
                    proc.kill()
                    proc.join(5)


def _describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"status {code}"

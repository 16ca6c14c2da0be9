"""Engine faults: notice a dead engine, restart it in process, or exit non-zero for the supervisor.

When the engine's loop dies (an exception escaped it: a bug, out of memory, a CUDA error), the engine has
already failed every request it held (each gets a 500 in the error shape, or a cut stream); from then on
/ready is 503 and new requests get 503 with Retry-After. The supervisor here then
  - restarts the engine in process after TTS_ENGINE_RESTART_DELAY s (a fresh engine from the same checkpoint,
    warmed up like at startup): /ready turns 200 again, voices and metrics are kept; or
  - asks the server to exit with status 3 when an in-process restart cannot help: a CUDA error other than out of
    memory (the CUDA context is unusable until the process ends), a restart that fails, or more than
    TTS_ENGINE_MAX_RESTARTS restarts within an hour. A process supervisor (systemd Restart=on-failure, Docker
    restart policy, Kubernetes) starts a fresh process; docs/security.md has the health-check settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from qwen_tts.engine_api import Engine, EngineNotReadyError, RequestHandle, SynthesisRequest
from qwen_tts.engines import release_device_memory

from .heap import freeze_startup_heap, thaw_and_collect
from .runtime import Runtime, StartupError, start_engine

logger = logging.getLogger("tts_server")

EXIT_ENGINE_FAILED = 3
_POLL_S = 0.05
_WINDOW_S = 3600.0


@dataclass(frozen=True)
class EngineFacts:
    """What an engine knows from construction on (`Engine`'s docstring), copied off it."""

    xvector_dim: int
    languages: tuple[str, ...]
    sample_rate: int
    device: torch.device
    model_info: dict[str, Any]

    @classmethod
    def of(cls, engine: Engine) -> EngineFacts:
        info = dict(engine.model_info)
        return cls(engine.xvector_dim, tuple(engine.languages), engine.sample_rate, engine.device, info)


class EngineStandIn(Engine):
    """Holds an engine's place while it is replaced: its facts (x-vector width, languages, rate, device, model
    info), never ready, refusing work as a stopped engine does, and no reference to it, so the old engine and its
    device memory are freed before the next one loads (a restart after running out of memory needs that room)."""

    def __init__(self, old: Engine, reason: str = "the engine is restarting") -> None:
        self._facts = EngineFacts.of(old)
        self._reason = reason
        self.fault: BaseException | None = None

    async def start(self) -> None:
        raise RuntimeError("a stand-in engine does not start")

    async def stop(self, drain_timeout: float = 0.0) -> None:
        return None

    def submit(self, request: SynthesisRequest) -> RequestHandle:
        raise EngineNotReadyError(self._reason)

    def cancel(self, handle: RequestHandle) -> None:
        return None  # its requests were failed with the engine it stands in for

    @property
    def ready(self) -> bool:
        return False

    @property
    def xvector_dim(self) -> int:
        return self._facts.xvector_dim

    @property
    def languages(self) -> list[str]:
        return list(self._facts.languages)

    @property
    def sample_rate(self) -> int:
        return self._facts.sample_rate

    @property
    def device(self) -> torch.device:
        return self._facts.device

    @property
    def model_info(self) -> dict[str, Any]:
        return dict(self._facts.model_info)


def needs_new_process(fault: BaseException | None) -> bool:
    """True for faults after which this process cannot use the GPU again (sticky CUDA errors)."""
    if fault is None or isinstance(fault, torch.OutOfMemoryError):  # memory is freed with the old engine
        return False
    if isinstance(fault, torch.AcceleratorError):
        return True
    text = str(fault)
    return any(s in text for s in ("CUDA error", "CUBLAS_STATUS", "cuDNN error", "device-side assert"))


class EngineSupervisor:
    """Watches `runtime.engine`; restarts it, or calls `on_fatal(reason)` (the server then exits non-zero)."""

    def __init__(
        self,
        runtime: Runtime,
        on_fatal: Callable[[str], None],
        *,
        restart_delay: float,
        max_restarts: int,
    ):
        self.runtime = runtime
        self.on_fatal = on_fatal
        self.restart_delay = restart_delay
        self.max_restarts = max_restarts
        self._restarts: list[float] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.runtime.supervised = True
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="engine-supervisor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _dead(self) -> bool:
        rt = self.runtime
        return not (rt.engine.ready or rt.draining or rt.restarting or rt.engine.restarting_itself)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_POLL_S)
            if self._dead() and not await self._recover():
                return

    async def _recover(self) -> bool:
        rt = self.runtime
        fault = getattr(rt.engine, "fault", None)
        reason = f"{type(fault).__name__}: {fault}" if fault is not None else "engine stopped serving"
        logger.error("engine failed (%s); in-flight requests were failed", reason)
        if needs_new_process(fault):
            return self._fatal(f"{reason}; the CUDA context is unusable, a new process is needed")
        del fault  # its traceback's frames hold the old engine: it must be freed before the next one loads
        if rt.engine_factory is None:
            return self._fatal(f"{reason}; this engine cannot be rebuilt in process")
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < _WINDOW_S]
        if len(self._restarts) >= self.max_restarts:
            return self._fatal(f"{reason}; {len(self._restarts)} restarts within the hour already")
        self._restarts.append(now)
        rt.restarting = True
        try:
            await asyncio.sleep(self.restart_delay)
            logger.info("restarting the engine")
            old = rt.engine
            with contextlib.suppress(Exception):
                await old.stop(0.0)
            rt.engine = EngineStandIn(old)  # the routes still answer (not ready, 503) without holding the old engine
            gone = weakref.ref(old)
            del old
            thaw_and_collect()  # the old engine's reference cycles (which may hold device memory) are freed now
            if gone() is None:
                release_device_memory(rt.engine.device)  # and what the CUDA libraries kept for its streams
            else:  # a thread of it may still launch work on those streams: leave their workspaces alone
                logger.warning("the old engine was not freed (a thread still running?): its device memory stays")
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            engine = rt.engine_factory()
            await start_engine(engine, rt.settings)
        except (StartupError, Exception) as e:
            rt.restarting = False
            return self._fatal(f"{reason}; the restart failed: {e}")
        rt.engine = engine
        freeze_startup_heap()  # the new engine's long-lived objects, out of the collector's walks again
        rt.engine_restarts += 1
        rt.metrics.engine_restarts.inc()
        rt.restarting = False
        logger.info("engine restarted (%d restart(s) in the last hour); ready again", len(self._restarts))
        return True

    def _fatal(self, reason: str) -> bool:
        self.runtime.supervised = False
        logger.critical("engine failure needs a new process: %s; exiting with status %d", reason, EXIT_ENGINE_FAILED)
        self.on_fatal(reason)
        return False

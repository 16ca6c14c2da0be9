"""The Serve replica: one `tts_server` runtime (engine + voices) with the server's FastAPI app as its ingress.

Every route, stream and error is the single-process server's: the app is `tts_server.app.create_app` over the
replica's runtime. Serve routes each request to the less loaded of two replicas (its power-of-two-choices
router, on ongoing requests), holds at most `max_ongoing_requests` at a replica and refuses past
`max_queued_requests` per proxy. Serve's health check asks the engine: a replica whose engine died and
could not be restarted in process (tts_server/recovery.py) fails it, and Serve replaces the replica.
Voices come from TTS_PROFILES_DIR, which all replicas share: `VoiceRegistry` re-reads a profile whose file
changed and forgets one whose file is gone, so a profile written by one replica is served by all.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import torch
from fastapi import FastAPI
from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tts_server import faults
from tts_server.app import create_app
from tts_server.heap import freeze_startup_heap
from tts_server.recovery import EngineSupervisor
from tts_server.runtime import Runtime
from tts_server.serve import torch_threads
from tts_server.settings import load_settings

from .config import RAY_ENV_PREFIX, RayServeSettings, load_ray_settings

logger = logging.getLogger("tts_serve")

REPLICA_HEADER = "X-Replica-Id"


class ReplicaHeader:
    """Names the replica that served a response (X-Replica-Id): for logs, load checks and the tests."""

    def __init__(self, app: ASGIApp, replica_id: str):
        self.app = app
        self.header = (REPLICA_HEADER.lower().encode(), replica_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


@serve.ingress()
class TTSReplica:
    """One engine and its app. Constructed by Serve in a replica process; `check_health` is Serve's probe."""

    async def __init__(self) -> None:
        t0 = time.monotonic()
        for name in [k for k in os.environ if k.startswith(RAY_ENV_PREFIX)]:
            os.environ.pop(name)  # the deployment's settings, not the server's: no "unknown setting" warnings
        settings = load_settings()
        if not logging.getLogger().handlers:
            logging.basicConfig(
                level=settings.log_level.upper(),
                format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                stream=sys.stderr,
            )
        torch.set_num_threads(torch_threads(settings))  # Ray sets OMP_NUM_THREADS from the replica's num_cpus
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.fatal: str | None = None
        self.runtime = await Runtime.start(settings, fault_hook=faults.hook(settings.fault_file))
        self.supervisor = EngineSupervisor(
            self.runtime,
            self._on_fatal,
            restart_delay=settings.engine_restart_delay,
            max_restarts=settings.engine_max_restarts,
        )
        self.supervisor.start()
        freeze_startup_heap()  # the engine and app live as long as the replica: out of the collector's full walks
        logger.info(
            "replica %s ready (pid %d) in %.1f s, torch threads %d",
            self.replica_id,
            os.getpid(),
            time.monotonic() - t0,
            torch.get_num_threads(),
        )

    def _on_fatal(self, reason: str) -> None:
        """The engine cannot be restarted in this process: fail the health check so Serve replaces the replica."""
        logger.error("replica %s: engine failed for good (%s); asking Serve for a new replica", self.replica_id, reason)
        self.fatal = reason
        self.runtime.begin_drain()

    def __serve_build_asgi_app__(self) -> Any:
        app: FastAPI = create_app(self.runtime.settings, runtime=self.runtime)
        app.add_middleware(ReplicaHeader, replica_id=self.replica_id)  # outermost
        return app

    async def check_health(self) -> None:
        if self.fatal is not None:
            raise RuntimeError(f"engine failed: {self.fatal}")
        if not self.runtime.alive:
            raise RuntimeError("engine is down and not recovering")

    async def __del__(self) -> None:
        """Serve calls this after the replica's requests finished (or graceful_shutdown_timeout_s passed)."""
        if not hasattr(self, "supervisor"):  # the constructor failed (StartupError): nothing was started
            return
        logger.info("replica %s stopping", self.replica_id)
        self.runtime.begin_drain()
        await self.supervisor.stop()
        await self.runtime.stop(drain_timeout=0.0)


def build_app(ray_settings: RayServeSettings, *, cluster_gpus: float) -> serve.Application:
    """The Serve application: the replica deployment with options from the settings (config.py)."""
    server = load_settings()
    options = ray_settings.deployment_options(server, cluster_gpus=cluster_gpus)
    return serve.deployment(TTSReplica).options(name="TTSReplica", **options).bind()


def app_builder(args: dict[str, Any]) -> serve.Application:
    """For Serve config files (`serve run`, `serve deploy`, KubeRay's serveConfigV2):
    `import_path: tts_serve.deployment:app_builder`; `args` are RayServeSettings fields by name (they override
    TTS_RAY_*). Set num_gpus in `args` on a cluster that autoscales its GPU workers: at build time it may have none."""
    import ray

    ray_settings = load_ray_settings(**args)
    return build_app(ray_settings, cluster_gpus=float(ray.cluster_resources().get("GPU", 0.0)))

"""`python -m tts_serve` (scripts/serve_ray.sh): the server as a Ray Serve application.

With no TTS_RAY_ADDRESS it starts a Ray cluster on this machine and runs one replica per GPU (one replica on a
machine without GPUs); with TTS_RAY_ADDRESS=auto it joins the cluster of this node (docs/deployment.md has the
multi-machine and KubeRay recipes). The proxy listens on TTS_HOST:TTS_PORT with every route of the server.
SIGTERM or Ctrl-C removes the application: Serve stops routing to the replicas, lets their requests finish for
up to graceful_shutdown_timeout_s (TTS_DRAIN_TIMEOUT), then stops them. Exit 0, 1 (start failed), 2 (settings).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
import time
from types import FrameType

from tts_server.settings import SettingsError, load_settings

from .config import RayServeSettings, load_ray_settings
from .proxy import CALLBACK_PATH

logger = logging.getLogger("tts_serve")
DEPLOYMENT = "TTSReplica"


def _parse(argv: list[str] | None) -> dict[str, object]:
    fields = ", ".join("TTS_RAY_" + n.upper() for n in RayServeSettings.model_fields)
    parser = argparse.ArgumentParser(
        prog="python -m tts_serve",
        description="Qwen3-TTS server on Ray Serve: N engine replicas behind one HTTP proxy. Each replica is "
        "configured by the server's TTS_* variables; the deployment by " + fields + ".",
        epilog="See docs/deployment.md.",
    )
    parser.add_argument("--replicas", type=int, help="fixed replica count (TTS_RAY_REPLICAS)")
    parser.add_argument("--address", help="Ray cluster to join, e.g. auto (TTS_RAY_ADDRESS)")
    parser.add_argument("--num-cpus", type=float, help="CPUs per replica (TTS_RAY_NUM_CPUS)")
    parser.add_argument("--num-gpus", type=float, help="GPUs per replica (TTS_RAY_NUM_GPUS)")
    args = parser.parse_args(argv)
    return {k: v for k, v in vars(args).items() if v is not None}


def replica_counts(app_name: str) -> dict[str, int]:
    """Replica states of the deployment, e.g. {"RUNNING": 2}."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None or DEPLOYMENT not in app.deployments:
        return {}
    return {str(k): v for k, v in app.deployments[DEPLOYMENT].replica_states.items()}


def _failure_reason(app_name: str) -> str | None:
    """The replicas' own one-line StartupError (bad model path, ...), from Serve's deployment status."""
    from ray import serve

    try:
        app = serve.status().applications.get(app_name)
        text = app.deployments[DEPLOYMENT].message if app and DEPLOYMENT in app.deployments else ""
    except Exception:  # the cluster is going down; the generic error is all there is
        return None
    found = re.findall(r"StartupError: ([^\n]+)", text)
    return found[-1].strip() if found else None


def main(argv: list[str] | None = None) -> int:
    overrides = _parse(argv)
    try:
        server = load_settings()
        ray_settings = load_ray_settings(**overrides)
    except SettingsError as e:
        print(e, file=sys.stderr)
        return 2
    logging.basicConfig(
        level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    # Read by Serve's proxy when it starts (a local cluster inherits this environment).
    os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", CALLBACK_PATH)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # one line per replica in the forwarded logs

    import ray
    from ray import serve

    from .deployment import build_app

    t0 = time.monotonic()
    local = ray_settings.address is None
    if local:
        ray.init(address="local", include_dashboard=ray_settings.dashboard, logging_level=logging.WARNING)
    else:
        ray.init(address=ray_settings.address, logging_level=logging.WARNING)
    stop = threading.Event()

    def on_signal(sig: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        serve.start(http_options={"host": server.host, "port": server.port})
        gpus = float(ray.cluster_resources().get("GPU", 0.0))
        app = build_app(ray_settings, cluster_gpus=gpus)
        serve.run(app, name=ray_settings.app_name, route_prefix="/", blocking=False)
    except Exception as e:
        logger.error("startup failed: %s", _failure_reason(ray_settings.app_name) or f"{type(e).__name__}: {e}")
        _shutdown(ray_settings, local)
        return 1
    logger.info(
        "Ray Serve ready in %.1f s: replicas %s, cluster GPUs %g, listening on http://%s:%d",
        time.monotonic() - t0,
        replica_counts(ray_settings.app_name),
        gpus,
        server.host,
        server.port,
    )
    while not stop.wait(1.0):
        pass
    logger.info("stopping: draining the replicas (up to %g s)", server.drain_timeout)
    _shutdown(ray_settings, local)
    logger.info("stopped")
    return 0


def _shutdown(ray_settings: RayServeSettings, local: bool) -> None:
    import ray
    from ray import serve

    try:
        # Deleting the app drains it: the proxies stay up while each replica finishes its requests (streams
        # included) for up to graceful_shutdown_timeout_s. serve.shutdown alone would take the proxies down first.
        serve.delete(ray_settings.app_name)
        if local:
            serve.shutdown()
    finally:
        ray.shutdown()

"""Ray Serve settings (`TTS_RAY_*` variables; the server's own `TTS_*` settings configure each replica).

Defaults follow from the server settings: a replica takes as many requests at once as its engine admits
(TTS_MAX_CONCURRENT slots + TTS_MAX_QUEUE), so its own admission never refuses what Serve sent it; beyond that
Serve's proxy queues up to `max_queued_requests` per proxy and refuses the rest with 429 (or 503) and
Retry-After (TTS_RETRY_AFTER). Serve's health checks call the replica, not its HTTP routes, so they need no room.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tts_server.settings import ENV_PREFIX, ServerSettings, SettingsError

RAY_ENV_PREFIX = "TTS_RAY_"


class RayServeSettings(BaseSettings):
    """How the replicas are deployed. Each field: what it controls and why it has its default."""

    model_config = SettingsConfigDict(env_prefix=RAY_ENV_PREFIX, extra="forbid", validate_default=True)

    # Ray cluster to join: None starts a local one on this machine (all its GPUs and CPUs); "auto" joins the
    # cluster this node belongs to (`ray start` ran here); "ray://head:10001" is a remote head.
    address: str | None = None
    # Serve application name (one app, routed at "/": every route of the server keeps its path).
    app_name: str = Field("tts", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    # Fixed replica count. None: one per GPU of the cluster (at least 1), or min_replicas when autoscaling.
    replicas: int | None = Field(None, ge=1, le=1024)
    # Autoscaling bounds: set max_replicas (> min_replicas) to let Serve scale on ongoing requests per replica.
    min_replicas: int = Field(1, ge=0, le=1024)
    max_replicas: int | None = Field(None, ge=1, le=1024)
    # Ongoing requests per replica the autoscaler aims at. None: the engine's slots (TTS_MAX_CONCURRENT).
    target_ongoing_requests: float | None = Field(None, gt=0)
    # Seconds the load must stay above (below) the target before the autoscaler adds (removes) a replica;
    # Serve's defaults. A removed replica drains first (graceful_shutdown_timeout_s).
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    # Resources one replica reserves. num_gpus None: 1 when the cluster has GPUs, else 0. Fractions are allowed
    # (two replicas per GPU: 0.5; tests on a small CPU box: num_cpus 0.25).
    num_gpus: float | None = Field(None, ge=0)
    num_cpus: float = Field(1.0, ge=0)
    # Requests Serve sends one replica at once. None: TTS_MAX_CONCURRENT + TTS_MAX_QUEUE.
    max_ongoing_requests: int | None = Field(None, ge=1, le=100_000)
    # Requests waiting in a proxy for a replica; past it the proxy refuses. -1: no bound (never use in production).
    max_queued_requests: int = Field(64, ge=-1, le=1_000_000)
    # Status of a proxy refusal: 429 like the server's own admission refusal, or 503.
    backpressure_status: Literal[429, 503] = 429
    # Seconds between Serve's health checks of each replica (its engine), and how long one may take.
    health_check_period_s: float = Field(5.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    # Seconds a replica being removed (scale-down, redeploy, shutdown) waits for its requests. None: TTS_DRAIN_TIMEOUT.
    graceful_shutdown_timeout_s: float | None = Field(None, ge=0)
    # Start Ray's dashboard with a local cluster (the Ray state API and `serve status` need it).
    dashboard: bool = True

    @model_validator(mode="after")
    def _bounds(self) -> RayServeSettings:
        if self.max_replicas is not None:
            if self.replicas is not None:
                raise ValueError("set TTS_RAY_REPLICAS or TTS_RAY_MAX_REPLICAS (autoscaling), not both")
            if self.max_replicas < max(1, self.min_replicas):
                raise ValueError("TTS_RAY_MAX_REPLICAS must be at least TTS_RAY_MIN_REPLICAS and at least 1")
        return self

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    def deployment_options(self, server: ServerSettings, *, cluster_gpus: float) -> dict[str, Any]:
        """Keyword arguments for `serve.deployment(...).options(...)` (no Ray import needed to compute them)."""
        num_gpus = self.num_gpus if self.num_gpus is not None else (1.0 if cluster_gpus >= 1 else 0.0)
        ongoing = self.max_ongoing_requests or server.max_concurrent + server.max_queue
        options: dict[str, Any] = {
            "ray_actor_options": {
                "num_cpus": self.num_cpus,
                "num_gpus": num_gpus,
                "runtime_env": {"env_vars": replica_env()},
            },
            "max_ongoing_requests": ongoing,
            "max_queued_requests": self.max_queued_requests,
            "backpressure_config": {"status_code": self.backpressure_status, "retry_after_s": server.retry_after},
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
            "graceful_shutdown_timeout_s": (
                self.graceful_shutdown_timeout_s
                if self.graceful_shutdown_timeout_s is not None
                else server.drain_timeout
            ),
            "graceful_shutdown_wait_loop_s": 0.5,
        }
        if self.autoscaling:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas,
                "initial_replicas": max(1, self.min_replicas),
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests or float(server.max_concurrent),
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
            }
        else:
            per_gpu = int(cluster_gpus // num_gpus) if num_gpus > 0 else 0
            options["num_replicas"] = self.replicas or max(1, per_gpu)
        return options


def replica_env() -> dict[str, str]:
    """The server's TTS_* variables (not TTS_RAY_*), handed to every replica wherever it runs in the cluster."""
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX) and not k.startswith(RAY_ENV_PREFIX)}


def load_ray_settings(**overrides: Any) -> RayServeSettings:
    """Read TTS_RAY_*; a bad value is one SettingsError line naming the variable."""
    try:
        return RayServeSettings(**overrides)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        name = (RAY_ENV_PREFIX + loc.upper()) if loc else "TTS_RAY_*"
        raise SettingsError(f"{name}: {err.get('msg', 'invalid value')}") from None

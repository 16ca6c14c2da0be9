"""Test helpers for the server: an in-process app over any engine, and a real `inference_server.py` process on
a free loopback port (always killed on exit)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI

from qwen_tts.engine_api import Engine
from qwen_tts.voices import VoiceProfile, profile_path, save_profile
from tts_server.app import create_app
from tts_server.runtime import Runtime
from tts_server.settings import ServerSettings, load_settings

REPO_ROOT = Path(__file__).resolve().parent.parent
VO_PYTHON = REPO_ROOT / ".venv-vllm-omni" / "bin" / "python"


def needs_vllm_omni() -> pytest.MarkDecorator:
    """The skip mark of tests that run .venv-vllm-omni's python; in CI a missing environment is an error."""
    if not VO_PYTHON.exists() and os.environ.get("CI") == "true":
        raise RuntimeError(f"{VO_PYTHON} is missing: CI must run scripts/setup_vllm_omni.sh before the tests")
    return pytest.mark.skipif(not VO_PYTHON.exists(), reason="no .venv-vllm-omni (run scripts/setup_vllm_omni.sh)")


def write_voice(profiles_dir: Path, speaker_id: str, dim: int, seed: int = 0) -> Path:
    x = torch.randn(dim, generator=torch.Generator().manual_seed(seed))
    return save_profile(profile_path(profiles_dir, speaker_id), VoiceProfile(x_vector=x, model="test"), overwrite=True)


def pcm16(data: bytes) -> np.ndarray:
    """The samples of a `pcm` response body (16-bit little-endian mono)."""
    return np.frombuffer(data, "<i2")


def metric(text: str, name: str) -> float:
    """The value of the sample `name` (with its labels) in a /metrics page; 0.0 where it is absent."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def clean_settings(**overrides: Any) -> ServerSettings:
    """Settings from defaults and `overrides` only, whatever TTS_* variables or .env file the test runner has."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("TTS_")}
    try:
        return load_settings(env_file=None, **overrides)
    finally:
        os.environ.update(saved)


@dataclass
class InProcess:
    app: FastAPI
    runtime: Runtime
    client: httpx.AsyncClient


@contextlib.asynccontextmanager
async def in_process(engine: Engine, **overrides: Any) -> AsyncIterator[InProcess]:
    """Start `engine` behind the app and yield an httpx client that talks to it through ASGI."""
    settings = clean_settings(**overrides)
    runtime = await Runtime.start(settings, engine=engine)
    app = create_app(settings, runtime=runtime)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=30) as client:
            yield InProcess(app, runtime, client)
    finally:
        await runtime.stop()


def http_scope(path: str, headers: list[tuple[bytes, bytes]], method: str = "POST", **extra: Any) -> dict[str, Any]:
    """An ASGI HTTP scope, as a server hands one to the app (for driving the app without a socket)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1234),
        "server": ("testserver", 80),
        **extra,
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def demo_env(root: Path, **extra: str) -> dict[str, str]:
    """The variables of a server on the demo checkpoint in `root`/demo-tiny (written at its first start) with its
    voice profiles in `root`/voices, plus `extra`."""
    return {"TTS_DEMO_DIR": str(root / "demo-tiny"), "TTS_PROFILES_DIR": str(root / "voices"), **extra}


class ServerProcess:
    """`python inference_server.py [args]` (or the command `argv` followed by `args`) on 127.0.0.1:<free port>
    (given as TTS_PORT, or as --port with `port_flag`), in `cwd` (default: the repository); stdout+stderr go to
    `log_path`."""

    def __init__(
        self,
        env: dict[str, str],
        log_path: Path,
        startup_timeout: float = 120.0,
        python: str | None = None,
        *,
        args: Sequence[str] = (),
        argv: Sequence[str] | None = None,
        cwd: Path | None = None,
        port_flag: bool = False,
    ):
        self.log_path = Path(log_path)
        # The free port is picked before the server binds it, so another process may take it in between (an
        # outgoing connection's local port): then the server exits "port N ... is in use" and a new port is tried.
        for attempt in range(3):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            # Not TRITON_INTERPRET either (conftest sets it for this process's CPU kernel tests).
            full_env = {k: v for k, v in os.environ.items() if not k.startswith("TTS_") and k != "TRITON_INTERPRET"}
            full_env.update({"TTS_HOST": "127.0.0.1", "PYTHONUNBUFFERED": "1"})
            port_args = ["--port", str(self.port)] if port_flag else []
            if not port_flag:
                full_env["TTS_PORT"] = str(self.port)
            full_env.update(env)
            self._log = open(self.log_path, "wb")  # noqa: SIM115  (closed in stop)
            self.proc = subprocess.Popen(
                [*(argv or (python or sys.executable, str(REPO_ROOT / "inference_server.py"))), *args, *port_args],
                cwd=cwd or REPO_ROOT,
                env=full_env,
                stdout=self._log,
                stderr=subprocess.STDOUT,
            )
            try:
                self._wait_ready(startup_timeout)
                return
            except RuntimeError:
                self.kill()
                if attempt == 2 or f"port {self.port} on " not in self.log() or "is in use" not in self.log():
                    raise
            except BaseException:
                self.kill()
                raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n{self.log()}")
            try:
                if httpx.get(self.url + "/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready within {timeout} s:\n{self.log()}")

    def health(self) -> dict[str, Any]:
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_idle(self, limit: float = 60.0) -> dict[str, Any]:
        """Poll /health until nothing is running, queued or admitted (fails after `limit` s: work was left over)."""
        deadline = time.monotonic() + limit
        while True:
            health = self.health()
            if health["running"] == 0 and health["waiting"] == 0 and health["admitted"] == 0:
                return health
            assert time.monotonic() < deadline, f"engine still busy: {health}"
            time.sleep(0.05)

    def log(self) -> str:
        if not self._log.closed:  # kill and stop close it (a startup retry reads the log after its kill)
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()


@contextlib.contextmanager
def server_process(env: dict[str, str], log_path: Path, startup_timeout: float = 120.0) -> Iterator[ServerProcess]:
    server = ServerProcess(env, log_path, startup_timeout)
    try:
        yield server
    finally:
        server.kill()


def demo_server(root: Path, **extra: str) -> contextlib.AbstractContextManager[ServerProcess]:
    """`server_process` over `demo_env(root, **extra)`, logging to `root`/server.log."""
    return server_process(demo_env(root, **extra), root / "server.log")

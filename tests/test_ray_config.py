"""Ray Serve settings and the proxy's error shaping (tts_serve.config, tts_serve.proxy): no Ray needed."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from typing import Any

import httpx
import pytest
import yaml

from server_helpers import REPO_ROOT, clean_settings
from tts_serve.config import load_ray_settings, replica_env
from tts_serve.proxy import CALLBACK_PATH, ServeErrorShape
from tts_server.settings import SettingsError


def _ray(**overrides: Any):
    return load_ray_settings(**overrides)


def test_defaults_follow_the_server_settings() -> None:
    server = clean_settings(max_concurrent=4, max_queue=3, retry_after=2, drain_timeout=12)
    opts = _ray().deployment_options(server, cluster_gpus=0)
    assert opts["max_ongoing_requests"] == 7  # the engine's slots + queue: its own admission never refuses
    assert opts["backpressure_config"] == {"status_code": 429, "retry_after_s": 2}
    assert opts["graceful_shutdown_timeout_s"] == 12
    assert opts["num_replicas"] == 1  # no GPU: one replica
    assert opts["ray_actor_options"]["num_gpus"] == 0.0
    assert "autoscaling_config" not in opts


def test_one_replica_per_gpu_or_per_gpu_share() -> None:
    server = clean_settings()
    assert _ray().deployment_options(server, cluster_gpus=8)["num_replicas"] == 8
    opts = _ray(num_gpus=0.5).deployment_options(server, cluster_gpus=2)
    assert opts["num_replicas"] == 4
    assert opts["ray_actor_options"]["num_gpus"] == 0.5
    assert _ray(replicas=3).deployment_options(server, cluster_gpus=8)["num_replicas"] == 3


def test_autoscaling_bounds() -> None:
    server = clean_settings(max_concurrent=16)
    opts = _ray(min_replicas=2, max_replicas=6).deployment_options(server, cluster_gpus=8)
    assert "num_replicas" not in opts
    assert opts["autoscaling_config"] == {
        "min_replicas": 2,
        "initial_replicas": 2,
        "max_replicas": 6,
        "target_ongoing_requests": 16.0,
        "upscale_delay_s": 30.0,
        "downscale_delay_s": 600.0,
    }
    with pytest.raises(SettingsError, match="TTS_RAY_MAX_REPLICAS"):
        _ray(min_replicas=4, max_replicas=2)
    with pytest.raises(SettingsError, match="not both"):
        _ray(replicas=2, max_replicas=4)


def test_bad_values_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_RAY_NUM_CPUS", "-1")
    with pytest.raises(SettingsError, match="TTS_RAY_NUM_CPUS"):
        load_ray_settings()
    monkeypatch.setenv("TTS_RAY_NUM_CPUS", "1")
    monkeypatch.setenv("TTS_RAY_BACKPRESSURE_STATUS", "500")
    with pytest.raises(SettingsError, match="TTS_RAY_BACKPRESSURE_STATUS"):
        load_ray_settings()


def test_replicas_get_the_server_variables_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_MAX_QUEUE", "5")
    monkeypatch.setenv("TTS_RAY_REPLICAS", "2")
    env = replica_env()
    assert env["TTS_MAX_QUEUE"] == "5"
    assert "TTS_RAY_REPLICAS" not in env


def _asgi(status: int, body: bytes, headers: list[tuple[bytes, bytes]], *, fail: bool = False, silent: bool = False):
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if silent:
            return  # Serve's proxy when the replica died before answering
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if fail:
            raise RuntimeError("replica died mid-stream")
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return ServeErrorShape(app)


async def _get(app: Any, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.get("/synthesize", headers=headers)


async def test_proxy_backpressure_gets_the_error_shape() -> None:
    plain = [
        (b"content-type", b"text/plain"),
        (b"retry-after", b"2"),
        (b"x-request-id", b"r1"),
        (b"x-request-id", b"r1"),
    ]
    r = await _get(_asgi(429, b"Request dropped due to backpressure", plain))
    assert r.status_code == 429
    assert r.headers["retry-after"] == "2"
    assert r.headers.get_list("x-request-id") == ["r1"]
    assert r.json() == {
        "error": {
            "message": "all replicas are at capacity; retry later",
            "type": "rate_limit_error",
            "param": None,
            "code": "server_overloaded",
        },
        "request_id": "r1",
    }
    r = await _get(_asgi(503, b"no replicas", [(b"content-type", b"text/plain")]), **{"X-Request-Id": "abc"})
    assert (r.status_code, r.headers["retry-after"], r.json()["request_id"]) == (503, "1", "abc")
    assert r.json()["error"]["code"] == "not_ready"


async def test_replica_answers_pass_untouched() -> None:
    body = b'{"error":{"code":"unknown_speaker"}}'
    r = await _get(_asgi(503, body, [(b"content-type", b"application/json")]))
    assert (r.status_code, r.content) == (503, body)
    r = await _get(_asgi(200, b"RIFF", [(b"content-type", b"audio/wav")]))
    assert (r.status_code, r.content) == (200, b"RIFF")


async def test_a_dead_replica_is_a_json_500_or_a_cut_stream() -> None:
    r = await _get(_asgi(0, b"", [], silent=True))
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "replica_failed"
    with pytest.raises(RuntimeError, match="mid-stream"):  # headers were out: the connection is cut
        await _get(_asgi(200, b"", [(b"content-type", b"audio/wav")], fail=True))


def test_the_kuberay_manifest_names_a_real_builder_and_valid_settings() -> None:
    spec = yaml.safe_load((REPO_ROOT / "deploy" / "kuberay" / "rayservice.yaml").read_text())["spec"]
    (app,) = yaml.safe_load(spec["serveConfigV2"])["applications"]
    module, attr = app["import_path"].split(":")
    source = (REPO_ROOT / (module.replace(".", "/") + ".py")).read_text()
    assert attr in {f.name for f in ast.parse(source).body if isinstance(f, ast.FunctionDef)}
    settings = load_ray_settings(**app["args"])
    assert settings.autoscaling and settings.num_gpus == 1
    env = {
        e["name"]: e.get("value")
        for e in spec["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == CALLBACK_PATH
    assert (
        clean_settings(
            **{k[4:].lower(): v for k, v in env.items() if k.startswith("TTS_") and v}
        ).profiles_dir.as_posix()
        == "/voices"
    )


def test_the_cli_refuses_a_bad_setting_before_starting_ray() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTS_")}
    env["TTS_RAY_MAX_QUEUED_REQUESTS"] = "-5"
    r = subprocess.run([sys.executable, "-m", "tts_serve"], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == "TTS_RAY_MAX_QUEUED_REQUESTS: Input should be greater than or equal to -1"

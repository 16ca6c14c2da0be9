"""tts_server/logs.py: TTS_LOG_FORMAT=json writes one JSON object per line (time, level, logger, message, and the
request id within a request), for the server's loggers and uvicorn's alike."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from qwen_tts.engines.fake import FakeEngine
from server_helpers import in_process
from tts_server import logs


@pytest.fixture
def root_logging() -> Iterator[None]:
    """configure_logging replaces the root handlers: put pytest's back afterwards."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    yield
    root.handlers[:], _ = saved
    root.setLevel(saved[1])
    logging.captureWarnings(False)


def _lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_json_format_writes_one_parseable_object_per_record(root_logging, capsys: pytest.CaptureFixture) -> None:
    logs.configure_logging("info", "json")
    logging.getLogger("tts_server").info("Ready with %d speakers", 3)
    logging.getLogger("uvicorn.error").warning('a line with a "quote"\nand a newline')
    logging.getLogger("tts_server").debug("not at info")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("tts_server.service").exception("request failed")
    err = capsys.readouterr().err
    lines = _lines(err)
    assert len(err.splitlines()) == len(lines) == 3  # the newline and the traceback stay inside their objects
    ready, uvicorn_line, failed = lines
    assert {k: ready[k] for k in ("level", "logger", "message")} == {
        "level": "INFO",
        "logger": "tts_server",
        "message": "Ready with 3 speakers",
    }
    assert set(ready) == {"time", "level", "logger", "message"}  # no request_id outside a request
    assert datetime.fromisoformat(ready["time"]).utcoffset().total_seconds() == 0
    assert (uvicorn_line["logger"], uvicorn_line["level"]) == ("uvicorn.error", "WARNING")
    assert uvicorn_line["message"] == 'a line with a "quote"\nand a newline'
    assert failed["message"] == "request failed" and failed["level"] == "ERROR"
    assert failed["exception"].startswith("Traceback") and "ValueError: boom" in failed["exception"]


def test_text_format_is_one_readable_line(root_logging, capsys: pytest.CaptureFixture) -> None:
    logs.configure_logging("warning", "text")
    logging.getLogger("tts_server").info("hidden")
    logging.getLogger("tts_server").warning("port %d", 8090)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith(" WARNING tts_server: port 8090")
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)


def test_python_warnings_become_json_records_too(root_logging, capsys: pytest.CaptureFixture) -> None:
    import warnings

    logs.configure_logging("info", "json")
    warnings.warn("an old call", DeprecationWarning, stacklevel=1)
    (line,) = _lines(capsys.readouterr().err)
    assert line["logger"] == "py.warnings" and "DeprecationWarning: an old call" in line["message"]


async def test_records_logged_within_a_request_carry_its_id(tmp_path: Path) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    handler.addFilter(logs.RequestIdFilter())
    access = logging.getLogger("tts_server.access")
    access.addHandler(handler)
    level = access.level
    access.setLevel(logging.INFO)
    try:
        async with in_process(FakeEngine(xvector_dim=8), profiles_dir=tmp_path) as s:
            r = await s.client.get("/speakers", headers={"x-request-id": "req-42"})
            assert r.status_code == 200
            generated = (await s.client.get("/health")).headers["x-request-id"]
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    by_path = {line["message"].split('"')[1]: line for line in _lines(stream.getvalue())}
    assert by_path["GET /speakers"]["request_id"] == "req-42"
    assert by_path["GET /health"]["request_id"] == generated  # the id the server made up and answered with
    assert logs.request_id.get() is None  # reset once the request is done


async def test_metrics_report_how_late_the_event_loop_ran(tmp_path: Path) -> None:
    """tts_event_loop_lag_seconds: a probe every 50 ms observes how late the loop woke it; a loop held for 0.5 s
    (as a long GIL hold or a blocking call would) shows as one probe more than 0.25 s late, the others on time."""
    import time

    from server_helpers import metric
    from tts_server.runtime import LOOP_LAG_INTERVAL_S

    async with in_process(FakeEngine(xvector_dim=8), profiles_dir=tmp_path) as s:
        await asyncio.sleep(4 * LOOP_LAG_INTERVAL_S)
        time.sleep(0.5)  # the loop is held: nothing else runs
        await asyncio.sleep(4 * LOOP_LAG_INTERVAL_S)
        text = (await s.client.get("/metrics")).text
        probe = s.runtime._lag_probe
    count = metric(text, "tts_event_loop_lag_seconds_count")
    on_time = metric(text, 'tts_event_loop_lag_seconds_bucket{le="0.25"}')
    assert count >= 4 and on_time >= 3
    assert count - on_time == 1  # the probe that slept through the hold, late by 0.45-0.5 s
    assert 0.45 <= metric(text, "tts_event_loop_lag_seconds_sum") < 0.5 + 0.25 * on_time
    assert probe.done()  # the runtime's stop ended the probe

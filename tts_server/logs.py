"""The server's logging: stdlib `logging` on stderr, as text or as one JSON object per line (TTS_LOG_FORMAT).

Every logger goes through the root handler set here, uvicorn's included (it is started with `log_config=None`), so
one format covers the server, the engine and uvicorn. Within a request, records carry its id: the request middleware
sets `request_id` for the task that serves it, and the JSON format writes it as `request_id`.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from datetime import datetime, timezone
from typing import Any, Literal

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# The id of the request whose task logs (tts_server/middleware.py sets it); None outside requests.
request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class RequestIdFilter(logging.Filter):
    """Stamps each record with the current request's id (None outside a request), for the formatters."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: time (UTC, ISO 8601), level, logger, message, and where present
    request_id, exception (the formatted traceback) and stack."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if getattr(record, "request_id", None):
            entry["request_id"] = record.request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: str, fmt: LogFormat = "text", *, force: bool = True) -> None:
    """Root logging at `level` on stderr, in `fmt`. `force=False` leaves a root logger that already has handlers
    alone (the app under a server that configured logging itself)."""
    root = logging.getLogger()
    if root.handlers and not force:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # Python warnings (a library's DeprecationWarning...) as log records, so that json stays one object a line.
    logging.captureWarnings(fmt == "json")

"""Prometheus metrics of one server instance (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Latency buckets from 10 ms (a warm GPU's first chunk) to 2 minutes (a long whole file on CPU).
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_RTF = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)
# How late the event loop runs a timer: from 1 ms (a busy loop) to 1 s (a stalled one).
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

# From half a millisecond (one request on an idle server) to 1 s (a burst waiting its turn on a busy loop).
TIME_TO_ENGINE_BUCKETS = (0.0005, *LOOP_LAG_BUCKETS)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, running: Callable[[], float], waiting: Callable[[], float], admitted: Callable[[], float]):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "tts_http_requests", "HTTP requests by route and status code", ["route", "status"], registry=r
        )
        self.syntheses = Counter(
            "tts_syntheses", "Engine requests by outcome (ok, error, timeout, disconnected)", ["outcome"], registry=r
        )
        self.rejections = Counter(
            "tts_rejections", "Requests refused before the engine, by reason", ["reason"], registry=r
        )
        self.disconnects = Counter("tts_client_disconnects", "Clients gone before their audio was complete", registry=r)
        self.ttfa = Histogram(
            "tts_time_to_first_audio_seconds", "Submit to first audio chunk", buckets=_LATENCY, registry=r
        )
        self.time_to_engine = Histogram(
            "tts_time_to_engine_seconds",
            "Request headers received to submission to the engine: the server's own share of first audio (waiting for "
            "the event loop, reading and checking the body, finding the voice)",
            buckets=TIME_TO_ENGINE_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "tts_queue_time_seconds", "Submit to start of prefill", buckets=_LATENCY, registry=r
        )
        self.rtf = Histogram(
            "tts_real_time_factor", "Wall time / audio time of finished requests", buckets=_RTF, registry=r
        )
        self.audio_seconds = Counter("tts_audio_seconds", "Seconds of audio produced", registry=r)
        self.voice_modes = Counter(
            "tts_voice_mode", "Engine requests by cloning mode (icl, xvector)", ["mode"], registry=r
        )
        self.engine_restarts = Counter("tts_engine_restarts", "In-process engine restarts after a fault", registry=r)
        # The WebSocket speech session (tts_server/realtime.py).
        self.ws_sessions = Gauge("tts_ws_sessions", "WebSocket speech sessions open now", registry=r)
        self.ws_session_ends = Counter(
            "tts_ws_session_ends",
            "WebSocket speech sessions ended, by reason (client, idle, slow_reader, auth, utterance_limit, ...)",
            ["reason"],
            registry=r,
        )
        self.ws_utterances = Counter(
            "tts_ws_utterances",
            "WebSocket utterances ended, by finish reason (eos, budget, cancelled, error, timeout, empty, ...)",
            ["finish_reason"],
            registry=r,
        )
        self.ws_errors = Counter("tts_ws_errors", "WebSocket error events sent, by code", ["code"], registry=r)
        self.ws_text_chars = Counter("tts_ws_text_chars", "Characters of text received over WebSockets", registry=r)
        self.ws_ttfa = Histogram(
            "tts_ws_time_to_first_audio_seconds",
            "WebSocket utterances: first text fragment received to first audio sent",
            buckets=_LATENCY,
            registry=r,
        )
        self.loop_lag = Histogram(
            "tts_event_loop_lag_seconds",
            "How late this process's event loop ran a timer due every 50 ms: time no HTTP client was served",
            buckets=LOOP_LAG_BUCKETS,
            registry=r,
        )
        Gauge("tts_requests_running", "Requests decoding in the engine", registry=r).set_function(running)
        Gauge("tts_requests_waiting", "Requests queued in the engine", registry=r).set_function(waiting)
        Gauge("tts_requests_admitted", "Requests holding an admission slot", registry=r).set_function(admitted)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""What a running server holds: settings, engine, voices, admission counter, metrics, and the startup sequence.

Startup follows the seed's log sequence: voice profiles loaded -> engine initialised -> ready with N speakers.
Anything that can fail at startup raises StartupError with one line that says what to fix. The engine comes from
the factory (`qwen_tts.engines.create_engine`) and is used only through `qwen_tts.engine_api.Engine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from qwen_tts import icl_profile
from qwen_tts.engine_api import Engine, EngineSettingsError
from qwen_tts.engines import create_engine
from qwen_tts.icl import IclReference
from qwen_tts.model.model_paths import DEMO
from qwen_tts.voices import DEMO_VOICE_ID, VoiceEncoder, VoiceRegistry, ensure_demo_voice

from .metrics import Metrics
from .settings import ServerSettings, unknown_env_vars
from .voice_watch import ProfileWatcher

logger = logging.getLogger("tts_server")
# The keys of /health's `model`, from the engine's model_info: the documented, stable part (docs/api.md).
MODEL_SUMMARY = ("name", "size", "xvector_dim", "device", "dtype")
Voice = tuple[torch.Tensor, IclReference]  # a voice as a request takes it: x-vector and ICL reference


class StartupError(RuntimeError):
    """The server cannot start; the message is one line for the operator."""


class ReferenceEncoderUnavailable(RuntimeError):
    """This server cannot compute ICL reference codes (no checkpoint, or one without the codec encoder)."""


class InlineVoices:
    """Voices enrolled from synthesis bodies' own references (tts_server/inline_reference.py), by content hash; the
    least recently used is dropped past `capacity`."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._voices: OrderedDict[str, Voice] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Voice | None:
        with self._lock:
            voice = self._voices.get(key)
            if voice is not None:
                self._voices.move_to_end(key)
            return voice

    def put(self, key: str, voice: Voice) -> None:
        with self._lock:
            self._voices[key] = voice
            self._voices.move_to_end(key)
            while len(self._voices) > self.capacity:
                self._voices.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._voices)


class Admission:
    """At most `limit` requests between admission and their end (engine slots + its queue); the rest get 429.

    The engine bounds itself too; this guard keeps the server's memory bounded whatever the backend does.
    Used from the event loop only.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.active = 0

    def try_acquire(self) -> bool:
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def release(self) -> None:
        self.active = max(0, self.active - 1)


LOOP_LAG_INTERVAL_S = 0.05  # the event-loop lag probe's period (Runtime._probe_loop_lag)


class Runtime:
    def __init__(self, settings: ServerSettings, engine: Engine, voices: VoiceRegistry):
        self.settings = settings
        self.engine = engine
        self.voices = voices
        self.admission = Admission(settings.max_concurrent + settings.max_queue)
        self.metrics = Metrics(
            running=lambda: self.engine.num_running,  # self.engine: the supervisor may replace it
            waiting=lambda: self.engine.num_waiting,
            admitted=lambda: self.admission.active,
        )
        # Builds a fresh engine like the first one (set by `start` when it built the engine; recovery.py uses it).
        self.engine_factory: Callable[[], Engine] | None = None
        self.restarting = False  # the supervisor is replacing a dead engine
        self.supervised = False  # a supervisor will restart a dead engine (recovery.py); False once it gives up
        self.engine_restarts = 0
        self.draining = False
        self.started_at = time.monotonic()
        self._stopped = False
        # Voice management (tts_server/voice_routes.py): the speaker encoder only when TTS_VOICE_UPLOAD is on, one
        # enrollment at a time, and the directory watch that serves hand-copied profiles without a restart.
        self.voice_encoder: VoiceEncoder | None = None
        self.enroll_lock = asyncio.Lock()
        # The codec encoder of ICL enrolment (a transcript with the clip), loaded on first need.
        self._reference_encoder: icl_profile.ReferenceEncoder | None = None
        self._reference_encoder_lock = threading.Lock()
        self.inline_voices = InlineVoices(settings.inline_reference_cache)
        self.profile_watcher: ProfileWatcher | None = None
        self._lag_probe: asyncio.Task | None = None

    def reference_encoder(self) -> icl_profile.ReferenceEncoder:
        """The served checkpoint's codec encoder, loaded once on first use (blocking: call it from a worker thread).
        ReferenceEncoderUnavailable, with the reason, when this server cannot compute reference codes."""
        with self._reference_encoder_lock:
            if self._reference_encoder is None:
                path = self.engine.model_info.get("path")
                if not path:
                    raise ReferenceEncoderUnavailable(f"the {self.settings.backend} engine serves no checkpoint")
                try:
                    self._reference_encoder = icl_profile.load_reference_encoder(path, device=self.engine.device)
                except Exception as e:  # no encoder weights in the checkpoint, or the module missing
                    raise ReferenceEncoderUnavailable(f"{type(e).__name__}: {e}") from e
                logger.info("ICL enrolment: codec encoder loaded")
            return self._reference_encoder

    # --- state ------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.engine.ready and not self.draining and not self._stopped

    @property
    def alive(self) -> bool:
        """False once the engine has died while we still meant to serve (a restart is the fix)."""
        return self.engine.ready or self.draining or self._stopped or self.recovering

    @property
    def recovering(self) -> bool:
        """The engine is down and the supervisor is on it (or about to be: it polls)."""
        return (
            self.restarting
            or self.engine.restarting_itself
            or (self.supervised and not self.engine.ready and not self.draining and not self._stopped)
        )

    def begin_drain(self) -> None:
        if not self.draining:
            logger.info("draining: refusing new requests, finishing %d in flight", self.admission.active)
        self.draining = True

    def model_summary(self) -> dict[str, Any]:
        """/health's `model`: what is served, in the terms an operator knows (MODEL_SUMMARY; None where the engine
        does not say, e.g. the fake engine's size)."""
        info = self.engine.model_info
        return {key: info.get(key) for key in MODEL_SUMMARY}

    def engine_description(self) -> dict[str, Any]:
        """/health's `engine`: the engine's whole description (its model_info: kernels, graphs, decoder, ...), for
        debugging; its keys are the engine's own and vary by backend and version."""
        info = self.engine.model_info
        info.pop("path", None)  # /health is public: no file system paths
        return info

    # --- lifecycle --------------------------------------------------------------------------------
    @classmethod
    async def start(
        cls, settings: ServerSettings, engine: Engine | None = None, *, fault_hook: Callable[[], None] | None = None
    ) -> Runtime:
        """Build the engine (resolving the model), load voices, start the engine (bounded by
        TTS_STAGE_INIT_TIMEOUT). `engine` (tests) replaces the one the settings describe. `fault_hook` (tests:
        tts_server/faults.py) goes to each engine built here, the first and every rebuilt one."""
        for name in unknown_env_vars():
            logger.warning("ignoring unknown setting %s (see tts_server/settings.py for the names)", name)
        logger.debug("settings: %s", settings.public_dict())
        built = engine is None
        if engine is None:
            engine = await asyncio.to_thread(_create_engine, settings, fault_hook)
        if settings.model_path == DEMO:
            await asyncio.to_thread(_ensure_demo_voice, settings, engine)
        voices = VoiceRegistry(settings.profiles_dir, xvector_dim=engine.xvector_dim, device=engine.device)
        await _load_voices(voices)
        needs_encoder = settings.voice_upload or settings.inline_reference
        encoder = await asyncio.to_thread(_load_voice_encoder, settings, engine) if needs_encoder else None
        await _start_engine(engine, settings)
        runtime = cls(settings, engine, voices)
        runtime.voice_encoder = encoder
        runtime.profile_watcher = ProfileWatcher(voices)
        runtime.profile_watcher.start()
        runtime._lag_probe = asyncio.create_task(runtime._probe_loop_lag(), name="tts-loop-lag")
        if built:
            runtime.engine_factory = lambda: _create_engine(settings, fault_hook)
        logger.info("Ready with %d speakers", len(voices))
        return runtime

    async def _probe_loop_lag(self) -> None:
        """Every LOOP_LAG_INTERVAL_S, how much later than due this event loop woke (/metrics'
        tts_event_loop_lag_seconds): what the engine thread's hold of the GIL, encoding and socket writes cost every
        client of this process at once."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LOOP_LAG_INTERVAL_S
            await asyncio.sleep(LOOP_LAG_INTERVAL_S)
            self.metrics.loop_lag.observe(max(0.0, loop.time() - due))

    async def stop(self, drain_timeout: float = 0.0) -> None:
        if self._stopped:
            return
        self.begin_drain()
        self._stopped = True
        if self.profile_watcher is not None:
            await self.profile_watcher.stop()
        if self._lag_probe is not None:
            self._lag_probe.cancel()
            if self._lag_probe.get_loop() is asyncio.get_running_loop():
                with contextlib.suppress(asyncio.CancelledError):
                    await self._lag_probe
        await self.engine.stop(drain_timeout=drain_timeout)
        logger.info("engine stopped")


async def _quiet_stop(engine: Engine) -> None:
    try:
        await engine.stop(0.0)
    except Exception:  # the engine never started properly; nothing more to clean
        logger.debug("engine stop after failed start raised", exc_info=True)


async def _load_voices(voices: VoiceRegistry) -> None:
    report = await asyncio.to_thread(voices.load_all)
    logger.info(
        "Loaded %d voice profiles from %s (%d skipped)", len(report.loaded), voices.profiles_dir, len(report.skipped)
    )


async def start_engine(engine: Engine, settings: ServerSettings) -> None:
    """Start (load, warm up) an engine within TTS_STAGE_INIT_TIMEOUT; StartupError with one line otherwise."""
    await _start_engine(engine, settings)


async def _start_engine(engine: Engine, settings: ServerSettings) -> None:
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(engine.start(), timeout=settings.stage_init_timeout)
    except asyncio.TimeoutError:
        await _quiet_stop(engine)
        raise StartupError(
            f"engine did not start within TTS_STAGE_INIT_TIMEOUT={settings.stage_init_timeout:g} s"
        ) from None
    except Exception as e:  # load failures carry their own message (missing file, bad config, CUDA...)
        await _quiet_stop(engine)
        raise StartupError(f"engine failed to start: {type(e).__name__}: {e}") from e
    info = engine.model_info
    logger.info(
        "Engine initialised in %.1f s: backend=%s device=%s dtype=%s slots=%d queue=%d",
        time.monotonic() - t0,
        settings.backend,
        engine.device,
        info.get("dtype", "?"),
        settings.max_concurrent,
        settings.max_queue,
    )


def _create_engine(settings: ServerSettings, fault_hook: Callable[[], None] | None = None) -> Engine:
    """The engine the settings describe; a setting it cannot use is one StartupError line naming the variable."""
    try:
        return create_engine(settings.engine_settings(), fault_hook=fault_hook)
    except EngineSettingsError as e:
        raise StartupError(f"{settings.describe_engine_setting(e.setting)}: {e}") from None
    except ImportError as e:  # a backend whose optional dependencies are not installed
        raise StartupError(f"{settings.describe_engine_setting('backend')}: {e}") from None


def _load_voice_encoder(settings: ServerSettings, engine: Engine) -> VoiceEncoder:
    """The served checkpoint's speaker encoder, for TTS_VOICE_UPLOAD and TTS_INLINE_REFERENCE (loaded alone, on the
    engine's device)."""
    setting = "TTS_VOICE_UPLOAD=true" if settings.voice_upload else "TTS_INLINE_REFERENCE=true"
    path = engine.model_info.get("path")
    if not path:
        raise StartupError(
            f"{setting} needs a checkpoint with a speaker encoder; the {settings.backend} engine has none"
        )
    try:
        encoder = VoiceEncoder(path, device=engine.device)
    except Exception as e:  # a checkpoint without speaker_encoder weights, or unreadable ones
        raise StartupError(f"{setting}: cannot load the speaker encoder ({type(e).__name__}: {e})") from e
    if encoder.xvector_dim != engine.xvector_dim:
        raise StartupError(
            f"{setting}: the speaker encoder gives width {encoder.xvector_dim}, the engine needs {engine.xvector_dim}"
        )
    enabled = "Voice upload" if settings.voice_upload else "Inline references"
    logger.info("%s enabled: speaker encoder loaded (x-vector width %d)", enabled, encoder.xvector_dim)
    return encoder


def _ensure_demo_voice(settings: ServerSettings, engine: Engine) -> None:
    """The demo voice for TTS_MODEL_PATH=demo: from the demo checkpoint the engine serves, or (the fake backend,
    which has none) a seeded random vector of the engine's width."""
    info = engine.model_info
    if info.get("name") == DEMO and info.get("path"):
        path = ensure_demo_voice(settings.profiles_dir, info["path"])
    elif settings.backend == "fake":
        path = ensure_demo_voice(settings.profiles_dir, None, dim=engine.xvector_dim)
    else:  # an engine handed in (tests) that serves no demo checkpoint
        return
    logger.info("Demo voice %r ready at %s", DEMO_VOICE_ID, path)

"""What a running server holds: settings, engine, voices, admission counter, metrics, and the startup sequence.

Startup follows the seed's log sequence: voice profiles loaded -> engine initialised -> ready with N speakers.
Anything that can fail at startup raises StartupError with one line that says what to fix.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from embedding_cache import EmbeddingCacheManager
from inference_config import ServerSettings, unknown_env_vars
from qwen_tts.engine_api import Engine

from .metrics import Metrics

logger = logging.getLogger("tts_server")

DEMO = "demo"


class StartupError(RuntimeError):
    """The server cannot start; the message is one line for the operator."""


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


class Runtime:
    def __init__(self, settings: ServerSettings, engine: Engine, voices: EmbeddingCacheManager, model_name: str):
        self.settings = settings
        self.engine = engine
        self.voices = voices
        self.model_name = model_name
        self.admission = Admission(settings.max_concurrent + settings.max_queue)
        self.metrics = Metrics(
            running=lambda: engine.num_running,
            waiting=lambda: engine.num_waiting,
            admitted=lambda: self.admission.active,
        )
        self.draining = False
        self.started_at = time.monotonic()
        self._stopped = False

    # --- state ------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.engine.ready and not self.draining and not self._stopped

    @property
    def alive(self) -> bool:
        """False once the engine has died while we still meant to serve (a restart is the fix)."""
        return self.engine.ready or self.draining or self._stopped

    def begin_drain(self) -> None:
        if not self.draining:
            logger.info("draining: refusing new requests, finishing %d in flight", self.admission.active)
        self.draining = True

    def public_model_info(self) -> dict:
        info = dict(getattr(self.engine, "model_info", {}) or {})
        info.pop("path", None)  # /health is public: no file system paths
        info["name"] = self.model_name
        return info

    # --- lifecycle --------------------------------------------------------------------------------
    @classmethod
    async def start(cls, settings: ServerSettings, engine: Engine | None = None) -> Runtime:
        """Resolve the model, load voices, start the engine (bounded by TTS_STAGE_INIT_TIMEOUT).

        `engine` (tests) replaces the one the settings describe; its width is known only once started.
        """
        for name in unknown_env_vars():
            logger.warning("ignoring unknown setting %s (see inference_config.py for the names)", name)
        model_dir, xvector_dim = None, None
        model_name = "fake" if settings.backend == "fake" else settings.model_path
        if engine is None:
            if settings.backend == "fake":
                engine = _create_engine(settings, None)
            else:
                model_dir, xvector_dim, model_name = await asyncio.to_thread(_prepare_model, settings)
                engine = _create_engine(settings, model_dir)
        voices = EmbeddingCacheManager(settings.profiles_dir, xvector_dim=xvector_dim)
        if xvector_dim is not None:
            await _load_voices(voices)
        await _start_engine(engine, settings)
        if xvector_dim is None:
            if settings.model_path == DEMO and settings.backend == "fake":
                await asyncio.to_thread(_ensure_random_demo_voice, settings.profiles_dir, engine.xvector_dim)
            voices.xvector_dim = engine.xvector_dim
            await _load_voices(voices)
        elif engine.xvector_dim != xvector_dim:
            await _quiet_stop(engine)
            raise StartupError(f"engine x-vector width {engine.xvector_dim} != the checkpoint's {xvector_dim}")
        voices.to(getattr(engine, "device", "cpu"))
        runtime = cls(settings, engine, voices, model_name)
        logger.info("Ready with %d speakers", len(voices))
        return runtime

    async def stop(self, drain_timeout: float = 0.0) -> None:
        if self._stopped:
            return
        self.begin_drain()
        self._stopped = True
        await self.engine.stop(drain_timeout=drain_timeout)
        logger.info("engine stopped")


async def _quiet_stop(engine: Engine) -> None:
    try:
        await engine.stop(0.0)
    except Exception:  # the engine never started properly; nothing more to clean
        logger.debug("engine stop after failed start raised", exc_info=True)


async def _load_voices(voices: EmbeddingCacheManager) -> None:
    report = await asyncio.to_thread(voices.load_all)
    logger.info(
        "Loaded %d voice profiles from %s (%d skipped)", len(report.loaded), voices.profiles_dir, len(report.skipped)
    )


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
    info = dict(getattr(engine, "model_info", {}) or {})
    logger.info(
        "Engine initialised in %.1f s: backend=%s device=%s dtype=%s slots=%d queue=%d",
        time.monotonic() - t0,
        settings.backend,
        info.get("device", "?"),
        info.get("dtype", "?"),
        settings.max_concurrent,
        settings.max_queue,
    )


def _prepare_model(settings: ServerSettings) -> tuple[Path, int, str]:
    """(checkpoint dir, x-vector width, display name); writes the demo checkpoint and voice when asked."""
    from qwen_tts.config import ConfigError, ModelConfig
    from qwen_tts.demo import DemoError, ensure_demo_voice, resolve_model_path

    try:
        model_dir = resolve_model_path(settings.model_path, demo_dir=settings.demo_dir)
        cfg = ModelConfig.from_pretrained(model_dir)
    except (DemoError, ConfigError, OSError, ValueError) as e:
        raise StartupError(f"TTS_MODEL_PATH={settings.model_path!r}: {e}") from None
    if settings.model_path == DEMO:
        path = ensure_demo_voice(settings.profiles_dir, model_dir)
        logger.info("Demo voice 'demo' ready at %s", path)
    name = DEMO if settings.model_path == DEMO else model_dir.name
    return model_dir, cfg.xvector_dim, name


def _ensure_random_demo_voice(profiles_dir: Path, dim: int) -> None:
    """The fake backend's demo voice: a seeded random vector of the engine's width."""
    import torch

    from qwen_tts.profiles import ProfileError, VoiceProfile, load_profile, save_profile

    path = Path(profiles_dir) / f"{DEMO}.safetensors"
    try:
        if load_profile(path, expected_dim=dim):
            return
    except ProfileError:
        pass
    x = torch.randn(dim, generator=torch.Generator().manual_seed(0))
    save_profile(path, VoiceProfile(x_vector=x, model="fake"), overwrite=True)


def _create_engine(settings: ServerSettings, model_dir: Path | None) -> Engine:
    if settings.backend == "fake":
        from .fake_engine import FakeEngine

        return FakeEngine(
            max_slots=settings.max_concurrent,
            max_queue=settings.max_queue,
            max_frames=settings.max_new_tokens,
            first_chunk_frames=settings.first_chunk_frames,
            chunk_frames=settings.chunk_frames,
            frame_delay=0.01,
        )
    if settings.backend == "vllm-omni":
        return _create_vllm_omni_engine(settings, model_dir)
    from qwen_tts.engine import EngineConfig, create_engine

    try:
        config = EngineConfig(
            model_path=str(model_dir),
            device=settings.device,
            dtype=settings.dtype,
            max_slots=settings.max_concurrent,
            max_queue=settings.max_queue,
            max_frames=settings.max_new_tokens,
            first_chunk_frames=settings.first_chunk_frames,
            chunk_frames=settings.chunk_frames,
        )
        return create_engine(config, backend=settings.backend)
    except (ValueError, ImportError) as e:
        raise StartupError(f"TTS_BACKEND={settings.backend!r}: {e}") from None


def _create_vllm_omni_engine(settings: ServerSettings, model_dir: Path | None) -> Engine:
    from qwen_tts.engines.vllm_omni import VllmOmniConfig, VllmOmniEngine

    try:
        config = VllmOmniConfig(
            model_path=str(model_dir),
            stage_config=str(settings.stage_config),
            stage_init_timeout=settings.stage_init_timeout,
            max_slots=settings.max_concurrent,
            max_queue=settings.max_queue,
            max_frames=settings.max_new_tokens,
            speaker_transport=settings.vllm_speaker_transport,
        )
        return VllmOmniEngine(config)
    except (ValueError, ImportError) as e:
        raise StartupError(f"TTS_BACKEND='vllm-omni': {e}") from None

"""Engine implementations and the one factory that builds them from `EngineSettings`.

Each backend is a package or module here (native/, vllm_omni/, fake.py) that implements
`qwen_tts.engine_api.Engine`. Callers import only this factory and the interface, never a backend.
"""

from __future__ import annotations

from qwen_tts.engine_api import Engine, EngineSettings, EngineSettingsError

# Names a setting may give; `create_engine` says which of them this build lacks.
BACKENDS = ("native", "vllm-omni", "fake")
AVAILABLE_BACKENDS = ("native", "vllm-omni", "fake")  # vllm-omni: where vllm and vllm-omni are installed


def create_engine(settings: EngineSettings) -> Engine:
    """The engine `settings.backend` names, not yet started (`xvector_dim`, `languages` and `model_info` are
    already known). Raises EngineSettingsError naming the setting at fault (backend, model_path, device...)."""
    if settings.backend == "native":
        from .native import NativeEngine

        return NativeEngine(settings)
    if settings.backend == "vllm-omni":
        from .vllm_omni import VllmOmniEngine

        try:
            return VllmOmniEngine.from_settings(settings)
        except ImportError as e:
            raise EngineSettingsError("backend", str(e)) from None
    if settings.backend == "fake":
        from .fake import FakeEngine

        return FakeEngine.from_settings(settings)
    raise EngineSettingsError(
        "backend",
        f"backend {settings.backend!r} is not available in this build (available: {', '.join(AVAILABLE_BACKENDS)})",
    )


__all__ = ["AVAILABLE_BACKENDS", "BACKENDS", "create_engine"]

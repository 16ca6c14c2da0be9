"""Server configuration from the environment (`TTS_*` variables): thin entry point over `tts_server.settings`,
which holds every variable with its default and the reason for it (docs/api.md lists them)."""

from tts_server.settings import (
    ENV_PREFIX,
    ServerSettings,
    SettingsError,
    load_settings,
    unknown_env_vars,
)

__all__ = ["ENV_PREFIX", "ServerSettings", "SettingsError", "load_settings", "unknown_env_vars"]

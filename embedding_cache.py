"""Voice id -> x-vector tensor on the engine's device: the seed's `EmbeddingCacheManager`, a thin entry point.

The registry, the profile format and the directory rules live in `qwen_tts.voices` (docs/voice_profiles.md).
"""

from qwen_tts.voices import (
    InvalidProfileError,
    InvalidSpeakerIdError,
    LoadReport,
    SpeakerError,
    SpeakerInfo,
    UnknownSpeakerError,
    VoiceRegistry,
    validate_speaker_id,
)

EmbeddingCacheManager = VoiceRegistry

__all__ = [
    "EmbeddingCacheManager",
    "InvalidProfileError",
    "InvalidSpeakerIdError",
    "LoadReport",
    "SpeakerError",
    "SpeakerInfo",
    "UnknownSpeakerError",
    "validate_speaker_id",
]

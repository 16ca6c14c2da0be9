"""Request bodies: strict pydantic models (unknown fields and type coercions are refused, with the field named).

Static bounds live here; limits that are settings (text length, frame cap) are checked by `check_limits`
so the message names the configured limit.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from qwen_tts.engine_api import MAX_SEED
from qwen_tts.icl_profile import MAX_REF_SECONDS, MAX_REF_TEXT_CHARS

VoiceMode = Literal["auto", "icl", "xvector"]


class _Strict(BaseModel):
    # strict: "0.5" is not a float and 1 is not a string; forbid: a misspelt option is an error, not ignored.
    model_config = ConfigDict(extra="forbid", strict=True)


class InlineReference(_Strict):
    """A reference clip and its transcript sent with the request (TTS_INLINE_REFERENCE)."""

    audio: str = Field(
        min_length=1,
        description=f"The clip's file, base64 (any format POST /v1/audio/voices takes; 1-{MAX_REF_SECONDS:g} s).",
    )
    text: str = Field(min_length=1, max_length=MAX_REF_TEXT_CHARS, description="What the clip says.")


class SynthesisOptions(_Strict):
    """What every synthesis body carries besides its voice and text (`speaker_id` and `text`, fields or
    properties of each body); `synthesis.engine_request` maps a body onto the engine's request."""

    language: str = Field(
        "Auto",
        min_length=1,
        max_length=32,
        description="A language name ('English', any case), its ISO 639-1 code ('en', also 'en-US'), or 'Auto'.",
    )
    max_new_tokens: int | None = Field(
        None, ge=1, description="Cap on generated codec frames (12.5 per second); at most TTS_MAX_NEW_TOKENS."
    )
    min_new_tokens: int | None = Field(
        None,
        ge=0,
        description="Frames before end-of-speech is allowed (default 2); equal to max_new_tokens fixes the length.",
    )
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 selects greedy decoding.")
    top_k: int | None = Field(None, ge=1, le=4096)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Same seed + same request = same audio.")
    speed: float = Field(
        1.0, ge=0.25, le=4.0, description="Playback rate, pitch preserved (a time-stretch of the audio)."
    )
    voice_mode: VoiceMode = Field(
        "auto",
        description="How the voice is cloned: 'auto' (ICL when the voice has ICL data, else x-vector), 'icl' (a "
        "voice without ICL data is refused), 'xvector' (the x-vector alone, for any voice).",
    )
    reference: InlineReference | None = Field(
        None,
        description="Clone from this clip and transcript instead of a stored voice (an ICL voice enrolled on the "
        "fly and cached; needs TTS_INLINE_REFERENCE=true). The voice field then only names the request's voice.",
    )


class SynthesizeRequest(SynthesisOptions):
    """POST /synthesize: one whole audio file."""

    speaker_id: str = Field(min_length=1, max_length=64)
    text: str = Field(min_length=1)
    response_format: Literal["wav", "pcm", "mp3", "flac", "opus", "aac"] = Field(
        "wav", description="pcm is raw signed 16-bit little-endian mono at 24 kHz; aac is an ADTS stream."
    )
    # The seed's body has it: false (the default) is this route's whole file; true is answered as
    # /synthesize/stream answers (float32 LE unless response_format is pcm or wav).
    stream: bool = Field(False, description="true: stream as /synthesize/stream does (formats f32le, pcm, wav).")


class StreamRequest(SynthesisOptions):
    """POST /synthesize/stream: raw samples as they are decoded."""

    speaker_id: str = Field(min_length=1, max_length=64)
    text: str = Field(min_length=1)
    response_format: Literal["f32le", "pcm", "wav"] = Field(
        "f32le", description="f32le: float32 LE (default); pcm: int16 LE; wav: int16 with a streaming header."
    )


class VoiceRef(_Strict):
    id: str = Field(min_length=1, max_length=64)


class SpeechRequest(SynthesisOptions):
    """POST /v1/audio/speech (OpenAI-compatible); our sampling options are accepted as extensions."""

    model: str = Field(min_length=1, max_length=256, description="Accepted and reported; one model is served.")
    input: str = Field(min_length=1)
    voice: str | VoiceRef = Field(description="A speaker id (a voice profile in TTS_PROFILES_DIR).")
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = Field(None, max_length=4096)

    @field_validator("instructions")
    @classmethod
    def _instructions(cls, value: str | None) -> str | None:
        if value and value.strip():
            raise ValueError("not supported by Base (voice-clone) checkpoints; leave it empty")
        return value

    @property
    def speaker_id(self) -> str:
        return self.voice if isinstance(self.voice, str) else self.voice.id

    @property
    def text(self) -> str:
        return self.input


def allowed_fields(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)

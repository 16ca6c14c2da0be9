"""A synthesis body's own reference clip and transcript (`reference`, base64), enrolled on the fly as an ICL voice
when TTS_INLINE_REFERENCE is on, and kept by content hash so a clip sent again runs no encoder.

The clip gets what an upload gets (`qwen_tts.voices.enroll_clip`: format, channels, rate and duration from the header,
then silence and clipping), within TTS_VOICE_UPLOAD_MAX_SECONDS and an ICL reference's MAX_REF_SECONDS. Enrolment
runs one clip at a time (the upload route's lock), in a worker thread; the cache holds TTS_INLINE_REFERENCE_CACHE
voices, the least recently used dropped first. The body's `speaker_id` (`voice`) then only names the request's voice
in logs: no profile is looked up or written.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math

import anyio

from qwen_tts.icl_profile import MAX_REF_SECONDS, IclDataError, check_ref_text, make_reference
from qwen_tts.voices import enroll_clip

from .enrolment import enrolment_refusals
from .errors import InvalidField
from .runtime import Runtime, Voice
from .schemas import SynthesisOptions
from .settings import ServerSettings, upload_bytes_for

INLINE_REFERENCE_PATHS = ("/synthesize", "/synthesize/stream", "/v1/audio/speech")


def max_clip_seconds(settings: ServerSettings) -> float:
    return min(settings.voice_upload_max_seconds, MAX_REF_SECONDS)


def body_limit_bytes(settings: ServerSettings) -> int:
    """The body limit of the synthesis routes with inline references on: a JSON body plus the base64 of the largest
    clip the duration limit accepts."""
    return settings.max_body_bytes + 4 * math.ceil(upload_bytes_for(max_clip_seconds(settings)) / 3)


def _decode(audio: str) -> bytes:
    try:
        return base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidField("reference.audio: not valid base64", param="reference.audio") from None


async def inline_voice(runtime: Runtime, body: SynthesisOptions) -> Voice | None:
    """The voice of a body's inline reference (None without one): from the cache, or enrolled now. InvalidField
    naming the field for a refused reference, or where inline references are off."""
    ref = body.reference
    if ref is None:
        return None
    if not runtime.settings.inline_reference or runtime.voice_encoder is None:
        raise InvalidField(
            "reference: inline references are off on this server (an operator enables them with "
            "TTS_INLINE_REFERENCE=true); enrol the voice instead (POST /v1/audio/voices with ref_text)",
            param="reference",
            code="inline_reference_disabled",
        )
    try:
        text = check_ref_text(ref.text)
    except IclDataError as e:
        raise InvalidField(f"reference.text: {e}", param="reference.text") from None
    clip = _decode(ref.audio)
    if not clip:
        raise InvalidField("reference.audio: the clip is empty", param="reference.audio")
    key = hashlib.sha256(hashlib.sha256(clip).digest() + text.encode("utf-8")).hexdigest()
    cache = runtime.inline_voices
    voice = cache.get(key)
    if voice is not None:
        return voice
    async with runtime.enroll_lock:  # one clip through the encoders at a time, as uploads
        voice = cache.get(key)  # enrolled by a request that held the lock before this one
        if voice is None:
            voice = await anyio.to_thread.run_sync(_enroll, runtime, clip, text)
            cache.put(key, voice)
    return voice


def _enroll(runtime: Runtime, clip: bytes, text: str) -> Voice:
    encoder = runtime.voice_encoder
    assert encoder is not None  # inline_voice checked it
    with enrolment_refusals("reference.audio", "reference.text", "reference"):
        enrolled = enroll_clip(
            encoder,
            io.BytesIO(clip),
            "reference.audio",
            ref_text=text,
            reference_encoder=runtime.reference_encoder,
            max_seconds=max_clip_seconds(runtime.settings),
        )
    assert enrolled.ref_codes is not None  # a transcript was given: enroll_clip computed them
    x = enrolled.x_vector.to(runtime.voices.device)
    return x, make_reference(enrolled.ref_codes, enrolled.ref_text)

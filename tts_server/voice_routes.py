"""Voice management over HTTP, as vLLM-Omni's speech API and OpenAI clients shape it, and `GET /v1/models/{id}`.

- `GET /v1/audio/voices`: the voices now in the profiles directory (`/speakers` stays, with its own shape).
- `POST /v1/audio/voices`: multipart `name`, `audio_sample` (the reference clip), optional `ref_text` (its
  transcript). The clip goes through the extractor's checks (`qwen_tts.voices.enroll_clip`: format, channels, rate
  and duration from the header before any decoding, then decoded in blocks mixed to mono; silence, clipping) and
  the speaker encoder loaded at startup; with `ref_text` the voice is an ICL voice: the checkpoint's codec encoder
  (loaded on the first such upload) computes the clip's reference codes once, here, and the profile keeps them.
  The profile is written atomically into the directory and loaded, so the voice is usable by the next request. 201
  with the voice; 409 if the name is taken.
- `DELETE /v1/audio/voices/{name}`: removes the profile file.

Upload and delete answer 403 unless TTS_VOICE_UPLOAD is on; with TTS_API_KEYS set every route here needs a key
(ApiKeyMiddleware). The upload body is parsed in memory (it is already, whole, within TTS_VOICE_UPLOAD_MAX_BYTES:
BodyLimitMiddleware read it), so nothing a client sends is written anywhere but voice_profiles/.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import Field, File, create_form_parser

from qwen_tts.audio import ACCEPTED_FORMATS, MAX_CHANNELS, MAX_SAMPLE_RATE
from qwen_tts.icl_profile import MAX_REF_SECONDS, MAX_REF_TEXT_CHARS
from qwen_tts.voices import (
    InvalidProfileError,
    InvalidSpeakerIdError,
    SpeakerInfo,
    UnknownSpeakerError,
    VoiceProfile,
    enroll_clip,
    validate_speaker_id,
)

from .enrolment import enrolment_refusals
from .errors import BadRequest, Conflict, Forbidden, InvalidField, NotFound
from .middleware import BodyLimit
from .routes import openai_models, runtime_of
from .runtime import Runtime
from .settings import ServerSettings

router = APIRouter()

VOICES_PATH = "/v1/audio/voices"
VOICE_ROUTES = (VOICES_PATH,)
UPLOAD_FIELDS = ("name", "audio_sample", "ref_text")
_MAX_TEXT_FIELD_BYTES = 64 * 1024  # name and ref_text: far above what they may hold, so the check names the field

_UPLOAD_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["name", "audio_sample"],
                    "properties": {
                        "name": {"type": "string", "description": "The voice id: 1-64 of letters, digits, _ . -"},
                        "audio_sample": {
                            "type": "string",
                            "format": "binary",
                            "description": f"The reference clip: {ACCEPTED_FORMATS}; at most {MAX_CHANNELS} "
                            f"channels and {MAX_SAMPLE_RATE} Hz, told apart by content (the file name is only "
                            "quoted in errors); 5-30 s of one speaker is best",
                        },
                        "ref_text": {
                            "type": "string",
                            "description": "Transcript of the clip: makes an ICL voice (its reference codes are "
                            f"computed once, at upload; the clip at most {MAX_REF_SECONDS:g} s). Without it, an "
                            "x-vector voice",
                        },
                    },
                    "additionalProperties": False,
                }
            }
        },
    }
}


def upload_body_limit(settings: ServerSettings) -> BodyLimit:
    """The upload route's body limit and its 413: TTS_VOICE_UPLOAD_MAX_BYTES (by default derived from
    TTS_VOICE_UPLOAD_MAX_SECONDS, so a clip the duration limit accepts fits), named with where it comes from."""
    assert settings.voice_upload_max_bytes is not None  # set by the settings' validation
    return BodyLimit(settings.voice_upload_max_bytes, settings.upload_limit_reason(), param="audio_sample")


def voice_object(info: SpeakerInfo) -> dict[str, Any]:
    return {
        "id": info.speaker_id,
        "name": info.speaker_id,
        "object": "voice",
        "dim": info.dim,
        "model": info.model,
        "created_at": info.created_at,
        "source_sha256": info.source_sha256,
        "source_seconds": info.source_seconds,
        "ref_text": info.ref_text,
        "icl": info.icl,
        "ref_seconds": info.ref_seconds,
    }


def _require_management(runtime: Runtime) -> None:
    if not runtime.settings.voice_upload or runtime.voice_encoder is None:
        raise Forbidden(
            "voice upload and delete are disabled on this server (an operator enables them with TTS_VOICE_UPLOAD=true)",
            code="voice_management_disabled",
        )


@router.get(VOICES_PATH)
async def list_voices(request: Request) -> dict[str, Any]:
    """Voices now in the profiles directory: `voices` (the ids, as vLLM-Omni lists them) and `data` (details)."""
    runtime = runtime_of(request)
    found = await anyio.to_thread.run_sync(runtime.voices.list_speakers)
    return {
        "object": "list",
        "voices": [s.speaker_id for s in found],
        "data": [voice_object(s) for s in found],
        "upload_enabled": runtime.voice_encoder is not None,
    }


@dataclass
class _Upload:
    name: str
    audio: bytes
    filename: str
    ref_text: str


def _parse_upload(content_type: str, body: bytes, max_bytes: int) -> _Upload:
    """The multipart body, parsed in memory (no temp files): exactly the fields UPLOAD_FIELDS, each once."""
    fields: dict[str, list[bytes]] = {}
    files: dict[str, list[tuple[str, bytes]]] = {}

    def on_field(field: Field) -> None:
        name = field.field_name.decode("utf-8", "replace") if field.field_name else ""
        fields.setdefault(name, []).append(field.value or b"")

    def on_file(file: File) -> None:
        name = file.field_name.decode("utf-8", "replace") if file.field_name else ""
        file.file_object.seek(0)
        filename = file.file_name.decode("utf-8", "replace") if file.file_name else ""
        files.setdefault(name, []).append((filename, file.file_object.read()))

    config = {
        "MAX_BODY_SIZE": max_bytes,
        "MAX_MEMORY_FILE_SIZE": max_bytes + 1,  # never spill to a temp file
        "MAX_FIELD_SIZE": _MAX_TEXT_FIELD_BYTES,
        "MAX_FIELDS": 16,
    }
    try:
        parser = create_form_parser({"Content-Type": content_type.encode("latin-1")}, on_field, on_file, config)
        parser.write(body)
        parser.finalize()
    except (FormParserError, ValueError) as e:
        raise BadRequest(f"body is not valid multipart/form-data ({e})", code="invalid_multipart") from None

    unknown = sorted((set(fields) | set(files)) - set(UPLOAD_FIELDS))
    if unknown:
        raise InvalidField(
            f"{unknown[0]}: unknown field (allowed: {', '.join(UPLOAD_FIELDS)})", param=unknown[0], code="invalid_value"
        )
    for key in UPLOAD_FIELDS:
        if len(fields.get(key, [])) + len(files.get(key, [])) > 1:
            raise InvalidField(f"{key}: given more than once", param=key)
    if "audio_sample" in fields:
        raise InvalidField("audio_sample: must be a file part (curl: -F audio_sample=@clip.wav)", param="audio_sample")
    if "audio_sample" not in files:
        raise InvalidField("audio_sample: field required (the reference clip, as a file)", param="audio_sample")
    texts: dict[str, str] = {}
    for key in ("name", "ref_text"):
        if key in files:
            raise InvalidField(f"{key}: must be a text field, not a file", param=key)
        raw = fields.get(key, [b""])[0]
        try:
            texts[key] = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidField(f"{key}: not UTF-8 text", param=key) from None
    if not texts["name"]:
        raise InvalidField("name: field required (the new voice's id)", param="name")
    if len(texts["ref_text"]) > MAX_REF_TEXT_CHARS:
        raise InvalidField(f"ref_text: longer than {MAX_REF_TEXT_CHARS} characters", param="ref_text")
    filename, audio = files["audio_sample"][0]
    if not audio:
        raise InvalidField("audio_sample: the file is empty", param="audio_sample")
    return _Upload(name=texts["name"], audio=audio, filename=filename, ref_text=texts["ref_text"].strip())


def _model_label(runtime: Runtime) -> str:
    """What a profile records as its model, as the extractor writes it ('Qwen3-TTS-12Hz-1.7B-Base [1b7]')."""
    info = runtime.engine.model_info
    name, size = str(info.get("name", "")), str(info.get("size", "") or "")
    return f"{name} [{size}]" if size else name


@router.post(VOICES_PATH, status_code=201, openapi_extra=_UPLOAD_SCHEMA)
async def upload_voice(request: Request) -> JSONResponse:
    """Enroll a reference clip as a new voice (multipart: name, audio_sample, optional ref_text)."""
    runtime = runtime_of(request)
    _require_management(runtime)
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise BadRequest(
            "send multipart/form-data with the fields name, audio_sample (a file) and optionally ref_text",
            code="invalid_multipart",
        )
    body = await request.body()
    limit = runtime.settings.voice_upload_max_bytes
    upload = await anyio.to_thread.run_sync(_parse_upload, content_type, body, limit)
    try:
        validate_speaker_id(upload.name)
    except InvalidSpeakerIdError as e:
        raise InvalidField(f"name: {e}", param="name") from None

    encoder = runtime.voice_encoder
    assert encoder is not None  # _require_management
    max_seconds = runtime.settings.voice_upload_max_seconds
    async with runtime.enroll_lock:  # one clip through the encoder at a time; synthesis is not held up by it
        with enrolment_refusals(
            "audio_sample", "ref_text", "ref_text", "; upload without ref_text for an x-vector voice"
        ):
            enrolled = await anyio.to_thread.run_sync(
                lambda: enroll_clip(
                    encoder,
                    io.BytesIO(upload.audio),
                    "audio_sample",
                    ref_text=upload.ref_text,
                    reference_encoder=runtime.reference_encoder,
                    max_seconds=max_seconds,
                    filename=upload.filename or None,
                )
            )
        levels = enrolled.levels
        profile = VoiceProfile(
            x_vector=enrolled.x_vector,
            model=_model_label(runtime),
            source_sha256=hashlib.sha256(upload.audio).hexdigest(),
            source_seconds=levels.seconds,
            ref_text=enrolled.ref_text,
            ref_codes=enrolled.ref_codes,
        )
        try:
            info = await anyio.to_thread.run_sync(runtime.voices.add, upload.name, profile)
        except FileExistsError as e:
            raise Conflict(f"name: {e}", param="name", code="voice_exists") from None
        except UnknownSpeakerError:  # the name is a link that leaves the directory
            raise Conflict(f"name: {upload.name!r} cannot be used in this profiles directory", param="name") from None
    return JSONResponse({"success": True, "voice": voice_object(info), "warnings": levels.warnings}, status_code=201)


@router.delete(VOICES_PATH + "/{name}")
async def delete_voice(request: Request, name: str) -> dict[str, Any]:
    """Remove a voice's profile file; requests already running with it finish with it."""
    runtime = runtime_of(request)
    _require_management(runtime)
    try:
        await anyio.to_thread.run_sync(runtime.voices.delete, name)
    except InvalidSpeakerIdError as e:
        raise InvalidField(f"name: {e}", param="name") from None
    except UnknownSpeakerError:
        raise NotFound(f"voice {name!r} not found", param="name", code="voice_not_found") from None
    except InvalidProfileError as e:
        raise Conflict(f"name: {e.reason}", param="name") from None
    return {"success": True, "id": name, "message": f"voice {name!r} deleted"}


@router.get("/v1/models/{model_id:path}")
async def openai_model(request: Request, model_id: str) -> dict[str, Any]:
    """OpenAI `models.retrieve`: the one served model, under its served name."""
    (model,) = (await openai_models(request))["data"]
    if model_id != model["id"]:
        raise NotFound(f"model {model_id!r} is not served here (this server serves {model['id']!r})", param="model",
                       code="model_not_found")  # fmt: skip
    return model

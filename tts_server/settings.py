"""Server configuration: `TTS_*` variables, from the environment or a `.env` file, one typed pydantic-settings object.

The seed's variables keep their names and defaults (TTS_MODEL_PATH, TTS_STAGE_CONFIG, TTS_PROFILES_DIR,
TTS_DEVICE, TTS_HOST, TTS_PORT=8090, TTS_MAX_CONCURRENT=16, TTS_STAGE_INIT_TIMEOUT, TTS_TEMPERATURE,
TTS_TOP_K, TTS_MAX_NEW_TOKENS); the rest are the limits and switches of the hardened server.
`load_settings()` turns any bad value into one `SettingsError` line naming the variable (or the command-line flag,
tts_server/cli.py, that gave it). Precedence: flags, then the environment, then the `.env` file, then the defaults.

Engine defaults are not repeated here: they come from `EngineSettings` and `SynthesisRequest`, and
`ServerSettings.engine_settings()` is the one mapping from these variables to the engine's settings.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from qwen_tts.engine_api import EngineSettings, SynthesisRequest
from qwen_tts.voices import DEFAULT_PROFILES_DIR, MAX_CLIP_SECONDS, MIN_CLIP_SECONDS

ENV_PREFIX = "TTS_"
# Read from the working directory when present (load_settings' env_file names another, or None for none).
ENV_FILE = Path(".env")
_ENGINE = EngineSettings()  # the engine's defaults, read below
# Server setting -> EngineSettings field: the one mapping (engine_settings() and error messages both use it). A
# "backend_options." target is a key of EngineSettings.backend_options (an option of the vllm-omni backend's own).
BACKEND_OPTION = "backend_options."
ENGINE_FIELDS = {
    "model_path": "model_path",
    "backend": "backend",
    "demo_dir": "demo_dir",
    "stage_config": BACKEND_OPTION + "stage_config",
    "stage_init_timeout": BACKEND_OPTION + "stage_init_timeout",
    "vllm_speaker_transport": BACKEND_OPTION + "speaker_transport",
    "device": "device",
    "dtype": "dtype",
    "max_concurrent": "max_slots",
    "max_queue": "max_queue",
    "max_new_tokens": "max_frames",
    "first_chunk_frames": "first_chunk_frames",
    "chunk_frames": "chunk_frames",
    "chunk_growth": "chunk_growth",
    "admission_step_budget_ms": "admission_step_budget_ms",
    "batch_invariant_decode": "batch_invariant_decode",
    "decoder_fp16": "decoder_fp16",
    "fused_deterministic": "fused_deterministic",
    "fast_path": "fast_path",
}
# Variables of earlier versions that TTS_FAST_PATH replaced: set, they stop the server with a line that says so.
REPLACED_BY_FAST_PATH = ("TTS_CP_STACK_KERNEL", "TTS_TALKER_STACK_KERNEL", "TTS_SMALL_M_HEADS")
DEFAULT_CONNECTIONS_PER_CLIENT = 64
DEFAULT_UPLOAD_INFLIGHT_BYTES = 32 * 1024 * 1024
# The upload body limit, unless TTS_VOICE_UPLOAD_MAX_BYTES is set, follows TTS_VOICE_UPLOAD_MAX_SECONDS: a clip of
# that length as the largest file a recorder writes for it (48 kHz, stereo, 32-bit samples: 384,000 bytes a
# second, so 60 s of CD-quality stereo WAV, 10.6 MB, fits with room), plus headroom for the file's own headers and
# the multipart form around it.
UPLOAD_BYTES_PER_SECOND = 48_000 * 2 * 4
UPLOAD_HEADROOM_BYTES = 1024 * 1024
_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?|mps)$")


def upload_bytes_for(max_seconds: float) -> int:
    """The upload body limit that fits a clip of `max_seconds` in any format a recorder writes."""
    return math.ceil(max_seconds * UPLOAD_BYTES_PER_SECOND) + UPLOAD_HEADROOM_BYTES


class SettingsError(ValueError):
    """A configuration value is unusable; the message is one line naming the variable."""


def read_key_file(path: Path) -> list[str]:
    """The keys of a TTS_API_KEYS_FILE: one a line, blank lines and `#` comments skipped. ValueError (never echoing a
    key) where it cannot be read or a key is shorter than 8 characters."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise ValueError(f"cannot read the file ({reason})") from None
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if len(key) < 8:
            raise ValueError(f"line {number}: each API key must be at least 8 characters")
        keys.append(key)
    if not keys:
        raise ValueError("the file holds no key (an empty file would leave the server without authentication)")
    return keys


def _split_list(value: Any) -> Any:
    """Accept `a,b,c` as well as a JSON list, so shell users need no quoting gymnastics."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            import json

            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


class ServerSettings(BaseSettings):
    """Every knob of the server. Each field: what it controls and why it has its default."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", validate_default=True, env_file=ENV_FILE, env_file_encoding="utf-8"
    )
    _upload_bytes_derived: bool = PrivateAttr(False)  # TTS_VOICE_UPLOAD_MAX_BYTES came from the duration limit

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """pydantic-settings' own order (arguments, environment, .env file); of a .env file only the TTS_* lines
        are ours: it may hold other programs' variables too (a container's, a shell's). A TTS_* line that is no
        setting stays an error (extra="forbid"): a misspelt TTS_API_KEYS must not leave a server open."""
        if isinstance(dotenv_settings, DotEnvSettingsSource):
            prefix = ENV_PREFIX.lower()
            dotenv_settings.env_vars = {
                k: v for k, v in dotenv_settings.env_vars.items() if k.lower().startswith(prefix)
            }
        return init_settings, env_settings, dotenv_settings, file_secret_settings

    # --- model and engine --------------------------------------------------------------------
    # "demo" (the built-in tiny random checkpoint, written on first use), a checkpoint directory, or a hub id
    # found in the local Hugging Face cache. Default demo so the server runs offline out of the box.
    model_path: str = _ENGINE.model_path
    # vLLM-Omni deploy config (stage layout); read only by the vllm-omni backend.
    stage_config: Path = Path("stage_config_optimized.yaml")
    # vllm-omni backend: how the speaker vector reaches the talker. auto: the raw-tensor fast path when the
    # vllm-omni-myfi plugins are installed, else a float list (what stock vLLM-Omni takes).
    vllm_speaker_transport: Literal["auto", "tensor", "list"] = "auto"
    # native: our PyTorch engine; vllm-omni: the optional AsyncOmni pipeline; fake: sine tones, for HTTP tests.
    backend: Literal["native", "vllm-omni", "fake"] = _ENGINE.backend  # type: ignore[assignment]
    # auto picks cuda when available, else cpu.
    device: str = _ENGINE.device
    # None: float32 on CPU, bfloat16 on CUDA (the engine decides). No float16: the code predictor overflows in it.
    dtype: Literal["float32", "bfloat16"] | None = None
    # torch intra-op threads of the engine. None: OMP_NUM_THREADS if set, else one per usable core minus one, kept
    # for the event loop and audio encoding (more threads than cores oversubscribe: 4 concurrent requests on 2
    # cores ran 1.39x slower with torch's default than with one thread).
    torch_threads: int | None = Field(None, ge=1, le=1024)
    # Seconds allowed for loading and warming the engine before startup fails.
    stage_init_timeout: float = Field(600.0, gt=0)
    # Decode each request on its own, so its audio is bit-identical whatever runs beside it (default: batched decode,
    # identical codes and audio within 1 int16 LSB; see docs/security.md for the measured cost).
    batch_invariant_decode: bool = _ENGINE.batch_invariant_decode
    # On CUDA, Code2Wav's final conv stack in float16 (the audio about as close to the exact float32 decode, more
    # audio-s/s: docs/performance.md); false keeps it float32 with TF32. Ignored on CPU.
    decoder_fp16: bool = _ENGINE.decoder_fp16
    # The native engine's kernels on CUDA: default; one-stream (both stack kernels and the few-row heads: the fastest
    # lone stream, but a request's codes then match alone and beside one other stream, not beside more); eager (no
    # compiled or custom kernel and no CUDA graph: for debugging). Figures: docs/performance.md. Ignored on CPU.
    fast_path: Literal["default", "one-stream", "eager"] = _ENGINE.fast_path  # type: ignore[assignment]
    # On CUDA, the compiled blocks in inductor's deterministic mode: the same request and seed give the same codes
    # from a fresh process (a replica, a restart); off, inductor times its reduction configurations per process
    # (a little faster: docs/performance.md). Ignored on CPU.
    fused_deterministic: bool = _ENGINE.fused_deterministic
    # Streaming granularity: a small first chunk for fast first audio, then larger ones for throughput.
    first_chunk_frames: int = Field(_ENGINE.first_chunk_frames, ge=1, le=256)
    chunk_frames: int = Field(_ENGINE.chunk_frames, ge=1, le=256)
    # Each later chunk at most this many times the one before (3, 6, 12 frames by default): a stream that runs at
    # this many times real time stays ahead of playback while its chunks grow.
    chunk_growth: int = Field(_ENGINE.chunk_growth, ge=2, le=256)
    # Keep new requests queued while the running ones get a frame (80 ms of audio) less often than every this many
    # ms; 0: admit whenever a slot is free (see EngineSettings.admission_step_budget_ms).
    admission_step_budget_ms: float = Field(_ENGINE.admission_step_budget_ms, ge=0, le=60_000)

    # --- voices ---------------------------------------------------------------------------------
    # Directory of `<speaker_id>.safetensors` profiles; nothing outside it is ever read.
    profiles_dir: Path = DEFAULT_PROFILES_DIR
    # Where the demo checkpoint is written on first use (None: a per-user cache directory).
    demo_dir: Path | None = None
    # --- voice management over HTTP (tts_server/voice_routes.py) ---------------------------------
    # POST /v1/audio/voices (enroll an uploaded clip) and DELETE /v1/audio/voices/{name}. Off by default: whoever
    # may call them changes the voices every client uses. With TTS_API_KEYS set they need a key, like every route.
    # On, the checkpoint's speaker encoder is loaded at startup (never otherwise: synthesis does not need it).
    voice_upload: bool = False
    # Largest upload request in bytes (the whole multipart body). Unset: derived from TTS_VOICE_UPLOAD_MAX_SECONDS
    # (UPLOAD_BYTES_PER_SECOND a second plus UPLOAD_HEADROOM_BYTES: 24,088,576 for 60 s), so any clip the duration
    # limit accepts also fits the byte limit.
    voice_upload_max_bytes: int | None = Field(None, ge=64 * 1024, le=256 * 1024 * 1024)
    # Upload bytes being received, decoded and enrolled at once, over all clients (each upload holds its declared size
    # until it is answered); past it 429 with Retry-After. Enrolment runs one clip at a time anyway. Unset: 32 MiB, or
    # TTS_VOICE_UPLOAD_MAX_BYTES where that is larger.
    voice_upload_inflight_bytes: int | None = Field(None, ge=64 * 1024, le=4 * 1024 * 1024 * 1024)
    # Longest reference clip accepted, in seconds (the extractor's limit; 5-30 s of clean speech is best).
    voice_upload_max_seconds: float = Field(MAX_CLIP_SECONDS, ge=MIN_CLIP_SECONDS, le=600)
    # A synthesis body may carry its own reference clip and transcript (`reference`, base64), enrolled on the fly as
    # an ICL voice. Off by default: it runs the speaker and codec encoders on the request path (once per clip, then
    # cached) and takes bodies as large as a clip; on, the speaker encoder is loaded at startup. The clip gets the
    # upload checks, within TTS_VOICE_UPLOAD_MAX_SECONDS and an ICL reference's 30 s.
    inline_reference: bool = False
    # Inline references kept enrolled, by content hash (the least recently used is dropped past it).
    inline_reference_cache: int = Field(32, ge=1, le=4096)

    # --- sampling defaults (a request may override within the limits below) ----------------------
    temperature: float = Field(SynthesisRequest.temperature, ge=0.0, le=2.0)
    top_k: int = Field(SynthesisRequest.top_k, ge=1, le=4096)
    # Hard cap on generated codec frames per request (12.5 frames/s: 2048 frames = 164 s of audio).
    max_new_tokens: int = Field(_ENGINE.max_frames, ge=1, le=65536)

    # --- network ---------------------------------------------------------------------------------
    host: str = "0.0.0.0"
    port: int = Field(8090, ge=1, le=65535)
    # HTTP front-end processes. 0: one process serves HTTP and runs the engine. N >= 1: the engine runs in its own
    # process and N front-end processes share the port, reaching it over a local socket (tts_server/processes.py),
    # so the HTTP work (parsing, encoding, socket writes) does not share an interpreter with the engine's loop.
    api_processes: int = Field(0, ge=0, le=64)
    # Browser origins allowed by CORS; empty means no CORS headers at all (never a wildcard by default).
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Bearer keys; empty disables auth. /health, /ready and /metrics stay public.
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    # A file of more keys, one a line (blank lines and # comments skipped): keeps keys out of the environment and
    # the command line, where other users of the machine may read them. Its keys join TTS_API_KEYS'.
    api_keys_file: Path | None = None
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    # text: one human-readable line per record; json: one JSON object per line (time, level, logger, message,
    # request_id within a request) for log collectors. tts_server/logs.py.
    log_format: Literal["text", "json"] = "text"

    # --- admission and limits -------------------------------------------------------------------
    # Requests decoding at once in the engine (its batch slots).
    max_concurrent: int = Field(_ENGINE.max_slots, ge=1, le=4096)
    # Requests waiting behind the slots; beyond this the server answers 429 instead of queueing without bound.
    # Unset: the engine's default, or what a lower TTS_MAX_CONNECTIONS leaves room for.
    max_queue: int | None = Field(None, ge=0, le=100_000)
    # Open connections in all; at the cap the longest-idle one is closed, and only if all are busy a newcomer gets 503.
    max_connections: int = Field(1024, ge=1, le=1_000_000)
    # --- connection hygiene (enforced by tts_server/http_server.py, see docs/security.md) ------------
    # Open connections from one client address; past it 429. Keeps one client from taking the whole TTS_MAX_CONNECTIONS.
    # Unset: 64, or TTS_MAX_CONNECTIONS where that is lower.
    max_connections_per_client: int | None = Field(None, ge=1, le=1_000_000)
    # Seconds a connection has to deliver complete request headers (after opening, or after its last response).
    header_timeout: float = Field(10.0, gt=0, le=3600)
    # Seconds an idle kept-alive connection stays open between requests.
    keep_alive_timeout: float = Field(5.0, gt=0, le=3600)
    # Largest request header block in bytes; past it 431 (nginx and most proxies allow 8-16 KiB).
    max_header_bytes: int = Field(16384, ge=1024, le=1024 * 1024)
    # Seconds a client is told to wait (Retry-After) when refused for overload.
    retry_after: int = Field(1, ge=0, le=3600)
    # Longest text accepted (characters); OpenAI's speech API uses 4096.
    max_text_chars: int = Field(4096, ge=1, le=1_000_000)
    # Largest request body in bytes; 4096 characters of \\u-escaped JSON fit comfortably.
    max_body_bytes: int = Field(65536, ge=1024, le=64 * 1024 * 1024)
    # Seconds a client has to send its whole request body; then 408 (a trickling client cannot hold a slot).
    body_timeout: float = Field(30.0, gt=0)
    # Seconds a request may take end to end (queue + synthesis); then 504 and its engine work is cancelled.
    request_timeout: float = Field(300.0, gt=0)
    # Seconds SIGTERM waits for in-flight requests before cancelling them.
    drain_timeout: float = Field(30.0, ge=0)
    # --- the WebSocket speech session, /v1/audio/speech/stream (tts_server/realtime.py, docs/api.md) ----------
    # Sessions open at once over all clients, and from one client address; past them the handshake gets 503 / 429.
    # (An upgraded connection leaves TTS_MAX_CONNECTIONS' accounting: these caps bound WebSockets instead.)
    ws_max_sessions: int = Field(256, ge=1, le=100_000)
    ws_max_sessions_per_client: int = Field(16, ge=1, le=100_000)
    # Largest client message (a JSON text frame) in bytes: over it, an error event; over 4 times it, the connection is
    # closed by the protocol layer (1009) before the message is buffered.
    ws_max_message_bytes: int = Field(16384, ge=256, le=16 * 1024 * 1024)
    # Longest text fragment (a `text` message, or the text of `start`), in characters. An utterance's whole text is
    # bounded by TTS_MAX_TEXT_CHARS, as an HTTP request's is.
    ws_max_fragment_chars: int = Field(1024, ge=1, le=1_000_000)
    # Text and messages a session may send per second (an LLM streams about 4 characters a token); each rate may
    # be exceeded for a burst of 2 seconds' worth. A fragment over the rate is refused with an error event.
    ws_text_chars_per_s: float = Field(1000.0, gt=0, le=1_000_000)
    ws_messages_per_s: float = Field(200.0, gt=0, le=1_000_000)
    # Utterances one connection may start; past it, an error event and the connection is closed.
    ws_max_utterances: int = Field(1000, ge=1, le=10_000_000)
    # Seconds a session may sit with no utterance and no message before it is closed.
    ws_idle_timeout: float = Field(60.0, gt=0, le=86_400)
    # Seconds an utterance whose text has not ended may wait for its next fragment: it holds a capacity slot (and,
    # once its first text has come, an engine row), so past this it is cancelled with an error event.
    ws_text_timeout: float = Field(10.0, gt=0, le=3600)
    # Seconds one message to the client may take to leave (a client must read its audio as it comes, buffering for
    # playback): past it the client is taken to have stopped reading and the connection is cut.
    ws_send_timeout: float = Field(10.0, gt=0, le=3600)
    # --- engine faults (tts_server/recovery.py) -------------------------------------------------------------
    # Seconds between an engine failure and its in-process restart (/ready is 503 meanwhile; no hot crash loop).
    engine_restart_delay: float = Field(1.0, ge=0, le=600)
    # In-process restarts allowed within an hour; past that the server exits 3 for its process supervisor.
    engine_max_restarts: int = Field(5, ge=0, le=1000)
    # Tests only: a file whose content (loop, oom, cuda) makes the engine loop raise that fault. Never set in production.
    fault_file: Path | None = None
    # Name reported by /v1/models; any `model` value is accepted on /v1/audio/speech.
    served_model_name: str = Field("qwen3-tts", min_length=1, max_length=128)

    @field_validator("cors_origins", "api_keys", mode="before")
    @classmethod
    def _lists(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        value = value.strip().lower()
        if not _DEVICE_PATTERN.fullmatch(value):
            raise ValueError("must be auto, cpu, cuda, cuda:N or mps")
        return value

    @field_validator("model_path", "host")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        value = value.strip()
        if not value:
            raise ValueError("must not be empty")
        return value

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        for key in value:
            if len(key.get_secret_value()) < 8:
                raise ValueError("each API key must be at least 8 characters")
        return value

    @field_validator("api_keys_file")
    @classmethod
    def _keys_file(cls, value: Path | None) -> Path | None:
        if value is not None:
            read_key_file(value)  # unreadable, or a key too short: the error names this setting
        return value

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        for origin in value:
            if origin == "*":
                raise ValueError("'*' is not allowed; list the origins explicitly")
            if not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(f"{origin!r} is not an origin like https://example.com")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ServerSettings:
        if self.api_keys_file is not None:
            self.api_keys = [*self.api_keys, *(SecretStr(k) for k in read_key_file(self.api_keys_file))]
        if self.first_chunk_frames > self.chunk_frames:
            raise ValueError("TTS_FIRST_CHUNK_FRAMES must not exceed TTS_CHUNK_FRAMES")
        if self.max_queue is None:
            self.max_queue = max(0, min(_ENGINE.max_queue, self.max_connections - self.max_concurrent - 1))
        if self.max_connections <= self.max_concurrent + self.max_queue:
            raise ValueError(
                f"TTS_MAX_CONNECTIONS ({self.max_connections}) must exceed TTS_MAX_CONCURRENT + TTS_MAX_QUEUE "
                f"({self.max_concurrent} + {self.max_queue}): every request admitted or queued holds a connection"
            )
        if self.max_connections_per_client is None:
            self.max_connections_per_client = min(DEFAULT_CONNECTIONS_PER_CLIENT, self.max_connections)
        if self.max_connections_per_client > self.max_connections:
            raise ValueError("TTS_MAX_CONNECTIONS_PER_CLIENT must not exceed TTS_MAX_CONNECTIONS")
        if self.voice_upload_max_bytes is None:
            self._upload_bytes_derived = True
            self.voice_upload_max_bytes = upload_bytes_for(self.voice_upload_max_seconds)
        if self.voice_upload_inflight_bytes is None:
            self.voice_upload_inflight_bytes = max(DEFAULT_UPLOAD_INFLIGHT_BYTES, self.voice_upload_max_bytes)
        if self.voice_upload_inflight_bytes < self.voice_upload_max_bytes:
            raise ValueError(
                "TTS_VOICE_UPLOAD_INFLIGHT_BYTES must be at least TTS_VOICE_UPLOAD_MAX_BYTES (else no upload of the "
                "largest size could ever be taken)"
            )
        return self

    def upload_limit_reason(self) -> str:
        """Where the upload byte limit comes from, for the 413 that names it."""
        seconds = f"TTS_VOICE_UPLOAD_MAX_SECONDS={self.voice_upload_max_seconds:g}"
        if not self._upload_bytes_derived:
            return f"TTS_VOICE_UPLOAD_MAX_BYTES; clips are also limited to {seconds} s"
        return (
            f"TTS_VOICE_UPLOAD_MAX_BYTES unset: derived from {seconds}, that many seconds of 48 kHz stereo 32-bit "
            f"audio plus {UPLOAD_HEADROOM_BYTES // 1024} KiB"
        )

    def public_dict(self) -> dict[str, Any]:
        """The settings for the startup log, with secrets reduced to a count."""
        d = self.model_dump(mode="json")
        d["api_keys"] = len(self.api_keys)  # those of TTS_API_KEYS_FILE included
        return d

    def engine_settings(self) -> EngineSettings:
        """What the engine is built from: the one mapping from TTS_* variables to `EngineSettings`."""
        fields: dict[str, Any] = {"backend_options": {}}
        for name, engine in ENGINE_FIELDS.items():
            if engine.startswith(BACKEND_OPTION):
                fields["backend_options"][engine.removeprefix(BACKEND_OPTION)] = getattr(self, name)
            else:
                fields[engine] = getattr(self, name)
        return EngineSettings(**fields)

    def describe_engine_setting(self, engine_field: str) -> str:
        """`TTS_<NAME>='value'` for the variable behind an EngineSettings field (for one-line startup errors)."""
        for name, engine in ENGINE_FIELDS.items():
            if engine == engine_field:
                return f"{ENV_PREFIX}{name.upper()}={str(getattr(self, name))!r}"
        return f"engine setting {engine_field}"


def _describe(err: dict[str, Any], env_file: Path | None, flags: Mapping[str, str], given: Mapping[str, Any]) -> str:
    """One error as the operator wrote it: the flag, the variable, or the variable in the .env file, with its value
    (never a key's)."""
    loc = [str(p) for p in err.get("loc", ()) if not isinstance(p, int)]
    field = loc[0] if loc else ""
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = "no such setting"
    if not field:
        return msg
    if field in flags:  # as typed: --port 0
        raw = given.get(field)
        return f"{flags[field]}: {msg}" if raw is None else f"{flags[field]} {shlex.quote(str(raw))}: {msg}"
    if field in given:
        name, raw, where = ENV_PREFIX + field.upper(), given[field], ""
    else:
        # A .env line that is no setting keeps its whole name (TTS_TYPO) as its location.
        name, where = field.upper() if field.upper().startswith(ENV_PREFIX) else ENV_PREFIX + field.upper(), ""
        raw = os.environ.get(name)
        if raw is None and env_file is not None:
            raw = _dotenv_value(env_file, name)
            where = f" (in {env_file})" if raw is not None else ""
    if field == "api_keys" or err.get("type") == "extra_forbidden" or raw is None:  # keys, or maybe one misspelt
        return f"{name}{where}: {msg}"
    raw = str(raw)
    shown = raw if len(raw) <= 60 else raw[:57] + "..."
    return f"{name}={shown!r}{where}: {msg}"


def _dotenv_value(env_file: Path, name: str) -> str | None:
    """`name`'s value in the .env file, as pydantic-settings reads it (python-dotenv; names are case-insensitive)."""
    from dotenv import dotenv_values

    try:
        values = dotenv_values(env_file, encoding="utf-8")
    except OSError:
        return None
    return next((v for k, v in values.items() if k.upper() == name and v is not None), None)


def load_settings(
    *, env_file: Path | None = ENV_FILE, flags: Mapping[str, str] | None = None, **overrides: Any
) -> ServerSettings:
    """Read the environment and `env_file` (overrides win); raise SettingsError with one line per the first bad
    value. `env_file`: the .env file (ENV_FILE, read where it exists; None: none). `flags`: for a field in
    `overrides` that came from the command line, the flag that gave it, for the error line."""
    if replaced := [name for name in REPLACED_BY_FAST_PATH if name in os.environ]:
        raise SettingsError(
            f"invalid configuration: {', '.join(replaced)}: replaced by TTS_FAST_PATH (default, one-stream: both "
            "stack kernels and the few-row heads, eager); unset it"
        )
    try:
        return ServerSettings(_env_file=env_file, **overrides)  # type: ignore[call-arg]
    except ValidationError as e:
        errors = e.errors()
        first = _describe(errors[0], env_file, flags or {}, overrides)
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise SettingsError(f"invalid configuration: {first}{more}") from None
    except ValueError as e:  # a JSON list that does not parse, raised before validation
        raise SettingsError(f"invalid configuration: {e}") from None


def unknown_env_vars(environ: dict[str, str] | None = None) -> list[str]:
    """TTS_* variables that match no setting: usually typos that would otherwise be silently ignored."""
    environ = os.environ if environ is None else environ
    known = {ENV_PREFIX + name.upper() for name in ServerSettings.model_fields}
    return sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known)

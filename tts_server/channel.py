"""The local channel between API front-end processes and the engine process (TTS_API_PROCESSES, processes.py).

One Unix domain socket connection per front-end, asyncio streams on both ends, and a compact binary framing: a
frame is a 9-byte header (payload length, message kind, request number) and its payload. PCM travels as raw float32
bytes, x-vectors and ICL codes as raw tensor bytes; the few small control messages are JSON. Standard library only.

Front-end -> engine: SUBMIT (a request), TEXT (a streamed-text fragment or its end), CANCEL, CREDIT (chunks the
front-end's consumer has taken). Engine -> front-end: FACTS (at connect: what `Engine` says before start), STATE
(readiness and load, on change), CHUNK, FINISH (the request's stats), REFUSED (submission refused: queue full, not
ready, or an option the engine rejects).

Flow control is per request: the engine process sends at most `credit_window` chunks a front-end has not yet handed
to its consumer, so a client that stops reading holds at most that many chunks in the front-end, and the engine
process stops forwarding its audio until the client's deadline cuts it.
"""

from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import fields
from enum import IntEnum
from typing import Any

import numpy as np
import torch

from qwen_tts.engine_api import FinishReason, RequestStats, SynthesisRequest
from qwen_tts.icl import NUM_CODEBOOKS, IclReference

HEADER = struct.Struct("<IBI")  # payload bytes, Kind, request number (0: the connection itself)
CHUNK_HEADER = struct.Struct("<IId")  # frames so far, frame budget, started_at (the engine's monotonic clock)
JSON_LENGTH = struct.Struct("<I")
MAX_PAYLOAD = 256 * 1024 * 1024  # a frame larger than this is a broken peer, not a message
CREDIT_WINDOW = 8  # chunks of one request in flight to a front-end before the engine process waits for credit

# SynthesisRequest fields sent as JSON; xvector, icl and text_stream travel in their own form, return_codes not at all.
_SCALAR_FIELDS = tuple(
    f.name for f in fields(SynthesisRequest) if f.name not in ("xvector", "icl", "text_stream", "return_codes")
)
# RequestStats fields the engine's FINISH carries (times are CLOCK_MONOTONIC, the same in every process of the host).
_STATS_FIELDS = ("started_at", "first_audio_at", "finished_at", "frames", "samples", "frame_budget")


class Kind(IntEnum):
    SUBMIT = 1
    TEXT = 2
    CANCEL = 3
    CREDIT = 4
    FACTS = 10
    STATE = 11
    CHUNK = 12
    FINISH = 13
    REFUSED = 14


class ChannelClosed(ConnectionError):
    """The peer closed the connection (or sent something that is not a frame)."""


def frame(kind: Kind, number: int, *parts: bytes) -> bytes:
    size = sum(len(p) for p in parts)
    return b"".join((HEADER.pack(size, kind, number), *parts))


def json_frame(kind: Kind, number: int, body: dict[str, Any]) -> bytes:
    return frame(kind, number, json.dumps(body, default=str).encode())


async def read_frame(reader: asyncio.StreamReader) -> tuple[Kind, int, bytes]:
    """The next frame; ChannelClosed at the end of the stream or on a malformed header."""
    try:
        header = await reader.readexactly(HEADER.size)
        size, kind, number = HEADER.unpack(header)
        if size > MAX_PAYLOAD:
            raise ChannelClosed(f"frame of {size} bytes")
        payload = await reader.readexactly(size) if size else b""
        return Kind(kind), number, payload
    except (asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
        raise ChannelClosed(str(e) or "connection closed") from None


class FrameWriter:
    """Frames written in one turn of the event loop leave together, in one write: at hundreds of streams a turn
    carries many requests' chunks (and credits), and each separate write would be a system call."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if self.writer.is_closing():
            raise ChannelClosed("connection closed")
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        if self._pending and not self.writer.is_closing():
            self.writer.write(b"".join(self._pending))
        self._pending.clear()

    async def drain(self) -> None:
        """Wait while the socket's buffer is over its high-water mark (the peer is not reading)."""
        try:
            await self.writer.drain()
        except ConnectionError as e:
            raise ChannelClosed(str(e)) from None


# --- requests --------------------------------------------------------------------------------------------------------
def encode_request(request: SynthesisRequest) -> bytes:
    """SUBMIT's payload: JSON (the scalar fields, sizes, the ICL transcript and key), then the x-vector as float32 and
    the ICL codes as int64."""
    head: dict[str, Any] = {name: getattr(request, name) for name in _SCALAR_FIELDS}
    xvector = request.xvector.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    head["xvector_bytes"] = len(xvector)
    head["text_stream"] = request.text_stream is not None
    codes = b""
    if request.icl is not None:
        codes = request.icl.codes.to("cpu").contiguous().numpy().tobytes()
        head["icl"] = {"text": request.icl.text, "key": request.icl.key, "frames": request.icl.frames}
    body = json.dumps(head).encode()
    return b"".join((JSON_LENGTH.pack(len(body)), body, xvector, codes))


def decode_request(payload: bytes) -> tuple[SynthesisRequest, bool]:
    """The request of a SUBMIT payload (its x-vector on the CPU) and whether it comes with a text stream."""
    (n,) = JSON_LENGTH.unpack_from(payload)
    head = json.loads(payload[JSON_LENGTH.size : JSON_LENGTH.size + n])
    at = JSON_LENGTH.size + n
    x_end = at + head["xvector_bytes"]
    xvector = torch.from_numpy(np.frombuffer(payload[at:x_end], np.float32).copy())
    icl = None
    if "icl" in head:
        codes = np.frombuffer(payload[x_end:], np.int64).copy().reshape(head["icl"]["frames"], NUM_CODEBOOKS)
        icl = IclReference(codes=torch.from_numpy(codes), text=head["icl"]["text"], key=head["icl"]["key"])
    request = SynthesisRequest(xvector=xvector, icl=icl, **{name: head[name] for name in _SCALAR_FIELDS})
    return request, bool(head["text_stream"])


# --- audio and stats -------------------------------------------------------------------------------------------------
def chunk_frame(number: int, chunk: np.ndarray, stats: RequestStats) -> bytes:
    head = CHUNK_HEADER.pack(stats.frames, stats.frame_budget, stats.started_at or 0.0)
    return frame(Kind.CHUNK, number, head, np.ascontiguousarray(chunk, np.float32).tobytes())


def read_chunk(payload: bytes, stats: RequestStats) -> np.ndarray:
    """The PCM of a CHUNK payload; its counts go onto `stats` (the front-end's copy)."""
    frames, budget, started_at = CHUNK_HEADER.unpack_from(payload)
    stats.frames, stats.frame_budget = frames, budget
    if started_at and stats.started_at is None:
        stats.started_at = started_at
    return np.frombuffer(payload, np.float32, offset=CHUNK_HEADER.size)


def stats_body(stats: RequestStats) -> dict[str, Any]:
    body = {name: getattr(stats, name) for name in _STATS_FIELDS}
    body["finish_reason"] = stats.finish_reason.value if stats.finish_reason else None
    body["error"] = stats.error
    return body


def apply_stats(body: dict[str, Any], stats: RequestStats) -> tuple[FinishReason, str | None]:
    """A FINISH body onto the front-end's stats (its own first_audio_at, the arrival at the front-end, is kept)."""
    for name in _STATS_FIELDS:
        if name == "first_audio_at" and stats.first_audio_at is not None:
            continue
        if body.get(name) is not None:
            setattr(stats, name, body[name])
    return FinishReason(body.get("finish_reason") or FinishReason.ERROR.value), body.get("error")

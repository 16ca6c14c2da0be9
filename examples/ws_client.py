"""Stream text into the server's WebSocket speech session as an LLM would (word pieces at a given rate) and write the
audio that streams back to a WAV file; optionally barge in (cancel) part way. Protocol: docs/api.md ("WebSocket").

    python examples/ws_client.py --url ws://127.0.0.1:8090/v1/audio/speech/stream --voice demo \
        --text "Hello! This sentence arrives token by token." --rate 30 --out hello.wav
    python examples/ws_client.py --voice demo --rate 10 --barge-in 1.5 --out cut.wav   # cancel after 1.5 s

Needs only `websockets` (installed with uvicorn[standard]). The key, if the server has keys, comes from --key or
TTS_API_KEY and is sent as an Authorization header.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
import wave
from dataclasses import dataclass, field

from websockets.asyncio.client import connect

DEFAULT_TEXT = (
    "Hello! This is a voice agent speaking while its language model is still writing the rest of the sentence. "
    "Each word piece is sent as it is generated, and the audio comes back as it is synthesized."
)


def word_pieces(text: str) -> list[str]:
    """`text` cut as an LLM's tokenizer roughly would: a leading space with each word, long words in pieces of at most
    four characters, punctuation on its own."""
    pieces = []
    for word in re.findall(r"\s*[\w']+|\s*[^\w\s]+|\s+", text):
        while len(word) > 5:
            pieces.append(word[:4])
            word = word[4:]
        pieces.append(word)
    return pieces


@dataclass
class Utterance:
    """What came back for one utterance, with client-side times (time.perf_counter)."""

    first_text_at: float = 0.0
    text_ended_at: float = 0.0  # when end (or cancel) was sent
    arrivals: list[tuple[float, float]] = field(default_factory=list)  # (arrival time, audio seconds) per frame
    pcm: bytearray = field(default_factory=bytearray)
    done: dict | None = None
    errors: list[dict] = field(default_factory=list)

    @property
    def time_to_first_audio(self) -> float | None:
        return self.arrivals[0][0] - self.first_text_at if self.arrivals else None


async def session_event(ws) -> dict:
    """The server's `session` event (its sample rate and limits), or an error's message as RuntimeError."""
    event = json.loads(await ws.recv())
    if event.get("type") != "session":
        raise RuntimeError(f"no session: {event}")
    return event


async def speak(
    ws,
    voice: str,
    pieces: list[str],
    rate: float,
    *,
    language: str = "Auto",
    barge_in: float | None = None,
    options: dict | None = None,
) -> Utterance:
    """One utterance in pcm: `pieces` sent at `rate` a second, then end (or cancel after `barge_in` s); the audio."""
    out = Utterance()
    await ws.send(json.dumps({"type": "start", "voice": voice, "language": language, "response_format": "pcm",
                              **(options or {})}))  # fmt: skip
    started = json.loads(await ws.recv())
    if started.get("type") != "started":
        raise RuntimeError(f"not started: {started}")
    rate_hz = 24000

    async def send_text() -> None:
        t0 = out.first_text_at = time.perf_counter()
        for i, piece in enumerate(pieces):
            if barge_in is not None and time.perf_counter() - t0 >= barge_in:
                break
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            await ws.send(json.dumps({"type": "text", "text": piece}))
        if barge_in is not None:
            await asyncio.sleep(max(0.0, t0 + barge_in - time.perf_counter()))
        out.text_ended_at = time.perf_counter()
        await ws.send(json.dumps({"type": "cancel" if barge_in is not None else "end"}))

    sender = asyncio.ensure_future(send_text())
    try:
        expect_audio = False
        while out.done is None:
            message = await ws.recv()
            if isinstance(message, bytes):
                if expect_audio:
                    out.pcm += message
                    out.arrivals.append((time.perf_counter(), len(message) / 2 / rate_hz))
                expect_audio = False
                continue
            event = json.loads(message)
            kind = event.get("type")
            if kind == "audio":
                expect_audio = event["utterance_id"] == started["utterance_id"]
            elif kind == "error":
                out.errors.append(event)
            elif kind == "done" and event["utterance_id"] == started["utterance_id"]:
                out.done = event
        await sender
    finally:
        sender.cancel()
    return out


def write_wav(path: str, pcm: bytes, rate: int = 24000) -> None:
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)


async def main_async(a: argparse.Namespace) -> int:
    key = a.key or os.environ.get("TTS_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with connect(a.url, additional_headers=headers, max_size=2**24) as ws:
        session = await session_event(ws)
        pieces = word_pieces(a.text)
        out = await speak(ws, a.voice, pieces, a.rate, language=a.language, barge_in=a.barge_in)
        await ws.send(json.dumps({"type": "close"}))
    write_wav(a.out, bytes(out.pcm), session["sample_rate"])
    for error in out.errors:
        print("error:", error["error"]["message"], file=sys.stderr)
    ttfa = out.time_to_first_audio
    done = out.done or {}
    print(f"{len(pieces)} pieces at {a.rate:g}/s; first audio {ttfa * 1000:.0f} ms after the first piece; "
          f"{done.get('audio_seconds', 0):.2f} s of audio ({done.get('finish_reason')}) -> {a.out}"
          if ttfa is not None else f"no audio ({done.get('finish_reason')})")  # fmt: skip
    return 0 if out.done is not None and not out.errors else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="ws://127.0.0.1:8090/v1/audio/speech/stream")
    p.add_argument("--voice", default="demo", help="a speaker id (GET /v1/audio/voices)")
    p.add_argument("--language", default="Auto")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--rate", type=float, default=30.0, help="word pieces sent a second (an LLM's token rate)")
    p.add_argument("--barge-in", type=float, default=None, metavar="S", help="cancel the utterance after S seconds")
    p.add_argument("--key", default=None, help="API key (default: $TTS_API_KEY)")
    p.add_argument("--out", default="ws_client.wav", help="the WAV file to write")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main_async(parse_args())))

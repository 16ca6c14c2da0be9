"""Test clips in the containers libsndfile cannot write (MP4/M4A, ADTS, WebM), encoded by FFmpeg through PyAV, as a
phone's voice memo or a browser's MediaRecorder would hand them over."""

from __future__ import annotations

import io

import av
import numpy as np

# muxer and encoder per file kind; Opus runs at 48 kHz whatever the input.
KINDS = {
    "m4a": ("ipod", "aac"),
    "alac.m4a": ("ipod", "alac"),
    "aac": ("adts", "aac"),
    "webm": ("webm", "libopus"),
    "ac3.mp4": ("mp4", "ac3"),
}


class _Unseekable(io.RawIOBase):
    """Where a live recorder writes: the muxer cannot go back, so a WebM gets no duration (as MediaRecorder's)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, b) -> int:  # type: ignore[override]
        self.data += bytes(b)
        return len(b)


def ffmpeg_clip(x: np.ndarray, sr: int, kind: str = "m4a", *, live: bool = False) -> bytes:
    """(N,) or (N, C) float32 samples at `sr` encoded as `kind` (a key of KINDS), in memory; `live`: written as a
    recorder streams it, without seeking back (no duration in a WebM's header)."""
    muxer, codec = KINDS[kind]
    planes = np.ascontiguousarray((x[:, None] if x.ndim == 1 else x).T, dtype=np.float32)
    layout = "mono" if planes.shape[0] == 1 else "stereo"
    buf = _Unseekable() if live else io.BytesIO()
    with av.open(buf, "w", format=muxer) as container:
        stream = container.add_stream(codec, rate=48000 if codec == "libopus" else sr, layout=layout)
        frame = av.AudioFrame.from_ndarray(planes, format="fltp", layout=layout)
        frame.sample_rate = sr
        convert = av.AudioResampler(
            format=stream.codec_context.format, layout=layout, rate=stream.codec_context.sample_rate
        )
        for piece in [*convert.resample(frame), *convert.resample(None)]:
            for packet in stream.encode(piece):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return bytes(buf.data) if isinstance(buf, _Unseekable) else buf.getvalue()

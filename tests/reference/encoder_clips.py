"""The clips of the encoder parity fixture, made the same way in the reference venv and in ours (numpy only).

Each clip is a deterministic voiced-sounding signal (harmonics of a gliding f0 under a syllable envelope, plus
noise from the legacy RandomState, whose stream numpy keeps stable), stereo clips with a second channel that
differs from the first, so the channel mean matters. Short clips are under a second and not a whole number of
1920-sample frames at 24 kHz; long ones last seconds, one of them past the encoder transformer's 250-step sliding
window (ten seconds), which the reference does not apply.
"""

from __future__ import annotations

import numpy as np

# (name, sample rate, channels, samples)
CLIPS: list[tuple[str, int, int, int]] = [
    ("24k-mono-short", 24000, 1, 12_717),
    ("24k-mono-whole-frames", 24000, 1, 3 * 1920),
    ("24k-stereo-long", 24000, 2, 96_123),
    ("24k-mono-over-window", 24000, 1, 252_345),
    ("16k-mono-short", 16000, 1, 9_871),
    ("16k-stereo-long", 16000, 2, 67_891),
    ("44k-stereo-short", 44100, 2, 38_519),
    ("44k-mono-long", 44100, 1, 145_529),
]


def make_clip(name: str, sample_rate: int, channels: int, samples: int) -> np.ndarray:
    """(samples,) float32 for mono, (samples, channels) float32 for stereo; peak 0.6."""
    seed = sum(name.encode()) * 7919 + sample_rate
    rng = np.random.RandomState(seed)
    t = np.arange(samples, dtype=np.float64) / sample_rate
    f0 = rng.uniform(100.0, 220.0) * (1.0 + 0.3 * t / max(t[-1], 1e-9)) * (1 + 0.04 * np.sin(2 * np.pi * 5.5 * t))
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(2.0, 4.0) * t) ** 2
    out = []
    for c in range(channels):
        harmonics = sum(np.sin(k * phase + c * 0.7 * k) / k**1.2 for k in range(1, 10))
        out.append(harmonics * envelope * (1.0 - 0.3 * c) + 0.08 * rng.standard_normal(samples))
    wav = np.stack(out, axis=1) if channels > 1 else out[0]
    return (0.6 * wav / np.abs(wav).max()).astype(np.float32)


def fingerprint(wav: np.ndarray) -> np.ndarray:
    """A few numbers that tell whether two venvs made the same clip: the first samples and the energy."""
    flat = wav.reshape(-1).astype(np.float64)
    return np.concatenate([flat[:16], [np.square(flat).sum(), flat.sum()]])

"""Model path resolution ('demo', a checkpoint directory, or a hub id in the local cache) and the demo voice.

`demo` is the built-in tiny random checkpoint (`qwen_tts.checkpoint.write_random_checkpoint`), written once
into a cache directory: built in a temporary sibling directory and renamed into place, so two processes
starting together never see a half-written checkpoint. Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from .profiles import ProfileError, VoiceProfile, load_profile, save_profile

log = logging.getLogger("qwen_tts.demo")

DEMO = "demo"
DEMO_SEED = 0
DEMO_VOICE_ID = "demo"
DEMO_DIR_ENV = "TTS_DEMO_DIR"
_STAMP = "demo.json"  # records which writer produced the cached checkpoint
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


class DemoError(ValueError):
    """A model path cannot be resolved; the message says what to do."""


def default_demo_dir() -> Path:
    env = os.environ.get(DEMO_DIR_ENV)
    if env:
        return Path(env).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "qwen3-tts-server" / "demo-tiny"


def _writer_stamp() -> dict[str, str]:
    """Identifies the checkpoint writer's code, so a cached demo from an older writer is rebuilt."""
    from . import checkpoint

    source = Path(checkpoint.__file__).read_bytes()
    return {"size": "tiny", "seed": str(DEMO_SEED), "writer_sha256": hashlib.sha256(source).hexdigest()}


def _is_current(path: Path, stamp: dict[str, str]) -> bool:
    try:
        return json.loads((path / _STAMP).read_text()) == stamp and (path / "config.json").is_file()
    except (OSError, ValueError):
        return False


def ensure_demo_checkpoint(path: str | Path | None = None) -> Path:
    """The tiny demo checkpoint directory, written on first use (atomically, safe against racing writers)."""
    from .checkpoint import write_random_checkpoint

    final = Path(path).expanduser() if path is not None else default_demo_dir()
    stamp = _writer_stamp()
    if _is_current(final, stamp):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        log.info("writing the tiny demo checkpoint to %s", final)
        write_random_checkpoint(tmp, size="tiny", seed=DEMO_SEED)
        (tmp / _STAMP).write_text(json.dumps(stamp))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is a normal directory
        if final.exists():
            if _is_current(final, stamp):  # another process won the race
                return final
            # A stale demo from an older writer: move it aside first (rename is atomic, rmtree is not).
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
            os.replace(final, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_current(final, stamp):  # lost a race to a writer that left something else
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _hub_cache_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]).expanduser())
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]).expanduser() / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def find_in_hub_cache(repo_id: str) -> Path | None:
    """The local snapshot of `repo_id` (refs/main first, else the newest) that has a config.json."""
    folder = "models--" + repo_id.replace("/", "--")
    for cache in _hub_cache_dirs():
        repo = cache / folder
        snapshots = repo / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = repo / "refs" / "main"
        if ref.is_file():
            snap = snapshots / ref.read_text().strip()
            if (snap / "config.json").is_file():
                return snap
        candidates = [s for s in snapshots.iterdir() if (s / "config.json").is_file()]
        if candidates:
            return max(candidates, key=lambda s: s.stat().st_mtime)
    return None


def resolve_model_path(spec: str, demo_dir: str | Path | None = None) -> Path:
    """'demo' -> the cached tiny checkpoint (written once); a directory -> itself (it must hold config.json);
    'Org/Name' -> its snapshot in the local Hugging Face cache. Raises DemoError with what to do."""
    spec = spec.strip()
    if spec == DEMO:
        return ensure_demo_checkpoint(demo_dir)
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DemoError(f"{spec} is a file; expected a checkpoint directory")
        if not (path / "config.json").is_file():
            raise DemoError(f"{spec} has no config.json (is this a Qwen3-TTS checkpoint directory?)")
        return path
    if _HUB_ID.fullmatch(spec):
        snap = find_in_hub_cache(spec)
        if snap is not None:
            return snap
        name = spec.split("/")[1]
        raise DemoError(
            f"{spec} is not in the local Hugging Face cache and nothing is downloaded at run time; "
            f"run: huggingface-cli download {spec} --local-dir ./models/{name} and use that folder"
        )
    raise DemoError(f"{spec}: no such directory (expected 'demo', a checkpoint directory or a hub id like Org/Name)")


def synthetic_clip(seconds: float = 3.0, sample_rate: int = 24000) -> np.ndarray:
    """A deterministic voice-like signal (a gliding harmonic tone with a little noise) for the demo voice."""
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    f0 = 140.0 + 25.0 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    wav = sum(0.4 / k * np.sin(k * phase) for k in range(1, 8))
    wav = wav * (0.6 + 0.4 * np.sin(2 * np.pi * 3.0 * t) ** 2)
    noise = np.random.default_rng(DEMO_SEED).standard_normal(t.shape[0])
    return (0.5 * wav + 0.01 * noise).astype(np.float32)


def _demo_xvector(model_path: Path, dim: int) -> tuple[torch.Tensor, str]:
    """The demo checkpoint's speaker encoder on the synthetic clip; a seeded random vector if the loader is
    not available. Returns (vector, sha256 of the clip or '')."""
    try:
        from .loading import load_speaker_encoder
    except ImportError:
        load_speaker_encoder = None
    if load_speaker_encoder is not None:
        clip = synthetic_clip()
        encoder, _ = load_speaker_encoder(model_path, device="cpu")
        x = encoder.eval().embed(torch.from_numpy(clip)).detach().to("cpu", torch.float32).reshape(-1)
        return x, hashlib.sha256(clip.tobytes()).hexdigest()
    return torch.randn(dim, generator=torch.Generator().manual_seed(DEMO_SEED)), ""


def ensure_demo_voice(profiles_dir: str | Path, model_path: str | Path) -> Path:
    """`<profiles_dir>/demo.safetensors` for the demo checkpoint at `model_path`, (re)written unless it already
    holds exactly this checkpoint's demo vector. A valid profile whose metadata names another model is
    someone's own voice called 'demo': kept as is."""
    from .config import ModelConfig

    path = Path(profiles_dir) / f"{DEMO_VOICE_ID}.safetensors"
    dim = ModelConfig.from_pretrained(model_path).xvector_dim
    x, clip_sha = _demo_xvector(Path(model_path), dim)
    try:
        existing = load_profile(path, expected_dim=dim)
        if existing.model != DEMO or torch.equal(existing.x_vector, x):
            return path
    except ProfileError:
        pass
    seconds = 3.0 if clip_sha else None
    profile = VoiceProfile(x_vector=x, model=DEMO, source_sha256=clip_sha, source_seconds=seconds)
    return save_profile(path, profile, overwrite=True)

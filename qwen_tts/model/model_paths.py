"""Model path resolution: 'demo', a checkpoint directory, or a hub id in the local Hugging Face cache.

`demo` is the built-in tiny random checkpoint (`qwen_tts.model.random_checkpoint.write_random_checkpoint`), written once
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

log = logging.getLogger("qwen_tts.model.model_paths")

DEMO = "demo"
DEMO_SEED = 0
DEMO_DIR_ENV = "TTS_DEMO_DIR"
_STAMP = "demo.json"  # records which writer produced the cached checkpoint
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


class ModelPathError(ValueError):
    """A model path cannot be resolved; the message says what to do."""


def default_demo_dir() -> Path:
    env = os.environ.get(DEMO_DIR_ENV)
    if env:
        return Path(env).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "qwen3-tts-server" / "demo-tiny"


def _writer_stamp() -> dict[str, str]:
    """Identifies the checkpoint writer's code, so a cached demo from an older writer is rebuilt."""
    from . import random_checkpoint

    source = Path(random_checkpoint.__file__).read_bytes()
    return {"size": "tiny", "seed": str(DEMO_SEED), "writer_sha256": hashlib.sha256(source).hexdigest()}


def _is_current(path: Path, stamp: dict[str, str]) -> bool:
    try:
        return json.loads((path / _STAMP).read_text()) == stamp and (path / "config.json").is_file()
    except (OSError, ValueError):
        return False


def ensure_demo_checkpoint(path: str | Path | None = None) -> Path:
    """The tiny demo checkpoint directory, written on first use (atomically, safe against racing writers)."""
    from .random_checkpoint import write_random_checkpoint

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
    'Org/Name' -> its snapshot in the local Hugging Face cache. Raises ModelPathError with what to do."""
    spec = spec.strip()
    if spec == DEMO:
        return ensure_demo_checkpoint(demo_dir)
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelPathError(f"{spec} is a file; expected a checkpoint directory")
        if not (path / "config.json").is_file():
            raise ModelPathError(f"{spec} has no config.json (is this a Qwen3-TTS checkpoint directory?)")
        return path
    if _HUB_ID.fullmatch(spec):
        snap = find_in_hub_cache(spec)
        if snap is not None:
            return snap
        name = spec.split("/")[1]
        raise ModelPathError(
            f"{spec} is not in the local Hugging Face cache and nothing is downloaded at run time; "
            f"run: hf download {spec} --local-dir ./models/{name} (the `hf` command of huggingface_hub) and use that folder"
        )
    raise ModelPathError(
        f"{spec}: no such directory (expected 'demo', a checkpoint directory or a hub id like Org/Name)"
    )

"""Fault injection for tests (TTS_FAULT_FILE): write a fault kind into that file and the engine loop raises it at
its next busy step, as a real failure would. Off unless the setting names a file; no HTTP route can reach it.

Kinds: `loop` (an exception in the engine loop), `oom` (torch.OutOfMemoryError, as CUDA raises it), `cuda`
(torch.AcceleratorError: a sticky CUDA error, after which only a new process helps).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from qwen_tts.engine_api import Engine

logger = logging.getLogger("tts_server")


def make_fault(kind: str) -> BaseException:
    if kind == "oom":
        return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected fault)")
    if kind == "cuda":
        return torch.AcceleratorError("CUDA error: an illegal memory access was encountered (injected fault)")
    return RuntimeError(f"injected fault in the engine loop ({kind or 'loop'})")


def file_trigger(path: Path) -> Callable[[], None]:
    """A hook for the engine loop: raises the fault written in `path` once, then deletes the file."""

    def hook() -> None:
        try:
            kind = path.read_text().strip()
        except FileNotFoundError:
            return
        path.unlink(missing_ok=True)
        logger.warning("injecting fault %r into the engine loop", kind)
        raise make_fault(kind)

    return hook


def installer(path: Path | None) -> Callable[[Engine], None] | None:
    """Installs the file trigger on each engine the server runs (the first and every restarted one)."""
    if path is None:
        return None
    logger.warning("fault injection is on (TTS_FAULT_FILE=%s): for tests only", path)
    hook = file_trigger(Path(path))

    def install(engine: Engine) -> None:
        if hasattr(engine, "fault_hook"):
            engine.fault_hook = hook

    return install

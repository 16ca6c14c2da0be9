"""Fault injection for tests (TTS_FAULT_FILE): write a fault kind into that file and the engine loop raises it at
its next busy step, as a real failure would. Off unless the setting names a file; no HTTP route can reach it. The
hook is handed to each engine the server builds (`Runtime.start(fault_hook=...)`, the native engine's constructor).

Kinds: `loop` (an exception in the engine loop), `oom` (torch.OutOfMemoryError, as CUDA raises it), `cuda`
(torch.AcceleratorError: a sticky CUDA error, after which only a new process helps).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

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


def hook(path: Path | None) -> Callable[[], None] | None:
    """The fault hook for every engine the server builds (the first and each restarted one), or None when off."""
    if path is None:
        return None
    logger.warning("fault injection is on (TTS_FAULT_FILE=%s): for tests only", path)
    return file_trigger(Path(path))

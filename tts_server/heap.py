"""Keep Python's cyclic garbage collector out of the event loop's way.

A full (generation 2) collection walks every tracked object in the process, and the server's startup leaves
some 200,000 of them that live as long as the process (torch, the app, the engine's modules). Serving allocates
enough for a full collection every second or two under load, and each one held the GIL for 85-130 ms on a
2-core machine: every stream and the engine loop stopped together (with 64 streaming clients of the fake engine,
one wave's time to first audio went from 35 to 145 ms on the server's own clock). Freezing the heap that
startup leaves moves it out of the collector's view (`gc.freeze`): later collections walk only what serving
made. Frozen objects are still freed by reference counting; only cycles among them are never collected, so
before an engine is replaced the heap is thawed and collected (the old engine's cycles may hold device memory).
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger("tts_server")


def freeze_startup_heap() -> int:
    """Collect what startup left as garbage, then freeze the rest; returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("startup heap frozen: %d objects out of the garbage collector's walks", frozen)
    return frozen


def thaw_and_collect() -> None:
    """Make every object collectable again and run a full collection (before an engine is replaced)."""
    gc.unfreeze()
    gc.collect()

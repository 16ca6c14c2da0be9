"""The profiles directory, watched: a profile copied in (or written by the extractor, or uploaded) is loaded, and one
removed is dropped, without a restart. watchfiles (inotify on Linux, the platform's notifier elsewhere) wakes us;
every batch of changes ends in one `VoiceRegistry.sync()`, which rescans the directory, so a missed or merged event
changes nothing. The registry also checks a file on every use, so a request never sees a stale voice meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import anyio
from watchfiles import Change, awatch

from qwen_tts.voices import PROFILE_SUFFIX, VoiceRegistry

logger = logging.getLogger("tts_server.voices")

RETRY_DELAY_S = 2.0  # after the watch itself fails (the directory was removed, inotify limits): try again


def _is_profile(change: Change, path: str) -> bool:
    name = os.path.basename(path)
    # Hidden files include the temp files of an atomic write in progress; the rename into place is the event.
    return name.endswith(PROFILE_SUFFIX) and not name.startswith(".")


class ProfileWatcher:
    """A background task that keeps `registry` in line with its directory until `stop()`."""

    def __init__(self, registry: VoiceRegistry):
        self.registry = registry
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.syncs = 0  # batches of changes applied (tests and logs)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="profile-watcher")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout=5.0)
            self._task = None

    async def _run(self) -> None:
        directory = self.registry.profiles_dir
        while not self._stop.is_set():
            try:
                await anyio.to_thread.run_sync(lambda: directory.mkdir(parents=True, exist_ok=True))
                logger.info("watching %s for voice profiles", directory)
                async for _changes in awatch(
                    directory, watch_filter=_is_profile, stop_event=self._stop, recursive=False
                ):
                    await self._apply()
            except Exception as e:  # the directory vanished, a watch limit was hit...: log, wait, try again
                logger.warning("watching %s failed (%s: %s); retrying in %g s", directory, type(e).__name__, e,
                               RETRY_DELAY_S)  # fmt: skip
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=RETRY_DELAY_S)

    async def _apply(self) -> None:
        loaded, dropped = await anyio.to_thread.run_sync(self.registry.sync)
        self.syncs += 1
        for speaker_id in loaded:
            logger.info("voice %r loaded from %s", speaker_id, self.registry.profiles_dir)
        for speaker_id in dropped:
            logger.info("voice %r removed", speaker_id)

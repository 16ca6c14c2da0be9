"""Text that arrives while its speech is generated: a voice agent's LLM output, fragment by fragment.

A `SynthesisRequest` with a `text_stream` runs in streaming-text mode (the talker reads one text token per frame).
The producer (the server's event loop, a client library) pushes fragments and ends the stream; the engine's thread
reads what has arrived. Fragments are only appended, so anything read stays true.

    stream = TextStream()
    handle = engine.submit(SynthesisRequest(text="", xvector=x, text_stream=stream, non_streaming_text=False))
    stream.push("Hello, ")
    stream.push("world.")
    stream.end()
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["TextSnapshot", "TextStream", "TextStreamClosedError"]


class TextStreamClosedError(ValueError):
    """A fragment pushed after `end()`."""


@dataclass(frozen=True)
class TextSnapshot:
    text: str  # everything pushed so far
    ended: bool  # no more text will come
    version: int  # grows with every push and with end(): a reader that saw this version has nothing new


class TextStream:
    """Thread-safe, append-only text of one utterance. Listeners (an engine waking its loop) are called after every
    push and after `end()`, on the producer's thread; they must not block."""

    def __init__(self, text: str = "") -> None:
        self._lock = threading.Lock()
        self._text = text
        self._ended = False
        self._version = 1 if text else 0
        self._listeners: list[Callable[[], None]] = []

    def push(self, fragment: str) -> None:
        if not isinstance(fragment, str):
            raise TypeError(f"a text fragment must be str, not {type(fragment).__name__}")
        with self._lock:
            if self._ended:
                raise TextStreamClosedError("the text stream has ended")
            if not fragment:
                return
            self._text += fragment
            listeners = self._changed()
        for listener in listeners:
            listener()

    def end(self) -> None:
        """No more text: the engine feeds end-of-text after what has arrived. Ending twice is harmless."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            listeners = self._changed()
        for listener in listeners:
            listener()

    def _changed(self) -> list[Callable[[], None]]:
        """Under the lock: a new version, and the listeners to call once the lock is released."""
        self._version += 1
        return list(self._listeners)

    def snapshot(self) -> TextSnapshot:
        with self._lock:
            return TextSnapshot(self._text, self._ended, self._version)

    @property
    def ended(self) -> bool:
        with self._lock:
            return self._ended

    @property
    def version(self) -> int:
        """The snapshot's version without copying the text: a reader polls this to see whether anything is new."""
        with self._lock:
            return self._version

    def add_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

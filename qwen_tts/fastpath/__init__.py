"""The CUDA fast path: kernels grouped by op, which the engine hands to the model for its decode steps.

`build` (step.py) is the one entry point: it makes the `FastStep` that holds every kernel choice and the re-laid
weights, and hands it to the talker and Code2Wav. Imported on first use, so that importing a kernel module (or this
package) imports no other.
"""

from __future__ import annotations

from typing import Any

_STEP_NAMES = ("FastStep", "build", "model_info")


def __getattr__(name: str) -> Any:
    if name in _STEP_NAMES:
        from qwen_tts.fastpath import step

        return getattr(step, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

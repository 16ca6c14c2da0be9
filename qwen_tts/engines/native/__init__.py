"""The native engine: our PyTorch model behind `qwen_tts.engine_api.Engine`.

engine.py is the engine loop, scheduler.py the queue, slots and per-request state, frame_step.py the batched
frame step with its eager and CUDA-graph runners.
"""

from .engine import NativeEngine

__all__ = ["NativeEngine"]

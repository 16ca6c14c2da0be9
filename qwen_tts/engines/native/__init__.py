"""The native engine: our PyTorch model behind `qwen_tts.engine_api.Engine`.

engine.py is the engine loop; scheduler.py the queue, slots, per-request state and each turn's decisions (a plain
plan); runner.py builds the model, fast path, graphs, prefill and decoder and executes the plans; frame_step.py
is the batched frame step with its eager and CUDA-graph runners, prefill.py the batched prefill, decoder.py the
streaming Code2Wav.
"""

from .engine import NativeEngine

__all__ = ["NativeEngine"]

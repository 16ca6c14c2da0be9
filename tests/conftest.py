"""Shared fixtures: one tiny random checkpoint per test session (written by qwen_tts.model.random_checkpoint, seed 0).

Also pins torch to one intra-op thread for the test run (see below)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

# Without a GPU, Triton kernels (qwen_tts/fastpath/decode_attention.py) run in Triton's CPU interpreter. It must be chosen
# before any kernel is defined, so before qwen_tts is imported. Processes the tests start do not inherit it
# (server_helpers.ServerProcess drops it): another environment's Triton must not be forced into the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton.runtime.interpreter as _interpreter
    except ImportError:
        pass
    else:
        # Triton 3.6's interpreter turns a loaded scalar into a Python int with int(array), which numpy >= 2.3
        # refuses for a 1-element 1-d array (a kernel's `range(0, tl.load(p) + 1, ...)`): take the element.
        _patch_tensor = _interpreter._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interpreter._patch_lang_tensor = _patch_lang_tensor

        # Its tl.dot multiplies bf16 operands as their raw uint16 storage (it widens only fp8): widen bf16 to
        # float32 first, which is what the tensor cores compute with a float32 accumulator.
        _builder = _interpreter.InterpreterBuilder
        _create_dot = _builder.create_dot

        def _create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
            import triton.language as tl

            def widen(x):
                if x.dtype.scalar != tl.bfloat16:
                    return x
                data = _interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view("float32")
                return _interpreter.TensorHandle(data, tl.float32)

            return _create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

        _builder.create_dot = _create_dot_bf16

        # And its float32 -> bf16 cast (`x.to(tl.bfloat16)`) truncates, where the GPU rounds to nearest even:
        # twice the rounding error in every bf16 kernel output. Round as the GPU does.
        _cast_impl = _builder.cast_impl

        def _cast_rtne(self, src, dst_type):
            import triton.language as tl

            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                # torch's cast (its own RTNE handles the carry into the exponent, which the interpreter's does not)
                x32 = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
                data = x32.to(torch.bfloat16).view(torch.uint16).numpy().reshape(src.data.shape)
                return _interpreter.TensorHandle(data, tl.bfloat16)
            return _cast_impl(self, src, dst_type)

        _builder.cast_impl = _cast_rtne
        _builder.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)

from qwen_tts.model.random_checkpoint import write_random_checkpoint

TINY_SEED = 0

# Tiny models are all per-op overhead: intra-op threads only add synchronisation, and on a busy 2-core machine
# they oversubscribe (greedy generation measured 20x slower with 2 threads than with 1). An explicit
# OMP_NUM_THREADS wins.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of a tiny random checkpoint in the official layout. Treat it as read-only (copy it to edit)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny_ckpt") / "tiny", size="tiny", seed=TINY_SEED)


@pytest.fixture
def tiny_copy(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """A private, editable copy of the tiny checkpoint."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "tiny"))


@pytest.fixture(scope="session")
def tiny_qwen3tts(tiny_checkpoint: Path):
    """The tiny checkpoint loaded on CPU in float32, with the speaker encoder."""
    from qwen_tts.model.loading import load_model

    return load_model(tiny_checkpoint, device="cpu", speaker_encoder=True)


@pytest.fixture
def clean_tts_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No TTS_* variable, and the test's own working directory (so no .env file but one the test writes)."""
    for key in list(os.environ):
        if key.startswith("TTS_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)

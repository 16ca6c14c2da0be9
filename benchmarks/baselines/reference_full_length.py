"""Run a baseline script with every row of the official generate kept at the length it was generated to.

    python benchmarks/baselines/reference_full_length.py reference_baseline.py --size full --frames 100 --batches 1,32
    FRAMES=100 python benchmarks/baselines/reference_full_length.py peer_baseline.py   # its official (tf5 build) rows

The official `Qwen3TTSForConditionalGeneration.generate` runs every row of a batch for the same number of steps
(the baseline script passes an end-of-speech id the sampler suppresses), then cuts each row's codes at its first
codec end-of-speech token (2150). That token is not suppressed, so with random weights a row draws it now and then:
rows come back at different lengths, the script's `torch.stack` of a batch fails, and its frame count (the speed's
numerator) misses frames that were generated. This wrapper pads each row back to the generated length with code 0
(a valid code in every codebook), so the batch stacks and the script counts the frames it timed. The generation
itself is untouched. It runs in the official implementation's environment (its wheels on PYTHONPATH, not ours):
only the standard library, torch and the official module are imported here before the script. Where that module
is not found, the script runs unwrapped and a JSON line says so.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import json
import runpy
import sys
import types

import torch


def pad_rows(rows: list[torch.Tensor], length: int) -> tuple[list[torch.Tensor], int]:
    """Each [T_i, ...] tensor padded with zeros along dim 0 to `length` (never cut); and how many were padded."""
    out, padded = [], 0
    for r in rows:
        missing = length - r.shape[0]
        if missing > 0:
            r = torch.cat([r, r.new_zeros((missing, *r.shape[1:]))])
            padded += 1
        out.append(r)
    return out, padded


def _stub_missing(*names: str) -> None:
    """The same audio-I/O modules the baseline script stubs when absent; the official package imports them at
    module level but the x-vector generation path never calls them."""
    for name in names:
        try:
            __import__(name)
        except Exception:
            m = types.ModuleType(name)
            m.__spec__ = importlib.machinery.ModuleSpec(name, None)
            sys.modules[name] = m


def install(stub_audio_io: bool = True) -> dict:
    """Wrap the official generate; returns a dict the wrapper fills with what it padded (for the log)."""
    if stub_audio_io:
        _stub_missing("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi", "sox")
    from qwen_tts.core.models import modeling_qwen3_tts as m

    talker_generate = m.Qwen3TTSTalkerForConditionalGeneration.generate
    generate = m.Qwen3TTSForConditionalGeneration.generate
    seen: dict = {"frames": 0, "padded_rows": 0, "calls": 0}

    def counting_talker_generate(self, *args, **kwargs):
        result = talker_generate(self, *args, **kwargs)
        # The frames the official generate stacks before cutting them (a step whose codes are not out yet has None).
        # A result of another shape (another build's talker) leaves 0: rows are then padded to the longest one.
        with contextlib.suppress(AttributeError, IndexError, TypeError):
            seen["frames"] = sum(1 for h in result.hidden_states if h[-1] is not None)
        return result

    def full_length_generate(self, *args, **kwargs):
        seen["frames"] = 0
        codes, hidden = generate(self, *args, **kwargs)
        length = max([seen["frames"], *(c.shape[0] for c in codes)])
        codes, padded = pad_rows(codes, length)
        hidden, _ = pad_rows(hidden, length)
        seen["padded_rows"] += padded
        seen["calls"] += 1
        if padded:  # a JSON line among the script's own (it has no "batch": tables and ratios skip it)
            print(json.dumps({"padded_rows": padded, "rows": len(codes), "frames": length}), flush=True)
        return codes, hidden

    m.Qwen3TTSTalkerForConditionalGeneration.generate = counting_talker_generate
    m.Qwen3TTSForConditionalGeneration.generate = full_length_generate
    return seen


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: reference_full_length.py <reference_baseline.py> [its arguments]")
    try:
        install()
    except (ImportError, AttributeError) as e:  # not the official layout: the script runs as it is, and says so
        print(json.dumps({"full_length_wrapper": f"not installed: {type(e).__name__}: {e}"}), flush=True)
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])

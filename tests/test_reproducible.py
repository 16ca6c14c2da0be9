"""A fresh process gives the same bits: the engine's path on the same weights and inputs, in two processes.

Each run is a child process (this file run as a script) with an empty inductor and Triton cache, as on a fresh
machine or container: it loads a random checkpoint (bf16 on CUDA), sets the engine's fast path up with the default
settings and teacher-forces one fixed sequence the engine's way (a prefill, then a talker token a step; the code
predictor one frame a call with fixed codes). The talker's and the code predictor's logits of the two runs must be
equal bit for bit. On CUDA this is what `EngineSettings.fused_deterministic` buys: inductor would otherwise time
several configurations of a reduction kernel on first use and could keep another one in each process
(docs/security.md, "Determinism"). On the CPU (the eager layers) it checks the harness itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@torch.inference_mode()
def child(ckpt: Path, device: str, prompt_len: int, frames: int, out: Path) -> None:
    """One run: the teacher-forced logits of the engine's path, saved to `out`."""
    from qwen_tts import fastpath
    from qwen_tts.engine_api import EngineSettings
    from qwen_tts.engines.native.engine import talker_cache_len
    from qwen_tts.fastpath.options import FastPath
    from qwen_tts.model.loading import load_model
    from qwen_tts.model.reference_loop import teacher_forced_logits

    dev = torch.device(device)
    m = load_model(ckpt, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    settings = EngineSettings()
    fastpath.build(
        m.talker, m.code2wav, FastPath.preset(settings.fast_path), dev, talker_cache_len(settings),
        settings.fused_deterministic,
    )  # fmt: skip
    fast = m.talker.kernels is not None
    t = m.talker
    g = torch.Generator().manual_seed(0)
    vocab = m.config.talker.codebook_size
    ids = torch.randint(0, vocab, (prompt_len + frames - 1,), generator=g).to(dev)
    codes = torch.randint(0, vocab, (frames, t.code_predictor.num_residual + 1), generator=g).to(dev)
    seq = t.embed_codec(ids)  # inputs at the scale of the codec embeddings
    _, talker_logits, cp_logits = teacher_forced_logits(t, seq, prompt_len, codes)
    torch.save({"talker": talker_logits[:, :vocab].cpu(), "code_predictor": cp_logits.cpu(), "fast": fast}, out)


def fresh_run(ckpt: Path, device: str, prompt_len: int, frames: int, work: Path, run: int) -> dict:
    """`child` in a new process with its own empty compile caches; its saved logits."""
    out = work / f"run-{run}.pt"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor-{run}")
    env["TRITON_CACHE_DIR"] = str(work / f"triton-{run}")
    cmd = [sys.executable, __file__, str(ckpt), device, str(prompt_len), str(frames), str(out)]
    subprocess.run(cmd, check=True, env=env, timeout=600)
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize(
    ("device", "size", "prompt_len", "frames"),
    [
        ("cpu", "tiny", 8, 4),
        pytest.param(
            "cuda", "0.6b", 32, 16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        ),
    ],
)
def test_two_fresh_processes_give_the_same_logits_bit_for_bit(
    tiny_checkpoint: Path, tmp_path: Path, device: str, size: str, prompt_len: int, frames: int
) -> None:
    if size == "tiny":
        ckpt = tiny_checkpoint
    else:  # full-size random weights, as the engine runs them
        from qwen_tts.model.random_checkpoint import write_random_checkpoint

        ckpt = write_random_checkpoint(tmp_path / size, size=size, seed=0)
    first, second = (fresh_run(ckpt, device, prompt_len, frames, tmp_path, run) for run in range(2))
    assert first["fast"] is second["fast"] is (device == "cuda")  # the CPU runs the eager layers
    for part, positions in (("talker", frames), ("code_predictor", frames * 15)):
        a, b = first[part], second[part]
        assert a[..., 0].numel() == positions, part
        assert torch.equal(a, b), f"{part}: {int((a != b).sum())} logits differ, up to {float((a - b).abs().max())}"


if __name__ == "__main__":
    ckpt, device, prompt_len, frames, out = sys.argv[1:]
    child(Path(ckpt), device, int(prompt_len), int(frames), Path(out))

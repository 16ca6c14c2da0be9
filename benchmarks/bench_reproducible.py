"""Does a fresh process give the same bits? The engine's path (its CUDA set-up, `fastpath.build`) on the same weights
and inputs, once per process, compared across processes.

Each run is a child process: it loads a random checkpoint in bf16, sets the fast path up with the settings a variant
names, and teacher-forces a fixed sequence the engine's way (a prefill, then a talker token a step; the code
predictor one frame a call through `CodePredictor.forward`, its sampler replaced by fixed codes). It saves the talker
and code-predictor logits. The parent compares every run of a variant with its first: equal bits, elements that
differ, the largest difference, top-1 agreement. Within a process the engine is deterministic and batch invariant
(tests/test_engine.py); across processes inductor may time several configurations of a reduction kernel on first
use and keep another one (`EngineSettings.fused_deterministic`). Each run gets an empty inductor and Triton cache, as
on a fresh machine or container (inductor keeps its tuned choices in its cache, so runs sharing one would agree).

    python3 benchmarks/bench_reproducible.py --size 0.6b --runs 2 --variants default,deterministic --out rep.json
    python3 benchmarks/bench_reproducible.py --size tiny --device cpu --runs 2     # the harness itself, anywhere
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from qwen_tts.engine_api import EngineSettings
from qwen_tts.model.random_checkpoint import write_random_checkpoint
from qwen_tts.model.reference_loop import teacher_forced_logits

# Variant name -> EngineSettings fields over the defaults.
VARIANTS = {
    "default": {},
    "deterministic": {"fused_deterministic": True},
    "no-deterministic": {"fused_deterministic": False},
}


@torch.inference_mode()
def child(ckpt: Path, device: str, variant: str, prompt_len: int, frames: int, out: Path) -> None:
    """One run: the teacher-forced logits of the engine's path, saved to `out`."""
    from qwen_tts import fastpath
    from qwen_tts.engines.native.engine import talker_cache_len
    from qwen_tts.model.loading import load_model

    dev = torch.device(device)
    m = load_model(ckpt, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    settings = dataclasses.replace(EngineSettings(), **VARIANTS[variant])
    fastpath.build(m.talker, m.code2wav, settings, dev, talker_cache_len(settings))
    fast = m.talker.kernels is not None
    t = m.talker
    g = torch.Generator().manual_seed(0)
    vocab = m.config.talker.codebook_size
    ids = torch.randint(0, vocab, (prompt_len + frames - 1,), generator=g).to(dev)
    codes = torch.randint(0, vocab, (frames, t.code_predictor.num_residual + 1), generator=g).to(dev)
    seq = t.embed_codec(ids)  # inputs at the scale of the codec embeddings
    _, talker_logits, cp_logits = teacher_forced_logits(t, seq, prompt_len, codes)
    torch.save(
        {"talker": talker_logits[:, :vocab].cpu(), "code_predictor": cp_logits.cpu(), "fast": fast},
        out,
    )


def compare(a: dict, b: dict) -> dict:
    out = {}
    for part in ("talker", "code_predictor"):
        x, y = a[part], b[part]
        out[part] = {
            "equal": bool(torch.equal(x, y)),
            "elements_differing": int((x != y).sum()),
            "max_abs_diff": float((x - y).abs().max()),
            "top1_agreement": round(float((x.argmax(-1) == y.argmax(-1)).float().mean()), 4),
            "positions": int(x[..., 0].numel()),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="0.6b", choices=["tiny", "tiny-mtp", "0.6b", "1.7b"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--runs", type=int, default=2, help="processes per variant")
    ap.add_argument("--variants", default="default,deterministic", help=f"comma-separated, of {sorted(VARIANTS)}")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--shared-cache", action="store_true", help="let runs share inductor's cache (its tuned configs among them)"
    )
    ap.add_argument("--child", nargs=3, metavar=("CKPT", "VARIANT", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(Path(a.child[0]), a.device, a.child[1], a.prompt_len, a.frames, Path(a.child[2]))
        return
    variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    ckpt = a.workdir / f"random-{a.size}-seed0"
    if not (ckpt / "speech_tokenizer/model.safetensors").is_file():
        write_random_checkpoint(ckpt, size=a.size, seed=0)
    results: dict = {"size": a.size, "device": a.device, "runs": a.runs, "frames": a.frames, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            runs = []
            for r in range(a.runs):
                path = Path(tmp) / f"{v}-{r}.pt"
                t0 = time.time()
                cmd = [sys.executable, __file__, "--device", a.device, "--prompt-len", str(a.prompt_len)]
                cmd += ["--frames", str(a.frames), "--child", str(ckpt), v, str(path)]
                env = dict(os.environ)
                if not a.shared_cache:  # as a fresh machine or container: nothing compiled or tuned before
                    env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / f"inductor-{v}-{r}")
                    env["TRITON_CACHE_DIR"] = str(Path(tmp) / f"triton-{v}-{r}")
                subprocess.run(cmd, check=True, env=env)
                runs.append(torch.load(path, weights_only=True))
                print(f"{v} run {r}: {time.time() - t0:.0f} s", file=sys.stderr)
            results["variants"][v] = {
                "fast_path": runs[0]["fast"],
                "against_run_0": [compare(runs[0], other) for other in runs[1:]],
            }
    print(json.dumps(results, indent=2))
    if a.out:
        a.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

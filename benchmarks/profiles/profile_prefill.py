"""Where a request's admission time goes (prompt build, talker prefill, slot set-up), on the engine's own objects.

Starts the native engine on a random full-size checkpoint; with the engine idle, times each piece of admitting a
group of requests (device work included, best of --repeats) for each group size, then profiles one round and
prints the top operators by host time and by device time.

    python benchmarks/profiles/profile_prefill.py --size 1.7b --groups 1,8 --tokenizer-dir PATH
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # bench_engine

import torch
from bench_engine import TEXT

from qwen_tts.engine_api import EngineSettings, SynthesisRequest
from qwen_tts.engines import create_engine
from qwen_tts.model.layers import upload
from qwen_tts.model.prompt import build_prompt, build_text_prompts
from qwen_tts.model.random_checkpoint import write_random_checkpoint


def sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def timed(engine, fn, repeats: int) -> tuple[float, object]:
    """Best of `repeats` wall times of fn() in ms, device work included."""
    best, out = float("inf"), None
    for _ in range(repeats):
        sync(engine)
        t0 = time.perf_counter()
        out = fn()
        sync(engine)
        best = min(best, 1000 * (time.perf_counter() - t0))
    return best, out


def parts(engine, n: int, repeats: int) -> dict[str, float]:
    """The admission of n requests at once, piece by piece, run from this thread while the engine is idle (the
    pieces the model runner's admit/_prefill run, on slots 0..n-1, which the next real prefill overwrites)."""
    r = engine._runner
    text_ids = r._tokenizer.text_ids(TEXT)
    xs = [torch.randn(engine.xvector_dim, generator=torch.Generator().manual_seed(i)) for i in range(n)]

    def prompts():  # one by one, as the engine builds a lone request's: text in the prefill, its heads and table
        return [
            build_prompt(r._cfg, r._talker, text_ids, r._role_ids, upload(x, engine.dtype, engine.device),
                         "auto", True, None, r._heads, r._text)
            for x in xs
        ]  # fmt: skip

    def together():  # the same prompts in one call, as the engine builds a burst's
        return build_text_prompts(r._cfg, r._talker, [text_ids] * n, r._role_ids, xs, ["auto"] * n, r._heads, r._text)

    out = {}
    with torch.inference_mode():
        out["prompt_ms"], ps = timed(engine, prompts, repeats)
        out["prompts_together_ms"], _ = timed(engine, together, repeats)
        T = max(p.prefill.shape[0] for p in ps)
        embeds = torch.zeros(n, T, ps[0].prefill.shape[1], device=engine.device, dtype=engine.dtype)
        for i, p in enumerate(ps):
            embeds[i, : p.prefill.shape[0]] = p.prefill
        pos = torch.arange(T, device=engine.device).expand(n, T)
        slots = torch.arange(n, device=engine.device)
        out["talker_ms"], _ = timed(engine, lambda: r._talker(embeds, pos, r._cache, slots, T), repeats)
        req = SynthesisRequest(text=TEXT, xvector=xs[0], seed=1)
        out["slots_ms"], _ = timed(engine, lambda: r._set_slot_params(slots, [req] * n), repeats)
        out["tokens"] = T
    return out


async def main(a) -> None:
    tmp = tempfile.TemporaryDirectory()
    t0 = time.perf_counter()
    ckpt = write_random_checkpoint(Path(tmp.name) / a.size, size=a.size, seed=0, tokenizer_dir=a.tokenizer_dir)
    settings = EngineSettings(
        model_path=str(ckpt), device=a.device, max_slots=max(a.groups), max_frames=100, warmup=a.warmup
    )
    engine = create_engine(settings)
    await engine.start()
    print(f"[prefill] checkpoint + start {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        for n in a.groups:
            r = parts(engine, n, a.repeats)
            print(f"[prefill] group {n}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()), flush=True)
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            parts(engine, a.groups[0], 1)
        ka = prof.key_averages()
        print(ka.table(sort_by="cpu_time_total", row_limit=a.rows))
        if engine.device.type == "cuda":
            print(ka.table(sort_by="self_cuda_time_total", row_limit=a.rows))
    finally:
        await engine.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "0.6b", "1.7b"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--groups", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--tokenizer-dir")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="start the engine without its warm-up and graph capture (the prompts need neither)")  # fmt: skip
    asyncio.run(main(ap.parse_args()))

"""The bytes one frame step must read, per checkpoint size, and what that allows: runs anywhere (no weights, no GPU).

A frame step at one stream is memory bound: every weight matrix it multiplies is read from memory (the talker's
layers once, the code predictor's layers once per pass, each of its 15 heads once; the embedding tables only a row
each). From the checkpoint layout (`random_checkpoint.talker_spec`, the same shapes as the real files) this prints,
for each size, those bytes, the K/V cache the talker's attention reads at a given position, and the step's time if it
read them at a given bandwidth with nothing else in the way: the floor under x real time per stream.

It also answers what the floor for "size A at least R times faster per stream than size B" asks of the engine. With
steps of bytes/bandwidth + a fixed overhead o (launch gaps, sampling, everything not bandwidth), the ratio is
(b_B / bw + o) / (b_A / bw + o), so R needs o <= (b_B - R b_A) / ((R - 1) bw): the budget printed as
`overhead_budget_ms`. The code predictor is the same network in both sizes (hidden 1024, 5 layers, 15 passes a
frame), so its bytes are common to both, and the ratio of the bytes alone is the best any engine can do.

    python3 benchmarks/profiles/step_bytes.py --bandwidth-tb-s 4.8 --ratio 1.5 --out step_bytes.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from qwen_tts.model.random_checkpoint import model_config, talker_spec

BF16 = 2  # bytes per weight, the engine's dtype on the GPU


def step_bytes(size: str, position: int = 300, prompt_one_pass: bool = True) -> dict:
    """Bytes of one frame step at one stream for a checkpoint size, by part (bf16 weights and cache)."""
    cfg = model_config(size).talker
    parts = {"talker_layers": 0, "codec_head": 0, "cp_layers": 0, "cp_heads": 0, "cp_projection": 0}
    for name, shape in talker_spec(cfg).items():
        n = math.prod(shape) * BF16
        if name.startswith("code_predictor.model.layers."):
            parts["cp_layers"] += n
        elif name.startswith("code_predictor.lm_head."):
            parts["cp_heads"] += n
        elif name.startswith("code_predictor.small_to_mtp_projection."):
            parts["cp_projection"] += n
        elif name.startswith("model.layers."):
            parts["talker_layers"] += n
        elif name == "codec_head.weight":
            parts["codec_head"] += n
    passes = 15 if prompt_one_pass else 16  # the code predictor's prompt (2 tokens) in one pass, then 14 more
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * BF16 * position
    read = {
        "talker_layers": parts["talker_layers"],
        "codec_head": parts["codec_head"],
        "cp_layers": passes * parts["cp_layers"],
        "cp_heads": parts["cp_heads"],
        "cp_projection": passes * parts["cp_projection"],
        "talker_kv": kv,
    }
    total = sum(read.values())
    return {"size": size, "passes": passes, "position": position, "bytes": read, "total_bytes": total}


def ratio_floor(a: dict, b: dict, bandwidth_tb_s: float, ratio: float) -> dict:
    """What "a at least `ratio` times faster per stream than b" needs: the bytes' own ratio, and the most fixed
    overhead per step (ms) that still allows it at this bandwidth."""
    bw = bandwidth_tb_s * 1e9  # bytes per ms
    ta, tb = a["total_bytes"] / bw, b["total_bytes"] / bw
    budget = (tb - ratio * ta) / (ratio - 1)
    return {
        "faster": a["size"],
        "than": b["size"],
        "bytes_ratio": round(b["total_bytes"] / a["total_bytes"], 3),
        "ratio": ratio,
        "overhead_budget_ms": round(budget, 3),
        "steps_at_budget_ms": {a["size"]: round(ta + max(budget, 0), 3), b["size"]: round(tb + max(budget, 0), 3)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1.7b,0.6b")
    ap.add_argument("--position", type=int, default=300, help="the talker's cache position (K/V read per step)")
    ap.add_argument("--bandwidth-tb-s", type=float, default=4.8, help="memory bandwidth (an H200: 4.8 TB/s)")
    ap.add_argument("--ratio", type=float, default=1.5, help="the per-stream speed ratio asked of the smaller size")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.ratio <= 1:
        ap.error("--ratio must be > 1")
    sizes = [s for s in a.sizes.split(",") if s]
    rows = [step_bytes(s, a.position) for s in sizes]
    bw = a.bandwidth_tb_s * 1e9
    for r in rows:
        r["floor_ms"] = round(r["total_bytes"] / bw, 3)
        r["xrt_at_floor"] = round(80.0 / r["floor_ms"], 1)  # a frame is 80 ms of audio (12.5 Hz)
        print(f"{r['size']}: {r['total_bytes'] / 1e9:.3f} GB a step, {r['floor_ms']} ms at {a.bandwidth_tb_s} TB/s "
              f"({r['xrt_at_floor']}x real time); " + ", ".join(f"{k} {v / 1e9:.3f}" for k, v in r["bytes"].items()))  # fmt: skip
    out: dict = {"bandwidth_tb_s": a.bandwidth_tb_s, "sizes": rows}
    if len(rows) == 2:
        by_size = sorted(rows, key=lambda r: r["total_bytes"])
        out["ratio_floor"] = ratio_floor(by_size[0], by_size[1], a.bandwidth_tb_s, a.ratio)
        print(json.dumps(out["ratio_floor"]))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""The batch CLI through the vllm-omni backend: `--stage-configs-path` selects it, in the vLLM-Omni environment."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import soundfile as sf
import torch

from qwen_tts.model.random_checkpoint import write_random_checkpoint
from server_helpers import REPO_ROOT, VO_PYTHON, needs_vllm_omni, write_voice

pytestmark = [pytest.mark.slow, needs_vllm_omni()]


def test_batch_cli_with_stage_configs_path(tmp_path: Path) -> None:
    ckpt = write_random_checkpoint(tmp_path / "tiny", size="tiny", seed=0, dtype=torch.float32)
    write_voice(tmp_path / "voices", "alice", 32, seed=1)
    manifest = tmp_path / "manifest.json"
    items = [
        {"id": f"line{i}", "speaker_id": "alice", "text": f"Batch line number {i}.", "options": opts}
        for i, opts in enumerate([{"greedy": True, "min_frames": 20, "max_frames": 20}, {"max_frames": 30}])
    ]
    manifest.write_text(json.dumps(items))
    out = tmp_path / "out"
    r = subprocess.run(
        [
            str(VO_PYTHON), "batch_inference.py", "--model", str(ckpt), "--manifest", str(manifest),
            "--profiles-dir", str(tmp_path / "voices"), "--output-dir", str(out), "--no-progress",
            "--stage-configs-path", "stage_config_cpu.yaml", "--concurrency", "2",
        ],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "vllm-omni"
    assert summary["totals"]["ok"] == 2 and summary["totals"]["failed"] == 0
    first = sf.read(str(out / "line0.wav"), dtype="float32")[0]
    assert len(first) == 20 * 1920  # greedy, fixed length: exactly 20 frames
    second = sf.read(str(out / "line1.wav"), dtype="float32")[0]
    assert 0 < len(second) <= 30 * 1920 and len(second) % 1920 == 0

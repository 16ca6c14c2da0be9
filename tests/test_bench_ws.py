"""benchmarks/e2e/bench_ws.py: the stall while text arrives, and a tiny run against a server it starts (fake backend)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "e2e"))
_spec = importlib.util.spec_from_file_location("bench_ws", ROOT / "benchmarks" / "e2e" / "bench_ws.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_the_stall_while_text_arrives_counts_only_arrivals_before_the_end() -> None:
    u = bench.Utterance(first_text_at=0.0, text_ended_at=2.0)
    # 0.5 s of audio at 1.0, the next at 1.8 (300 ms dry), the last at 3.0 (after the text ended: not counted).
    u.arrivals = [(1.0, 0.5), (1.8, 0.5), (3.0, 0.5)]
    assert bench.stall_while_text(u) == pytest.approx(0.3)
    assert bench.stall_seconds(u.arrivals) == pytest.approx(0.3 + 0.7)
    assert u.time_to_first_audio == 1.0
    row = bench.level_stats(10.0, 2, [u, RuntimeError("refused")], wall=3.0)
    assert (row["ok"], row["failed"], row["failures"]) == (1, 1, ["RuntimeError"])
    assert row["ttfa_p50_ms"] == 1000.0 and row["stall_while_text_max_ms"] == 300.0
    assert row["zero_stall_while_text_share"] == 0.0


@pytest.mark.slow
def test_a_tiny_run_against_a_server_it_starts(capsys: pytest.CaptureFixture) -> None:
    rows = bench.main(["--backend", "fake", "--rates", "50", "--sessions", "1,3", "--words", "6"])
    assert [(r["sessions"], r["ok"], r["failed"]) for r in rows] == [(1, 1, 0), (3, 3, 0)]
    for r in rows:
        assert 0 < r["ttfa_p50_ms"] < 5000 and r["audio_s"] > 0
    assert "stall-while-text p95" in capsys.readouterr().out

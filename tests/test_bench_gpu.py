"""benchmarks/e2e/bench_gpu.py: the continuity replay, the trace attribution, the baseline plumbing, a tiny run."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "e2e" / "bench_gpu.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_stall_replays_arrivals_against_a_player_started_at_the_first_chunk():
    # 240 ms first chunk; the second lands before it has played out; the third 100 ms after the player ran dry.
    arrivals = [(10.0, 0.24), (10.2, 0.96), (11.3, 0.96)]
    assert bench.stall_seconds(arrivals) == pytest.approx(0.1)
    # A stall shifts the rest of the playback: the fourth chunk is due at 11.3 + 0.96, not 11.2 + 0.96.
    assert bench.stall_seconds([*arrivals, (12.2, 0.5)]) == pytest.approx(0.1)
    assert bench.stall_seconds([*arrivals, (12.36, 0.5)]) == pytest.approx(0.1 + 0.1)
    assert bench.stall_seconds([(5.0, 1.0)]) == 0.0
    assert bench.stall_seconds([]) == 0.0


def test_stream_stats_report_ttfa_percentiles_and_zero_stall_share():
    def stream(sent: float, arrivals: list[tuple[float, float]]) -> object:
        s = bench.Stream()
        s.sent, s.arrivals = sent, arrivals
        return s

    smooth = stream(0.0, [(0.1, 0.5), (0.3, 0.5)])
    stalled = stream(0.0, [(0.3, 0.2), (0.9, 1.0)])  # runs dry at 0.5, next chunk at 0.9: 400 ms stall
    failed = stream(0.0, [])
    failed.error = "queue_full"
    out = bench.stream_stats([smooth, stalled, failed], wall=2.0)
    assert (out["requests"], out["ok"], out["errors"]) == (3, 2, {"queue_full": 1})
    assert out["audio_s"] == pytest.approx(2.2)
    assert out["audio_s_per_s"] == pytest.approx(1.1)
    assert (out["ttfa_p50_ms"], out["ttfa_max_ms"]) == (100.0, 300.0)
    assert out["stall_max_ms"] == pytest.approx(400.0)
    assert out["zero_stall_share"] == 0.5
    assert out["xrt_per_stream_median"] == pytest.approx(statistics_median([1.0 / 0.3, 1.2 / 0.9]), abs=1e-3)


def statistics_median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[0] + xs[1]) / 2


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 7, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_attribute_groups_kernels_by_the_range_around_their_launch():
    trace = {
        "traceEvents": [
            _x("user_annotation", "module:Talker<-frame_step", 0, 100),
            _x("user_annotation", "sub:TalkerModel", 10, 40),
            _x("user_annotation", "sample", 70, 20),  # the engine's own range wins over the module's
            _x("cuda_runtime", "cudaLaunchKernel", 20, 2, correlation=1),
            _x("cuda_runtime", "cudaLaunchKernel", 60, 2, correlation=2),
            _x("cuda_runtime", "cudaLaunchKernel", 75, 2, correlation=3),
            _x("cuda_runtime", "cudaGraphLaunch", 200, 30, correlation=4),
            _x(
                "kernel",
                "void at::native::vectorized_elementwise_kernel<4, Foo>(int, Bar)",
                900,
                5,
                tid=1,
                correlation=1,
            ),
            _x("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 910, 7, tid=1, correlation=2),
            _x("kernel", "void at::native::(anonymous namespace)::topk_kernel<float>(X)", 920, 4, tid=1, correlation=3),
            _x("kernel", "triton_poi_fused_add_0", 1000, 3, tid=1, correlation=4),
            _x("kernel", "triton_poi_fused_add_0", 1004, 3, tid=1, correlation=4),
            _x("gpu_memcpy", "Memcpy HtoD", 990, 1, tid=1, correlation=5),
        ]
    }
    a = bench.attribute(trace, on_cuda=True)
    assert dict(a["groups"]) == {
        "module:Talker<-frame_step/TalkerModel": [1, 5],
        "module:Talker<-frame_step/own ops": [1, 7],
        "sample": [1, 4],
        "(cuda graph)": [2, 6],
    }
    assert dict(a["names"]) == {
        "native::vectorized_elementwise_kernel": [1, 5],
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n": [1, 7],
        "native::topk_kernel": [1, 4],
        "triton_poi_fused_add_0": [2, 6],
    }
    assert dict(a["api"]) == {"cudaLaunchKernel": [3, 6], "cudaGraphLaunch": [1, 30]}
    assert len(a["memcpy"]) == 1
    # per step, in ms (trace times are in us)
    assert bench.by_caller(a["groups"], 2) == {"frame_step": 0.006, "(cuda graph)": 0.003, "sample": 0.002}


def test_a_baseline_runs_with_only_its_own_python_path(tmp_path):
    script = tmp_path / "fake_baseline.py"
    script.write_text(
        "import json, os, sys\n"
        "print('building...')\n"
        "print(json.dumps({'batch': 1, 'pp': os.environ.get('PYTHONPATH'), 'frames': os.environ.get('FRAMES'),"
        " 'cwd': os.getcwd()}))\n"
    )
    site = str(tmp_path / "site")
    res = bench.run_baseline("fake", [sys.executable, str(script)], site, {"FRAMES": "7"}, timeout=60)
    assert res["rc"] == 0 and "error" not in res
    [row] = res["rows"]
    assert (row["pp"], row["frames"]) == (site, "7")
    assert Path(row["cwd"]).resolve() != ROOT  # not the repository: our qwen_tts must not shadow the official one

    script.write_text("import sys\nprint('boom', file=sys.stderr)\nsys.exit(3)\n")
    res = bench.run_baseline("fake", [sys.executable, str(script)], site, {}, timeout=60)
    assert res["rc"] == 3 and "boom" in res["error"] and res["rows"] == []


def test_baseline_rows_and_ratios_from_the_scripts_output_lines():
    results = {
        "args": {"reference_size": "full"},
        "sizes": {
            "1.7b": {
                "engine": [
                    {"concurrency": 1, "xrt_per_stream_median": 6.0, "audio_s_per_s": 6.0},
                    {"concurrency": 64, "xrt_per_stream_median": 2.0, "audio_s_per_s": 128.0},
                ]
            }
        },
        "baselines": {
            "reference": {
                "rows": [
                    {"batch": 1, "frames": 100, "ms_per_step": 205.0, "gen_xRT": 0.39},
                    {"batch": 32, "frames": 3200, "ms_per_step": 156.0, "gen_xRT": 16.0},
                ]
            },
            "peer": {
                "rows": [
                    {"system": "faster-qwen3-tts", "mode": "whole", "audio_s": 8.0, "wall_s": 2.2, "xRT": 3.6},
                    {"system": "faster-qwen3-tts", "mode": "whole", "audio_s": 8.0, "wall_s": 2.0, "xRT": 4.0},
                    {"system": "faster-qwen3-tts", "mode": "stream chunk=4", "ttfa_ms": 140.0, "xRT": 3.2},
                    {"padded_rows": 1, "rows": 16, "frames": 99},  # the wrapper's note: no table row
                    {"system": "official (tf5 build)", "batch": 16, "audio_s": 128.0, "audio_s_per_s": 6.0},
                ]
            },
        },
    }
    rows = {r[1] + f" n={r[2]}": r for r in bench.baseline_rows(results)}
    assert rows["official (HF generate) n=32"][3:6] == ["0.50", "16.0", "156.0"]
    assert rows["faster-qwen3-tts whole n=1"][3] == "4.00"  # the best of the repeats
    assert rows["faster-qwen3-tts stream chunk=4 n=1"][6] == "140/-"
    assert rows["official tf5 batch 16 n=16"][3:5] == ["0.38", "6.0"]
    assert len(rows) == 5  # official 1 and 32, faster-qwen3-tts whole and stream, official tf5 16
    # A baseline that printed only notes (its script failed after the wrapper's line) shows as an error row.
    note = {"full_length_wrapper": "not installed: ImportError"}
    failed = {**results, "baselines": {"reference": {"rows": [note]}, "peer": {"rows": [note]}}}
    assert [(r[1], r[3]) for r in bench.baseline_rows(failed)] == [
        ("official (HF generate)", "error"),
        ("faster-qwen3-tts", "error"),
    ]
    assert bench.ratios(results) == {
        "engine c=1 / official b=1 (audio-s/s)": round(6.0 / 0.39, 2),
        "engine c=64 / official b=32 (audio-s/s)": 8.0,
        "engine c=1 / faster-qwen3-tts whole (x real time)": 1.5,
    }


def test_tiny_run_end_to_end(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--sizes", "tiny", "--parts", "engine,poisson", "--concurrency", "1,2", "--frames", "6"]
    argv += ["--poisson-rates", "50", "--poisson-count", "2", "--workdir", str(tmp_path), "--out", str(out)]
    results = bench.main(argv)
    assert json.loads(out.read_text())["sizes"]["tiny"]["engine"] == results["sizes"]["tiny"]["engine"]
    levels = results["sizes"]["tiny"]["engine"]
    assert [r["concurrency"] for r in levels] == [1, 2]
    for r in levels:
        n = r["concurrency"]
        assert (r["requests"], r["ok"], r["errors"]) == (n, n, {})
        assert r["audio_s"] == pytest.approx(n * 6 * 0.08)  # end-of-speech held off: every request 6 frames
        assert r["engine_steps"] == 6
        assert r["chunks_per_stream"] == 2  # a 3-frame first chunk, then the rest
        assert 0 < r["ttfa_p50_ms"] <= r["ttfa_p95_ms"]
        assert 0.0 <= r["zero_stall_share"] <= 1.0
    [p] = results["sizes"]["tiny"]["poisson"]
    assert (p["requests"], p["ok"], p["audio_s"]) == (2, 2, pytest.approx(2 * 6 * 0.08))
    text = bench.report(results)
    assert text.splitlines()[-1].startswith("| tiny | poisson 50/s | 2 ")
    assert "| tiny | engine | 2 |" in text


def test_loop_lag_reads_the_servers_probe_between_two_metrics_pages():
    def page(counts):  # cumulative counts per bucket bound, as prometheus_client writes them
        bounds = ["0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "+Inf"]
        return "\n".join(
            f'tts_event_loop_lag_seconds_bucket{{le="{b}"}} {c}' for b, c in zip(bounds, counts, strict=True)
        )

    before = page([5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5])
    # 100 probes more: 90 within 1 ms, 8 within 10 ms, 1 within 50 ms, 1 within 250 ms
    after = page([95, 97, 100, 103, 103, 104, 104, 105, 105, 105, 105])
    assert bench.loop_lag(before, after) == {
        "probes": 100,
        "late_10ms_share": 0.02,
        "p99_ms_at_most": 50.0,
        "max_ms_at_most": 250.0,
    }
    assert bench.loop_lag("", "") == {"probes": 0}  # a server without the probe


def test_time_to_engine_reads_the_servers_histogram_between_two_metrics_pages():
    def page(counts):
        bounds = ["0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "+Inf"]
        lines = [f'tts_time_to_engine_seconds_bucket{{le="{b}"}} {c}' for b, c in zip(bounds, counts, strict=True)]
        return "\n".join([*lines, 'tts_event_loop_lag_seconds_bucket{le="+Inf"} 7'])  # another histogram, ignored

    before = page([0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
    # 20 requests more: 8 within 1 ms, 4 within 2.5 ms, 6 within 25 ms, 2 within 100 ms
    after = page([0, 10, 14, 14, 14, 20, 20, 22, 22, 22, 22, 22])
    assert bench.time_to_engine(before, after) == {
        "requests": 20,
        "p50_ms_at_most": 2.5,
        "p95_ms_at_most": 100.0,
        "max_ms_at_most": 100.0,
    }
    assert bench.time_to_engine(before, before) == {"requests": 0}


def test_engine_variants_run_the_poisson_rates_asked_of_them(tmp_path):
    argv = ["--sizes", "tiny", "--parts", "engine,poisson", "--concurrency", "1", "--frames", "6"]
    argv += [
        "--poisson-rates",
        "50",
        "--poisson-count",
        "2",
        "--workdir",
        str(tmp_path),
        "--out",
        str(tmp_path / "b.json"),
    ]
    argv += ["--engine-variants", "first-chunk-2", "--variant-concurrency", "2", "--variant-poisson-rates", "40"]
    results = bench.main(argv)
    res = results["sizes"]["tiny"]
    assert [(r.get("variant"), r["concurrency"]) for r in res["engine"]] == [(None, 1), ("first-chunk-2", 2)]
    assert [(p.get("variant"), p["rate_per_s"], p["ok"]) for p in res["poisson"]] == [
        (None, 50.0, 2),
        ("first-chunk-2", 40.0, 2),
    ]
    # The variant's first chunk is 2 frames (0.16 s), the default's 3.
    assert [r["first_stream_chunks"][0][1] for r in res["engine"]] == [pytest.approx(0.24), pytest.approx(0.16)]
    assert "| tiny | poisson first-chunk-2 40/s | 2 " in bench.report(results)


@pytest.mark.slow
def test_the_http_part_streams_closed_levels_then_open_loop_arrivals_through_the_server(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--sizes", "tiny", "--parts", "http", "--http-clients", "2", "--http-poisson-rates", "20"]
    argv += ["--poisson-count", "3", "--frames", "6", "--workdir", str(tmp_path), "--out", str(out)]
    results = bench.main(argv)
    closed, arrivals = results["sizes"]["tiny"]["http"]
    assert (closed["clients"], closed["ok"], closed["errors"]) == (2, 2, {})
    assert closed["audio_s"] == pytest.approx(2 * 6 * 0.08)  # every byte of the f32le streams counted once
    assert closed["client_cpu_s"] > 0
    lag = closed["server_loop_lag"]  # the server's event-loop probe ran through the level
    assert lag["probes"] >= 1 and 0.0 <= lag["late_10ms_share"] <= 1.0 and lag["max_ms_at_most"] >= 1.0
    # every request of the level reached the engine, counted by the server from its arrival
    assert closed["server_time_to_engine"]["requests"] == 2 and closed["server_time_to_engine"]["max_ms_at_most"] > 0
    assert arrivals["server_time_to_engine"]["requests"] == 3
    assert (arrivals["rate_per_s"], arrivals["requests"], arrivals["ok"], arrivals["errors"]) == (20.0, 3, 3, {})
    assert arrivals["audio_s"] == pytest.approx(3 * 6 * 0.08)
    assert arrivals["arrival_span_s"] == round(bench.poisson_offsets(20.0, 3, 0)[-1], 2)
    assert 1 <= arrivals["max_in_flight"] <= 3
    # first audio is timed from each client's arrival: the server's own clock runs inside it
    assert 0 < arrivals["server_ttfa_p50_ms"] <= arrivals["ttfa_p50_ms"]
    text = bench.report(results)
    assert "| tiny | http stream | 2 |" in text
    assert "| tiny | http poisson 20/s | 3 (max " in text


def test_the_icl_part_runs_xvector_then_icl_streams_on_one_engine(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--sizes", "tiny", "--parts", "icl", "--icl-levels", "1,4", "--icl-ref-frames", "20", "--frames", "6"]
    results = bench.main([*argv, "--workdir", str(tmp_path), "--out", str(out)])
    rows = results["sizes"]["tiny"]["icl"]
    assert [(r["mode"], r["concurrency"], r["icl_streams"]) for r in rows] == [
        ("xvector", 1, 0), ("icl", 1, 1), ("xvector", 4, 0), ("mixed", 4, 2)
    ]  # fmt: skip
    for r in rows:
        n = r["concurrency"]
        assert (r["requests"], r["ok"], r["errors"]) == (n, n, {})
        assert r["audio_s"] == pytest.approx(n * 6 * 0.08) and r["ref_frames"] == 20  # the reference is not output
    assert "| tiny | icl mixed (2 ICL, ref 20 frames) | 4 |" in bench.report(results)


def test_a_level_that_never_ends_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    """--level-timeout-s: a level with no result in time is named in the results and the report, that engine's
    later levels are not started, and the parts after it still run."""
    import asyncio

    real = bench.closed_level

    async def stuck_at_two(engine, n, frames, greedy):
        if n == 2:
            await asyncio.sleep(60)
        return await real(engine, n, frames, greedy)

    monkeypatch.setattr(bench, "closed_level", stuck_at_two)
    out = tmp_path / "bench.json"
    argv = ["--sizes", "tiny", "--parts", "engine,poisson", "--concurrency", "1,2,4", "--frames", "4",
            "--level-timeout-s", "3", "--poisson-rates", "50", "--poisson-count", "2", "--workdir", str(tmp_path),
            "--out", str(out)]  # fmt: skip
    results = bench.main(argv)
    assert results["timed_out"] == ["tiny engine c=2"]
    assert [r["concurrency"] for r in results["sizes"]["tiny"]["engine"]] == [1]  # c=4 not started
    [p] = results["sizes"]["tiny"]["poisson"]
    assert (p["requests"], p["ok"]) == (2, 2)
    assert "timed out (--level-timeout-s): tiny engine c=2" in bench.report(results)
    assert json.loads(out.read_text())["timed_out"] == ["tiny engine c=2"]


def _waves(argv: list[str]) -> list[dict]:
    spec = importlib.util.spec_from_file_location(
        "bench_http_waves", ROOT / "benchmarks" / "e2e" / "bench_http_waves.py"
    )
    waves = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(waves)
    return waves.main(["--clients", "3", "--frames", "5", "--waves", "2", "--pause", "0", *argv])


@pytest.mark.slow
def test_bench_gpus_http_level_reports_the_servers_first_audio_beside_the_clients():
    rows = _waves(["--client", "bench-gpu"])  # the fake engine's server; bench_gpu.http_level as its http part
    assert [r["wave"] for r in rows] == [1, 2]
    for r in rows:
        assert (r["ok"], r["errors"]) == (3, {})
        assert r["audio_s"] == pytest.approx(3 * 5 * 0.08)  # every byte of 3 streams of 5 frames counted once
        # 10 ms per frame, a 3-frame first chunk: the server's own clock, inside the client's
        assert 30 <= r["server_ttfa_p50_ms"] <= r["server_ttfa_p95_ms"] <= r["ttfa_max_ms"]
        assert r["server_time_to_engine"]["requests"] == 3


@pytest.mark.slow
def test_the_wave_driver_streams_a_second_wave_over_the_same_kept_alive_connections():
    rows = _waves(["--client", "h11"])
    assert [r["connections_opened"] for r in rows] == [3, 0]
    for r in rows:
        assert (r["ok"], r["errors"]) == (3, {})
        assert 30 <= r["server_ttfa_p50_ms"] <= r["ttfa_p50_ms"]
        # each wave's three requests reached the engine, timed by the server from their arrival
        assert r["server_time_to_engine"]["requests"] == 3
        assert 0 < r["server_time_to_engine"]["p50_ms_at_most"] <= r["ttfa_p50_ms"]


def test_engine_variants_combine_with_plus_and_unknown_names_are_refused_up_front():
    assert bench.variant_settings("") == {}
    assert bench.variant_settings("chunk-24+fp32-decoder") == {"chunk_frames": 24, "decoder_fp16": False}
    assert bench.engine_variants("one-stream,chunk-24") == ["one-stream", "chunk-24"]
    with pytest.raises(ValueError, match="unknown engine variant 'fast'"):
        bench.variant_settings("chunk-24+fast")
    with pytest.raises(bench.argparse.ArgumentTypeError, match="unknown engine variant 'fast'"):
        bench.engine_variants("chunk-24,fast")
    # At most ten, and every variant is real EngineSettings and FastPath fields: a preset and its changes combine.
    from qwen_tts.fastpath.options import FastPath

    assert len(bench.VARIANTS) <= 10
    for name in bench.VARIANTS:
        bench.variant_engine(name)
    settings, fast = bench.variant_engine("one-stream+fp32-decoder", max_slots=2)
    assert (settings.fast_path, settings.max_slots, settings.decoder_fp16) == ("one-stream", 2, False)
    assert fast == FastPath(cp_stack_kernel="cuda", talker_stack_kernel="cuda", small_m_heads=True)


def test_gpu_variants_script_names_its_stages_and_refuses_unknown_ones_before_installing(tmp_path):
    import subprocess

    script = ROOT / "benchmarks" / "gpu" / "gpu_variants.sh"
    env = {"PATH": "/usr/bin:/bin", "WHEEL_DIR": str(tmp_path / "none"), "OUT": str(tmp_path),
           "SITE_PREFIX": str(tmp_path / "site")}  # fmt: skip
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    words = " ".join(usage.stderr.replace("#", " ").split())  # the header's lines joined
    stages = (
        "Stages: tests, tests-engine (the engine's CUDA tests), checks (the CUDA cases of tests/test_determinism.py and "
        "tests/test_reproducible.py), pytest (the tests PYTEST_ARGS names), stack (the one-kernel code predictor "
        "stack: its passes alone, STACK_MODES naming bench_stack.py's modes, then its tests), sampler (the sampler "
        "kernel alone), attention, gemm, profile, step (the frame step alone, per STEP_SIZES), codec (Code2Wav "
        "alone), engine, teacher-forced (tests/reference/make_fixture.py --teacher-forced per TF_SIZES, with the "
        "official package from .whl/reference; benchmarks/gpu/gpu_wheels.sh with REFERENCE_WHEELS). VARIANTS "
        "overrides the engine stage's variant list, CODEC_VARIANTS the Code2Wav variants of the profile and codec "
        "stages, STEP_VARIANTS the step stage's."
    )
    assert usage.returncode == 2 and stages in words
    bad = subprocess.run(["bash", str(script), "tests", "speed"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "unknown stage speed" in bad.stderr
    # A known stage gets as far as the wheel install, which names the missing folder.
    none = subprocess.run(["bash", str(script), "gemm"], capture_output=True, text=True, env=env)
    assert none.returncode == 2 and f"no wheels in {tmp_path / 'none'}/server" in none.stderr


def test_step_bytes_counts_each_sizes_weights_and_the_overhead_a_speed_ratio_allows(tmp_path, monkeypatch):
    """benchmarks/profiles/step_bytes.py from the checkpoint layout: every weight matrix of a frame step counted once per read,
    the code predictor's the same in both sizes, and the overhead budget the exact one at which the ratio holds."""
    spec = importlib.util.spec_from_file_location("step_bytes", ROOT / "benchmarks" / "profiles" / "step_bytes.py")
    sb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sb)
    from qwen_tts.model.random_checkpoint import model_config

    out = tmp_path / "bytes.json"
    monkeypatch.setattr(sys, "argv", ["step_bytes.py", "--bandwidth-tb-s", "4.0", "--ratio", "1.4", "--out", str(out)])
    sb.main()
    res = json.loads(out.read_text())
    big, small = res["sizes"]
    for r in (big, small):
        t = model_config(r["size"]).talker
        cp = t.code_predictor
        layer = lambda h, i, q, kv, d: 2 * (h * (q + 2 * kv) * d + q * d * h + 3 * h * i + 2 * h + 2 * d)  # noqa: E731
        assert r["bytes"]["talker_layers"] == t.num_hidden_layers * layer(
            t.hidden_size, t.intermediate_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim
        )
        cp_layer = layer(cp.hidden_size, cp.intermediate_size, cp.num_attention_heads, cp.num_key_value_heads,
                         cp.head_dim)  # fmt: skip
        assert r["bytes"]["cp_layers"] == 15 * cp.num_hidden_layers * cp_layer
        assert r["bytes"]["talker_kv"] == 2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * 2 * 300
        assert r["total_bytes"] == sum(r["bytes"].values())
        assert r["floor_ms"] == round(r["total_bytes"] / 4.0e9, 3)
    assert big["bytes"]["cp_layers"] == small["bytes"]["cp_layers"]  # one code predictor for both sizes
    assert small["bytes"]["cp_projection"] == 0 < big["bytes"]["cp_projection"]
    floor = res["ratio_floor"]
    assert (floor["faster"], floor["than"]) == ("0.6b", "1.7b")
    assert floor["bytes_ratio"] == round(big["total_bytes"] / small["total_bytes"], 3)
    # At the budget the two steps are exactly the asked ratio apart.
    o, bw = floor["overhead_budget_ms"], 4.0e9
    assert abs((big["total_bytes"] / bw + o) / (small["total_bytes"] / bw + o) - 1.4) < 2e-3


def _profile_step():
    spec = importlib.util.spec_from_file_location("profile_step", ROOT / "benchmarks" / "profiles" / "profile_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_step_files_the_step_kernels_by_family() -> None:
    """benchmarks/profiles/profile_step.py's kernel families, on kernel names an H200 replay of the frame step showed: our
    matmul kernels apart from inductor's kernels that are named after the op around them."""
    mod = _profile_step()
    want = {
        "_small_m_kernel": "few-row matmul",
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_small_m_lin": "compiled",
        "triton_poi_fused_mul_silu_small_m_linear_split_1": "compiled",
        "_sample_kernel": "sampler kernel",
        "_split_attention_kernel": "attention",
        "_combine_partitions_kernel": "attention",
        "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT": "gemm",
        "void at::native::index_elementwise_kernel<128, 4, at::native": "copy/index",
    }
    assert {name: mod.category(name) for name in want} == want


def test_profile_step_tables_count_launches_and_ms_per_run() -> None:
    """profile_step.kernel_tables over profiler kernel events (device time in us): launches and ms per run, by name
    and by family; top_rows orders them by time."""
    from types import SimpleNamespace

    mod = _profile_step()
    events = [SimpleNamespace(name="_small_m_kernel", device_time=6.0)] * 8  # 4 a run
    events += [SimpleNamespace(name="_split_attention_kernel", device_time=20.0)] * 2  # 1 a run
    by_name, by_cat = mod.kernel_tables(events, name_len=6, runs=2)
    assert mod.top_rows(by_name) == {"_small": (4, 0.024), "_split": (1, 0.02)}
    assert mod.top_rows(by_cat, 1) == [("few-row matmul", 4, 0.024)]
    assert mod.top_rows(by_cat) == {"few-row matmul": (4, 0.024), "attention": (1, 0.02)}


FAKE_OFFICIAL = """
import torch


class _Result:
    def __init__(self, hidden_states):
        self.hidden_states = hidden_states


class Qwen3TTSTalkerForConditionalGeneration:
    def generate(self, frames):
        # One entry per step; the last step's codes are not out yet (None), as in the official generate.
        return _Result([(None, torch.zeros(1))] * frames + [(None, None)])


class Qwen3TTSForConditionalGeneration:
    def __init__(self):
        self.talker = Qwen3TTSTalkerForConditionalGeneration()

    def generate(self, lengths, frames):
        self.talker.generate(frames)  # every row ran `frames` steps; each is cut where it drew end-of-speech
        codes = [torch.full((n, 16), 7) for n in lengths]
        return codes, [torch.ones(n, 4) for n in lengths]
"""


def _fake_official_site(root: Path) -> Path:
    pkg = root / "qwen_tts" / "core" / "models"
    pkg.mkdir(parents=True)
    for d in (root / "qwen_tts", root / "qwen_tts" / "core", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "modeling_qwen3_tts.py").write_text(FAKE_OFFICIAL)
    return root


def test_reference_wrapper_pads_rows_cut_at_end_of_speech_back_to_the_generated_length(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "reference_full_length", ROOT / "benchmarks" / "baselines" / "reference_full_length.py"
    )
    wrapper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wrapper)
    import torch

    rows, padded = wrapper.pad_rows([torch.ones(3, 2), torch.ones(5, 2), torch.ones(6, 2)], 5)
    assert padded == 1 and [r.shape[0] for r in rows] == [5, 5, 6]  # padded to 5, never cut
    assert rows[0][3:].eq(0).all() and rows[0][:3].eq(1).all()

    # The official module is a stand-in here: our own qwen_tts has the same top-level name, so it is swapped out.
    spec = importlib.util.spec_from_file_location(
        "fake_modeling", _fake_official_site(tmp_path) / "qwen_tts/core/models/modeling_qwen3_tts.py"
    )
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    models = type(sys)("qwen_tts.core.models")
    models.modeling_qwen3_tts = fake
    monkeypatch.setitem(sys.modules, "qwen_tts.core", type(sys)("qwen_tts.core"))
    monkeypatch.setitem(sys.modules, "qwen_tts.core.models", models)
    monkeypatch.setitem(sys.modules, "qwen_tts.core.models.modeling_qwen3_tts", fake)
    seen = wrapper.install(stub_audio_io=False)
    codes, hidden = fake.Qwen3TTSForConditionalGeneration().generate([9, 2, 4], 9)
    assert [c.shape for c in codes] == [torch.Size([9, 16])] * 3
    assert [h.shape[0] for h in hidden] == [9, 9, 9]
    assert codes[1][:2].eq(7).all() and codes[1][2:].eq(0).all()  # the row's own codes, then code 0
    assert seen["padded_rows"] == 2 and seen["calls"] == 1
    # Rows all cut short: padded to what the talker generated (9), not to the longest row left (4).
    codes, _ = fake.Qwen3TTSForConditionalGeneration().generate([3, 4], 9)
    assert [c.shape[0] for c in codes] == [9, 9]


@pytest.mark.parametrize("order", [["--baseline-gpu", "1"], ["--baselines-first"]], ids=["other-gpu", "first"])
def test_baselines_run_in_the_same_run_through_the_full_length_wrapper(tmp_path, order):
    site = _fake_official_site(tmp_path / "site")
    script = tmp_path / "reference_baseline.py"
    script.write_text(
        "import json, os, sys, torch\n"
        "from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration as M\n"
        "codes, _ = M().generate([5, 2, 9], 9)\n"
        "batch = torch.stack(codes)\n"  # fails on rows of different lengths without the wrapper
        "print(json.dumps({'batch': 3, 'frames': sum(c.shape[0] for c in codes), 'gen_xRT': 1.0, 'ms_per_step': 1.0,"
        " 'shape': list(batch.shape), 'argv': sys.argv[1:], 'gpu': os.environ.get('CUDA_VISIBLE_DEVICES')}))\n"
    )
    out = tmp_path / "bench.json"
    argv = ["--sizes", "tiny", "--parts", "engine,reference", "--concurrency", "1", "--frames", "4",
            "--reference-script", str(script), "--reference-site", str(site), "--reference-batches", "3",
            *order, "--workdir", str(tmp_path), "--out", str(out)]  # fmt: skip
    results = bench.main(argv)
    ref = results["baselines"]["reference"]
    assert ref["rc"] == 0 and "error" not in ref
    padded, row = ref["rows"]
    assert padded == {"padded_rows": 2, "rows": 3, "frames": 9}
    # The other GPU is the only one the baseline sees; first, it inherits this process's setting.
    gpu = "1" if "--baseline-gpu" in order else os.environ.get("CUDA_VISIBLE_DEVICES")
    assert (row["shape"], row["frames"], row["gpu"]) == ([3, 9, 16], 27, gpu)
    assert row["argv"][row["argv"].index("--batches") + 1] == "3"
    assert [r["concurrency"] for r in results["sizes"]["tiny"]["engine"]] == [1]
    assert json.loads(out.read_text())["baselines"]["reference"]["rows"] == ref["rows"]
    assert [r[2] for r in bench.baseline_rows(results)] == [3]  # the padding line is not a table row


def test_the_wrapper_runs_a_script_unwrapped_where_the_official_module_is_missing(tmp_path):
    script = tmp_path / "peer_baseline.py"
    script.write_text("import json, sys\nprint(json.dumps({'batch': 1, 'argv': sys.argv[1:]}))\n")
    wrapper = str(ROOT / "benchmarks" / "baselines" / "reference_full_length.py")
    res = bench.run_baseline("peer", [sys.executable, wrapper, str(script), "--x", "1"], str(tmp_path), {}, 60)
    note, row = res["rows"]
    assert note["full_length_wrapper"].startswith("not installed: ModuleNotFoundError")
    assert row == {"batch": 1, "argv": ["--x", "1"]} and res["rc"] == 0


def test_stream_times_find_the_steps_streams_idle_time_in_the_window() -> None:
    """Kernels on two streams: the busiest (the steps') covers 0-10 and 14-20 us, overlapping kernels counted once;
    the other runs 9-13. The window is 20 us, the GPU busy 19 (10-13 by the other stream, 13-14 by none), the steps'
    stream idle 4."""

    def k(ts, dur, stream):
        return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "args": {"stream": stream}}

    trace = {"traceEvents": [k(0, 6, 7), k(4, 6, 7), k(14, 6, 7), k(9, 4, 13), {"ph": "X", "cat": "cpu_op", "ts": 0,
                                                                                   "dur": 99}]}  # fmt: skip
    assert bench.union_us([(0, 6), (4, 10), (14, 20)]) == 16 and bench.union_us([]) == 0
    st = bench.stream_times(trace)
    assert st["span_us"] == 20 and st["any_busy_us"] == 19
    assert st["main_stream"] == "7" and st["main_idle_us"] == 4
    assert st["streams"] == {"7": {"kernels": 3, "busy_us": 16}, "13": {"kernels": 1, "busy_us": 4}}
    assert bench.stream_times({"traceEvents": []}) == {}


def test_profile_lines_show_a_variants_profile_and_its_streams() -> None:
    """A variant engine's profile (--variant-profile) is printed under its size and variant, with the GPU by stream:
    the window's span, the time any kernel ran, the steps' stream's idle time and each stream's busy time."""
    prof = {
        "batch": 1, "graphs": True, "kernels_per_step": 110, "device_ms_per_step": 2.9, "wall_ms_per_step": 3.3,
        "by_range_ms_per_step": {"(cuda graph)": 2.9}, "top10_prefix": [{"name": "cp_stack_pass", "per_step": 16}],
        "gpu_span_ms_per_step": 3.3, "gpu_any_busy_ms_per_step": 3.1, "main_stream_idle_ms_per_step": 0.4,
        "streams_busy_ms_per_step": {"7": {"kernels": 110, "busy": 2.9, "main": True},
                                     "13": {"kernels": 40, "busy": 0.5, "main": False}},
    }  # fmt: skip
    lines = bench.profile_lines({"sizes": {"0.6b": {"variant_profile": {"cp-stack-cuda": [prof]}}}})
    assert lines[0].startswith("profile 0.6b cp-stack-cuda graphs b=1: 110 kernels/step, device 2.90 ms/step")
    assert lines[2] == (
        "  GPU ms/step: span 3.30, any kernel 3.10, steps' stream idle 0.40 | busy: steps 2.90 (110 kernels), "
        "stream 13 0.50 (40 kernels)"
    )
    assert len(lines) == 3


def test_engine_memory_builds_and_frees_engines_one_after_another(capsys):
    """benchmarks/e2e/engine_memory.py on the CPU: two tiny engines, each started, run and stopped; each engine object is
    collected once stopped (nothing keeps it), and the memory fields are null off CUDA."""
    spec = importlib.util.spec_from_file_location("engine_memory", ROOT / "benchmarks" / "e2e" / "engine_memory.py")
    mem = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mem)
    records = mem.main(["--size", "tiny", "--device", "cpu", "--engines", "2", "--frames", "6"])
    assert [r["engine"] for r in records] == [0, 1]
    assert all(r["collected"] for r in records)
    assert all(r["started_gib"] is None and r["left_gib"] is None for r in records)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[-1]["all_collected"] is True and lines[-1]["size"] == "tiny" and len(lines) == 3


def _trace_request():
    spec = importlib.util.spec_from_file_location(
        "trace_request", ROOT / "benchmarks" / "profiles" / "trace_request.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trace_analysis_finds_a_frame_held_up_and_the_thread_that_made_no_call():
    """benchmarks/profiles/trace_request.py's analysis on a synthetic trace: three frames of 100 us on stream 7 (each ending in
    its codes copy), the second with a 300 us hole of which the decoder's kernel on stream 9 covers 200 us, and the
    engine thread (most graph launches) silent for 350 us."""
    tr = _trace_request()

    def kernel(ts, dur, stream, name="k"):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    def copy(ts):
        return {"cat": "gpu_memcpy", "name": tr.CODES_COPY, "ts": ts, "dur": 2.0, "args": {"stream": 7}}

    def call(ts, tid, name="cudaMemcpyAsync", dur=5.0):
        return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [copy(-2.0)]  # frames run from one copy's end to the next
    events += [kernel(10.0, 40.0, 7), kernel(55.0, 40.0, 7), copy(98.0)]  # frame 1: 100 us, a 5 us gap
    events += [kernel(100.0, 50.0, 7), kernel(450.0, 45.0, 7, "late_kernel"), copy(498.0)]  # frame 2: 400 us
    events += [kernel(200.0, 200.0, 9, "decoder_conv")]  # the decoder beside frame 2's hole
    events += [kernel(510.0, 80.0, 7), copy(598.0)]  # frame 3: 100 us
    events += [call(0.0, "loop", "cudaGraphLaunch"), call(100.0, "loop", "cudaGraphLaunch"), call(450.0, "loop")]
    events += [call(150.0, "decoder", "cudaGraphLaunch"), call(160.0, "decoder")]
    out = tr.analyze(events, slowest=1)
    assert out["steps_stream"] == 7 and out["kernels_by_stream"] == {7: 5, 9: 1}
    assert out["frames"] == 3 and out["median_frame_us"] == 100.0
    assert [f["frame_us"] for f in out["frame_list"]] == [100.0, 400.0, 100.0]
    slow = out["slowest"][0]
    assert slow["frame_us"] == 400.0 and slow["kernels"] == 2 and slow["busy_us"] == 95.0
    assert slow["gaps_us"] == 300.0 and slow["gaps_with_decoder_us"] == 200.0 and slow["decoder_us"] == 200.0
    assert slow["longest_gap_us"] == 300.0 and slow["before"] == "late_kernel"
    threads = {t["thread"]: t for t in out["host_threads"]}
    assert threads["loop"]["engine_loop"] and not threads["decoder"]["engine_loop"]
    assert threads["loop"]["longest_without_a_call_us"] == 345.0 and threads["loop"]["from_us"] == 105.0
    assert threads["decoder"]["longest_without_a_call_us"] == 5.0
    with pytest.raises(ValueError, match="no CUDA graph launch"):
        tr.analyze([e for e in events if e.get("name") != "cudaGraphLaunch"])


def test_timing_delta_gives_admission_per_request_and_the_rest_per_step():
    before = {
        "steps": 10,
        "step_s": 1.0,
        "prefill_s": 0.5,
        "prefill_prompt_s": 0.1,
        "decode_chunks": 2,
        "decode_rows": 8,
    }
    after = {
        "steps": 30,
        "step_s": 1.4,
        "prefill_s": 0.9,
        "prefill_prompt_s": 0.3,
        "decode_chunks": 6,
        "decode_rows": 40,
    }
    out = bench.timing_delta(before, after, 4)
    assert out == {
        "engine_steps": 20,
        "step_ms_per_step": 20.0,
        "prefill_ms_per_req": 100.0,
        "prefill_prompt_ms_per_req": 50.0,
        "decode_rows_per_chunk": 8.0,
    }

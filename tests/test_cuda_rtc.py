"""cuda_rtc's cluster launch: its driver structs laid out as cuda.h lays them out, and (on a GPU) a cluster launch
whose blocks meet at the cluster barrier and see each other's stores (benchmarks/kernels/bench_sync.py's kernel)."""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from qwen_tts.fastpath import cuda_rtc

ROOT = Path(__file__).resolve().parents[1]


def test_launch_structs_have_the_drivers_layout() -> None:
    """CUlaunchAttribute: a 4-byte id padded to 8, then a 64-byte value (72 bytes); CUlaunchConfig: seven unsigned
    ints, the stream at 32, the attributes' pointer at 40, their count at 48 (56 bytes). A wrong offset would hand the
    driver garbage."""
    a, c = cuda_rtc._LaunchAttribute, cuda_rtc._LaunchConfig
    assert ctypes.sizeof(a) == 72 and a.value.offset == 8 and a.value.size == 64
    assert ctypes.sizeof(c) == 56
    assert (c.shared.offset, c.stream.offset, c.attrs.offset, c.nattrs.offset) == (24, 32, 40, 48)


def load_bench_sync():
    spec = importlib.util.spec_from_file_location("bench_sync", ROOT / "benchmarks" / "kernels" / "bench_sync.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_sync"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cluster_launch_meets_at_the_cluster_barrier_and_sees_the_clusters_stores() -> None:
    """bench_sync's modes on the GPU, clusters of two: every block's check of a word another block wrote before the
    barrier passes (no error), and the device holds clusters of two."""
    bs = load_bench_sync()
    dev = torch.device("cuda")
    kernel = cuda_rtc.compile_kernel(bs.SOURCE, "sync_bench", dev)
    assert kernel.max_active_clusters(2, 128, 64 * 1024) >= 1
    for mode in ("grid+data", "cluster+data", "cluster+dsmem"):
        row = bs.time_mode(kernel, mode, 8, 128, 64 * 1024, 2, (20, 60))
        assert row["error"] == 0, row

"""The CUDA fast path (qwen_tts/fastpath/fused.py, decode_attention.py) computes what the eager modules compute.

On a machine without a GPU the Triton kernel runs in Triton's interpreter and the compiled blocks through
inductor's CPU backend: slow, but the same code paths and the same arithmetic as on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from qwen_tts.fastpath import fused, sample_kernel, small_m_gemm
from qwen_tts.fastpath.decode_attention import (
    HAVE_TRITON,
    SPLIT_BLOCK,
    SPLIT_PARTS,
    decode_attention,
    reference_decode_attention,
)
from qwen_tts.fastpath.options import FastPath
from qwen_tts.fastpath.step import FastStep
from qwen_tts.model.loading import load_model

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("split", [False, True], ids=["one-program", "split"])
@pytest.mark.parametrize(
    ("B", "Hq", "Hkv", "D", "slots", "L"),
    [(3, 16, 8, 128, 5, 100), (2, 4, 2, 32, 4, 40), (1, 8, 8, 16, 2, 20), (2, 6, 2, 32, 3, 50)],
)
def test_decode_attention_equals_gather_and_sdpa(B, Hq, Hkv, D, slots, L, split) -> None:
    g = torch.Generator().manual_seed(B * 100 + Hq)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    # q|k|v as views of one wide buffer (the fused path's layout: row strides wider than the heads).
    qkv = rand(B, (Hq + 2 * Hkv) * D)
    q = qkv[:, : Hq * D].reshape(B, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hkv) * D].reshape(B, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D :].reshape(B, Hkv, D)
    cache_k, cache_v = rand(slots, Hkv, L, D), rand(slots, Hkv, L, D)
    ref_k, ref_v = cache_k.double(), cache_v.double()
    slot_ids = torch.randperm(slots, generator=g)[:B].to(DEVICE)
    positions = torch.randint(0, L, (B,), generator=g).to(DEVICE)
    out = decode_attention(q, k, v, cache_k, cache_v, slot_ids, positions, split)
    ref = reference_decode_attention(q.double(), k.double(), v.double(), ref_k, ref_v, slot_ids, positions)
    assert out.shape == (B, Hq, D)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    # The new key and value landed at each row's position; nothing else in the cache moved.
    assert torch.equal(cache_k.double(), ref_k) and torch.equal(cache_v.double(), ref_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_attention_across_partition_edges(dtype) -> None:
    """Rows from one position to more than SPLIT_PARTS full blocks, on each side of block and partition edges,
    against float64 gather + SDPA: the partition holding a row's position writes its key and value first, and the
    partitions combine to the softmax over all of them."""
    g = torch.Generator().manual_seed(11)
    T, NP = SPLIT_BLOCK, SPLIT_PARTS
    pos = [0, 1, T - 1, T, T + 1, 3 * T + 5, NP * T - 1, NP * T, NP * T + 1, 3 * NP * T + 7]
    B, Hq, Hkv, D, L = len(pos), 16, 8, 32, 3 * NP * T + 8
    q, k, v = (torch.randn(B, h, D, generator=g).to(DEVICE, dtype) for h in (Hq, Hkv, Hkv))
    cache_k, cache_v = (torch.randn(B, Hkv, L, D, generator=g).to(DEVICE, dtype) for _ in range(2))
    ref_k, ref_v = cache_k.double(), cache_v.double()
    slots = torch.randperm(B, generator=g).to(DEVICE)
    positions = torch.tensor(pos, device=DEVICE)
    out = decode_attention(q, k, v, cache_k, cache_v, slots, positions, split=True)
    ref = reference_decode_attention(q.double(), k.double(), v.double(), ref_k, ref_v, slots, positions)
    assert torch.equal(cache_k.double(), ref_k) and torch.equal(cache_v.double(), ref_v)
    rel = ((out.double() - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))).max().item()
    # float32: exact arithmetic up to rounding. bf16: the output's own rounding to 8 significant bits (RMS ~1.7e-3
    # relative, what torch's own bf16 matmul shows) dominates.
    assert rel < (1e-5 if dtype == torch.float32 else 2.5e-3)
    # Position 0 attends to its own key alone: the output is its value, repeated over the query heads.
    torch.testing.assert_close(out[0].float(), v[0].float().repeat_interleave(Hq // Hkv, 0), rtol=1e-2, atol=1e-2)


def test_split_attention_gives_a_row_the_same_bits_alone_and_in_a_batch() -> None:
    """Batch invariance: a row's arithmetic depends on its own position, not on the rows beside it."""
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, D, L = 5, 16, 8, 32, 4 * SPLIT_BLOCK
    q, k, v = (torch.randn(B, h, D, generator=g).to(DEVICE, torch.bfloat16) for h in (Hq, Hkv, Hkv))
    cache = [torch.randn(B, Hkv, L, D, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2)]
    slots = torch.arange(B, device=DEVICE)
    positions = torch.tensor([70, 3, 127, 40, 33], device=DEVICE)
    together = decode_attention(q, k, v, *(c.clone() for c in cache), slots, positions, split=True)
    for i in range(B):
        alone = decode_attention(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], *(c.clone() for c in cache), slots[i : i + 1],
            positions[i : i + 1], split=True,
        )  # fmt: skip
        assert torch.equal(alone, together[i : i + 1]), i


def test_split_attention_rejects_a_head_dim_below_16() -> None:
    q = torch.zeros(1, 2, 8, device=DEVICE)
    kv = torch.zeros(1, 2, 8, device=DEVICE)
    cache = torch.zeros(1, 2, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim 8 < 16"):
        decode_attention(q, kv, kv, cache, cache.clone(), torch.zeros(1, dtype=torch.long, device=DEVICE),
                         torch.zeros(1, dtype=torch.long, device=DEVICE), split=True)  # fmt: skip


@pytest.mark.parametrize("split", [False, True], ids=["one-program", "split"])
def test_decode_attention_takes_one_position_expanded_over_the_batch(split) -> None:
    g = torch.Generator().manual_seed(7)
    B, H, D, L = 4, 2, 16, 24
    q, k, v = (torch.randn(B, H, D, generator=g).to(DEVICE) for _ in range(3))
    cache_k, cache_v = (torch.randn(B, H, L, D, generator=g).to(DEVICE) for _ in range(2))
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    slots = torch.arange(B, device=DEVICE)
    positions = torch.tensor([5], device=DEVICE).expand(B)  # stride 0, as the code predictor passes it
    out = decode_attention(q, k, v, cache_k, cache_v, slots, positions, split)
    ref = reference_decode_attention(q, k, v, ref_k, ref_v, slots, positions)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"split_attention": True},
        {"small_m_gemm": True},
        {"cp_one_pass": True},
        {"kernel_sampler": True},
    ],
    ids=["default", "split", "small-m-gemm", "cp-one-pass", "kernel-sampler"],
)
async def test_fused_engine_codes_equal_the_reference_loop(tiny_checkpoint, variant, monkeypatch) -> None:
    """The fused path (a FastStep handed to the talker; on CPU the engine keeps it), and each optional kernel on it
    (the kernel each one names must be the one that runs), gives the reference loop's codes. So does
    the code predictor's two prompt tokens as two rows of one pass (cp_one_pass: 15 passes a frame, not 16), and
    the sort-free sampler kernel (kernel_sampler: every one of a frame's 16 draws, top-p's included)."""
    variant = dict(variant)
    one_pass = variant.pop("cp_one_pass", False)
    kernel_sampler = variant.pop("kernel_sampler", False)
    import test_engine_reference as ref_tests

    from qwen_tts.fastpath import decode_attention as attention_mod

    calls = {"split": 0, "small_m": 0, "stack": 0, "sampler": 0}
    real_split, real_small_m = attention_mod.split_decode_attention, small_m_gemm.small_m_matmul
    real_stack = FastStep.stack_step

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(attention_mod, "split_decode_attention", counted("split", real_split))
    monkeypatch.setattr(small_m_gemm, "small_m_matmul", counted("small_m", real_small_m))
    monkeypatch.setattr(FastStep, "stack_step", counted("stack", real_stack))
    monkeypatch.setattr(sample_kernel, "sample", counted("sampler", sample_kernel.sample))
    # A code predictor draw that feeds the next pass goes through sample_feed (cp_fused_feed, on by default): a draw too.
    monkeypatch.setattr(sample_kernel, "sample_feed", counted("sampler", sample_kernel.sample_feed))
    # A private copy (enable() re-lays its weights), in float32 on CUDA too: bf16 kernels that differ from eager
    # ones in rounding would flip near-tied codes.
    model = load_model(tiny_checkpoint, device=DEVICE, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.talker.state_dict().items()}
    cases = ref_tests.CASES[:3] + ref_tests.CASES[-2:]  # greedy, both text modes, top-p, the long penalised runs
    with ref_tests.eos_boost(model, 3.0):
        reqs = [ref_tests.request(model, i, text, opts) for i, (text, opts) in enumerate(cases)]
        expected = [ref_tests.reference(model, r) for r in reqs]  # eager modules
        kernels = {"split_attention": False, "small_m_gemm": False, **variant}
        # The kernels this test names, the others off (the CPU's: no input tables, one split, eager rounding).
        options = FastPath(
            **kernels, cp_prompt_one_pass=one_pass, kernel_sampler=kernel_sampler, cp_fused_feed=False,
            cp_input_tables=False, small_m_split_k=1,
        )  # fmt: skip
        fast = FastStep(options, DEVICE, deterministic=False)
        fast.take_talker(model.talker, 64)
        assert model.talker.kernels is fast
        after = model.talker.state_dict()
        assert all(torch.equal(v, after[k]) for k, v in before.items())  # same weights, new layout
        # On CUDA the engine enables the fast path itself, with the kernels its settings name (on CPU it leaves
        # the model as enabled here).
        eng, handles = await ref_tests.run_engine(
            model, reqs, frame_step="eager", kernel_sampler=kernel_sampler, cp_prompt_one_pass=one_pass,
            **kernels,
        )  # fmt: skip
    for (text, _), h, e in zip(cases, handles, expected, strict=True):
        got = torch.cat(h.codes) if h.codes else torch.zeros(0, 16, dtype=torch.long)
        assert torch.equal(got, e.cpu()), text
    assert len({e.shape[0] for e in expected}) >= 3  # EOS at different frames: the boundary rules are in play
    assert (calls["split"] > 0) == bool(variant.get("split_attention"))
    assert (calls["small_m"] > 0) == bool(variant.get("small_m_gemm"))
    # Every batched frame step: the talker's one pass and the code predictor's 16 (15, its prompt in one pass).
    assert calls["stack"] == eng.timings["steps"] * (16 if one_pass else 17) > 0
    assert calls["sampler"] == (eng.timings["steps"] * 16 if kernel_sampler else 0)
    assert eng.model_info["cp_stack_kernel"] == "off"


def test_attention_benchmark_times_both_kernels_and_checks_them_against_float64(tmp_path) -> None:
    """benchmarks/kernels/bench_attention.py end to end on this machine (on CPU: the interpreter, timed by the clock)."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "bench_attention", root / "benchmarks" / "kernels" / "bench_attention.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "attention.json"
    argv = ["bench_attention.py", "--batches", "1,3", "--positions", "5,40", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--layers", "2", "--iters", "1", "--device", DEVICE, "--out", str(out)]  # fmt: skip
    old, sys.argv = sys.argv, argv
    try:
        bench.main()
    finally:
        sys.argv = old
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["position"], r["kernel"]) for r in rows] == [
        (b, p, k) for b in (1, 3) for p in (5, 40) for k in ("one-program", "split")
    ]
    for r in rows:
        assert r["us_per_call"] > 0 and r["kv_tb_per_s"] > 0
        assert r["rel_err_vs_fp64"] < 2.5e-3  # bf16 inputs and output: the output's rounding
    assert all(r["speedup"] == 1.0 for r in rows if r["kernel"] == "one-program")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("M", "K", "N"), [(2, 64, 48), (16, 300, 70), (5, 32, 16), (1, 1024, 96)])
def test_small_m_matmul_equals_float64(M, K, N, dtype) -> None:
    """K and N off the block sizes (masked tails), one to sixteen rows."""
    g = torch.Generator().manual_seed(M * K + N)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = torch.randn(N, K, generator=g).to(DEVICE, dtype)
    y = small_m_gemm.small_m_matmul(x, w)
    ref = x.double() @ w.double().T
    assert y.shape == (M, N) and y.dtype == dtype
    # float32: IEEE products (no TF32). bf16: the output's own rounding (RMS ~1.7e-3 relative, as F.linear's).
    assert ((y.double() - ref).norm() / ref.norm()).item() < (1e-6 if dtype == torch.float32 else 2.5e-3)


def test_small_m_matmul_gives_a_row_the_same_bits_alone_and_in_a_batch() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 512, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randn(80, 512, generator=g).to(DEVICE, torch.bfloat16)
    full = small_m_gemm.small_m_matmul(x, w)
    for i in range(16):
        assert torch.equal(small_m_gemm.small_m_matmul(x[i : i + 1], w), full[i : i + 1]), i
    assert torch.equal(small_m_gemm.small_m_matmul(x[3:9], w), full[3:9])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("M", "K", "N", "split"),
    [(2, 1024, 48, 3), (16, 300, 70, 2), (5, 640, 16, 4), (1, 2048, 96, 8), (3, 1000, 40, 5)],
)
def test_split_k_matmul_equals_float64_and_leaves_its_counters_at_zero(M, K, N, split, dtype) -> None:
    """Splits of equal and unequal runs of K tiles (1000 = 8 tiles of 128, the last masked: 5 splits of 2 tiles
    become 4), tails in N and M; every counter is back at zero for the next launch."""
    g = torch.Generator().manual_seed(M * K + N + split)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = torch.randn(N, K, generator=g).to(DEVICE, dtype)
    y = small_m_gemm.small_m_matmul(x, w, block_k=128, split_k=split)
    ref = x.double() @ w.double().T
    assert y.shape == (M, N) and y.dtype == dtype
    assert ((y.double() - ref).norm() / ref.norm()).item() < (1e-6 if dtype == torch.float32 else 2.5e-3)
    assert int(small_m_gemm.prepare(DEVICE).abs().sum()) == 0
    # The same call again: the same bits (a fixed order of the partial sums, counters ready).
    assert torch.equal(small_m_gemm.small_m_matmul(x, w, block_k=128, split_k=split), y)


def test_split_k_gives_a_row_the_same_bits_alone_and_in_a_batch() -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(16, 768, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randn(48, 768, generator=g).to(DEVICE, torch.bfloat16)
    full = small_m_gemm.small_m_matmul(x, w, block_k=128, split_k=3)
    for i in (0, 7, 15):
        assert torch.equal(small_m_gemm.small_m_matmul(x[i : i + 1], w, block_k=128, split_k=3), full[i : i + 1])
    assert torch.equal(small_m_gemm.small_m_matmul(x[2:11], w, block_k=128, split_k=3), full[2:11])


def test_split_k_is_chosen_from_the_shape_and_the_sm_count() -> None:
    cpu = torch.device("cpu")  # counts as an H200's 132 SMs
    # never split: every shape one program per column block
    assert small_m_gemm.split_k_for(1024, 3072, cpu, max_split_k=1) == 1
    # 16 x 256 blocks (explicit, whatever the defaults).
    blocks = dict(block_n=16, block_k=256, max_split_k=4)
    assert small_m_gemm.split_k_for(1024, 2048, cpu, **blocks) == 2  # 64 column blocks: two fit on 132 SMs
    assert small_m_gemm.split_k_for(1024, 3072, cpu, **blocks) == 2  # 12 tiles of K: 6 per split
    assert small_m_gemm.split_k_for(2048, 6144, cpu, **blocks) == 1  # 128 blocks: a second set would not fit
    assert small_m_gemm.split_k_for(4096, 1024, cpu, **blocks) == 1  # 256 blocks fill the SMs already
    assert small_m_gemm.split_k_for(64, 256, cpu, **blocks) == 1  # a single K tile cannot split
    assert small_m_gemm.split_k_for(64, 768, cpu, **blocks) == 3  # no more splits than K tiles
    blocks["max_split_k"] = 8
    assert small_m_gemm.split_k_for(256, 1280, cpu, **blocks) == 5  # 16 blocks want 8; 5 tiles, 5 splits of one
    blocks["max_split_k"] = 5
    assert small_m_gemm.split_k_for(256, 1792, cpu, **blocks) == 4  # 7 tiles in 5 splits: runs of 2, so 4
    # The default 32 x 128 blocks, on the 1.7B step's shapes (N, K), at the engine's default maximum of 4.
    assert (small_m_gemm.BLOCK_N, small_m_gemm.BLOCK_K) == (32, 128)
    assert small_m_gemm.split_k_for(1024, 2048, cpu, max_split_k=4) == 4  # code predictor o: 32 blocks
    assert small_m_gemm.split_k_for(1024, 3072, cpu, max_split_k=4) == 4  # code predictor down
    assert small_m_gemm.split_k_for(2048, 2048, cpu, max_split_k=4) == 2  # talker o: 64 blocks, two fit
    assert small_m_gemm.split_k_for(4096, 1024, cpu, max_split_k=4) == 1  # qkv: 128 blocks
    assert small_m_gemm.split_k_for(12288, 2048, cpu, max_split_k=4) == 1  # talker gate_up: 384 blocks
    with pytest.raises(ValueError, match="split K must be 1 to 8, not 9"):
        small_m_gemm.split_k_for(1024, 2048, cpu, max_split_k=9)


def test_the_op_splits_k_as_set(monkeypatch) -> None:
    """`linear` (the compiled blocks' op) splits K for a narrow weight once its maximum is raised."""
    launches = []
    real = small_m_gemm._small_m_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(small_m_gemm, "_small_m_kernel", Spy())
    g = torch.Generator().manual_seed(8)
    # Small integers: every partial sum is exact in float32, so any split order gives the exact product. (With
    # random reals the split sums K in another order: on an H200, 2.8e-5 apart at outputs of ~30.)
    x = torch.randint(-8, 9, (2, 1024), generator=g).float().to(DEVICE)
    w = torch.randint(-8, 9, (32, 1024), generator=g).float().to(DEVICE)
    exact = (x.double() @ w.double().T).float()
    plain = small_m_gemm.linear(x, w, 1)
    assert launches == [(1, 1)]  # 1 column block of 32, unsplit
    split = small_m_gemm.linear(x, w, 2)
    assert launches == [(1, 1), (1, 2)]  # then 2 splits of 4 K tiles each
    assert torch.equal(plain, exact) and torch.equal(split, exact)


def test_small_m_matmul_refuses_what_it_cannot_take() -> None:
    w = torch.zeros(8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="17 rows > SMALL_M_MAX"):
        small_m_gemm.small_m_matmul(torch.zeros(17, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="x has 16 columns, w 32"):
        small_m_gemm.small_m_matmul(torch.zeros(2, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"x is torch\.bfloat16, w torch\.float32"):
        small_m_gemm.small_m_matmul(torch.zeros(2, 32, device=DEVICE, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"split_k 3 outside 1\.\.2 \(K tiles of 16\)"):
        small_m_gemm.small_m_matmul(torch.zeros(2, 32, device=DEVICE), w, block_k=16, split_k=3)


def test_small_m_linear_compiles_as_one_op_and_hands_large_batches_to_f_linear(monkeypatch) -> None:
    """Inside a fullgraph torch.compile region (the fused blocks' use), with dynamic rows: the kernel up to 16 rows,
    F.linear beyond."""
    calls = []
    real = small_m_gemm.small_m_matmul
    monkeypatch.setattr(
        small_m_gemm, "small_m_matmul", lambda x, w, **kw: (calls.append(x.shape[0]), real(x, w, **kw))[1]
    )

    def block(x, w):
        return torch.relu(small_m_gemm.linear(x * 2, w)) + 1

    fn = torch.compile(block, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(9)
    w = torch.randn(32, 64, generator=g).to(DEVICE)
    for rows in (4, 16, 40):
        x = torch.randn(rows, 64, generator=g).to(DEVICE)
        torch.testing.assert_close(fn(x, w), torch.relu(torch.nn.functional.linear(x * 2, w)) + 1)
    assert calls == [4, 16]


def test_gemm_benchmark_sweeps_configs_and_totals_the_step(tmp_path) -> None:
    """benchmarks/kernels/bench_gemm.py end to end on this machine, on the tiny model's shapes."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_gemm", root / "benchmarks" / "kernels" / "bench_gemm.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shapes = bench.layer_shapes("tiny")
    # q|k|v, o, gate|up, down of both stacks; the code predictor's layers run once per pass.
    assert [(s["stack"], s["name"]) for s in shapes][:4] == [("talker", n) for n in ("qkv", "o", "gate_up", "down")]
    assert shapes[4]["calls"] == bench.CODE_PREDICTOR_PASSES * shapes[0]["calls"]
    out = tmp_path / "gemm.json"
    argv = ["bench_gemm.py", "--size", "tiny", "--rows", "2,5", "--configs", "16,32x16x2", "--max-splits", "1,4",
            "--reps", "2", "--iters", "1", "--device", DEVICE, "--out", str(out)]  # fmt: skip
    old, sys.argv = sys.argv, argv
    try:
        bench.main()
    finally:
        sys.argv = old
    result = json.loads(out.read_text())
    assert len(result["shapes"]) == 2 * len(shapes)
    for r in result["shapes"]:
        assert set(r["kernel_us"]) == {"16x16x2", "32x16x2", "16x16x2k4", "32x16x2k4"}
        assert r["best_us"] == min(r["kernel_us"].values())
        # 16-wide K tiles: 2-4 of them, so the split configurations split (as split_k_for chose), the others not.
        assert r["splits"]["16x16x2"] == 1 and r["splits"]["16x16x2k4"] == min(4, r["K"] // 16)
    for step in result["step"]:
        rs = [r for r in result["shapes"] if r["M"] == step["M"]]
        assert step["cublas_ms"] == round(sum(r["calls"] * r["cublas_us"] for r in rs) / 1e3, 3)
        assert step["per_shape_best_ms"] <= step["kernel_ms"] + 1e-3


@pytest.mark.skipif(
    "recompile_limit" not in __import__("inspect").signature(torch.compile).parameters,
    reason="torch.compile takes no per-call recompile limit here",
)
def test_compiled_regions_keep_their_recompile_limit_whatever_the_global() -> None:
    """fused.compiled's regions carry RECOMPILE_LIMIT themselves: with Dynamo's global limit at 1, a region still
    compiles once per dtype (three specialisations) instead of failing under fullgraph."""
    cfg = torch._dynamo.config
    before = cfg.recompile_limit
    rope = fused.compiled("rope")
    positions = torch.arange(4)
    inv_freq = torch.rand(8)
    try:
        cfg.recompile_limit = 1
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            cos, sin = rope(positions, inv_freq, dtype)
            want = positions[:, None].float() * inv_freq
            emb = torch.cat((want, want), -1)
            assert cos.dtype == sin.dtype == dtype
            torch.testing.assert_close(cos.float(), emb.cos().to(dtype).float())
            torch.testing.assert_close(sin.float(), emb.sin().to(dtype).float())
    finally:
        cfg.recompile_limit = before


@pytest.fixture
def compile_options(monkeypatch):
    """The inductor options each of fused's regions is compiled with, in order (torch.compile replaced by a
    recorder), from both of fused's options off; its settings restored afterwards."""
    seen = []

    def fake_compile(fn, **kwargs):
        seen.append(kwargs["options"])
        return fn

    monkeypatch.setattr(fused, "_compile", fake_compile)
    monkeypatch.setattr(fused, "_compiled", {})
    yield seen


def test_emulate_casts_recompiles_the_regions_with_inductors_option(compile_options) -> None:
    """Regions(emulate_casts=True): the regions compiled with it carry emulate_precision_casts (with the
    batch-invariant split_reductions off as before), beside those compiled without it; the same options again take
    the region compiled already."""
    fused.compiled("rope")
    assert compile_options[-1] == {"split_reductions": False, "emulate_precision_casts": False}
    fused.compiled("rope", fused.Regions(emulate_casts=False))
    assert len(compile_options) == 1  # the same options: the region stays
    cos, sin = fused.compiled("rope", fused.Regions(emulate_casts=True))(torch.arange(3), torch.rand(4), torch.float32)
    assert compile_options[-1] == {"split_reductions": False, "emulate_precision_casts": True}
    assert len(compile_options) == 2 and cos.shape == sin.shape == (3, 8)


def test_deterministic_mode_compiles_the_regions_without_timed_reduction_configs(compile_options) -> None:
    """Regions(deterministic=True): the regions compiled with it carry inductor's deterministic option (a
    reduction's configuration by rule, not by timing on first use), beside those compiled without it."""
    if not hasattr(torch._inductor.config, "deterministic"):
        pytest.skip("this torch has no deterministic mode in inductor")
    fused.compiled("rope")
    assert "deterministic" not in compile_options[-1]
    assert fused.Regions(deterministic=True).deterministic
    fused.compiled("rope", fused.Regions(deterministic=True))
    assert compile_options[-1]["deterministic"] is True and compile_options[-1]["split_reductions"] is False

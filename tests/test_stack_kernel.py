"""The one-kernel decoder stack (qwen_tts/fastpath/stack/: the CUDA kernel of stack_cuda.cu over the weights
stack_kernel.StackWeights re-lays) computes what the eager `DecoderStack` computes.

Without a GPU the layouts, the options and the source are checked; the kernel itself runs on CUDA only.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import shutil
import subprocess
import weakref
from pathlib import Path

import pytest
import torch

from qwen_tts.fastpath import fused
from qwen_tts.fastpath.decode_attention import HAVE_TRITON
from qwen_tts.fastpath.stack import stack_cuda, stack_kernel
from qwen_tts.fastpath.stack.stack_cuda import StackOptions
from qwen_tts.fastpath.stack.stack_kernel import StackKernel
from qwen_tts.model.config import DecoderLayersConfig
from qwen_tts.model.layers import DecoderStack
from qwen_tts.model.random_checkpoint import layer_stack

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CACHE_LEN = 16  # the code predictor's

# (hidden, intermediate, layers, q heads, kv heads, head dim): the tiny checkpoints' code predictors (a hidden width
# that is not a power of two among them), one with every matmul split over K, and GQA groups of one and four.
SHAPES = {
    "tiny": (32, 64, 2, 2, 1, 16),
    "tiny-mtp": (24, 48, 2, 2, 1, 16),
    "split": (256, 512, 2, 4, 2, 64),
    "group4": (64, 96, 1, 4, 1, 32),
}


def make_stack(shape, dtype, seed=0):
    cfg = DecoderLayersConfig(
        **layer_stack(*shape), rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64, vocab_size=8
    )
    torch.manual_seed(seed)
    ref = DecoderStack(cfg)
    with torch.no_grad():
        for p in ref.parameters():  # norm weights around 1, matrices with outputs of order 1
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) / p.shape[1] ** 0.5)
    ref = ref.to(DEVICE, dtype)
    kern = copy.deepcopy(ref)
    FUSED[kern] = fused.fuse(kern)
    KERNELS[kern] = StackKernel(kern, FUSED[kern], CACHE_LEN, OPTIONS.current)
    return ref, kern


class _Options:
    """The kernel's options a test sets (`cuda_options`); the helpers below run the kernel with them."""

    current = StackOptions()

    def __call__(self, **changes) -> dict:
        if changes:
            self.current = self.current.replace(**changes)
        return dataclasses.asdict(self.current)


OPTIONS = _Options()
FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a stack's layers' fused weights
KERNELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a stack's StackKernel


def weights(kern):
    return KERNELS[kern].weights


def stack_pass(kern, x, positions, cache, slots, phase_range=None):
    k = KERNELS[kern]
    k.options = OPTIONS.current
    return k.stack_pass(x, positions, cache, slots, phase_range)


def runs(kern, x, cache) -> bool:
    k = KERNELS.get(kern)
    if k is None:
        return False
    k.options = OPTIONS.current
    return k.runs(x, cache)


def step(kern, x, positions, cache, slots, shared_slots=False):
    """What the fast path's stack_step does: the kernel where it takes the pass, else the fused path's kernels."""
    if runs(kern, x, cache):
        return stack_pass(kern, x, positions, cache, slots)
    return fused.stack_step(kern, FUSED[kern], x, positions, cache, slots, shared_slots=shared_slots)


def layout(sw, max_len, nblk, rows=stack_cuda.MAX_ROWS):
    return stack_cuda.layout(sw, max_len, nblk, rows, OPTIONS.current)


def device_layout(sw, max_len, device, rows=stack_cuda.MAX_ROWS):
    return stack_cuda.device_layout(sw, max_len, device, rows, OPTIONS.current)


def blocks(sw, max_len, device):
    return stack_cuda.blocks(sw, max_len, device, OPTIONS.current)


def cuda_prepare(sw, max_len, device):
    return stack_cuda.prepare(sw, max_len, device, OPTIONS.current)


def cuda_runs(sw, x, cache):
    return stack_cuda.runs(sw, x, cache, OPTIONS.current)


def eager(stack, x, positions, cache, slots):
    with torch.no_grad():
        return stack(x[:, None], positions[:, None], cache, slots, CACHE_LEN)[:, 0]


def test_rows_sharing_a_slot_see_each_others_keys() -> None:
    """The code predictor's two prompt tokens as two rows of one pass (fused.stack_step's shared_slots): row 1 at
    position 1 attends to row 0's key at position 0, written in the same pass. Equals the eager stack run on the
    two tokens as one sequence."""
    ref, kern = make_stack(SHAPES["split"], torch.float32)
    H = SHAPES["split"][0]
    c_ref, c_kern = (
        ref.new_cache(3, CACHE_LEN, DEVICE, torch.float32),
        kern.new_cache(3, CACHE_LEN, DEVICE, torch.float32),
    )
    x = torch.randn(2, 2, H, generator=torch.Generator().manual_seed(2)).to(DEVICE)  # two sequences of two tokens
    slots = torch.tensor([1, 2], device=DEVICE)
    with torch.no_grad():
        want = ref(x, torch.arange(2, device=DEVICE).expand(2, 2), c_ref, slots, CACHE_LEN)
    got = step(kern, x.reshape(4, H), torch.tensor([0, 1, 0, 1], device=DEVICE), c_kern,
               slots.repeat_interleave(2), shared_slots=True)  # fmt: skip
    assert (got.view(2, 2, H) - want).abs().max().item() < 2e-5 * want.abs().max().item()
    assert (c_kern.k - c_ref.k).abs().max().item() < 1e-4


def test_the_layers_parameters_are_views_of_the_stacked_weights() -> None:
    """enable() re-lays the weights (one tensor per kind for all layers) without copying: the state dict is the same
    and each parameter shares the stacked tensor's storage, so loading weights in place reaches the kernel."""
    ref, kern = make_stack(SHAPES["tiny"], torch.float32)
    want = ref.state_dict()
    got = kern.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    sw = weights(kern)
    lay = kern.layers[1]
    assert lay.self_attn.k_proj.weight.data_ptr() == sw.w_qkv[1, 2 * 16 :].data_ptr()
    assert lay.mlp.up_proj.weight.data_ptr() == sw.w_gate_up[1, 64:].data_ptr()
    assert lay.self_attn.k_norm.weight.data_ptr() == sw.qk_norm[1, 1].data_ptr()
    with torch.no_grad():
        lay.mlp.down_proj.weight.mul_(2)
    assert torch.equal(sw.w_down[1], lay.mlp.down_proj.weight)


def test_what_the_kernel_does_not_take() -> None:
    ref, kern = make_stack(SHAPES["tiny"], torch.float32)
    cache = kern.new_cache(17, CACHE_LEN, DEVICE, torch.float32)
    x = torch.zeros(17, 32, device=DEVICE)
    assert not runs(ref, x[:2], cache)  # not taken
    with pytest.raises(ValueError, match="0 fused layers for a stack of 2"):
        StackKernel(copy.deepcopy(ref), [], CACHE_LEN, StackOptions())
    # the CUDA kernel: bf16 on a GPU only, at most four rows
    assert not runs(kern, x[:2], cache)  # float32
    assert not runs(kern, x[:5].bfloat16(), kern.new_cache(5, CACHE_LEN, DEVICE, torch.bfloat16))
    with pytest.raises(ValueError, match="runs phases from 0"):
        stack_pass(kern, x[:2], torch.zeros(2, dtype=torch.long), cache, torch.arange(2), phase_range=(1, 3))


# The CUDA kernel (stack_cuda.cu): bf16 passes of at most four rows, one persistent launch with the weights copied
# into shared memory a phase ahead of the grid wait.
FULL = (1024, 3072, 5, 16, 8, 128)  # the code predictor of both sizes


def test_cuda_kernel_layout_fits_an_h200_with_the_code_predictor() -> None:
    """The 1.7B/0.6B code predictor on 132 SMs: a block's largest weight share is 48 gate|up rows of 1024 (96 KiB),
    two slots of it and four rows of activations fit the H200's 227 KiB a block; a longer cache takes the chunked
    attention; a width that 16-byte copies cannot take or a smaller shared memory are refused with the reason."""
    from qwen_tts.fastpath.stack import stack_cuda

    H, inter, L, nq, nkv, D = FULL
    lay = stack_cuda.Layout(H=H, I=inter, D=D, NQ=nq, NKV=nkv, L=L, T=CACHE_LEN, nblk=132)
    assert lay.slot_bytes == 48 * 1024 * 2
    assert lay.act_bytes == 4 * 3072 * 2
    assert lay.res_rows == 48  # the gate|up share
    # ... and the norm weights staged during the grid wait: 2 KiB, 5.6 KiB to spare.
    assert lay.shared_bytes == 2 * 98304 + 24576 + 32 + 48 * 16 + 8 * 16 + 16 * 128 + 4 * 128 + 2048 <= 232448
    assert stack_cuda.why_not(lay, 232448) is None
    # 512 threads: sixteen warps' sums of squares and raw vectors (the short cache's scratch outgrows the rows'
    # activations: keys and values of 17 positions, two queries, their scores, a vector a warp).
    wide = stack_cuda.Layout(**{**lay.__dict__, "threads": 512})
    assert wide.warps == 16 and wide.att_warps == 8
    assert wide.act_bytes == 4 * (2 * CACHE_LEN * 128 + 2 * 128 + 2 * CACHE_LEN + 16 * 128) > lay.act_bytes
    assert wide.shared_bytes == lay.shared_bytes - lay.act_bytes + wide.act_bytes + 8 * 16 <= 232448
    assert stack_cuda.why_not(wide, 232448) is None
    assert "multiple of 32" in stack_cuda.why_not(stack_cuda.Layout(**{**lay.__dict__, "threads": 500}), 232448)
    longer = stack_cuda.Layout(**{**lay.__dict__, "T": 64})  # attention in chunks (the talker's: below)
    assert longer.long and not lay.long and stack_cuda.why_not(longer, 232448) is None
    assert "multiples of 8" in stack_cuda.why_not(stack_cuda.Layout(**{**lay.__dict__, "H": 1020}), 232448)
    assert "shared memory" in stack_cuda.why_not(lay, 101376)  # a consumer GPU's 99 KiB


def assert_builds_for_hopper_without_spills(lay, tmp_path) -> None:
    """The layout's source builds for sm_90 with nvcc (NVRTC's front end), and neither the kernel nor any function
    it calls out of line spills registers."""
    src = tmp_path / "k.cu"
    src.write_text(lay.source())
    res = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"), str(src)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    spills = re.findall(r"(\d+) bytes spill stores", res.stderr)
    assert "cp_stack_pass" in res.stderr and spills and set(spills) == {"0"}, res.stderr[-3000:]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"threads": 512},
    ],
    ids=["default", "t512"],
)
@pytest.mark.parametrize("shape", ["full", "tiny-mtp"])
def test_cuda_kernel_source_compiles_for_hopper_without_spills(shape, opts, tmp_path) -> None:
    """The source the engine hands NVRTC, for the code predictor's shape and a tiny one and each option, builds for
    sm_90 with nvcc (the same front end) and its registers do not spill."""
    from qwen_tts.fastpath.stack import stack_cuda

    H, inter, L, nq, nkv, D = FULL if shape == "full" else SHAPES[shape]
    lay = stack_cuda.Layout(H=H, I=inter, D=D, NQ=nq, NKV=nkv, L=L, T=CACHE_LEN, nblk=132, **opts)
    assert_builds_for_hopper_without_spills(lay, tmp_path)


def relative_errors(a, b):
    """The relative RMS and the largest difference of a from the float32 b."""
    d = a.float() - b
    return (d.square().mean() / b.square().mean()).sqrt().item(), d.abs().max().item()


def assert_as_close_as_eager(triples, step) -> None:
    """Each (ours, the eager bf16 stack's, float32): ours as close to float32 as the eager bf16 one, relative RMS
    within 1.5x and the largest difference within 2x, the eager error floored at one bf16 rounding."""
    for ours, theirs, exact_t in triples:
        (rms, big), (rms_e, big_e) = relative_errors(ours, exact_t), relative_errors(theirs, exact_t)
        one = 2**-8 * exact_t.abs().max().item()
        assert rms <= 1.5 * max(rms_e, 2**-9) and big <= 2 * max(big_e, one), (step, rms, rms_e, big, big_e)


def assert_batch_invariant_and_replayable(kern, x, pos, slots, base) -> None:
    """Each row alone (from the cache `base`) gets the bits it gets in the batch of all; a CUDA graph replay of the
    batch gets the eager launch's output and cache; the counters end at zero."""
    cache = copy.deepcopy(base)
    batch = stack_pass(kern, x, pos, cache, slots)
    for i in range(x.shape[0]):
        alone = stack_pass(kern, x[i : i + 1], pos[i : i + 1], copy.deepcopy(base), slots[i : i + 1])
        assert torch.equal(alone[0], batch[i]), i
    graphed = copy.deepcopy(base)
    stack_pass(kern, x, pos, copy.deepcopy(base), slots)  # compiled and warmed outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = stack_pass(kern, x, pos, graphed, slots)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, batch)
    assert torch.equal(graphed.k, cache.k) and torch.equal(graphed.v, cache.v)
    assert not stack_kernel.prepare(DEVICE).any()


def make_cuda_stack(dims, seed=0):
    return make_stack(dims, torch.bfloat16, seed)


@pytest.fixture
def cuda_options():
    """The kernel's options for a test that sets them (`OPTIONS`; back to the defaults after it)."""
    OPTIONS.current = StackOptions()
    yield OPTIONS
    OPTIONS.current = StackOptions()


# A case's option (non-default) for the CUDA kernel: the name in the test's id, then the stack_cuda option.
OPTION_CASES = {
    "chunked": {"chunked": True},
    "splitbar": {"split_barrier": True},
    "t512": {"threads": 512},
}
# And a long cache's: chunks of at least 128 positions; its cached keys staged, with chunks of 64 (the default), 192
# (one a row up to 192 positions, each staged whole) and 256 (a chunk's positions past the 192 a slot holds read
# from the cache).
LONG_OPTION_CASES = {
    **OPTION_CASES,
    "chunk128": {"chunk": 128},
    "stage": {"stage": True},
    "stage192": {"stage": True, "chunk": 192},
    "stage256": {"stage": True, "chunk": 256},
    "split32": {"split": 32},
    "split64": {"split": 64},
    "chunk128split64": {"chunk": 128, "split": 64},
}
CUDA_CASES = [
    (shape, rows, "default") for shape in ("full", "split", "group4", "tiny", "tiny-mtp") for rows in (1, 2, 4)
]
CUDA_CASES += [(shape, 3, opt) for shape in ("full", "tiny-mtp") for opt in OPTION_CASES]


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA kernel needs a GPU")
@pytest.mark.parametrize(("shape", "rows", "opts"), CUDA_CASES)
def test_cuda_kernel_equals_the_eager_stack_over_positions(shape, rows, opts, cuda_options) -> None:
    """Passes at positions 0-4 of rows in scattered slots, against the same weights in float32: the kernel's output
    and the K/V it writes are as close to float32 as the eager bf16 stack's (relative RMS within 1.5x, largest
    difference within 2x, the eager error floored at one bf16 rounding); the barrier is back at zero, unwritten slots
    stay zero. (Against the eager bf16 stack itself two implementations' roundings add up: at the code predictor's
    five layers and four rows the largest difference reached 0.094 at an output scale of 5.) Options: attention by
    the long cache's code; four arrival counters; blocks of 512 threads."""

    cuda_options(**OPTION_CASES.get(opts, {}))
    dims = FULL if shape == "full" else SHAPES[shape]
    ref, kern = make_cuda_stack(dims)
    exact = copy.deepcopy(ref).float()
    H = dims[0]
    c_ref, c_kern = (s.new_cache(rows + 2, CACHE_LEN, DEVICE, torch.bfloat16) for s in (ref, kern))
    c_exact = exact.new_cache(rows + 2, CACHE_LEN, DEVICE, torch.float32)
    slots = torch.tensor([rows + 1, 0, 3, 2][:rows], device=DEVICE)
    assert cuda_runs(weights(kern), torch.zeros(rows, H, device=DEVICE, dtype=torch.bfloat16), c_kern)
    g = torch.Generator().manual_seed(5)
    for t in range(5):
        x = torch.randn(rows, H, generator=g).to(DEVICE, torch.bfloat16)
        pos = torch.full((rows,), t, device=DEVICE)
        want = eager(exact, x.float(), pos, c_exact, slots)
        base = eager(ref, x, pos, c_ref, slots)
        got = stack_pass(kern, x, pos, c_kern, slots)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        assert_as_close_as_eager(((got, base, want), (c_kern.k, c_ref.k, c_exact.k), (c_kern.v, c_ref.v, c_exact.v)), t)
    assert not c_kern.k[:, 1].any() and not c_kern.v[:, 1].any()
    assert not stack_kernel.prepare(DEVICE).any()


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA kernel needs a GPU")
@pytest.mark.parametrize("chunked", [False, True])
def test_cuda_kernel_rows_sharing_a_slot_see_each_others_keys(chunked, cuda_options) -> None:
    """The code predictor's two prompt tokens as two rows of one pass, for two sequences (four rows): each second
    row attends to its first row's key written in the same pass. Equals the eager stack on the two-token sequences.
    Both attention codes: the short cache's and the long cache's (option `chunked`)."""
    cuda_options(chunked=chunked)
    ref, kern = make_cuda_stack(FULL)
    H = FULL[0]
    c_ref, c_kern = (s.new_cache(3, CACHE_LEN, DEVICE, torch.bfloat16) for s in (ref, kern))
    x = torch.randn(2, 2, H, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    slots = torch.tensor([1, 2], device=DEVICE)
    with torch.no_grad():
        want = ref(x, torch.arange(2, device=DEVICE).expand(2, 2), c_ref, slots, CACHE_LEN)
    got = step(kern, x.reshape(4, H), torch.tensor([0, 1, 0, 1], device=DEVICE), c_kern,
               slots.repeat_interleave(2), shared_slots=True)  # fmt: skip
    scale = want.float().abs().max().item()
    assert (got.view(2, 2, H).float() - want.float()).abs().max().item() <= 2 * 2**-7 * scale
    assert (c_kern.k.float() - c_ref.k.float()).abs().max().item() <= 2 * 2**-7 * c_ref.k.float().abs().max().item()


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA kernel needs a GPU")
@pytest.mark.parametrize("opts", ["default"])
def test_cuda_kernel_gives_a_row_the_same_bits_alone_in_a_batch_and_replayed(opts, cuda_options) -> None:
    """Batch invariance (a row alone and among four: the same bits) and CUDA graph capture (a replay gives the eager
    launch's bits), on the code predictor's shape."""
    cuda_options(**OPTION_CASES.get(opts, {}))
    _, kern = make_cuda_stack(FULL)
    H = FULL[0]
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    pos = torch.ones(4, dtype=torch.long, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    base = kern.new_cache(4, CACHE_LEN, DEVICE, torch.bfloat16)
    base.k.normal_(generator=torch.Generator(device=DEVICE).manual_seed(6))
    base.v.normal_(generator=torch.Generator(device=DEVICE).manual_seed(7))
    assert_batch_invariant_and_replayable(kern, x, pos, slots, base)


# A long cache (the talker's): attention_long, in chunks of at least stack_cuda.CHUNK positions, at most
# Layout.max_chunks a (row, kv head), the chunks' partial softmax sums combined by the last chunk to finish.
TALKER_06B = (1024, 3072, 28, 16, 8, 128)  # the 0.6B's talker layer is the code predictor's, 28 of them


def test_cuda_kernel_layout_takes_the_06b_talker_with_its_long_cache() -> None:
    """The 0.6B's talker with the engine's cache (3,088 positions at the defaults) fits an H200's SMs: the same weight
    slots as the code predictor, attention's scratch within the activations' bytes, 4 chunks' partials a (row, kv
    head); the 1.7B's talker layer (a gate|up share of 2 x 47 rows of 2048) does not, and the reason says why."""
    from qwen_tts.fastpath.stack import stack_cuda

    H, inter, L, nq, nkv, D = TALKER_06B
    lay = stack_cuda.Layout(H=H, I=inter, D=D, NQ=nq, NKV=nkv, L=L, T=3088, nblk=132)
    assert lay.long and not stack_cuda.Layout(H=H, I=inter, D=D, NQ=nq, NKV=nkv, L=5, T=32, nblk=132).long
    assert lay.slot_bytes == 48 * 1024 * 2 and lay.act_bytes == 4 * 3072 * 2
    g = nq // nkv
    assert 2 * 2 * 4 * D + 4 * (g * D + 8 * D + 8 * g * (D + 2) + 1) <= lay.act_bytes  # attention's scratch fits
    assert lay.max_chunks == 4  # 132 SMs over 4 rows of 8 kv heads: every unit of a pass at once
    assert lay.partial_floats == 4 * nkv * 4 * g * (D + 2)
    assert stack_cuda.why_not(lay, 232448) is None
    big = stack_cuda.Layout(H=2048, I=6144, D=D, NQ=nq, NKV=nkv, L=L, T=3088, nblk=132)
    assert big.slot_bytes == 2 * 47 * 2048 * 2
    assert "shared memory" in stack_cuda.why_not(big, 232448)
    many = stack_cuda.Layout(H=H, I=inter, D=D, NQ=32, NKV=32, L=L, T=3088, nblk=132)
    assert "kv heads" in stack_cuda.why_not(many, 232448)  # more (row, kv head) counters than the barrier holds


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize(
    ("shape", "opts"),
    [("talker", ""), ("tiny-mtp", ""), ("split", ""), ("talker", "stage"), ("split", "stage"),
     ("talker", "stage+split32")],
)  # fmt: skip
def test_cuda_kernel_long_cache_source_compiles_for_hopper_without_spills(shape, opts, tmp_path) -> None:
    """The long-cache source (attention_long) for the 0.6B talker's shape and two small head widths (16 and 64:
    lanes without an element, two elements a lane) builds for sm_90 without spills; with the cached keys staged."""
    from qwen_tts.fastpath.stack import stack_cuda

    H, inter, L, nq, nkv, D = TALKER_06B if shape == "talker" else SHAPES[shape]
    extra = {k: v for o in opts.split("+") if o for k, v in LONG_OPTION_CASES[o].items()}
    lay = stack_cuda.Layout(H=H, I=inter, D=D, NQ=nq, NKV=nkv, L=L, T=3088, nblk=132, **extra)
    assert_builds_for_hopper_without_spills(lay, tmp_path)


LONG_LEN = 700  # positions up to 699: past the most chunks of 64 (4 for the talker's 8 kv heads), so chunks grow
LONG_SHAPE = (1024, 3072, 2, 16, 8, 128)  # the talker's layer, two of them
LONG_CASES = [(shape, rows, "default") for shape in ("talker", "split", "tiny-mtp") for rows in (1, 2, 4)]
LONG_CASES += [("talker", 4, "chunk128"), ("split", 2, "chunk128")]  # chunks of 128 positions at least: 1-4 a row
LONG_CASES += [("talker", 2, "t512")]  # blocks of 512 threads (attention's positions still over 8 warps)
LONG_CASES += [("talker", 4, "stage"), ("split", 2, "stage"), ("tiny-mtp", 3, "stage")]  # cached keys staged
LONG_CASES += [("talker", 4, "stage192"), ("talker", 4, "stage256")]  # staged whole, and past a slot's 192
# Past the chunk, shorter chunks: split32 gives 1, 4, 4 and 4 chunks at those positions; chunk128split64 1, 1, 3, 4.
LONG_CASES += [("talker", 4, "split32"), ("split", 2, "split32"), ("talker", 4, "chunk128split64")]


def long_positions(rows: int, step: int) -> list[int]:
    """Positions whose rows have 1, 2, 3 and the most chunks of the talker's shape (4 of 173 positions), moving
    with the step."""
    return [5 + step, 100 + step, 150 + step, 690 + step][:rows]


def filled_caches(stacks, rows: int, positions: list[int], slots: list[int], seed: int):
    """Caches of LONG_LEN positions for each stack, the same random bf16 keys and values before each row's position
    (float32 for a float32 stack)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    caches = [s.new_cache(rows + 2, LONG_LEN, DEVICE, next(s.parameters()).dtype) for s in stacks]
    for p, s in zip(positions, slots, strict=True):
        for t in ("k", "v"):
            vals = torch.randn(getattr(caches[0], t)[:, s, :, :p].shape, generator=g, device=DEVICE)
            for c in caches:
                getattr(c, t)[:, s, :, :p] = vals.to(torch.bfloat16).to(getattr(c, t).dtype)
    return caches


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA kernel needs a GPU")
@pytest.mark.parametrize(("shape", "rows", "opts"), LONG_CASES)
def test_cuda_kernel_with_a_long_cache_equals_the_eager_stack(shape, rows, opts, cuda_options) -> None:
    """Rows at positions with 1, 2, 3 and 4 chunks over three passes, in scattered slots of a 700-position cache
    holding random keys: the output and the K/V written as close to float32 as the eager bf16 stack's (the same
    bounds as the short cache's test); the attention counters back at zero; unwritten slots and positions zero.
    chunk128: chunks of at least 128 positions (so 1, 1, 2 and 4 chunks at those positions); stage: each unit's cached keys and values staged in shared memory;
    stage192: so, in chunks of 192 (1, 1, 1 and 4 chunks, each staged whole); stage256: in chunks of 256 (the last
    row's 3 chunks of 231 positions: 39 a chunk past the 192 staged)."""

    cuda_options(**LONG_OPTION_CASES.get(opts, {}))
    dims = LONG_SHAPE if shape == "talker" else SHAPES[shape]
    ref, kern = make_cuda_stack(dims)
    exact = copy.deepcopy(ref).float()
    H = dims[0]
    slot_list = [rows + 1, 0, 3, 2][:rows]
    slots = torch.tensor(slot_list, device=DEVICE)
    c_ref, c_kern, c_exact = filled_caches((ref, kern, exact), rows, long_positions(rows, 0), slot_list, seed=11)
    assert cuda_runs(weights(kern), torch.zeros(rows, H, device=DEVICE, dtype=torch.bfloat16), c_kern)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(rows, H, generator=g).to(DEVICE, torch.bfloat16)
            pos = torch.tensor(long_positions(rows, step), device=DEVICE)
            want = exact(x.float()[:, None], pos[:, None], c_exact, slots, LONG_LEN)[:, 0]
            base = ref(x[:, None], pos[:, None], c_ref, slots, LONG_LEN)[:, 0]
            got = stack_pass(kern, x, pos, c_kern, slots)
            triples = ((got, base, want), (c_kern.k, c_ref.k, c_exact.k), (c_kern.v, c_ref.v, c_exact.v))
            assert_as_close_as_eager(triples, step)
    assert not c_kern.k[:, 1].any() and not c_kern.v[:, 1].any()
    assert not c_kern.k[:, slot_list[0], :, 8:].any()  # the first row wrote positions 5-7 only
    assert not stack_kernel.prepare(DEVICE).any()


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA kernel needs a GPU")
@pytest.mark.parametrize("opts", ["default", "stage"])
def test_cuda_kernel_with_a_long_cache_rows_sharing_a_slot_see_each_others_keys(opts, cuda_options) -> None:
    """Two rows of one slot at positions 299 and 300 (in the last of the second row's four chunks) after 299 cached
    positions, as a two-token step of the eager stack: the second row attends to the first's key written in the same
    pass. stage: that chunk's cached keys staged, up to the first row's position only."""
    cuda_options(**LONG_OPTION_CASES.get(opts, {}))
    ref, kern = make_cuda_stack(LONG_SHAPE)
    H = LONG_SHAPE[0]
    c_ref, c_kern = filled_caches((ref, kern), 2, [299], [1], seed=3)
    x = torch.randn(1, 2, H, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    slots = torch.tensor([1], device=DEVICE)
    pos = torch.tensor([[299, 300]], device=DEVICE)
    with torch.no_grad():
        want = ref(x, pos, c_ref, slots, LONG_LEN)
    got = stack_pass(kern, x[0], pos[0], c_kern, slots.repeat(2))
    scale = want.float().abs().max().item()
    assert (got.float() - want[0].float()).abs().max().item() <= 2 * 2**-7 * scale
    k_scale = c_ref.k.float().abs().max().item()
    assert (
        c_kern.k[:, 1, :, 299:301].float() - c_ref.k[:, 1, :, 299:301].float()
    ).abs().max().item() <= 2 * 2**-7 * k_scale


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA kernel needs a GPU")
@pytest.mark.parametrize("opts", ["default", "stage192", "split32"])
def test_cuda_kernel_with_a_long_cache_gives_a_row_the_same_bits_alone_in_a_batch_and_replayed(opts, cuda_options):
    """Batch invariance with chunked attention (a row alone and among four: the same bits; each row's chunks depend
    on its position only) and a graph replay giving the eager launch's bits, with the talker's layer shape; also
    with the cached keys staged in chunks of 192 (which block stages a unit changes with the rows, its sums do not),
    and staged with the matmuls on the tensor cores."""
    cuda_options(**LONG_OPTION_CASES.get(opts, {}))
    _, kern = make_cuda_stack(LONG_SHAPE)
    H = LONG_SHAPE[0]
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    pos = torch.tensor(long_positions(4, 0), device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    base = kern.new_cache(4, LONG_LEN, DEVICE, torch.bfloat16)
    base.k.normal_(generator=torch.Generator(device=DEVICE).manual_seed(6))
    base.v.normal_(generator=torch.Generator(device=DEVICE).manual_seed(7))
    assert_batch_invariant_and_replayable(kern, x, pos, slots, base)


def test_the_lean_grid_keeps_every_blocks_largest_share() -> None:
    """The lean grid's block count: on an H200's 132 SMs the code predictor's layer and the 0.6B talker's (4,096
    q|k|v, 1,024 o and down, 3,072 gate and 3,072 up rows) keep 32, 8, 24 and 24 rows a block and 4 attention chunks
    on 128 blocks, and one block fewer would give some block more; the 1.7B talker's layer (6,144 gate rows: 47 a
    block) needs 131; a device with fewer SMs than that keeps them all."""
    from qwen_tts.fastpath.stack import stack_cuda

    def lay(dims, T, n):
        H, inter, L, nq, nkv, D = dims
        return stack_cuda.Layout(H=H, I=inter, D=D, NQ=nq, NKV=nkv, L=L, T=T, nblk=n)

    for dims, T in ((FULL, CACHE_LEN), (TALKER_06B, 3088)):
        assert stack_cuda.lean_blocks(lay(dims, T, 1), 132) == 128
        full, lean, fewer = lay(dims, T, 132), lay(dims, T, 128), lay(dims, T, 127)
        assert (lean.slot_bytes, lean.res_rows, lean.max_chunks) == (full.slot_bytes, full.res_rows, full.max_chunks)
        assert fewer.res_rows > full.res_rows  # 2 x 25 gate|up rows
        assert lean.shared_bytes == full.shared_bytes
    assert stack_cuda.lean_blocks(lay((2048, 6144, 28, 16, 8, 128), 3088, 1), 132) == 131
    assert stack_cuda.lean_blocks(lay(FULL, CACHE_LEN, 1), 100) == 100  # 41 q|k|v rows a block; 99 would give 42


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA kernel needs a GPU")
@pytest.mark.parametrize("long", [False, True], ids=["short-cache", "long-cache"])
def test_cuda_kernel_launches_on_the_lean_grid(long) -> None:
    """The kernel's grid on this device is the lean grid (the fewest blocks that keep each block's largest share of
    every phase), for the short cache (the code predictor's) and the long one (the talker's)."""
    from qwen_tts.fastpath.stack import stack_cuda

    dims = LONG_SHAPE if long else FULL
    _, kern = make_cuda_stack(dims)
    T = LONG_LEN if long else CACHE_LEN
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    lay = stack_cuda.Layout(H=dims[0], I=dims[1], D=dims[5], NQ=dims[3], NKV=dims[4], L=dims[2], T=T, nblk=1)
    assert blocks(weights(kern), T, DEVICE) == stack_cuda.lean_blocks(lay, sms)


# Options that change how, not what: the same sums in the same order.
SAME_BITS = ["t512"]


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA kernel needs a GPU")
@pytest.mark.parametrize("opt", SAME_BITS)
@pytest.mark.parametrize("shape", ["full", "split"])
def test_cuda_kernel_options_give_the_defaults_bits(shape, opt, cuda_options) -> None:
    """Each option that changes how the kernel works, not its sums, against the defaults: the same output and K/V
    bits over eight passes of four rows, two of them sharing a slot at consecutive positions (the second attends to
    the first's key of the same pass), the others in scattered slots. t512: blocks of 512 threads (each warp fewer
    rows)."""
    dims = FULL if shape == "full" else SHAPES[shape]
    _, kern = make_cuda_stack(dims)
    H = dims[0]
    slots = torch.tensor([5, 0, 3, 3], device=DEVICE)
    defaults = cuda_options()
    results = []
    for opts in ({}, OPTION_CASES[opt]):
        cuda_options(**{**defaults, **opts})
        cache = kern.new_cache(6, CACHE_LEN, DEVICE, torch.bfloat16)
        g = torch.Generator().manual_seed(9)
        outs = []
        with torch.no_grad():
            for t in range(8):
                x = torch.randn(4, H, generator=g).to(DEVICE, torch.bfloat16)
                pos = torch.tensor([t, t, 2 * t, 2 * t + 1], device=DEVICE)
                outs.append(stack_pass(kern, x, pos, cache, slots))
        results.append((torch.stack(outs), cache.k.clone(), cache.v.clone()))
    for base, changed in zip(*results, strict=True):
        assert torch.equal(base, changed)
    assert results[1][1][:, 3, :, :16].abs().sum() > 0 and not results[1][1][:, 1].any()
    assert not stack_kernel.prepare(DEVICE).any()


# The same for a long cache (the talker's attention in chunks).
LONG_SAME_BITS = ["t512", "stage", "split64"]


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA kernel needs a GPU")
@pytest.mark.parametrize("opt", LONG_SAME_BITS)
def test_cuda_kernel_long_cache_options_give_the_defaults_bits(opt, cuda_options) -> None:
    """Options that change how a long cache's attention works, not its sums, against the defaults, over five passes
    of four rows in a 700-position cache of random keys: rows with one and three chunks, and two rows of one slot at
    consecutive positions in the first round of one chunk (the second attends to the first's key of the same pass,
    which the cache does not hold yet). t512: blocks of 512 threads (attention's positions still over 8 warps); stage: the cached keys and values staged in shared memory (never the one the second row
    reads from the pass); split64: past the chunk of 64, chunks of 64 (the default's rule by the other expression)."""
    _, kern = make_cuda_stack(LONG_SHAPE)
    H = LONG_SHAPE[0]
    slot_list = [5, 0, 3, 3]
    slots = torch.tensor(slot_list, device=DEVICE)
    defaults = cuda_options()
    results = []
    for opts in ({}, LONG_OPTION_CASES[opt]):
        cuda_options(**{**defaults, **opts})
        (cache,) = filled_caches((kern,), 4, [5, 150, 60, 60], slot_list, seed=17)
        g = torch.Generator().manual_seed(9)
        outs = []
        with torch.no_grad():
            for t in range(5):
                x = torch.randn(4, H, generator=g).to(DEVICE, torch.bfloat16)
                pos = torch.tensor([5 + t, 150 + t, 60 + 2 * t, 61 + 2 * t], device=DEVICE)
                outs.append(stack_pass(kern, x, pos, cache, slots))
        results.append((torch.stack(outs), cache.k.clone(), cache.v.clone()))
    for base, changed in zip(*results, strict=True):
        assert torch.equal(base, changed)
    assert results[1][1][:, 3, :, 69].abs().sum() > 0 and not results[1][1][:, 3, :, 70:].any()
    assert not stack_kernel.prepare(DEVICE).any()


def test_the_stage_option_stages_a_long_caches_keys_in_a_free_weight_slot(cuda_options) -> None:
    """stage: the 0.6B talker's unit stages up to 192 positions (a 96 KiB slot of 128-wide keys and values); the
    layout adds the staged keys' mbarrier and count (16 bytes) and still fits an H200's shared memory; a short cache
    (the code predictor's, measured slower staged) is not staged and its layout is the default's."""
    from qwen_tts.fastpath.stack import stack_cuda

    H, inter, L, nq, nkv, D = TALKER_06B
    plain = stack_cuda.Layout(H=H, I=inter, D=D, NQ=nq, NKV=nkv, L=L, T=3088, nblk=128)
    staged = stack_cuda.Layout(H=H, I=inter, D=D, NQ=nq, NKV=nkv, L=L, T=3088, nblk=128, stage=True)
    assert staged.staged and not plain.staged and staged.stage_positions == 192
    assert 4 * D * staged.stage_positions <= staged.slot_bytes < 4 * D * (staged.stage_positions + 1)
    assert staged.shared_bytes == plain.shared_bytes + 16 and stack_cuda.why_not(staged, 232448) is None
    assert "constexpr int STAGE = 1;" in staged.source() and "constexpr int STAGE_POS = 192;" in staged.source()
    short = stack_cuda.Layout(H=H, I=inter, D=D, NQ=nq, NKV=nkv, L=5, T=17, nblk=128, stage=True)
    assert not short.staged and not short.long and "constexpr int STAGE = 0;" in short.source()
    assert short.shared_bytes == dataclasses.replace(short, stage=False).shared_bytes
    cuda_options(stage=True, chunk=192)
    lay = layout(staged, 3088, 128)
    assert lay.staged and lay.chunk == 192 and "constexpr int CHUNK = 192;" in lay.source()


def test_the_long_threads_option_sizes_only_a_long_caches_blocks(cuda_options) -> None:
    """long_threads: the talker's stack (a long cache) gets its own block size, the code predictor's keeps `threads`;
    0 gives both `threads`; a size that is not a multiple of 32 up to 1024 is refused with the reason."""
    from qwen_tts.fastpath.stack import stack_cuda

    H, inter, L, nq, nkv, D = TALKER_06B
    talker = stack_cuda.Layout(H=H, I=inter, D=D, NQ=nq, NKV=nkv, L=L, T=1, nblk=1)
    cp = stack_cuda.Layout(H=H, I=inter, D=D, NQ=nq, NKV=nkv, L=5, T=1, nblk=1)
    cuda_options(threads=512, long_threads=256)
    assert layout(cp, 16, 128).threads == 512 and layout(talker, 3088, 128).threads == 256
    assert "constexpr int NTHREADS = 512;" in layout(cp, 16, 128).source()
    assert "constexpr int NTHREADS = 256;" in layout(talker, 3088, 128).source()
    cuda_options(threads=256, long_threads=512)
    assert layout(cp, 16, 128).threads == 256 and layout(talker, 3088, 128).threads == 512
    assert cuda_options(long_threads=0)["long_threads"] == 0
    assert layout(talker, 3088, 128).threads == 256
    with pytest.raises(ValueError, match="a block of 100 threads: a multiple of 32 up to 1024"):
        cuda_options(long_threads=100)
    assert cuda_options()["long_threads"] == 0
    cuda_options(threads=512, long_threads=256)
    defaults = dataclasses.asdict(StackOptions())
    assert cuda_options(**defaults) == defaults and cuda_options()["threads"] == stack_cuda.NTHREADS
    assert cuda_options()["long_threads"] == 0


def test_bench_stack_reads_the_long_attentions_inside_from_the_timeline() -> None:
    """bench_stack.attention_detail: from the timeline's stamps (2 blocks, 5 L + 1 phases, 6 stamps), each layer's
    attention phase (phase 5 l + 1) split at attention_long's two stamps into its vectors, its positions and its
    combine, in us at the given clock, averaged over the layers; a block whose stamps are 0 had no unit."""
    import importlib.util
    import sys

    bench_dir = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels"
    sys.path.insert(0, str(bench_dir))  # bench_stack imports its sibling bench_attention
    try:
        spec = importlib.util.spec_from_file_location("bench_stack", bench_dir / "bench_stack.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(bench_dir))
    layers, ghz = 2, 2.0  # 2 GHz: 2,000 cycles a us
    st = torch.zeros(2, 5 * layers + 1, 6, dtype=torch.int64)
    for layer, (a, b, c) in enumerate([(1000, 5000, 3000), (3000, 7000, 1000)]):  # cycles: vectors, positions, combine
        t = st[0, 5 * layer + 1]
        t[0], t[1] = 100_000 * (layer + 1), 100_000 * (layer + 1) + 500
        t[2] = t[1] + a
        t[3] = t[2] + b
        t[4] = t[3] + c
    detail = bench.attention_detail(st, layers, ghz)
    assert detail == {"vectors": [1.0, None], "positions": [3.0, None], "combine": [1.0, None]}
    assert tuple(detail) == bench.ATT_STEPS


def test_the_timeline_reserves_attention_longs_stamps_in_its_scratch() -> None:
    """With the timeline a long cache's attention scratch holds two 8-byte stamps after its flag, at an 8-byte
    aligned offset (the source's att_stamps); without it the scratch is the flag's, so the default layout is unchanged."""
    from qwen_tts.fastpath.stack import stack_cuda

    H, inter, L, nq, nkv, D = SHAPES["tiny-mtp"]  # a scratch larger than the rows' activations
    lay = stack_cuda.Layout(H=H, I=inter, D=D, NQ=nq, NKV=nkv, L=L, T=3088, nblk=132)
    timed = stack_cuda.Layout(**{**lay.__dict__, "timeline": True})
    g = nq // nkv
    floats = 2 * stack_cuda.MAX_ROWS * D // 2 + g * D + lay.warps * D + lay.att_warps * g * (D + 2)  # up to the flag
    assert floats % 2 == 0  # the flag and a pad: the stamps start on 8 bytes
    assert lay.act_bytes >= 4 * (floats + 1) and timed.act_bytes >= 4 * (floats + 2) + 16
    src = timed.source()  # the flag after those floats, the stamps two words past it
    assert "(int*)(scratch + MAXM * D + GQ * D + NWARPS * D + ATTW * GQ * (D + 2))" in src
    assert "(u64*)(att_flag(scratch) + 2)" in src and "int* last = att_flag(scratch);" in src
    H, inter, L, nq, nkv, D = TALKER_06B
    full = stack_cuda.Layout(**{**lay.__dict__, "H": H, "I": inter, "L": L, "NQ": nq, "NKV": nkv, "D": D})
    assert stack_cuda.Layout(**{**full.__dict__, "timeline": True}).act_bytes == full.act_bytes  # the activations'


def test_the_cuda_kernels_chunk_option_takes_multiples_of_32_positions(cuda_options) -> None:
    """A long cache's chunk size (positions at least) is a multiple of a warp's 32: 128 is taken, 100 and 16 are
    refused with the reason, and the layout's source carries the chosen size."""
    from qwen_tts.fastpath.stack import stack_cuda

    assert cuda_options(chunk=128)["chunk"] == 128
    H, inter, L, nq, nkv, D = TALKER_06B
    assert (
        "constexpr int CHUNK = 128;"
        in layout(stack_cuda.Layout(H=H, I=inter, D=D, NQ=nq, NKV=nkv, L=L, T=3088, nblk=1), 3088, 132).source()
    )
    for bad in (100, 16):
        with pytest.raises(ValueError, match="multiple of 32"):
            cuda_options(chunk=bad)
    assert cuda_options()["chunk"] == 128


def test_the_cuda_kernels_split_option_takes_multiples_of_32_up_to_the_chunk(cuda_options) -> None:
    """Past the chunk, a long cache's chunks take at least `split` positions: 0 (as the chunk: the source's SPLIT is
    the chunk) or a multiple of 32 up to the chunk; a larger one, or one not a multiple of 32, is refused with the
    reason and leaves the options as they were."""
    from qwen_tts.fastpath.stack import stack_cuda

    H, inter, L, nq, nkv, D = TALKER_06B

    def source() -> str:
        return layout(stack_cuda.Layout(H=H, I=inter, D=D, NQ=nq, NKV=nkv, L=L, T=3088, nblk=1), 3088, 132).source()

    assert cuda_options()["split"] == 0 and "constexpr int SPLIT = 64;" in source()
    assert cuda_options(split=32)["split"] == 32
    assert "constexpr int CHUNK = 64;" in source() and "constexpr int SPLIT = 32;" in source()
    for bad in (48, -32):
        with pytest.raises(ValueError, match="multiple of 32"):
            cuda_options(split=bad)
    with pytest.raises(ValueError, match=r"split \(128\) must not exceed chunk \(64\)"):
        cuda_options(split=128)
    opts = cuda_options(chunk=192, split=128)
    assert (opts["chunk"], opts["split"]) == (192, 128)
    with pytest.raises(ValueError, match=r"split \(128\) must not exceed chunk \(64\)"):
        cuda_options(chunk=64)  # the split already set would exceed it
    with pytest.raises(ValueError, match=r"split \(64\) must not exceed chunk \(32\)"):
        cuda_options(chunk=32, split=64)
    opts = cuda_options()
    assert (opts["chunk"], opts["split"]) == (192, 128)  # refused: nothing changed


def test_the_exact_rows_option_takes_a_build_for_each_row_count(cuda_options) -> None:
    """exact_rows N: a pass of M <= N rows gets a layout compiled for M rows (MAXM) whose shared memory is carved as
    the four-row build's (MAXR 4: every region where, and as aligned as, the four-row build has it), with the same
    chunks a (row, kv head) as the four-row build, so the same sums; a pass of more rows and every pass at 0 (the
    module's default) take the four-row build; N past 3 is refused, and so is a build for 0 or 5 rows."""
    from qwen_tts.fastpath.stack import stack_cuda

    H, inter, L, nq, nkv, D = TALKER_06B
    sw = dataclasses.make_dataclass("SW", ["H", "I", "D", "NQ", "NKV", "L"])(H, inter, D, nq, nkv, L)
    for T in (CACHE_LEN + 1, 3088):  # the code predictor's cache and the talker's
        assert [layout(sw, T, 132, m).rows for m in (1, 2, 3, 4)] == [4] * 4  # off by default
        cuda_options(exact_rows=1)
        assert [layout(sw, T, 132, m).rows for m in (1, 2, 3, 4)] == [1, 4, 4, 4]
        cuda_options(exact_rows=3)
        builds = [layout(sw, T, 132, m) for m in (1, 2, 3, 4)]
        four = builds[-1]
        assert [b.rows for b in builds] == [1, 2, 3, 4] and layout(sw, T, 132) == four
        for m, lay in enumerate(builds, 1):
            assert dataclasses.replace(lay, rows=stack_cuda.MAX_ROWS) == four
            assert (lay.shared_bytes, lay.act_bytes, lay.max_chunks) == (four.shared_bytes, four.act_bytes, 4)
            src = lay.source()
            assert f"constexpr int MAXM = {m};\n" in src and "constexpr int MAXR = 4;\n" in src
            assert src.replace(f"MAXM = {m};", "MAXM = 4;") == four.source()  # nothing else differs
            assert stack_cuda.why_not(lay, 232448) is None
        cuda_options(exact_rows=0)
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="exact_rows must be 0 to 3"):
            cuda_options(exact_rows=bad)
    for bad in (0, 5):
        assert "1 to 4" in stack_cuda.why_not(dataclasses.replace(four, rows=bad), 232448)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("shape", ["full", "talker", "tiny-mtp"])
def test_the_fewer_rows_builds_compile_for_hopper_without_spills_and_with_less_code(shape, tmp_path) -> None:
    """The one- and two-row builds of the code predictor's layout (512 threads, as the engine runs it), the 0.6B
    talker's (staged, chunks of 32 past 64 positions) and a tiny one build for sm_90 without spills, in less code
    than the four-row build (the code predictor's and the talker's one-row builds by a fifth at least)."""
    from qwen_tts.fastpath.stack import stack_cuda

    if shape == "talker":
        H, inter, L, nq, nkv, D = TALKER_06B
        four = stack_cuda.Layout(H=H, I=inter, D=D, NQ=nq, NKV=nkv, L=L, T=3088, nblk=128, stage=True, split=32)
    else:
        H, inter, L, nq, nkv, D = FULL if shape == "full" else SHAPES[shape]
        four = stack_cuda.Layout(H=H, I=inter, D=D, NQ=nq, NKV=nkv, L=L, T=CACHE_LEN, nblk=128, threads=512)
    sizes = []
    for rows in (1, 2, stack_cuda.MAX_ROWS):
        build = tmp_path / str(rows)
        build.mkdir()
        assert_builds_for_hopper_without_spills(dataclasses.replace(four, rows=rows), build)
        sizes.append((build / "k.cubin").stat().st_size)
    assert sizes[0] <= sizes[1] <= sizes[2], sizes
    if shape != "tiny-mtp":
        assert sizes[0] < 0.8 * sizes[2] and sizes[1] < sizes[2], sizes


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA kernel needs a GPU")
@pytest.mark.parametrize("opts", ["default", "t512", "stage", "split32", "t512-long"])
@pytest.mark.parametrize("shape", ["full", "split", "talker"])
def test_each_rows_build_gives_the_four_row_builds_bits(shape, opts, cuda_options) -> None:
    """Passes of one, two and three rows by their own builds (exact_rows) and by the four-row build: the same output
    and K/V bits over passes at moving positions, eagerly and replayed from a CUDA graph; the code predictor's cache
    (the full and a split layer; two rows sharing a slot at consecutive positions, as its prompt pass has them) and
    the talker's long one (a row whose position moves from one chunk to four, 5 -> 690 positions, with its cached
    keys staged, in chunks of 32, at 512 threads)."""

    long = shape == "talker"
    if long != (opts in ("stage", "split32", "t512-long")) and opts != "default":
        pytest.skip("a long cache's option on the short cache, or the other way")
    dims = LONG_SHAPE if long else (FULL if shape == "full" else SHAPES[shape])
    _, kern = make_cuda_stack(dims)
    H = dims[0]
    opt = {"t512-long": {"threads": 512, "long_threads": 512}}.get(opts, LONG_OPTION_CASES.get(opts, {}))
    dev = torch.device("cuda", torch.cuda.current_device())
    starts = [5, 60, 100, 150, 400, 690] if long else [0, 2, 4, 6, 8, 10]
    # (rows, slots, position offsets) a pass: one row, two rows of one slot (the prompt pass), three in three slots
    shapes = [(1, [2], [0]), (2, [2, 2], [0, 1]), (3, [2, 3, 1], [0, 0, 0])]
    results = []
    for exact in (False, True):
        cuda_options(**opt, exact_rows=3 if exact else 0)
        if long:
            (cache,) = filled_caches((kern,), 3, [5, 5, 5], [1, 2, 3], seed=21)
            for t in ("k", "v"):  # keys and values at every position a pass reads
                getattr(cache, t)[:, 1:4].normal_(generator=torch.Generator(device=DEVICE).manual_seed(22))
        else:
            cache = kern.new_cache(5, CACHE_LEN, DEVICE, torch.bfloat16)
        assert [device_layout(weights(kern), cache.max_len, dev, m)[0].rows for m in (1, 2, 3)] == (
            [1, 2, 3] if exact else [4] * 3
        )
        assert cuda_prepare(weights(kern), cache.max_len, dev) is None
        g = torch.Generator().manual_seed(13)
        outs = []
        with torch.no_grad():
            for i, p in enumerate(starts):
                m, sl, off = shapes[i % 3]
                x = torch.randn(m, H, generator=g).to(DEVICE, torch.bfloat16)
                pos = torch.tensor([p + o for o in off], device=DEVICE)
                outs.append(stack_pass(kern, x, pos, cache, torch.tensor(sl, device=DEVICE)))
            # replayed: a one-row pass again from a graph, from the cache as it was before it
            x = torch.randn(1, H, generator=g).to(DEVICE, torch.bfloat16)
            pos, slot = torch.tensor([starts[-1] + 1], device=DEVICE), torch.tensor([2], device=DEVICE)
            before = (cache.k.clone(), cache.v.clone())
            eager_out = stack_pass(kern, x, pos, cache, slot).clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                graphed = stack_pass(kern, x, pos, cache, slot)
            torch.cuda.current_stream().wait_stream(stream)
            cache.k.copy_(before[0])
            cache.v.copy_(before[1])
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(graphed, eager_out)
        results.append((torch.cat(outs), cache.k.clone(), cache.v.clone()))
    for base, each in zip(*results, strict=True):
        assert torch.equal(base, each)
    assert results[1][0].abs().sum() > 0 and results[1][1][:, 2, :, starts[-1] + 1].abs().sum() > 0
    assert not stack_kernel.prepare(DEVICE).any()

"""The code predictor's decoder stack for one token per row (a pass of at most MAX_ROWS rows) as one persistent
CUDA kernel whose weights stream into shared memory ahead of the grid barriers (stack_cuda.cu).

Our own kernel (no official counterpart), beside the Triton one (stack_kernel.py), whose persistent mode measured
~33 us a layer on an H200 where the layer's 31.5 MB take 6.6 us at the memory's bandwidth: each of its five
phases a layer waited at the grid barrier and only then loaded its weights, so each phase cost a round trip to
memory plus the barrier (docs/history/benchmarks-diary.md, tenth and eleventh rounds). Triton gives no control over
asynchronous copies into shared memory, so that kernel could not start the next phase's loads before the wait.

Here each block owns the same slice of output rows of every matmul (with the whole K), so its share of a weight
is one or two contiguous byte ranges that depend on nothing computed. It copies the next matmul phase's share
into one of two shared-memory slots with cp.async before waiting at the barrier for the current one: the copy
flies while the grid catches up and while the phase in between (attention) runs. The rows' activations are tiny
(at most 4 x 3072 bf16) and every block reads them whole from L2, normalising them itself where a norm comes
first, so the norm needs no phase of its own. Attention is one unit per (row, kv head); keys written in the same
pass (the code predictor's two prompt tokens as two rows of one slot) are computed from the raw q|k|v by the unit
that reads them, so no phase orders the cache writes before the reads. A cache longer than MAX_POSITIONS (the
talker's) takes `attention_long`: units per (row, kv head, chunk of positions), lane groups of a warp each on one
position with an online softmax, the chunks' partial sums combined by the last unit to finish (a counter per (row,
kv head)), so every unit of a pass runs at once and a row's chunks depend on its position alone. Each row's RoPE
cosines and sines are computed once a pass into shared memory.

The arithmetic rounds where the eager layers round; matmul sums are float32 in an order fixed by K alone, so a
row's result does not depend on the other rows (batch invariant). bf16 only. The kernel is compiled by NVRTC on
first use for each shape (cuda_rtc.py) and launched on the current stream, so CUDA graphs capture it. The grid is
one block per SM and every block must be resident: the barrier would otherwise wait for a block that cannot start.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
from pathlib import Path

import torch
from torch import Tensor

MAX_ROWS = 4  # rows a pass: their activations share the block's shared memory with two weight slots
MAX_POSITIONS = 32  # a longer cache (the talker's) takes attention_long: chunks, combined by the last to finish
CHUNK = 64  # attention_long: positions a chunk at least; chunks a (row, kv head) at most: Layout.max_chunks
ATT_COUNTERS = 64  # attention_long's (row, kv head) counters: MAX_ROWS x kv heads at most
MAX_ARRIVE = 4  # the grid barrier's arrival counters, a 128-byte line each (the first line also holds the exit count)
BARRIER_INTS = 32 * MAX_ARRIVE + ATT_COUNTERS  # the barrier tensor stack_pass needs: the counters' lines, then those
NTHREADS = 256  # a block's threads unless the `threads` option says otherwise
_SOURCE = Path(__file__).with_name("stack_cuda.cu")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The kernel's compile-time shape: the stack's dims, the cache length, the grid and the shared memory."""

    H: int
    I: int  # noqa: E741 (the intermediate size, as H is the hidden)
    D: int
    NQ: int
    NKV: int
    L: int
    T: int
    nblk: int
    weights: bool = True  # False: no weight copies (profiling only: the phases' cost without their bytes)
    timeline: bool = False  # profiling: clock stamps of each phase's steps by two blocks (stack_pass's `timeline`)
    chunked: bool = False  # a short cache's attention by attention_long too (lane groups), not a unit's shared memory
    split_barrier: bool = False  # arrivals over MAX_ARRIVE counters (block b at b % 4; measured slower); False: one
    chunk: int = CHUNK  # attention_long: positions a chunk at least
    split: int = 0  # attention_long past `chunk` positions: chunks of at least this many (0: `chunk`)
    threads: int = NTHREADS  # a block's threads (a multiple of 32, at most 1024): more warps share a phase's rows
    stage: bool = False  # a long cache: a unit's cached keys and values copied into the free slot before the wait
    rows: int = MAX_ROWS  # the most rows a pass of this build takes (`exact_rows`; shared memory as MAX_ROWS')

    @property
    def slot_bytes(self) -> int:
        """The largest share of one matmul's weights a block copies (q|k|v, o, gate|up, down), 16-byte aligned."""
        H, I, D, NQ, NKV, n = self.H, self.I, self.D, self.NQ, self.NKV, self.nblk  # noqa: E741
        rows = max(_most(NQ * D + 2 * NKV * D, n) * H, _most(H, n) * NQ * D, 2 * _most(I, n) * H, _most(H, n) * I)
        return _align16(2 * rows)

    @property
    def stage_positions(self) -> int:
        """`stage`: the most cached positions a long cache's unit stages, its keys and values in one weight slot."""
        return self.slot_bytes // (4 * self.D)

    @property
    def staged(self) -> bool:
        """Whether the kernel stages cached keys and values (`stage` on a long cache; a short cache's, staged in the
        twenty-third round, measured slower; not where a weight slot cannot hold one position, at tiny test shapes)."""
        return self.stage and self.long and self.stage_positions >= 1

    @property
    def res_rows(self) -> int:
        """The most weight rows a block has in one phase (its gate|up share counts gate and up rows)."""
        n = self.nblk
        return max(_most(self.NQ * self.D + 2 * self.NKV * self.D, n), _most(self.H, n), 2 * _most(self.I, n))

    @property
    def warps(self) -> int:
        return self.threads // 32

    @property
    def att_warps(self) -> int:
        """The warps a long cache's attention unit spreads its positions over (at most 8 whatever the block's warps,
        so its sums are the same at any block size; the others only norm and rope the unit's vectors)."""
        return min(8, self.warps)

    @property
    def long(self) -> bool:
        """A cache longer than MAX_POSITIONS: attention in chunks (attention_long), not a unit's shared memory."""
        return self.T > MAX_POSITIONS or self.chunked

    @property
    def buffer_widths(self) -> tuple[int, int, int, int]:
        """A row's width in each buffer a pass writes: the residual stream, q|k|v, attention's output and the gated
        activation."""
        return self.H, (self.NQ + 2 * self.NKV) * self.D, self.NQ * self.D, self.I

    @property
    def act_bytes(self) -> int:
        """Activations (MAX_ROWS rows of the widest K, bf16) or attention's float32 scratch, whichever is larger."""
        acts = 2 * MAX_ROWS * max(self.H, self.NQ * self.D, self.I)
        g, D = self.NQ // self.NKV, self.D
        if self.long:  # this pass's keys and values (bf16), queries, a vector a warp, the warps' partials, a flag
            # (and with the timeline a pad and two 8-byte clock stamps)
            flag = 1 + (5 if self.timeline else 0)
            attn = 2 * 2 * MAX_ROWS * D + 4 * (g * D + self.warps * D + self.att_warps * g * (D + 2) + flag)
        else:
            attn = 4 * (2 * self.T * D + g * D + g * self.T + self.warps * D)
        return _align16(max(acts, attn))

    @property
    def max_chunks(self) -> int:
        """attention_long's chunks a (row, kv head) at most: the SMs over MAX_ROWS rows of NKV heads, so every unit
        of a pass runs at once (4 on 132 SMs with 8 kv heads)."""
        return max(1, self.nblk // (MAX_ROWS * self.NKV))

    @property
    def partial_floats(self) -> int:
        """attention_long's chunk partials (sums, max, total per query head), float32; 0 for a short cache."""
        return MAX_ROWS * self.NKV * self.max_chunks * self.NQ // self.NKV * (self.D + 2) if self.long else 0

    @property
    def shared_bytes(self) -> int:
        """Two weight slots, the activations, the rows' norms and the slots' mbarriers (32 bytes; 48 with the staged
        keys' mbarrier and its pad), a phase's sums, the norms' sums of squares by warp, the rows'
        RoPE tables, a layer's q/k norm weights, a norm's weights (staged while the grid waits)."""
        bars = 48 if self.staged else 32
        return (2 * self.slot_bytes + self.act_bytes + bars + 4 * MAX_ROWS * self.res_rows
                + 4 * self.warps * MAX_ROWS + 4 * MAX_ROWS * self.D + 2 * 2 * self.D
                + 2 * self.H)  # fmt: skip

    def source(self) -> str:
        consts = dict(H=self.H, I=self.I, D=self.D, NQ=self.NQ, NKV=self.NKV, L=self.L, T=self.T, MAXM=self.rows,
                      MAXR=MAX_ROWS,
                      NBLK=self.nblk, SLOT_BYTES=self.slot_bytes, ACT_BYTES=self.act_bytes,
                      WEIGHTS=int(self.weights), RES_ROWS=self.res_rows,
                      LONG=int(self.long), CHUNK=self.chunk, SPLIT=self.split or self.chunk, NCHUNK=self.max_chunks,
                      TIMELINE=int(self.timeline),
                      NARRIVE=MAX_ARRIVE if self.split_barrier else 1, MAXNARRIVE=MAX_ARRIVE,
                      NTHREADS=self.threads, ATTW=self.att_warps,
                      STAGE=int(self.staged),
                      STAGE_POS=max(1, self.stage_positions))  # fmt: skip
        prelude = "".join(f"constexpr int {k} = {v};\n" for k, v in consts.items())
        return prelude + _SOURCE.read_text()


def _most(n: int, parts: int) -> int:
    """The most rows any block gets of n split over `parts` by the kernel's lo(n, b) = n b / parts (floor): the
    shares differ by at most one, so the largest is the ceiling of n / parts."""
    return -(-n // parts)


def _align16(n: int) -> int:
    return -(-n // 16) * 16


@dataclasses.dataclass(frozen=True)
class StackOptions:
    """The kernel's choices (the fast path's object holds them; CUDA graphs keep the kernel they were captured with).

    Not choices, whatever the options: the weights by the copy engine (cp.async.bulk) marked evict-first in L2, the
    grid barrier released by an acquire-release fence, two weight rows a warp, each norm's weights staged in shared
    memory during the grid wait before it, a short cache's keys and values by 16-byte loads in one round, and a grid
    of only as many blocks as keep each block's largest share of every phase (`lean_blocks`), the other SMs left to
    kernels on other streams (Code2Wav's).

    weights: False for profiling only (no weight copies: the matmuls read stale shared memory); timeline: profiling,
    each phase's steps stamped (stack_pass's `timeline`); chunked: a short cache's attention by the long cache's
    code; split_barrier: the barrier's arrivals over four counters (else one); chunk: a long cache's chunks take at
    least this many positions (a multiple of 32), and a row's positions up to it are one chunk; split: past `chunk`
    positions, chunks of at least this many (a multiple of 32 up to `chunk`; 0: `chunk`), so a row just past `chunk`
    gets more, shorter chunks (other sums, batch invariant); threads: a block's threads (a long cache's positions
    stay on 8 warps, so the same bits); long_threads: a long cache's stack's (the talker's) block threads, whatever
    `threads` says of the others (0: as `threads`); stage: a long cache's attention unit has the copy engine bring
    its chunk's cached keys and values (as many positions as a weight slot holds) into the weight slot the attention
    phase leaves free, before the phase's grid wait, and reads them from shared memory (the same bits); exact_rows
    (0 to MAX_ROWS - 1): a pass of M <= exact_rows rows launches a build of the kernel compiled for M rows
    (`Layout.rows`: the same sums in the same order, the rows' loops and registers for M rows only), a pass of more
    rows the build for MAX_ROWS. docs/performance.md has what each measured."""

    weights: bool = True
    timeline: bool = False
    chunked: bool = False
    split_barrier: bool = False
    chunk: int = CHUNK
    split: int = 0
    threads: int = NTHREADS
    long_threads: int = 0
    stage: bool = False
    exact_rows: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.exact_rows < MAX_ROWS:
            raise ValueError(f"exact_rows must be 0 to {MAX_ROWS - 1} rows, not {self.exact_rows}")
        if err := _threads_error(self.threads):
            raise ValueError(err)
        if self.long_threads and (err := _threads_error(self.long_threads)):
            raise ValueError(err)
        if self.chunk < 32 or self.chunk % 32:
            raise ValueError(f"chunk must be a multiple of 32 positions, not {self.chunk}")
        if self.split < 0 or self.split % 32:
            raise ValueError(f"split must be 0 or a multiple of 32 positions, not {self.split}")
        if self.split > self.chunk:
            raise ValueError(f"split ({self.split}) must not exceed chunk ({self.chunk})")

    def replace(self, **changes) -> StackOptions:
        """These options with `changes` (checked as a new object is)."""
        return dataclasses.replace(self, **changes)


def _threads_error(threads: int) -> str | None:
    """Why a block cannot have this many threads (None: it can)."""
    if threads % 32 or not 32 <= threads <= 1024:
        return f"a block of {threads} threads: a multiple of 32 up to 1024"
    return None


DEFAULT_OPTIONS = StackOptions()


def layout(sw, max_len: int, nblk: int, rows: int = MAX_ROWS, options: StackOptions = DEFAULT_OPTIONS) -> Layout:
    """The layout of a `stack_kernel.StackWeights` stack with a cache of max_len positions on nblk SMs, for a pass of
    `rows` rows (the build for that many rows where the `exact_rows` option takes it, else the MAX_ROWS build)."""
    opts = dataclasses.asdict(options)
    long_threads = opts.pop("long_threads")
    exact_rows = opts.pop("exact_rows")
    lay = Layout(H=sw.H, I=sw.I, D=sw.D, NQ=sw.NQ, NKV=sw.NKV, L=sw.L, T=max_len, nblk=nblk, **opts)
    if lay.long and long_threads:
        lay = dataclasses.replace(lay, threads=long_threads)
    if 1 <= rows <= exact_rows:
        lay = dataclasses.replace(lay, rows=rows)
    return lay


def why_not(lay: Layout, max_shared: int) -> str | None:
    """Why the kernel cannot take this layout (None: it can)."""
    if lay.long and (lay.D % 16 or lay.D > 512):
        return f"a long cache's attention takes head dims that are multiples of 16 up to 512, not {lay.D}"
    if lay.long and MAX_ROWS * lay.NKV > ATT_COUNTERS:
        return f"{lay.NKV} kv heads: a long cache's attention counts at most {ATT_COUNTERS // MAX_ROWS}"
    if any(k % 8 for k in (lay.H, lay.I, lay.NQ * lay.D)):
        return "the hidden, intermediate and q widths must be multiples of 8 (16-byte copies)"
    if lay.NQ % lay.NKV:
        return f"{lay.NQ} query heads do not group over {lay.NKV} kv heads"
    if err := _threads_error(lay.threads):
        return err
    if not 1 <= lay.rows <= MAX_ROWS:
        return f"a build for {lay.rows} rows: 1 to {MAX_ROWS}"
    if lay.warps < lay.NQ // lay.NKV:
        return f"more than {lay.warps} query heads a kv head"
    if lay.shared_bytes > max_shared:
        return f"{lay.shared_bytes} bytes of shared memory a block, more than the device's {max_shared}"
    return None


@functools.cache
def _device_limits(device: torch.device) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, props.shared_memory_per_block_optin


def device_layout(
    sw, max_len: int, device: torch.device, rows: int = MAX_ROWS, options: StackOptions = DEFAULT_OPTIONS
) -> tuple[Layout, str | None]:
    """The layout on this device for a pass of `rows` rows and why the kernel cannot take it (None: it can); asked on
    every pass, so the arithmetic runs once per shape, device, row build and options."""
    return _checked_layout(layout(sw, max_len, 1, rows, options), device)


def _shares(lay: Layout) -> tuple[int, ...]:
    """What a grid of lay.nblk blocks gives its busiest block: its weight rows of q|k|v, of o and down, of gate and
    of up, and attention's chunks a (row, kv head)."""
    n = lay.nblk
    return _most(lay.NQ * lay.D + 2 * lay.NKV * lay.D, n), _most(lay.H, n), _most(lay.I, n), lay.max_chunks


def lean_blocks(shape: Layout, sms: int) -> int:
    """The fewest blocks (at most sms) whose busiest block has no more weight rows in any phase, nor attention
    fewer chunks, than on sms blocks: the same critical path, with SMs left for other streams' kernels. 128 of an
    H200's 132 for the code predictor's and the 0.6B talker's layer (4,096 q|k|v, 1,024 o and down, 3,072 gate and
    3,072 up rows: 32, 8, 24 and 24 a block either way; 4 chunks)."""
    full = _shares(dataclasses.replace(shape, nblk=sms))
    n = sms
    while n > 1 and _shares(dataclasses.replace(shape, nblk=n - 1)) == full:
        n -= 1
    return n


@functools.cache
def _checked_layout(shape: Layout, device: torch.device) -> tuple[Layout, str | None]:
    sms, max_shared = _device_limits(device)
    lay = dataclasses.replace(shape, nblk=lean_blocks(shape, sms))
    return lay, why_not(lay, max_shared)


@functools.cache
def _kernel(device: torch.device, lay: Layout):
    from qwen_tts.fastpath import cuda_rtc

    k = cuda_rtc.compile_kernel(lay.source(), "cp_stack_pass", device)
    k.set_max_shared(lay.shared_bytes)
    return k


def blocks(sw, max_len: int, device: torch.device | str, options: StackOptions = DEFAULT_OPTIONS) -> int:
    """The blocks a pass of this stack launches on the device with these options."""
    return device_layout(sw, max_len, _index(torch.device(device)), MAX_ROWS, options)[0].nblk


def prepare(sw, max_len: int, device: torch.device | str, options: StackOptions = DEFAULT_OPTIONS) -> str | None:
    """Compile and load the kernel for this stack, a cache of max_len positions and the device, before any graph
    capture; returns why it cannot run there (None: it can). A machine without NVRTC, or one whose SMs cannot hold
    the layout, gets the reason instead of an error, so the caller can fall back."""
    dev = _index(torch.device(device))
    if dev.type != "cuda":
        return "not a CUDA device"
    builds = [device_layout(sw, max_len, dev, m, options) for m in range(MAX_ROWS, 0, -1)]  # one past exact_rows
    if reason := next((r for _, r in builds if r), None):
        return reason
    try:
        for build in dict.fromkeys(b for b, _ in builds):
            _kernel(dev, build)
    except (OSError, RuntimeError) as e:
        return f"{type(e).__name__}: {str(e)[:500]}"
    return None


def runs(sw, x: Tensor, cache, options: StackOptions = DEFAULT_OPTIONS) -> bool:
    """Whether `stack_pass` can take this pass: CUDA, bf16, at most MAX_ROWS rows, a layout the device fits, a cache
    whose head vectors start on 16 bytes (its keys and values are read 16 bytes at a time)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and cache.k.dtype == torch.bfloat16):
        return False
    if x.shape[0] > MAX_ROWS or cache.k.stride(-1) != 1 or cache.k.stride() != cache.v.stride():
        return False
    if any(s % 8 for s in cache.k.stride()[:4]) or cache.k.data_ptr() % 16 or cache.v.data_ptr() % 16:
        return False
    return device_layout(sw, cache.max_len, _index(x.device), MAX_ROWS, options)[1] is None


def _index(device: torch.device) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)


def timeline_stamps(sw) -> int:
    """The int64 stamps of a timeline (the `timeline` option): two blocks (the first, the last), each phase (five a
    layer and the final norm), six points: the phase's start, its grid wait over, its weights in, its rows loaded, its
    products done, its end (attention: the start, the wait over, then its end as the last two)."""
    return 2 * (5 * sw.L + 1) * 6


def stack_pass(
    sw, x: Tensor, positions: Tensor, cache, slots: Tensor, barrier: Tensor, stop: int | None = None,
    timeline: Tensor | None = None, options: StackOptions = DEFAULT_OPTIONS,
) -> Tensor:  # fmt: skip
    """One token per row through the whole stack and its final norm: x (M, H) -> (M, H); each row's K/V written into
    its slot at its position (rows may share a slot at different positions). barrier: BARRIER_INTS int32 zeros on
    the device (the grid barrier's counters, then attention_long's; the kernel leaves them zero). stop: run only
    the first `stop` phases (five a layer, then the final norm; profiling, benchmarks/kernels/bench_stack.py: the output is
    then partial). timeline: with the `timeline` option, an int64 tensor of timeline_stamps(sw) that the pass fills
    with SM clock stamps (profiling)."""
    M, H = x.shape
    if H != sw.H:
        raise ValueError(f"x has {H} columns, the stack {sw.H}")
    if M > MAX_ROWS:
        raise ValueError(f"{M} rows > MAX_ROWS ({MAX_ROWS})")
    dev = _index(x.device)
    lay, reason = device_layout(sw, cache.max_len, dev, M, options)
    if reason:
        raise ValueError(f"stack_cuda cannot take this stack: {reason}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"stack_cuda runs bf16, not {x.dtype}")
    x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    positions = positions.to(torch.long).contiguous()
    slots = slots.to(torch.long).contiguous()
    kc, vc = cache.k, cache.v
    out = torch.empty_like(x)
    xs, qkvbuf, abuf, gbuf = (torch.empty((M, w), device=dev, dtype=x.dtype) for w in lay.buffer_widths)
    apart = torch.empty(max(lay.partial_floats, 1), device=dev, dtype=torch.float32)
    if barrier.numel() < BARRIER_INTS:
        raise ValueError(f"the barrier needs {BARRIER_INTS} int32 zeros, not {barrier.numel()}")
    ptrs = (x, xs, out, positions, slots, kc, vc, sw.ln1, sw.w_qkv, sw.qk_norm, sw.w_o, sw.ln2, sw.w_gate_up,
            sw.w_down, sw.norm, sw.rotary.inv_freq, qkvbuf, abuf, gbuf, apart, barrier)  # fmt: skip
    args = [ctypes.c_void_p(t.data_ptr()) for t in ptrs]
    args += [ctypes.c_int(M), ctypes.c_float(sw.eps), ctypes.c_float(1.0 / math.sqrt(lay.D))]
    args += [ctypes.c_longlong(s) for s in kc.stride()[:4]]
    args.append(ctypes.c_int(5 * lay.L + 1 if stop is None else stop))
    if lay.timeline and (timeline is None or timeline.numel() < timeline_stamps(sw) or timeline.dtype != torch.int64):
        raise ValueError(f"the timeline option needs an int64 tensor of {timeline_stamps(sw)} stamps")
    args.append(ctypes.c_void_p(timeline.data_ptr() if lay.timeline else 0))
    _kernel(dev, lay).launch(lay.nblk, lay.threads, args, lay.shared_bytes)
    return out

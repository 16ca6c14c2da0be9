"""What it costs blocks of one persistent kernel to wait for each other on this GPU: the grid-wide barrier the stack
kernel uses between its phases, the same barrier over a group of blocks, and a thread-block cluster's barrier
(Hopper), each with and without a handoff of data; and how many clusters of each size fit at once.

The stack kernel (qwen_tts/fastpath/stack/stack_cuda.cu) meets at a grid barrier five times a layer. Whether a layer's phases
could instead meet inside a cluster (16 blocks of one GPC, a hardware barrier, shared memory across the cluster)
depends on two figures this measures: the barriers' latencies, and whether 8 clusters of 16 blocks (one block an
SM, the kernel's shared memory) can be resident together.

Each mode runs `iters` rounds in one launch of `--blocks` blocks (one an SM: the kernel's shared memory; a cluster
mode only as many whole clusters as fit at once), timed by CUDA events at two round counts so the launch drops
out: microseconds a round.
  grid          thread 0 of each block: fence, add to one counter, poll it until every block has added
  grid+data     the same, then read a word another block wrote before it arrived (one more L2 round trip)
  group         the same barrier, over groups of --cluster blocks (a counter a group)
  cluster       barrier.cluster arrive (release) and wait (acquire): a cluster's blocks only
  cluster+data  a word written to global memory, the cluster barrier, then another block's word read
  cluster+dsmem a word stored into the next block's shared memory, the cluster barrier, then the own word read

    python3 benchmarks/kernels/bench_sync.py --blocks 128 --cluster 16 --out bench_out/sync.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from qwen_tts.fastpath import cuda_rtc

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u32 ld_cg(const u32* p) {
    u32 v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u32 smem_addr(const volatile void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}
__device__ __forceinline__ u64 now() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ u32 cluster_size() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}

// mode: 0 grid, 1 grid+data, 2 group, 3 cluster, 4 cluster+data, 5 cluster+dsmem. err: a wrong value or a
// timed-out wait (1 s) sets it and ends the block's rounds.
extern "C" __global__ void sync_bench(u32* ctr, u32* data, int iters, int mode, int group, u32* err) {
    extern __shared__ __align__(16) unsigned char smem[];
    volatile u32* own = (volatile u32*)smem;
    const int b = blockIdx.x, nb = gridDim.x;
    if (threadIdx.x == 0) *own = 0xffffffffu;
    if (mode >= 3) cluster_sync(); else __syncthreads();
    u32* c = ctr + (mode == 2 ? (b / group) * 32 : 0);  // a 128-byte line a counter
    const u32 n = mode == 2 ? (u32)group : (u32)nb;
    const u64 t0 = now();
    int bad = 0;
    for (int i = 0; i < iters && !bad; ++i) {
        if (mode <= 2) {
            if (threadIdx.x == 0) {
                if (mode == 1) data[b * 32] = (u32)i;
                asm volatile("fence.acq_rel.gpu;" ::: "memory");
                atomicAdd(c, 1u);
                const u32 target = (u32)(i + 1) * n;
                while (ld_acquire(c) < target) {
                    if (now() - t0 > 1000000000ull) {
                        bad = 1;
                        break;
                    }
                }
                if (mode == 1 && !bad && ld_cg(data + ((b + 1) % nb) * 32) < (u32)i) bad = 2;
            }
            bad = __syncthreads_or(bad);
        } else if (mode == 3) {
            cluster_sync();
        } else if (mode == 4) {
            const u32 r = cluster_rank(), cs = cluster_size(), base = b - r;
            if (threadIdx.x == 0) data[b * 32] = (u32)i;
            cluster_sync();
            if (threadIdx.x == 0 && ld_cg(data + (base + (r + 1) % cs) * 32) < (u32)i) bad = 3;
            bad = __syncthreads_or(bad);
        } else {
            const u32 r = cluster_rank(), cs = cluster_size();
            if (threadIdx.x == 0) {
                u32 local = smem_addr(own), remote;
                asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"((r + 1) % cs));
                asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(remote), "r"((u32)i) : "memory");
            }
            cluster_sync();
            if (threadIdx.x == 0 && *own != (u32)i) bad = 4;
            bad = __syncthreads_or(bad);
            cluster_sync();  // the word read before the next round's store
        }
    }
    if (threadIdx.x == 0 && bad) atomicMax(err, (u32)bad);
}
"""

MODES = {"grid": 0, "grid+data": 1, "group": 2, "cluster": 3, "cluster+data": 4, "cluster+dsmem": 5}


def time_mode(kernel, mode: str, blocks: int, threads: int, shared: int, cluster: int, iters: tuple[int, int]):
    """Microseconds a round (the difference of two launches' event times over the difference of their rounds)."""
    dev = torch.device("cuda")
    ctr = torch.zeros(32 * (blocks + 1), dtype=torch.int32, device=dev)
    data = torch.zeros(32 * blocks, dtype=torch.int32, device=dev)
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    launch_cluster = cluster if MODES[mode] >= 3 else 0
    times = []
    for n in (iters[0], iters[0], iters[1]):  # the first: warm-up
        ctr.zero_()
        data.zero_()
        args = [
            ctypes.c_void_p(ctr.data_ptr()),
            ctypes.c_void_p(data.data_ptr()),
            ctypes.c_int(n),
            ctypes.c_int(MODES[mode]),
            ctypes.c_int(cluster),
            ctypes.c_void_p(err.data_ptr()),
        ]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernel.launch(blocks, threads, args, shared, cluster=launch_cluster)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    us = (times[2] - times[1]) / (iters[1] - iters[0])
    return {"mode": mode, "us_per_round": round(us, 3), "error": int(err.item())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--threads", type=int, default=256)
    ap.add_argument("--shared-kib", type=int, default=200, help="dynamic shared memory a block (one block an SM)")
    ap.add_argument("--cluster", type=int, default=16, help="blocks a cluster (and a group)")
    ap.add_argument("--sizes", default="2,4,8,16", help="cluster sizes to ask the occupancy of")
    ap.add_argument("--iters", default="1000,6000")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default="bench_out/bench_sync.json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    kernel = cuda_rtc.compile_kernel(SOURCE, "sync_bench", dev)
    shared = a.shared_kib * 1024
    occupancy = {}
    for size in [int(x) for x in a.sizes.split(",") if x]:
        try:
            occupancy[size] = kernel.max_active_clusters(size, a.threads, shared)
        except RuntimeError as e:
            occupancy[size] = str(e)
    print(
        f"{props.name}, {props.multi_processor_count} SMs; clusters resident at once (one block an SM, "
        f"{a.shared_kib} KiB): " + ", ".join(f"{k} blocks: {v}" for k, v in occupancy.items())
    )
    iters = tuple(int(x) for x in a.iters.split(","))
    rows = []
    for mode in a.modes.split(","):
        blocks = a.blocks
        if MODES[mode] >= 3:
            if not isinstance(occupancy.get(a.cluster), int):
                continue
            # Only the clusters that fit at once: a cluster launched after another finished would add its rounds to
            # the time instead of running beside them.
            blocks = min(blocks // a.cluster, occupancy[a.cluster]) * a.cluster
        elif blocks > props.multi_processor_count:
            continue  # a grid barrier needs every block resident
        row = time_mode(kernel, mode, blocks, a.threads, shared, a.cluster, iters)
        row["blocks"] = blocks
        rows.append(row)
        err = f"  ERROR {row['error']}" if row["error"] else ""
        print(f"  {mode:14s} {row['us_per_round']:7.3f} us a round, {blocks} blocks{err}")
    out = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "blocks": a.blocks,
        "threads": a.threads,
        "shared_kib": a.shared_kib,
        "cluster": a.cluster,
        "max_active_clusters": occupancy,
        "rows": rows,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()

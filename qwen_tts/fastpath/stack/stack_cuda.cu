// One pass of a decoder stack (the code predictor's, or the 0.6B talker's: one token per row, at most MAXM rows) as
// one persistent CUDA kernel: our own (qwen_tts/fastpath/stack/stack_cuda.py compiles it with NVRTC and documents the design).
// What it computes is `layers.DecoderStack.forward` for T = 1 in bf16, rounded where the eager layers round.
//
// Each block owns a fixed slice of output rows of every matmul, with the whole K: its slice of a weight is one or
// two contiguous byte ranges, copied into shared memory by cp.async one matmul phase ahead of its use (two slots),
// so the copy is in flight while the block waits at the grid barrier and runs the phase in between. The phases of a
// layer: q|k|v (input norm recomputed per block), attention (q/k norm, RoPE from per-pass tables, cache write; one
// unit per row and kv head, or per chunk of positions of them for a long cache), o + residual, gate|up with SiLU *
// up (post-attention norm recomputed per block), down + residual; then the final norm. Blocks meet at a grid-wide
// barrier (an atomic counter) between phases; the grid is one block per SM, all resident. Data written in the
// kernel is read past L1 (ld.global.cg).
//
// Constants come from stack_cuda.py as `constexpr int`s written before this text (constants, not macros, so no
// header's names are touched): the shapes H, I, D, NQ, NKV, L, T, MAXM (the most rows a pass of this build takes),
// MAXR (the rows shared memory is carved for: four, whatever MAXM; a build for fewer rows uses the first of each
// region), NBLK, SLOT_BYTES, ACT_BYTES, RES_ROWS (the most weight rows a block has in one phase), and the options:
// WEIGHTS (0: no weight copies at all, the matmuls read whatever the slots hold; for profiling only, to see what the
// phases cost without their bytes); TIMELINE (profiling: clock stamps); NARRIVE (arrival counters, of MAXNARRIVE
// lines). The weights come by the copy engine (cp.async.bulk, one instruction a range, completion on an mbarrier)
// with an L2 evict-first policy; the matmuls' dot products on the CUDA cores take two weight rows a warp at once; the
// barrier's release is an acquire-release fence; each norm's weights are copied into shared memory during the grid
// wait before it; a short cache's cached keys and values come by 16-byte loads in one round. NBLK may be fewer than
// the SMs (stack_cuda.lean_blocks). LONG: the cache is longer than a warp has lanes (the talker's), so attention is split over
// one chunk up to CHUNK positions, past it chunks of at least SPLIT, at most NCHUNK a (row, kv head), whose partial
// softmax sums the last chunk to finish combines (`attention_long`); else one unit per (row, kv head) holds the
// whole cache in shared memory (`attention`). STAGE (a long cache): at the start of each attention phase, before its
// grid wait, a block's unit has the copy engine bring its chunk's cached keys and values (up to STAGE_POS positions)
// into the weight slot that phase leaves free, so they are read from shared memory instead of waiting on L2 or HBM.
// No headers: bf16 is handled as its bits (round to nearest even, as torch rounds), so NVRTC needs no include path.

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

constexpr int NQKV = NQ + 2 * NKV;
constexpr int QD = NQ * D;
constexpr int GQ = NQ / NKV;
constexpr int NWARPS = NTHREADS / 32;

__device__ __forceinline__ float f32(bf16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ bf16 b16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

__device__ __forceinline__ float rnd(float f) { return f32(b16(f)); }  // rounded to bf16, as a bf16 op's result

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}

__device__ __forceinline__ void mbar_init(u64* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}

// One thread: this phase's copies will bring `bytes` to the slot's mbarrier (the thread's arrival counts too).
__device__ __forceinline__ void mbar_expect(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
    // The weights stream through L2 once a pass: let them leave it first.
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
        "%4;" ::"r"(smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
        : "memory");
}

// A bulk copy of cached keys or values: no evict-first policy (the cache is read again by the next pass).
__device__ __forceinline__ void bulk_copy_plain(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}

__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile(
            "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(smem_addr(bar)), "r"(parity)
            : "memory");
    }
}

__device__ __forceinline__ uint4 ldcg4(const void* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ bf16 ldcg1(const bf16* p) {
    unsigned short v;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ float ldcgf(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Order this thread's view of memory (what the block barrier gave it included) before what follows, device-wide.
__device__ __forceinline__ void fence_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// The block's phase is done: every thread's stores before the one release, an acquire-release fence and a relaxed
// add (the block's stores reach thread 0 through the block barrier, and the fence is cumulative).
// NARRIVE counters, a 128-byte line apart (bar[0], bar[32], ...), take the arrivals, block b's at b % NARRIVE, so the
// adds of a phase queue at NARRIVE addresses instead of one; a wait sums them. One by default: four measured slower
// (the waits' polls of four lines cost more than the adds' queue saved).
__device__ __forceinline__ void grid_arrive(u32* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* ctr = bar + 32 * (blockIdx.x % NARRIVE);
        asm volatile("fence.acq_rel.gpu;\n\tred.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(ctr) : "memory");
    }
}

// Wait until `target` arrivals (every block's, of every phase so far): thread 0 polls with acquire loads, then the
// block barrier hands what it acquired to every thread.
__device__ __forceinline__ void grid_wait(const u32* bar, u32 target) {
    if (threadIdx.x == 0) {
        for (;;) {
            u32 got = 0;
#pragma unroll
            for (int k = 0; k < NARRIVE; ++k) got += ld_acquire(bar + 32 * k);
            if (got >= target) break;
        }
    }
    __syncthreads();
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block b's share [lo(b), lo(b + 1)) of n rows.
__device__ __forceinline__ int lo(int n, int b) { return (int)(((long long)n * b) / NBLK); }

// Copy `bytes` (a multiple of 16) from global to shared memory, no wait: one copy-engine instruction by thread 0
// completing on `bar`.
__device__ __forceinline__ void copy_async(void* dst, const void* src, int bytes, u64* bar) {
    if (!WEIGHTS || bytes == 0) return;
    if (threadIdx.x == 0) bulk_copy(dst, src, bytes, bar);
}

// `rows` weight rows of K from global (row stride K) into a slot: one contiguous range (copy_async).
__device__ __forceinline__ void copy_share(bf16* dst, const bf16* src, int rows, int K, u64* bar) {
    copy_async(dst, src, rows * K * 2, bar);
}

// The bytes of matmul phase f's weight share for block b.
__device__ __noinline__ int share_bytes(int f) {
    const int b = blockIdx.x, kind = f % 4;
    if (kind == 0) return (lo(NQKV * D, b + 1) - lo(NQKV * D, b)) * H * 2;
    if (kind == 1) return (lo(H, b + 1) - lo(H, b)) * QD * 2;
    if (kind == 2) return 2 * (lo(I, b + 1) - lo(I, b)) * H * 2;
    return (lo(H, b + 1) - lo(H, b)) * I * 2;
}

// Matmul phase f's weight share for block b into `dst` (f = 4 * layer + kind: q|k|v, o, gate|up, down); thread 0
// first tells the slot's mbarrier how many bytes will land.
__device__ __noinline__ void issue(int f, void* dst, u64* bar, const bf16* wqkv, const bf16* wo, const bf16* wgu,
                                   const bf16* wd) {
    const int b = blockIdx.x, layer = f / 4, kind = f % 4;
    if (threadIdx.x == 0) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the slot's last reads before the copy's writes
        mbar_expect(bar, WEIGHTS ? share_bytes(f) : 0);
    }
    bf16* d = (bf16*)dst;
    if (kind == 0) {
        const int r0 = lo(NQKV * D, b), r1 = lo(NQKV * D, b + 1);
        copy_share(d, wqkv + (u64)layer * NQKV * D * H + (u64)r0 * H, r1 - r0, H, bar);
    } else if (kind == 1) {
        const int r0 = lo(H, b), r1 = lo(H, b + 1);
        copy_share(d, wo + (u64)layer * H * QD + (u64)r0 * QD, r1 - r0, QD, bar);
    } else if (kind == 2) {
        const int j0 = lo(I, b), j1 = lo(I, b + 1);
        const bf16* w = wgu + (u64)layer * 2 * I * H;
        copy_share(d, w + (u64)j0 * H, j1 - j0, H, bar);  // gate rows
        copy_share(d + (j1 - j0) * H, w + (u64)(I + j0) * H, j1 - j0, H, bar);  // then their up rows
    } else {
        const int r0 = lo(H, b), r1 = lo(H, b + 1);
        copy_share(d, wd + (u64)layer * H * I + (u64)r0 * I, r1 - r0, I, bar);
    }
}

__device__ __forceinline__ float dot8(uint4 w, uint4 a) {
    const u32 wv[4] = {w.x, w.y, w.z, w.w}, av[4] = {a.x, a.y, a.z, a.w};
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        s += __uint_as_float(wv[j] << 16) * __uint_as_float(av[j] << 16);
        s += __uint_as_float(wv[j] & 0xffff0000u) * __uint_as_float(av[j] & 0xffff0000u);
    }
    return s;
}

// act (M, K) <- rows of x (M, K) from global (written in the kernel); NORM: each row RMS-normed and scaled by g,
// rounded as `layers.RMSNorm` rounds (normalise in float32, round, scale, round). A thread's 16-byte pieces are the
// same for a row whatever the other rows, so the sum of squares (in the thread, over the warp, over the warps in
// order) is batch invariant. red: NWARPS * MAXM floats.
__device__ void load_rows(bf16* act, const bf16* x, const bf16* g, int M, int K, bool norm, float eps,
                          float* inv, float* red) {
    const int n8 = M * K / 8, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float ss[MAXM];
#pragma unroll
    for (int m = 0; m < MAXM; ++m) ss[m] = 0.f;
    for (int i0 = threadIdx.x; i0 < n8; i0 += 4 * NTHREADS) {  // four loads in flight, then their uses in order
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
            if (i0 + u * NTHREADS < n8) v[u] = ldcg4(x + 8 * (i0 + u * NTHREADS));
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * NTHREADS;
            if (i < n8) {
                *(uint4*)(act + 8 * i) = v[u];
                if (norm) {
                    const float sq = dot8(v[u], v[u]);
                    const int row = 8 * i / K;
#pragma unroll
                    for (int m = 0; m < MAXM; ++m)
                        if (m == row) ss[m] += sq;
                }
            }
        }
    }
    if (!norm) {
        __syncthreads();
        return;
    }
#pragma unroll
    for (int m = 0; m < MAXM; ++m) {
        if (m < M) {
            const float t = warp_sum(ss[m]);
            if (lane == 0) red[warp * MAXM + m] = t;
        }
    }
    __syncthreads();
    if (threadIdx.x < M) {
        float t = 0.f;
        for (int w = 0; w < NWARPS; ++w) t += red[w * MAXM + threadIdx.x];
        inv[threadIdx.x] = rsqrtf(t / K + eps);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n8; i += NTHREADS) {
        const int m = 8 * i / K, k = 8 * i - m * K;
        const uint4 a = *(const uint4*)(act + 8 * i), gw = *(const uint4*)(g + k);
        const u32 av[4] = {a.x, a.y, a.z, a.w}, gv[4] = {gw.x, gw.y, gw.z, gw.w};
        u32 o[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const bf16 lo16 = b16(__uint_as_float(gv[j] << 16) * rnd(__uint_as_float(av[j] << 16) * inv[m]));
            const bf16 hi16 =
                b16(__uint_as_float(gv[j] & 0xffff0000u) * rnd(__uint_as_float(av[j] & 0xffff0000u) * inv[m]));
            o[j] = (u32)lo16 | ((u32)hi16 << 16);
        }
        *(uint4*)(act + 8 * i) = make_uint4(o[0], o[1], o[2], o[3]);
    }
    __syncthreads();
}


// acc[m] = act[m, k0:k1] . w[row, k0:k1] for one weight row in shared memory (k0 a multiple of 256), summed over
// the warp (every lane gets it). The order of the sum depends on K, k0 and k1 only, never on M or the other rows: a
// row's result is batch invariant. Inlined where K is a constant, so the loop unrolls.
__device__ __forceinline__ void row_dot_span(const bf16* w, const bf16* act, int M, int K, int k0, int k1, float* acc) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int m = 0; m < MAXM; ++m) acc[m] = 0.f;
    for (int k = k0 + 8 * lane; k < k1; k += 256) {
        const uint4 wv = *(const uint4*)(w + k);
#pragma unroll
        for (int m = 0; m < MAXM; ++m)
            if (m < M) acc[m] += dot8(wv, *(const uint4*)(act + m * K + k));
    }
#pragma unroll
    for (int m = 0; m < MAXM; ++m)
        if (m < M) acc[m] = warp_sum(acc[m]);  // the rows a pass has only
}

// The whole row.
__device__ __forceinline__ void row_dot(const bf16* w, const bf16* act, int M, int K, float* acc) {
    row_dot_span(w, act, M, K, 0, K, acc);
}

// row_dot for two weight rows at once: the same sums, each row's in the same order.
__device__ __forceinline__ void row_dot2(const bf16* w0, const bf16* w1, const bf16* act, int M, int K, float* a0,
                                         float* a1) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int m = 0; m < MAXM; ++m) a0[m] = a1[m] = 0.f;
    for (int k = 8 * lane; k < K; k += 256) {
        const uint4 v0 = *(const uint4*)(w0 + k), v1 = *(const uint4*)(w1 + k);
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            if (m < M) {
                const uint4 av = *(const uint4*)(act + m * K + k);
                a0[m] += dot8(v0, av);
                a1[m] += dot8(v1, av);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MAXM; ++m) {
        if (m < M) {
            a0[m] = warp_sum(a0[m]);
            a1[m] = warp_sum(a1[m]);
        }
    }
}

// res[r * MAXM + m] = act[m, :] . w[r, :] for the block's R weight rows in shared memory (K wide), a warp a row on
// the CUDA cores. A sum's order depends on R and K only, never on M: a row's result is batch invariant.
__device__ void block_matmul(const bf16* w, int R, int K, const bf16* act, int M, float* res) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float a0[MAXM], a1[MAXM];
    int r = warp;
    for (; r + NWARPS < R; r += 2 * NWARPS) {  // rows r and r + NWARPS together
        row_dot2(w + r * K, w + (r + NWARPS) * K, act, M, K, a0, a1);
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            if (m == lane && m < M) {
                res[r * MAXM + m] = a0[m];
                res[(r + NWARPS) * MAXM + m] = a1[m];
            }
        }
    }
    if (r < R) {  // the warp's odd row
        row_dot(w + r * K, act, M, K, a0);
#pragma unroll
        for (int m = 0; m < MAXM; ++m)
            if (m == lane && m < M) res[r * MAXM + m] = a0[m];
    }
    __syncthreads();
}

// RMSNorm over D (weight nw, in shared memory) then RoPE of one head vector y (shared), with cs the position's
// rounded cosines then sines (D / 2 each, shared: `rope_tables`): the result into dst (shared, D floats). One warp.
__device__ __noinline__ void norm_rope(const float* y, const bf16* nw, const float* cs, float eps, float* dst) {
    const int lane = threadIdx.x % 32;
    float ss = 0.f;
    for (int c = lane; c < D; c += 32) ss += y[c] * y[c];
    const float inv = rsqrtf(warp_sum(ss) / D + eps);
    for (int c = lane; c < D; c += 32) dst[c] = rnd(f32(nw[c]) * rnd(y[c] * inv));
    __syncwarp();
    float o[(D + 31) / 32];
    for (int c = lane, j = 0; c < D; c += 32, ++j) {
        const float part = dst[(c + D / 2) % D];
        const float rot = c < D / 2 ? -part : part;
        const int i = c % (D / 2);
        o[j] = rnd(rnd(dst[c] * cs[i]) + rnd(rot * cs[D / 2 + i]));
    }
    __syncwarp();
    for (int c = lane, j = 0; c < D; c += 32, ++j) dst[c] = o[j];
    __syncwarp();
}

// Eight bf16 from a 16-byte load as floats.
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    const u32 vv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        f[2 * j] = __uint_as_float(vv[j] << 16);
        f[2 * j + 1] = __uint_as_float(vv[j] & 0xffff0000u);
    }
}

// rope[r] <- row r's RoPE at its position: D / 2 cosines then D / 2 sines, each rounded to bf16 as the eager tables
// are (float32 angle = position x inverse frequency), once a pass: every layer's queries and keys of the pass use
// them (cached keys were roped when written).
__device__ void rope_tables(const long long* pos_p, const float* inv_freq, int M, float* rope) {
    for (int i = threadIdx.x; i < M * (D / 2); i += NTHREADS) {
        const int r = i / (D / 2), c = i % (D / 2);
        float sv, cv;
        sincosf((float)pos_p[r] * inv_freq[c], &sv, &cv);  // one range reduction for both (sinf's and cosf's values)
        rope[r * D + c] = rnd(cv);
        rope[r * D + D / 2 + c] = rnd(sv);
    }
}

// Attention for layer l: one unit per (row, kv head). Keys and values of positions written in this pass (this row's
// and those of rows sharing its slot at earlier positions) come from the raw q|k|v, normed and roped here; the rest
// from the cache. The unit writes its own row's key and value into the cache.
__device__ __noinline__ void attention(int l, int M, const long long* pos_p, const long long* slot_p, bf16* kc,
                                       bf16* vc, const bf16* qknw, const float* rope, const bf16* qkvbuf, bf16* abuf,
                                       float eps, float scale, long long scl, long long scs, long long sch,
                                       long long sct, float* scratch) {
    float* kf = scratch;  // (T, D)
    float* vf = kf + T * D;  // (T, D)
    float* qf = vf + T * D;  // (GQ, D)
    float* sc = qf + GQ * D;  // (GQ, T)
    float* raw = sc + GQ * T;  // (NWARPS, D): a warp's raw vector
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const bf16* qn = qknw;  // this layer's q and k norm weights, in shared memory
    const bf16* kn = qn + D;
    for (int u = blockIdx.x; u < M * NKV; u += NBLK) {
        const int m = u / NKV, h = u % NKV;
        const int p = (int)pos_p[m], s = (int)slot_p[m];
        const long long at = l * scl + s * scs + h * sch;
        // The row of this pass that writes position j of this slot, if any (-1).
        auto source = [&](int j) {
            int src = -1;
            for (int r = 0; r < M; ++r)
                if (src < 0 && (int)slot_p[r] == s && (int)pos_p[r] == j) src = r;
            return src;
        };
        // The cached keys and values, 16 bytes a thread, all in one round.
        for (int i = threadIdx.x; i < (p + 1) * (D / 8); i += NTHREADS) {
            const int j = i / (D / 8), c = 8 * (i % (D / 8));
            if (source(j) >= 0) continue;
            const uint4 kw = ldcg4(kc + at + j * sct + c), vw = ldcg4(vc + at + j * sct + c);
            unpack8(kw, kf + j * D + c);
            unpack8(vw, vf + j * D + c);
        }
        // Vectors: the keys (with their values) this pass writes among t < p + 1, then GQ queries; a warp each.
        for (int j = warp; j < p + 1 + GQ; j += NWARPS) {
            float* y = raw + warp * D;
            if (j <= p) {
                const int src = source(j);
                if (src >= 0) {
                    const bf16* row = qkvbuf + src * NQKV * D;
                    for (int c = lane; c < D; c += 32) {
                        y[c] = f32(ldcg1(row + (NQ + h) * D + c));
                        vf[j * D + c] = f32(ldcg1(row + (NQ + NKV + h) * D + c));
                    }
                    __syncwarp();
                    norm_rope(y, kn, rope + src * D, eps, kf + j * D);
                    if (src == m) {
                        for (int c = lane; c < D; c += 32) {
                            kc[at + j * sct + c] = b16(kf[j * D + c]);
                            vc[at + j * sct + c] = b16(vf[j * D + c]);
                        }
                    }
                }
            } else {
                const int g = j - p - 1;
                const bf16* row = qkvbuf + m * NQKV * D + (h * GQ + g) * D;
                for (int c = lane; c < D; c += 32) y[c] = f32(ldcg1(row + c));
                __syncwarp();
                norm_rope(y, qn, rope + m * D, eps, qf + g * D);
            }
            __syncwarp();
        }
        __syncthreads();
        for (int j = warp; j < GQ * (p + 1); j += NWARPS) {  // scores, a warp each
            const int g = j / (p + 1), t = j % (p + 1);
            float d = 0.f;
            for (int c = lane; c < D; c += 32) d += qf[g * D + c] * kf[t * D + c];
            d = warp_sum(d);
            if (lane == 0) sc[g * T + t] = d * scale;
        }
        __syncthreads();
        for (int g = warp; g < GQ; g += NWARPS) {  // softmax over positions 0..p (T <= 32: a lane each)
            const float v = lane <= p ? sc[g * T + lane] : -3.0e38f;
            const float mx = warp_max(v);
            const float e = lane <= p ? expf(v - mx) : 0.f;
            const float tot = warp_sum(e);
            if (lane <= p) sc[g * T + lane] = e / tot;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < GQ * D; i += NTHREADS) {
            const int g = i / D, c = i % D;
            float o = 0.f;
            for (int t = 0; t <= p; ++t) o += sc[g * T + t] * vf[t * D + c];
            abuf[m * QD + (h * GQ + g) * D + c] = b16(o);
        }
        __syncthreads();
    }
}

// The chunks of a (row, kv head) whose cache holds len positions: one up to CHUNK positions; past it one per SPLIT
// positions (SPLIT == CHUNK: one per CHUNK), at most NCHUNK (the SMs over MAXM rows of NKV heads: one unit a block at
// any row count); a function of the row's position alone, so a row's sums do not depend on the other rows.
__device__ __forceinline__ int chunks(int len) { return len <= CHUNK ? 1 : min(NCHUNK, (len + SPLIT - 1) / SPLIT); }

// Eight bf16 from a 16-byte load, times eight floats (summed in order).
__device__ __forceinline__ float dot8f(uint4 k, const float* q) {
    const u32 kv[4] = {k.x, k.y, k.z, k.w};
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        s += __uint_as_float(kv[j] << 16) * q[2 * j];
        s += __uint_as_float(kv[j] & 0xffff0000u) * q[2 * j + 1];
    }
    return s;
}

// Element e of query head g of a (row, kv head)'s output from its nch chunks' partials at pc (sums, max, total a
// query head, PS = D + 2 floats), before rounding: the chunks' sums scaled to the largest max and added in chunk
// order, every load at once. The last chunk to finish combines by it.
__device__ __forceinline__ float combine_chunks(const float* pc, int g, int e, int nch) {
    constexpr int PS = D + 2;
    float big = -3.0e38f, mk[NCHUNK], tk[NCHUNK], ok[NCHUNK];
#pragma unroll
    for (int k = 0; k < NCHUNK; ++k) {
        const float* pt = pc + (k * GQ + g) * PS;
        mk[k] = k < nch ? ldcgf(pt + D) : -3.0e38f;
        tk[k] = k < nch ? ldcgf(pt + D + 1) : 0.f;
        ok[k] = k < nch ? ldcgf(pt + e) : 0.f;
        big = fmaxf(big, mk[k]);
    }
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int k = 0; k < NCHUNK; ++k) {
        if (k < nch) {
            const float a = expf(mk[k] - big);
            num += a * ok[k];
            den += a * tk[k];
        }
    }
    return num / den;
}

// attention_long's flag in its scratch, after this pass's keys and values (MAXM, 2, D bf16), the queries (GQ, D),
// a vector a warp (NWARPS, D) and the position warps' partials (ATTW, GQ, D + 2).
__device__ __forceinline__ int* att_flag(float* scratch) {
    return (int*)(scratch + MAXM * D + GQ * D + NWARPS * D + ATTW * GQ * (D + 2));
}

// TIMELINE (profiling): after the flag and a pad (8-byte aligned: every count before the flag is even), its
// block's first unit's clock stamps, its vectors ready and its positions done (0: the block had no unit); thread
// 0 writes them, and the kernel's thread 0 copies them into the timeline (Layout.act_bytes counts them).
__device__ __forceinline__ u64* att_stamps(float* scratch) { return (u64*)(att_flag(scratch) + 2); }

extern __shared__ __align__(16) unsigned char smem[];

// STAGE: the staged keys' mbarrier, after the two slots' (and before a word holding how many positions it brings).
__device__ __forceinline__ u64* stage_bar() { return (u64*)(smem + 2 * SLOT_BYTES + ACT_BYTES + 4 * MAXR) + 2; }
__device__ __forceinline__ int stage_count() { return *(volatile int*)(stage_bar() + 1); }

// A pass's rows as a long cache's attention numbers its units: each row's position and slot (-1 past M); returns the
// units of all rows (one a chunk of each (row, kv head)).
__device__ __forceinline__ int unit_rows(int M, const long long* pos_p, const long long* slot_p, int* rp, int* rs) {
    int total = 0;
#pragma unroll
    for (int r = 0; r < MAXM; ++r) {
        rp[r] = r < M ? (int)pos_p[r] : -1;
        rs[r] = r < M ? (int)slot_p[r] : -1;
        total += r < M ? NKV * chunks(rp[r] + 1) : 0;
    }
    return total;
}

// a[r] of a register array, through selects (a variable index would put the array in memory).
__device__ __forceinline__ int pick(const int* a, int r) {
    int v = 0;
#pragma unroll
    for (int k = 0; k < MAXM; ++k)
        if (k == r) v = a[k];
    return v;
}

// Unit u's row, and in `rest` its index among that row's units (constant indices only).
__device__ __forceinline__ int unit_row(int u, int M, const int* rp, int& rest) {
    int m = 0;
    rest = u;
#pragma unroll
    for (int r = 0, found = 0; r < MAXM; ++r) {
        const int n = r < M ? NKV * chunks(rp[r] + 1) : 0;
        if (!found && rest < n) {
            m = r;
            found = 1;
        } else if (!found) {
            rest -= n;
        }
    }
    return m;
}

// STAGE: block b's first attention unit (u = b, as attention_long numbers them) has thread 0 copy the cached keys
// and values of layer l of its chunk, from the chunk's first position up to STAGE_POS of them and never a position a
// row of this pass writes in the unit's slot, into the first weight slot
// (keys at 0, values at STAGE_POS x D), completing on stage_bar; thread 0 writes how many positions beside it (0:
// none; attention then reads them all from the cache; a block barrier must come before attention reads it). The
// positions this launch reads are cached by earlier launches, so the copy can start before this pass's keys exist.
__device__ __noinline__ void stage_kv(int l, int M, const long long* pos_p, const long long* slot_p, const bf16* kc,
                                      const bf16* vc, long long scl, long long scs, long long sch, long long sct) {
    int* count = (int*)(stage_bar() + 1);
    if (threadIdx.x == 0) *count = 0;
    int rp[MAXM], rs[MAXM], rest;
    if ((int)blockIdx.x >= unit_rows(M, pos_p, slot_p, rp, rs) || sct != D) return;
    const int m = unit_row(blockIdx.x, M, rp, rest), p = pick(rp, m), s = pick(rs, m);
    const int len = p + 1, nch = chunks(len), h = rest / nch, c = rest % nch, span = (len + nch - 1) / nch;
    const int t0 = c * span;
    int lim = min(len, t0 + span);
#pragma unroll
    for (int r = 0; r < MAXM; ++r)  // a position of the chunk written in this pass comes from the pass's vectors
        if (r < M && rs[r] == s && rp[r] >= t0 && rp[r] < lim) lim = rp[r];
    const int n = min(lim - t0, STAGE_POS);
    if (n <= 0 || threadIdx.x != 0) return;
    bf16* dst = (bf16*)smem;
    u64* bar = stage_bar();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the slot's last reads before the copy's writes
    mbar_expect(bar, 2u * (u32)n * D * 2u);
    const long long at = l * scl + s * scs + h * sch + (long long)t0 * D;
    bulk_copy_plain(dst, kc + at, (u32)n * D * 2u, bar);
    bulk_copy_plain(dst + STAGE_POS * D, vc + at, (u32)n * D * 2u, bar);
    *count = n;
}

// Attention for layer l over a long cache (LONG): one unit per (row, kv head, chunk of positions). A unit norms and
// ropes its GQ queries, and the keys of its chunk written in this pass (this row's, and those of rows sharing its
// slot, from the raw q|k|v; the row's own also into the cache). Then LPP lanes take a position (16 elements a lane,
// two 16-byte loads of the key and two of the value), a warp 32 / LPP positions at once and two such rounds in
// flight, each lane group running a softmax online over its positions; the groups combine by shuffles, the warps in
// shared memory. A row's only chunk writes its output; else each chunk writes its partial (sums, max, total) to
// `part`, and the unit that finds the (row, kv head) counter at its last arrival combines them in chunk order.
// STAGE: the block's first unit finds its chunk's first cached positions (their count beside stage_bar) in the
// weight slot at the start of shared memory, once stage_bar's fill of this layer completes (stage_kv).
__device__ __noinline__ void attention_long(int l, int M, const long long* pos_p, const long long* slot_p,
                                            bf16* kc, bf16* vc, const bf16* qknw, const float* rope,
                                            const bf16* qkvbuf, bf16* abuf, float eps, float scale, long long scl,
                                            long long scs, long long sch, long long sct, float* scratch, float* part,
                                            u32* cnt) {
    constexpr int LPP = D / 16;  // lanes a position: elements [8j, 8j + 8) and [D/2 + 8j, D/2 + 8j + 8) for lane j
    constexpr int PPW = 32 / LPP;  // positions a warp at once
    constexpr int PPB = PPW * ATTW;  // and a block
    constexpr int PS = D + 2;  // a partial: D sums, the max, the total
    bf16* kv = (bf16*)scratch;  // (MAXM, 2, D) keys (normed, roped) and values written in this pass (16-byte rows)
    float* qf = (float*)(kv + MAXM * 2 * D);  // (GQ, D) the queries, normed and roped
    float* raw = qf + GQ * D;  // (NWARPS, D) a warp's raw vector
    float* ws = raw + NWARPS * D;  // (ATTW, GQ, PS) the position warps' partials
    int* last = att_flag(scratch);  // this unit combines the chunks (after ws)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grp = lane / LPP, j8 = 8 * (lane % LPP);
    const bf16* qn = qknw;  // this layer's q and k norm weights, in shared memory
    const bf16* knw = qn + D;
    int rp[MAXM], rs[MAXM];
    const int total = unit_rows(M, pos_p, slot_p, rp, rs);
    for (int u = blockIdx.x; u < total; u += NBLK) {
        int rest;
        const int m = unit_row(u, M, rp, rest);  // the unit's row, and its index among the row's units
        const int p = pick(rp, m), s = pick(rs, m), len = p + 1, nch = chunks(len);
        const int h = rest / nch, c = rest % nch, span = (len + nch - 1) / nch;
        const int t0 = c * span, t1 = min(len, t0 + span);
        const long long at = l * scl + s * scs + h * sch;
        for (int j = warp; j < GQ + M; j += NWARPS) {  // the queries, then the chunk's keys of this pass: a warp each
            float* y = raw + warp * D;
            if (j < GQ) {
                const bf16* row = qkvbuf + m * NQKV * D + (h * GQ + j) * D;
                for (int e = lane; e < D; e += 32) y[e] = f32(ldcg1(row + e));
                __syncwarp();
                norm_rope(y, qn, rope + m * D, eps, qf + j * D);
            } else {
                const int r = j - GQ, pr = pick(rp, r);
                if (pick(rs, r) == s && pr >= t0 && pr < t1) {
                    const bf16* row = qkvbuf + r * NQKV * D;
                    for (int e = lane; e < D; e += 32) {
                        y[e] = f32(ldcg1(row + (NQ + h) * D + e));
                        kv[(r * 2 + 1) * D + e] = ldcg1(row + (NQ + NKV + h) * D + e);
                    }
                    __syncwarp();
                    float* kf = raw + warp * D;  // normed and roped in place
                    norm_rope(y, knw, rope + r * D, eps, kf);
                    for (int e = lane; e < D; e += 32) kv[r * 2 * D + e] = b16(kf[e]);
                    __syncwarp();
                    if (r == m) {
                        for (int e = lane; e < D; e += 32) {
                            kc[at + pr * sct + e] = kv[r * 2 * D + e];
                            vc[at + pr * sct + e] = kv[(r * 2 + 1) * D + e];
                        }
                    }
                }
            }
            __syncwarp();
        }
        __syncthreads();
        if (TIMELINE && threadIdx.x == 0 && u == blockIdx.x) att_stamps(scratch)[0] = clock64();
        const int ns = STAGE && u == blockIdx.x ? stage_count() : 0;  // this unit's staged positions
        if (ns > 0) mbar_wait(stage_bar(), (u32)l & 1u);  // a fill every layer (its wait is the positions')
        const bf16* stg = (const bf16*)smem;
        if (ATTW == NWARPS || warp < ATTW) {  // the positions: ATTW warps (the others idle: the same sums)
            float q[GQ][16], mx[GQ], tot[GQ], o[GQ][16];
#pragma unroll
            for (int g = 0; g < GQ; ++g) {
                mx[g] = -3.0e38f;
                tot[g] = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    q[g][i] = qf[g * D + j8 + i];
                    q[g][8 + i] = qf[g * D + D / 2 + j8 + i];
                    o[g][i] = o[g][8 + i] = 0.f;
                }
            }
            // A position's key and value halves: this pass's from shared memory, the rest from the cache (written by
            // earlier launches: through L1 is fine).
            auto fetch = [&](int t, uint4* kr) {
                int src = -1;
#pragma unroll
                for (int r = 0; r < MAXM; ++r)
                    if (src < 0 && rs[r] == s && rp[r] == t) src = r;
                const bf16* kp = src >= 0 ? kv + src * 2 * D : kc + at + t * sct;
                const bf16* vp = src >= 0 ? kv + (src * 2 + 1) * D : vc + at + t * sct;
                if (STAGE && src < 0 && t - t0 < ns) {  // staged in shared memory
                    kp = stg + (t - t0) * D;
                    vp = stg + (STAGE_POS + t - t0) * D;
                }
                kr[0] = *(const uint4*)(kp + j8);
                kr[1] = *(const uint4*)(kp + D / 2 + j8);
                kr[2] = *(const uint4*)(vp + j8);
                kr[3] = *(const uint4*)(vp + D / 2 + j8);
            };
            // Every lane shuffles; a group past the chunk keeps its state.
            auto update = [&](const uint4* kr, bool ok) {
                float vf[16];
                unpack8(kr[2], vf);
                unpack8(kr[3], vf + 8);
#pragma unroll
                for (int g = 0; g < GQ; ++g) {
                    float d = dot8f(kr[0], q[g]) + dot8f(kr[1], q[g] + 8);
#pragma unroll
                    for (int off = 1; off < LPP; off *= 2) d += __shfl_xor_sync(0xffffffffu, d, off);
                    if (ok) {
                        d *= scale;
                        const float nm = fmaxf(mx[g], d), a = expf(mx[g] - nm), w = expf(d - nm);
                        tot[g] = tot[g] * a + w;
#pragma unroll
                        for (int i = 0; i < 16; ++i) o[g][i] = o[g][i] * a + w * vf[i];
                        mx[g] = nm;
                    }
                }
            };
            const int mine = t0 + warp * PPW + grp;  // this lane group's first position; then every PPB-th
            for (int t = mine; t - grp < t1; t += 2 * PPB) {  // the warp's first position decides: whole warps shuffle
                const uint4 zero = make_uint4(0, 0, 0, 0);
                uint4 ka[4] = {zero, zero, zero, zero}, kb[4] = {zero, zero, zero, zero};
                const bool va = t < t1, vb = t + PPB < t1;  // two rounds' loads in flight before either's arithmetic
                if (va) fetch(t, ka);
                if (vb) fetch(t + PPB, kb);
                update(ka, va);
                if (__any_sync(0xffffffffu, vb)) update(kb, vb);
            }
            // The warp's lane groups combined (shuffles), then lane group 0 writes the warp's partial.
#pragma unroll
            for (int off = LPP; off < 32; off *= 2) {
#pragma unroll
                for (int g = 0; g < GQ; ++g) {
                    const float om = __shfl_xor_sync(0xffffffffu, mx[g], off);
                    const float ot = __shfl_xor_sync(0xffffffffu, tot[g], off);
                    const float nm = fmaxf(mx[g], om), a = expf(mx[g] - nm), b = expf(om - nm);
                    tot[g] = tot[g] * a + ot * b;
#pragma unroll
                    for (int i = 0; i < 16; ++i) o[g][i] = o[g][i] * a + __shfl_xor_sync(0xffffffffu, o[g][i], off) * b;
                    mx[g] = nm;
                }
            }
            if (grp == 0) {
#pragma unroll
                for (int g = 0; g < GQ; ++g) {
                    float* wp = ws + (warp * GQ + g) * PS;
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        wp[j8 + i] = o[g][i];
                        wp[D / 2 + j8 + i] = o[g][8 + i];
                    }
                    if (lane == 0) {
                        wp[D] = mx[g];
                        wp[D + 1] = tot[g];
                    }
                }
            }
        }
        __syncthreads();
        if (TIMELINE && threadIdx.x == 0 && u == blockIdx.x) att_stamps(scratch)[1] = clock64();
        float* pc = part + (long long)((m * NKV + h) * NCHUNK) * GQ * PS;  // this (row, kv head)'s partials
        for (int i = threadIdx.x; i < GQ * D; i += NTHREADS) {  // the warps' partials combined, in warp order
            const int g = i / D, e = i % D;
            float big = -3.0e38f, num = 0.f, den = 0.f;
            for (int w = 0; w < ATTW; ++w) big = fmaxf(big, ws[(w * GQ + g) * PS + D]);
            for (int w = 0; w < ATTW; ++w) {
                const float* wp = ws + (w * GQ + g) * PS;
                const float a = expf(wp[D] - big);
                num += a * wp[e];
                den += a * wp[D + 1];
            }
            if (nch == 1) {
                abuf[m * QD + (h * GQ + g) * D + e] = b16(num / den);
            } else {
                float* pt = pc + (c * GQ + g) * PS;
                pt[e] = num;
                if (e == 0) {
                    pt[D] = big;
                    pt[D + 1] = den;
                }
            }
        }
        if (nch > 1) {  // the last chunk to finish combines them all
            __syncthreads();
            if (threadIdx.x == 0) {
                fence_gpu();
                *last = atomicAdd(cnt + m * NKV + h, 1u) == (u32)(nch - 1);
                if (*last) {
                    fence_gpu();
                    atomicExch(cnt + m * NKV + h, 0u);  // for the next layer
                }
            }
            __syncthreads();
            if (*last) {
                for (int i = threadIdx.x; i < GQ * D; i += NTHREADS) {
                    const int g = i / D, e = i % D;
                    const bf16 v = b16(combine_chunks(pc, g, e, nch));
                    abuf[m * QD + (h * GQ + g) * D + e] = v;
                }
            }
        }
        __syncthreads();  // the scratch is the next unit's
    }
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
    cp_stack_pass(const bf16* x_in, bf16* xs, bf16* out, const long long* pos_p, const long long* slot_p, bf16* kc,
                  bf16* vc, const bf16* ln1, const bf16* wqkv, const bf16* qkn, const bf16* wo, const bf16* ln2,
                  const bf16* wgu, const bf16* wd, const bf16* normw, const float* inv_freq, bf16* qkvbuf,
                  bf16* abuf, bf16* gbuf, float* apart, u32* bar, int M, float eps, float scale, long long scl,
                  long long scs, long long sch, long long sct, int stop, u64* tl) {
    bf16* act = (bf16*)(smem + 2 * SLOT_BYTES);
    // Shared memory is carved for MAXR rows whatever MAXM (a one-row build's arrays use the first of their space),
    // so every region starts where the MAXR-row build's does, as aligned.
    float* inv = (float*)(smem + 2 * SLOT_BYTES + ACT_BYTES);  // MAXM floats (MAXR's space)
    u64* full = (u64*)(inv + MAXR);  // the two slots' mbarriers
    // STAGE: then the staged keys' and values' mbarrier (stage_bar) and their count (16 bytes, keeping the alignment)
    float* res = (float*)(full + (STAGE ? 4 : 2));  // (RES_ROWS, MAXM) a phase's sums
    float* red = res + RES_ROWS * MAXR;  // (NWARPS, MAXM) the norms' sums of squares by warp
    float* rope = red + NWARPS * MAXR;  // (MAXM, D) each row's RoPE cosines and sines (rope_tables)
    bf16* qknw = (bf16*)(rope + MAXR * D);  // (2, D) the attention phase's q and k norm weights
    bf16* nrm = qknw + 2 * D;  // (H) the next norm's weights, copied in while the grid waits
    const int b = blockIdx.x;
    u32 target = 0;  // arrivals every block has made so far: the barrier's next wait
    int ph = 0;  // phases run (stop: profiling, the kernel cut after that many phases; the output is then partial)
    int issued = -1, awaited = -1;  // the last matmul phase whose weights were asked for, and waited for
    // TIMELINE (profiling): thread 0 of the first and the last block stamps its SM's clock at six points of each
    // phase: its start, the grid wait over, the weights in, the rows loaded (and normed), the products done, the end.
    // A long cache's attention has no weights or rows of its own: its second and third stamps are its first unit's
    // vectors ready and positions done (att_stamps; 0 where the block had no unit).
    auto mark = [&](int e) {
        if (TIMELINE && threadIdx.x == 0 && (b == 0 || b == NBLK - 1))
            tl[((b == 0 ? 0 : 1) * (5 * L + 1) + ph - 1) * 6 + e] = clock64();
    };
    // A stamp taken elsewhere (attention_long's). mark does not call it: that form gave ptxas other instruction
    // orders for some layouts without the timeline, and this keeps their machine code as it was.
    auto stamp = [&](int e, u64 t) {
        if (TIMELINE && threadIdx.x == 0 && (b == 0 || b == NBLK - 1))
            tl[((b == 0 ? 0 : 1) * (5 * L + 1) + ph - 1) * 6 + e] = t;
    };
    if (threadIdx.x == 0) {
        mbar_init(full);
        mbar_init(full + 1);
        if (STAGE) mbar_init(stage_bar());
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    // Matmul phase f's weights into slot f % 2, ahead of its grid wait (the slot's last use ended at a barrier).
    auto prefetch = [&](int f) {
        if (f < 4 * L) {
            issue(f, smem + (f & 1) * SLOT_BYTES, full + (f & 1), wqkv, wo, wgu, wd);
            issued = f;
        }
    };
    // Wait for matmul phase f's weights: the slot's (f / 2)-th fill.
    auto await_weights = [&](int f) -> const bf16* {
        mbar_wait(full + (f & 1), (f >> 1) & 1);
        awaited = f;
        __syncthreads();
        return (const bf16*)(smem + (f & 1) * SLOT_BYTES);
    };
    // A norm's weights into shared memory before the grid wait (by the warps that do not poll), so the rows' norm
    // after it reads them there instead of waiting on L2.
    auto stage_norm = [&](const bf16* g) -> const bf16* {
        if (threadIdx.x >= 32)
            for (int i = threadIdx.x - 32; i < H / 8; i += NTHREADS - 32) ((uint4*)nrm)[i] = ((const uint4*)g)[i];
        return nrm;
    };
    auto end_phase = [&]() {
        grid_arrive(bar);
        target += NBLK;
    };
    // The o and down phases: xs = x + src @ w.T over this block's H rows (the product rounded first, as
    // `x + F.linear(...)` rounds), x the residual stream as it stood (the pass input before layer 0's o adds to it).
    // A matmul phase after the first: the next phase's weights asked for, the grid wait, this phase's weights in.
    auto open_matmul = [&](int f) -> const bf16* {
        mark(0);
        prefetch(f + 1);
        grid_wait(bar, target);
        mark(1);
        const bf16* w = await_weights(f);
        mark(2);
        return w;
    };
    auto residual = [&](int f, const bf16* src, int K, const bf16* x) {
        const bf16* w = open_matmul(f);
        load_rows(act, src, 0, M, K, false, eps, inv, red);
        mark(3);
        const int r0 = lo(H, b), r1 = lo(H, b + 1);
        block_matmul(w, r1 - r0, K, act, M, res);
        mark(4);
        for (int i = threadIdx.x; i < (r1 - r0) * M; i += NTHREADS) {
            const int r = i / M, m = i - r * M, at = m * H + r0 + r;
            xs[at] = b16(rnd(res[r * MAXM + m]) + f32(ldcg1(x + at)));
        }
        end_phase();
        mark(5);
    };
    prefetch(0);
    rope_tables(pos_p, inv_freq, M, rope);  // the block barriers of the first phase order it before any use
    for (int l = 0; l < L && ph < stop; ++l) {
        const bf16* xcur = l == 0 ? x_in : xs;  // the residual stream (the pass input until layer 0's o adds to it)
        // q|k|v = rms_norm(x) @ w_qkv.T, each block its rows, the raw product rounded to bf16.
        if (ph++ < stop) {
            const int f = 4 * l;
            mark(0);
            prefetch(f + 1);
            const bf16* g = stage_norm(ln1 + l * H);
            if (target) grid_wait(bar, target);
            mark(1);
            const bf16* w = await_weights(f);
            mark(2);
            load_rows(act, xcur, g, M, H, true, eps, inv, red);
            mark(3);
            const int r0 = lo(NQKV * D, b), r1 = lo(NQKV * D, b + 1);
            block_matmul(w, r1 - r0, H, act, M, res);
            mark(4);
            for (int i = threadIdx.x; i < (r1 - r0) * M; i += NTHREADS) {
                const int r = i / M, m = i - r * M;
                qkvbuf[m * NQKV * D + r0 + r] = b16(res[r * MAXM + m]);
            }
            end_phase();
            mark(5);
        }
        if (ph++ < stop) {
            mark(0);
            // STAGE: the q|k|v slot is free until o's phase asks for gate|up's weights: the unit's cached keys there
            if (STAGE) stage_kv(l, M, pos_p, slot_p, kc, vc, scl, scs, sch, sct);
            for (int i = threadIdx.x; i < 2 * D; i += NTHREADS) qknw[i] = qkn[l * 2 * D + i];  // weights: before
            grid_wait(bar, target);  // the wait, whose block barrier publishes them
            mark(1);
            if (LONG) {
                if (TIMELINE && threadIdx.x == 0) att_stamps((float*)act)[0] = att_stamps((float*)act)[1] = 0;
                attention_long(l, M, pos_p, slot_p, kc, vc, qknw, rope, qkvbuf, abuf, eps, scale, scl, scs, sch, sct,
                               (float*)act, apart, bar + 32 * MAXNARRIVE);
                if (TIMELINE) {
                    stamp(2, att_stamps((float*)act)[0]);
                    stamp(3, att_stamps((float*)act)[1]);
                }
            } else {
                attention(l, M, pos_p, slot_p, kc, vc, qknw, rope, qkvbuf, abuf, eps, scale, scl, scs, sch, sct,
                          (float*)act);
            }
            mark(4);
            end_phase();
            mark(5);
        }
        // x = x + attn @ w_o.T
        if (ph++ < stop) residual(4 * l + 1, abuf, QD, xcur);
        // SiLU(gate) * up of rms_norm(x) @ w_gate_up.T
        if (ph++ < stop) {
            const bf16* g = stage_norm(ln2 + l * H);
            const bf16* w = open_matmul(4 * l + 2);
            load_rows(act, xs, g, M, H, true, eps, inv, red);
            mark(3);
            const int j0 = lo(I, b), nj = lo(I, b + 1) - j0;
            block_matmul(w, 2 * nj, H, act, M, res);  // nj gate rows, then their up rows
            mark(4);
            for (int i = threadIdx.x; i < nj * M; i += NTHREADS) {
                const int j = i / M, m = i - j * M;
                const float gate = rnd(res[j * MAXM + m]);
                const float a = rnd(gate / (1.f + expf(-gate)));
                gbuf[m * I + j0 + j] = b16(a * rnd(res[(nj + j) * MAXM + m]));
            }
            end_phase();
            mark(5);
        }
        // x = x + act @ w_down.T
        if (ph++ < stop) residual(4 * l + 3, gbuf, I, xs);
    }
    // The final norm: block m < M its row.
    if (ph < stop && b < M) {
        grid_wait(bar, target);
        load_rows(act, xs + b * H, normw, 1, H, true, eps, inv, red);
        for (int k = threadIdx.x; k < H; k += NTHREADS) out[b * H + k] = act[k];
    }
    // Copies still in flight (a cut run's next phase) land before the block leaves its shared memory.
    for (int f = awaited + 1; f <= issued; ++f) mbar_wait(full + (f & 1), (f >> 1) & 1);
    // The last block out resets the barrier for the next launch (every block has passed its last wait).
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(bar + 1, 1u) == NBLK - 1) {
#pragma unroll
            for (int k = 0; k < NARRIVE; ++k) atomicExch(bar + 32 * k, 0u);
            atomicExch(bar + 1, 0u);
        }
    }
}

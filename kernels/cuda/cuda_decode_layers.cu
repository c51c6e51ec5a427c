// kernels/cuda/cuda_decode_layers.cu — ops_decode_layers_fwd: a batch-1 decode step's whole stack of layers as
// one persistent kernel.
//
// Why: at batch 1 a decode step reads every weight once and does little else, so its bound is the HBM bandwidth,
// yet as separate kernels (five or six a layer, bench/README.md) every launch pays a few microseconds of fixed
// latency before its first weight arrives and a tail after its last: 0.5B ran at ~37 % of the bound and 1.5B at
// ~59 %. Here the weights never wait for the data: the weight stream does not depend on the activations, so it
// runs ahead of them.
// Status: correct (tests/unit/test_cuda_decode_layers.c) but not yet faster, so off by default
// (TANDEM_DECODE_LAYERS=1 turns it on): on an H100, batch-1 steps of 1.006 / 1.925 ms against 0.892 / 1.768 for
// the sequence (0.5B / 1.5B). A grid barrier costs 2-3 us and every phase's first dependent load of another
// block's output ~1-2 us, so five phases a layer cost about what the graph's kernel boundaries did; the attention
// with its merge (7-11 us) and the gate/up phase (7 / 18 us; for 1.5B the ring holds only a third of its rows,
// so it streams on the critical path) are the longest.
// TANDEM_DECODE_LAYERS_TRACE=1 prints each phase's time (eager steps). bench/notes/gpu-decode-batch1.md, tenth pass,
// has the numbers.
//
// Shape: one block per SM (a cooperative launch: all blocks resident), DL_WARPS consumer warps and one producer
// warp. Every weight matrix's output rows are split evenly over the blocks (block b owns rows [n b / B,
// n (b + 1) / B)), and the producer's one thread copies the block's rows of every matrix of every layer, in the
// order they are used (layer by layer: q|k|v, o, gate, up, down), into a ring of shared-memory slots with bulk
// asynchronous copies (cp.async.bulk, completion counted on an mbarrier per slot); it waits only for a slot to be
// free. The consumers take each slot's rows (row j of a phase to warp j % DL_WARPS), dot them with the phase's
// input vector (fp32 in shared memory) and free the slot. While they wait at a barrier, the producer fills the
// ring with the next phase's rows, so the HBM stream keeps going across phases and layers. Each layer's small
// vectors (the two norm weights and the q|k|v bias) come the same way, one layer ahead, into a double buffer.
//
// A layer is five phases, each ended by a grid-wide barrier (all blocks' writes visible to all; activations are
// read with ld.global.cg, past the non-coherent L1):
//   A  h1 = rmsnorm(x) (every block normalises the whole row itself), q|k|v rows + bias -> qkv (bf16)
//   B  attention items (kv head g, a run of context positions: 64 per round, at most DL_MAX_PARTS items per
//      head), one per block at a time: q of the group's heads turned by RoPE, the item holding the token's own
//      position takes the turned k and v from qkv (and stores them to the cache slot); 8 warps x 8 positions a
//      round, an online softmax over the rounds; the item's max, sum and unnormalised output per query head;
//      the last item of each kv head to finish (a counter per kv head) merges that group's heads into att
//   D  o rows of att, + residual -> xmid
//   E  h2 = rmsnorm(xmid), gate and up rows, silu(g) u -> act
//   F  down rows, + xmid -> x (in place)
// The rounding points are the sequence's (cuda_gemv.cu's fused projections, cuda_attention_paged.cu's output):
// h1, h2, the projections and each residual sum are rounded to bf16 where the sequence stores them; the sums run
// in another order, so results agree with the sequence to the last bits, not bit for bit. The kernel is
// deterministic (no atomics on data: the same bits every run, eager or replayed in a graph).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.h"

#define DL_WARPS 8                       // consumer warps; one more warp produces
#define DL_CONSUMERS (DL_WARPS * 32)
#define DL_THREADS (DL_CONSUMERS + 32)
#define DL_MAX_LAYERS 128
#define DL_MAX_G 8                       // query heads per kv head
#define DL_TOKENS 64                     // context positions per attention round: DL_WARPS warps x 8
#define DL_MAX_PARTS 16                  // attention items per kv head, at most (longer contexts: more rounds)
#define DL_SLOT_MIN 16384                // bytes of a ring slot, at least (and at least one weight row)
#define DL_MIN_STAGES 4
#define DL_MAX_STAGES 32

struct DlLayer {
    const bf16 *ln1, *wqkv, *bqkv, *wo, *ln2, *wgu, *wdown;
    bf16 *k_cache, *v_cache;
};

struct DlArgs {
    int L, C, I, Hq, Hkv;
    float eps, scale;
    bf16 *x;                    // (C) the residual stream, updated in place
    bf16 *qkv, *att, *xmid, *act;
    float *part_acc;            // (Hq, D, DL_MAX_PARTS) an attention item's unnormalised output
    float *part_ml;             // (Hq, DL_MAX_PARTS, 2) its max and sum
    unsigned long long *counter; // the grid barrier's arrivals (CudaState.grid_sync[0])
    unsigned long long *head_count; // (Hkv) attention items finished per kv head (CudaState.grid_sync[1..])
    const int32_t *positions, *slots, *token_seq, *block_tables;
    const float *inv_freq;
    int block_size, max_blocks;
    int n_stages, slot_bytes, act_floats, part_floats, vec_elems;
    unsigned long long *trace;  // TANDEM_DECODE_LAYERS_TRACE: (2 blocks, L, DL_TRACE_POINTS) globaltimer stamps
    DlLayer layer[DL_MAX_LAYERS];
};

#define DL_TRACE_POINTS 10
// A stamp of block 0's and the last block's thread 0 at point k of layer l (diagnostics, off unless traced).
__device__ __forceinline__ void trace_point(const DlArgs &a, int l, int k) {
    if (!a.trace || threadIdx.x != 0 || (blockIdx.x != 0 && blockIdx.x != gridDim.x - 1)) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    a.trace[((size_t)(blockIdx.x != 0) * a.L + l) * DL_TRACE_POINTS + k] = t;
}

// ---- PTX wrappers: mbarriers, bulk copies, acquire loads ----------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t *bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// Returns once the barrier's phase of this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t *bar, unsigned parity) {
    asm volatile(
        "{\n"
        " .reg .pred done;\n"
        "WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra WAIT_%=;\n"
        "}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}
// bytes (a multiple of 16) from global src to shared dst (both 16-byte aligned), counted on bar; the weights are
// read once per step, so they go into L2 as first to evict.
__device__ __forceinline__ void bulk_load(void *dst, const void *src, unsigned bytes, uint64_t *bar, uint64_t policy) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::
            "r"(smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
        : "memory");
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The consumer warps only (the producer runs on its own): named barrier 1.
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(DL_CONSUMERS) : "memory"); }

// Every block's consumers past this point see every write made before it by any block. The barrier is one 64-bit
// counter that only ever grows by one per block per barrier, so barrier k of a launch is complete when it reaches
// base + k B, base being its value when the launch began (counter_base: read before this block's first arrival,
// when at most B - 1 others can have arrived, so rounding down to a multiple of B recovers it). A block's thread
// 0 arrives without waiting for the atomic's reply, then polls (relaxed loads with a short sleep: many threads
// hammering one line, or acquire loads that invalidate L1 each time, slow everyone's memory traffic); one fence
// orders the block's later reads after the other blocks' writes.
__device__ unsigned long long counter_base(const unsigned long long *counter) {
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(counter) : "memory");
    return v / gridDim.x * gridDim.x;
}
__device__ void grid_sync(unsigned long long *counter, unsigned long long &target) {
    consumers_sync();
    target += gridDim.x;
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(counter) : "memory");
        for (;;) {
            unsigned long long v;
            asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(counter) : "memory");
            if (v >= target) break;
            __nanosleep(32);
        }
        __threadfence();
    }
    consumers_sync();
}

// Sum over the consumer threads, returned to all of them. red: DL_WARPS floats.
__device__ float consumers_sum(float v, float *red) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    consumers_sync();
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < DL_WARPS; w++) t += red[w];
    consumers_sync();
    return t;
}

// ---- the weight stream: which rows a block owns, in which order ---------------------------------------

__device__ __forceinline__ int split_at(int total, int b) { return (int)((long)total * b / gridDim.x); }

// Segment s (0 q|k|v, 1 o, 2 gate, 3 up, 4 down) of layer l: this block's rows (n of them, K values each).
__device__ __forceinline__ const bf16 *segment(const DlArgs &a, int D, int l, int s, int *n, int *K) {
    const DlLayer &ly = a.layer[l];
    const int QD = a.Hq * D;
    int total, k, off = 0;
    const bf16 *w;
    switch (s) {
    case 0: total = QD + 2 * a.Hkv * D, k = a.C, w = ly.wqkv; break;
    case 1: total = a.C, k = QD, w = ly.wo; break;
    case 2: total = a.I, k = a.C, w = ly.wgu; break;
    case 3: total = a.I, k = a.C, w = ly.wgu, off = a.I; break;
    default: total = a.C, k = a.I, w = ly.wdown; break;
    }
    const int r0 = split_at(total, blockIdx.x);
    *n = split_at(total, blockIdx.x + 1) - r0;
    *K = k;
    return w + ((size_t)off + r0) * k;
}

__device__ __forceinline__ int rows_per_slot(const DlArgs &a, int K) {
    const int r = a.slot_bytes / (K * 2);
    return r < 1 ? 1 : r;
}

// The small vectors of layer l into vec (ln1 (C) | bqkv (QKV, when there is one) | ln2 (C)), counted on bar.
__device__ void produce_vectors(const DlArgs &a, int D, int l, bf16 *vec, uint64_t *bar, uint64_t policy) {
    const DlLayer &ly = a.layer[l];
    const int QKV = (a.Hq + 2 * a.Hkv) * D;
    const unsigned c2 = (unsigned)a.C * 2, q2 = ly.bqkv ? (unsigned)QKV * 2 : 0;
    mbar_expect_tx(bar, 2 * c2 + q2);
    bulk_load(vec, ly.ln1, c2, bar, policy);
    if (q2) bulk_load(vec + a.C, ly.bqkv, q2, bar, policy);
    bulk_load(vec + a.C + QKV, ly.ln2, c2, bar, policy);
}

// The producer: every slot-full of this block's rows, all layers, in consumption order, and each layer's small
// vectors before its rows.
__device__ void produce(const DlArgs &a, int D, char *ring, uint64_t *full, uint64_t *empty, bf16 *vecs,
                        uint64_t *vfull, uint64_t *vempty) {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    unsigned g = 0;
    for (int l = 0; l < a.L; l++) {
        if (l >= 2) mbar_wait(&vempty[l & 1], ((l >> 1) - 1) & 1);
        produce_vectors(a, D, l, vecs + (size_t)(l & 1) * a.vec_elems, &vfull[l & 1], policy);
        for (int s = 0; s < 5; s++) {
            int n, K;
            const bf16 *rows = segment(a, D, l, s, &n, &K);
            const int rps = rows_per_slot(a, K);
            for (int r = 0; r < n; r += rps, g++) {
                const int cnt = n - r < rps ? n - r : rps, slot = (int)(g % (unsigned)a.n_stages);
                const unsigned use = g / (unsigned)a.n_stages;
                if (use > 0) mbar_wait(&empty[slot], (use - 1) & 1);
                const unsigned bytes = (unsigned)cnt * K * 2;
                mbar_expect_tx(&full[slot], bytes);
                bulk_load(ring + (size_t)slot * a.slot_bytes, rows + (size_t)r * K, bytes, &full[slot], policy);
            }
        }
    }
}

// Consumers: the block's rows of segment s dotted with xa (K floats), each lane's share of row base + j into
// part[(base + j) * 33 + lane]; row_sum adds them up after the phase. No warp reduction per row: a slot's rows go
// by at the speed of their loads and FMAs, not of a chain of shuffles each. g counts slots as the producer does.
__device__ void consume(const DlArgs &a, int D, int l, int s, int base, unsigned &g, const char *ring,
                        uint64_t *full, uint64_t *empty, const float *xa, float *part) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int n, K;
    segment(a, D, l, s, &n, &K);
    const int rps = rows_per_slot(a, K), K8 = K / 8;
    const float4 *x4 = reinterpret_cast<const float4 *>(xa);
    for (int r = 0; r < n; r += rps, g++) {
        const int cnt = n - r < rps ? n - r : rps, slot = (int)(g % (unsigned)a.n_stages);
        mbar_wait(&full[slot], (g / (unsigned)a.n_stages) & 1);
        const uint4 *st = reinterpret_cast<const uint4 *>(ring + (size_t)slot * a.slot_bytes);
        int j = (warp - (base + r) % DL_WARPS + DL_WARPS) % DL_WARPS;   // first row of this slot for this warp
        for (; j < cnt; j += DL_WARPS) {
            const uint4 *w4 = st + (size_t)j * K8;
            float acc0 = 0.0f, acc1 = 0.0f;
            for (int c = lane; c < K8; c += 32) {
                float w[8];
                unpack8f(w4[c], w);
                const float4 xa0 = x4[2 * c], xa1 = x4[2 * c + 1];
                acc0 = fmaf(w[0], xa0.x, acc0);
                acc1 = fmaf(w[1], xa0.y, acc1);
                acc0 = fmaf(w[2], xa0.z, acc0);
                acc1 = fmaf(w[3], xa0.w, acc1);
                acc0 = fmaf(w[4], xa1.x, acc0);
                acc1 = fmaf(w[5], xa1.y, acc1);
                acc0 = fmaf(w[6], xa1.z, acc0);
                acc1 = fmaf(w[7], xa1.w, acc1);
            }
            part[(base + r + j) * 33 + lane] = acc0 + acc1;
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot]);
    }
}

// Row j's dot product from its 32 lane partials (the stride of 33 keeps the threads of a warp on 32 banks).
__device__ __forceinline__ float row_sum(const float *part, int j) {
    float v = 0.0f;
#pragma unroll
    for (int k = 0; k < 32; k++) v += part[j * 33 + k];
    return v;
}

// ---- phase inputs ---------------------------------------------------------------------------------------

// xa (n) = the bf16 vector v (written earlier in this kernel: read past L1). n % 8 == 0.
__device__ void load_vec(float *xa, const bf16 *v, int n) {
    const uint4 *v4 = reinterpret_cast<const uint4 *>(v);
    for (int c = threadIdx.x; c < n / 8; c += DL_CONSUMERS) {
        float f[8];
        unpack8f(__ldcg(v4 + c), f);
#pragma unroll
        for (int k = 0; k < 8; k++) xa[8 * c + k] = f[k];
    }
    consumers_sync();
}

// xa (C) = rmsnorm(x) * w rounded to bf16, with cuda_gemv.cu's prologue arithmetic (o = w (x r)); w in shared
// memory.
__device__ void load_normed(float *xa, const bf16 *x, const bf16 *w, int C, float eps, float *red) {
    const uint4 *x4 = reinterpret_cast<const uint4 *>(x), *w4 = reinterpret_cast<const uint4 *>(w);
    float ss = 0.0f;
    for (int c = threadIdx.x; c < C / 8; c += DL_CONSUMERS) {
        float f[8];
        unpack8f(__ldcg(x4 + c), f);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            xa[8 * c + k] = f[k];
            ss += f[k] * f[k];
        }
    }
    const float rs = 1.0f / sqrtf(consumers_sum(ss, red) / (float)C + eps);
    for (int c = threadIdx.x; c < C / 8; c += DL_CONSUMERS) {   // the same c as above: this thread's own values
        float wv[8];
        unpack8f(w4[c], wv);
#pragma unroll
        for (int k = 0; k < 8; k++) xa[8 * c + k] = bf2f(f2bf(wv[k] * (xa[8 * c + k] * rs)));
    }
    consumers_sync();
}

// ---- attention (phase B) ---------------------------------------------------------------------------------

// The step's token: its position, cache slot (-1: none) and block table row; read once per launch.
struct DlToken {
    int pos, slot;
    const int32_t *table;
};

// Rounds of DL_TOKENS positions per item, and items per kv head, for a context of ctx positions.
__device__ __forceinline__ void attention_split(int ctx, int *rounds, int *parts) {
    const int n64 = (ctx + DL_TOKENS - 1) / DL_TOKENS;
    *rounds = (n64 + DL_MAX_PARTS - 1) / DL_MAX_PARTS;
    *parts = (n64 + *rounds - 1) / *rounds;
}

// Query heads [h0, h1) merged from their items' partials into att (bf16, as the sequence stores it). Two
// elements per thread at a time, each with its head's maxima and sums and its own partials in 16-byte loads
// issued together: one round trip per pair.
template <int D>
__device__ void merge_heads(const DlArgs &a, int n_parts, int h0, int h1) {
    const int n_vec = (n_parts + 3) / 4, e_end = h1 * D;
    const float4 *ml4 = reinterpret_cast<const float4 *>(a.part_ml);
    const float4 *acc4 = reinterpret_cast<const float4 *>(a.part_acc);
    for (int e0 = h0 * D + (int)threadIdx.x; e0 < e_end; e0 += 2 * DL_CONSUMERS) {
        float4 ml[2][DL_MAX_PARTS / 2], oc[2][DL_MAX_PARTS / 4];
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const int e = e0 + k * DL_CONSUMERS, h = (e < e_end ? e : h0 * D) / D;
#pragma unroll
            for (int v = 0; v < DL_MAX_PARTS / 2; v++)
                ml[k][v] = e < e_end && v < 2 * n_vec ? __ldcg(ml4 + (size_t)h * (DL_MAX_PARTS / 2) + v)
                                                      : make_float4(-INFINITY, 0.0f, -INFINITY, 0.0f);
#pragma unroll
            for (int v = 0; v < DL_MAX_PARTS / 4; v++)
                oc[k][v] = e < e_end && v < n_vec ? __ldcg(acc4 + (size_t)e * (DL_MAX_PARTS / 4) + v)
                                                  : make_float4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const int e = e0 + k * DL_CONSUMERS;
            if (e >= e_end) break;
            float mc[DL_MAX_PARTS], lc[DL_MAX_PARTS], o_c[DL_MAX_PARTS];
#pragma unroll
            for (int v = 0; v < DL_MAX_PARTS / 2; v++) {
                mc[2 * v] = ml[k][v].x, lc[2 * v] = ml[k][v].y, mc[2 * v + 1] = ml[k][v].z, lc[2 * v + 1] = ml[k][v].w;
            }
#pragma unroll
            for (int v = 0; v < DL_MAX_PARTS / 4; v++) {
                o_c[4 * v] = oc[k][v].x, o_c[4 * v + 1] = oc[k][v].y;
                o_c[4 * v + 2] = oc[k][v].z, o_c[4 * v + 3] = oc[k][v].w;
            }
            float mx = -INFINITY;
#pragma unroll
            for (int c = 0; c < DL_MAX_PARTS; c++)
                if (c < n_parts) mx = fmaxf(mx, mc[c]);
            float su = 0.0f, o = 0.0f;
#pragma unroll
            for (int c = 0; c < DL_MAX_PARTS; c++) {
                if (c >= n_parts) break;
                const float f = mc[c] == -INFINITY ? 0.0f : expf(mc[c] - mx);
                su = fmaf(lc[c], f, su);
                o = fmaf(o_c[c], f, o);
            }
            a.att[e] = f2bf(o / su);
        }
    }
}

// Phase B. Shared memory of an item, inside the xa region: qs (G, D), kn, vn (D) the token's own turned k and
// its v, ps (warps, G, 8) probabilities, wpart (warps, G, 2 + D) each warp's max, sum and output.
template <int D>
__device__ void attention_items(const DlArgs &a, const DlToken &tk, int l, float *sm, float *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int G = a.Hq / a.Hkv, half = D / 2, QD = a.Hq * D, KVD = a.Hkv * D;
    const int pos = tk.pos, ctx = pos + 1, slot_new = tk.slot;
    int rounds, n_parts;
    attention_split(ctx, &rounds, &n_parts);
    const int32_t *table = tk.table;
    const bf16 *kc = a.layer[l].k_cache, *vc = a.layer[l].v_cache;
    float *qs = sm, *kn = qs + G * D, *vn = kn + D, *ps = vn + D, *wpart = ps + DL_WARPS * G * 8;
    constexpr int DQ = D / 4, DL_ = D / 32;
    for (int it = blockIdx.x; it < a.Hkv * n_parts; it += gridDim.x) {
        const int g = it % a.Hkv, c = it / a.Hkv, first = c * rounds * DL_TOKENS;
        // This item holds the token's own position, whose k and v it takes from qkv (and stores); with no slot
        // (a padding row) nothing is stored and the cache is read as it is, as the sequence would.
        const int own = slot_new >= 0 && pos >= first && pos < first + rounds * DL_TOKENS;
        // q of the group's heads (and the own k) turned, v copied, rounded as the stored split would be.
        for (int e = threadIdx.x; e < (G + (own ? 2 : 0)) * half; e += DL_CONSUMERS) {
            const int hh = e / half, i = e % half;
            const bool is_v = hh == G + 1;
            const int col = hh < G ? (g * G + hh) * D : hh == G ? QD + g * D : QD + KVD + g * D;
            const float y0 = bf2f(__ldcg(a.qkv + col + i)), y1 = bf2f(__ldcg(a.qkv + col + i + half));
            float o1 = y0, o2 = y1;
            if (!is_v) {
                float sn, cs;
                sincosf(__fmul_rn((float)pos, a.inv_freq[i]), &sn, &cs);
                o1 = bf2f(f2bf(rot1(y0, y1, cs, sn)));
                o2 = bf2f(f2bf(rot2(y0, y1, cs, sn)));
            }
            float *dst = hh < G ? qs + hh * D : is_v ? vn : kn;
            dst[i] = o1;
            dst[i + half] = o2;
            if (hh >= G) {   // the token's k, v to its cache slot
                bf16 *cache = (is_v ? a.layer[l].v_cache : a.layer[l].k_cache) + ((size_t)slot_new * a.Hkv + g) * D;
                cache[i] = f2bf(o1);
                cache[i + half] = f2bf(o2);
            }
        }
        consumers_sync();
        // Each warp: 8 positions a round, 4 lanes per position for the scores (D / 4 dims each), lanes over dims
        // (D / 32 each) for the output; an online softmax over the rounds.
        const int sub = lane & 3;
        float m[DL_MAX_G], lsum[DL_MAX_G], acc[DL_MAX_G][DL_];
#pragma unroll
        for (int hh = 0; hh < DL_MAX_G; hh++) {
            m[hh] = -INFINITY;
            lsum[hh] = 0.0f;
#pragma unroll
            for (int j = 0; j < DL_; j++) acc[hh][j] = 0.0f;
        }
        bool bad = false;
        for (int r = 0; r < rounds; r++) {
            const int t0 = first + r * DL_TOKENS + warp * 8, t = t0 + (lane >> 2);
            if (t0 >= ctx) break;
            const bool valid = t < ctx, mine = valid && own && t == pos;
            long slot = -1;
            if (valid && !mine) {
                const int lb = t / a.block_size;
                const int blk = lb < a.max_blocks ? table[lb] : -1;
                bad |= blk < 0;
                slot = blk < 0 ? -1 : (long)blk * a.block_size + t % a.block_size;
            }
            // Every load of the round issued before any is used: the k quarter row of this lane's position and
            // this lane's D / 32 dims of the v rows of the warp's 8 positions, from slot 0 where there is no
            // position (the value is dropped after), so no load waits behind a branch.
            const bf16 *krow = kc + ((size_t)(slot < 0 ? 0 : slot) * a.Hkv + g) * D + sub * DQ;
            uint4 kraw[DQ / 8];
#pragma unroll
            for (int v = 0; v < DQ / 8; v++) kraw[v] = reinterpret_cast<const uint4 *>(krow)[v];
            using VVec = typename std::conditional<DL_ == 2, unsigned, uint2>::type;
            VVec vraw[8];
            long sl[8];
#pragma unroll
            for (int tt = 0; tt < 8; tt++) {
                sl[tt] = __shfl_sync(0xffffffffu, slot, tt * 4);
                vraw[tt] = *reinterpret_cast<const VVec *>(vc + ((size_t)(sl[tt] < 0 ? 0 : sl[tt]) * a.Hkv + g) * D +
                                                           lane * DL_);
            }
            float vv[8][DL_];
#pragma unroll
            for (int tt = 0; tt < 8; tt++) {
                const bool mine_tt = own && t0 + tt == pos;
                const unsigned *w = reinterpret_cast<const unsigned *>(&vraw[tt]);
#pragma unroll
                for (int j = 0; j < DL_; j += 2) {
                    const unsigned u = w[j / 2];
                    const float lo = __uint_as_float(u << 16), hi = __uint_as_float(u & 0xffff0000u);
                    vv[tt][j] = mine_tt ? vn[lane * DL_ + j] : sl[tt] >= 0 ? lo : 0.0f;
                    vv[tt][j + 1] = mine_tt ? vn[lane * DL_ + j + 1] : sl[tt] >= 0 ? hi : 0.0f;
                }
            }
            float kf[DQ];
#pragma unroll
            for (int v = 0; v < DQ / 8; v++) unpack8f(kraw[v], kf + 8 * v);
            if (mine) {
#pragma unroll
                for (int k = 0; k < DQ; k++) kf[k] = kn[sub * DQ + k];
            }
            const bool live = valid && (mine || slot >= 0);
#pragma unroll
            for (int hh = 0; hh < DL_MAX_G; hh++) {
                if (hh >= G) break;
                const float *qh = qs + hh * D + sub * DQ;
                float s = 0.0f;
#pragma unroll
                for (int k = 0; k < DQ; k++) s = fmaf(qh[k], kf[k], s);
                s += __shfl_xor_sync(0xffffffffu, s, 1);
                s += __shfl_xor_sync(0xffffffffu, s, 2);
                s = live ? s * a.scale : -INFINITY;
                float mx = s;
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
                const float m_new = fmaxf(m[hh], mx);
                const float p = live ? expf(s - m_new) : 0.0f;
                float su = p;
                su += __shfl_xor_sync(0xffffffffu, su, 4);
                su += __shfl_xor_sync(0xffffffffu, su, 8);
                su += __shfl_xor_sync(0xffffffffu, su, 16);
                const float alpha = m[hh] == -INFINITY ? 0.0f : expf(m[hh] - m_new);
                lsum[hh] = lsum[hh] * alpha + su;
#pragma unroll
                for (int j = 0; j < DL_; j++) acc[hh][j] *= alpha;
                m[hh] = m_new;
                if (sub == 0) ps[(warp * G + hh) * 8 + (lane >> 2)] = p;
            }
            __syncwarp();
#pragma unroll
            for (int tt = 0; tt < 8; tt++)
#pragma unroll
                for (int hh = 0; hh < DL_MAX_G; hh++) {
                    if (hh >= G) break;
                    const float pr = ps[(warp * G + hh) * 8 + tt];
#pragma unroll
                    for (int j = 0; j < DL_; j++) acc[hh][j] = fmaf(pr, vv[tt][j], acc[hh][j]);
                }
            __syncwarp();
        }
        const bool any_bad = __any_sync(0xffffffffu, bad);
#pragma unroll
        for (int hh = 0; hh < DL_MAX_G; hh++) {
            if (hh >= G) break;
            float *wp = wpart + (warp * G + hh) * (2 + D);
            if (lane == 0) {
                wp[0] = m[hh];
                wp[1] = any_bad ? NAN : lsum[hh];
            }
#pragma unroll
            for (int j = 0; j < DL_; j++) wp[2 + lane * DL_ + j] = any_bad ? NAN : acc[hh][j];
        }
        consumers_sync();
        // The item's partial per query head: the warps' merged in a fixed order.
        for (int e = threadIdx.x; e < G * D; e += DL_CONSUMERS) {
            const int hh = e / D, d = e % D;
            float mx = -INFINITY;
            for (int w = 0; w < DL_WARPS; w++) mx = fmaxf(mx, wpart[(w * G + hh) * (2 + D)]);
            float su = 0.0f, o = 0.0f;
            for (int w = 0; w < DL_WARPS; w++) {
                const float *wp = wpart + (w * G + hh) * (2 + D);
                const float f = wp[0] == -INFINITY ? 0.0f : expf(wp[0] - mx);
                su = fmaf(wp[1], f, su);
                o = fmaf(wp[2 + d], f, o);
            }
            const size_t pi = (size_t)(g * G + hh) * DL_MAX_PARTS + c;
            if (d == 0) {
                a.part_ml[2 * pi] = mx;
                a.part_ml[2 * pi + 1] = su;
            }
            a.part_acc[((size_t)(g * G + hh) * D + d) * DL_MAX_PARTS + c] = o;
        }
        // The last item of kv head g to finish merges the group's query heads into att (the counter goes back to
        // 0 for the next layer), so phase D only loads att.
        consumers_sync();
        int *last = reinterpret_cast<int *>(red);
        if (threadIdx.x == 0) {
            __threadfence();
            const unsigned long long done = atomicAdd(a.head_count + g, 1ull);
            *last = done == (unsigned long long)n_parts - 1;
            if (*last) {
                atomicExch(a.head_count + g, 0ull);
                __threadfence();
            }
        }
        consumers_sync();
        if (*last) merge_heads<D>(a, n_parts, g * G, (g + 1) * G);
        consumers_sync();
    }
}

// ---- the kernel -----------------------------------------------------------------------------------------

template <int D>
__global__ void __launch_bounds__(DL_THREADS, 1) decode_layers_kernel(const __grid_constant__ DlArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) char smem[];
    char *ring = smem;
    bf16 *vecs = reinterpret_cast<bf16 *>(smem + (size_t)a.n_stages * a.slot_bytes);   // (2, vec_elems)
    float *xa = reinterpret_cast<float *>(vecs + 2 * (size_t)a.vec_elems);
    float *part = xa + a.act_floats, *red = part + a.part_floats;   // part: the phase's lane partials
    uint64_t *full = reinterpret_cast<uint64_t *>(red + 32), *empty = full + a.n_stages;
    uint64_t *vfull = empty + a.n_stages, *vempty = vfull + 2;
    if (threadIdx.x == 0) {
        for (int s = 0; s < a.n_stages; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], DL_WARPS);
        }
        for (int s = 0; s < 2; s++) {
            mbar_init(&vfull[s], 1);
            mbar_init(&vempty[s], 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x >= DL_CONSUMERS) {   // the producer warp
        if (threadIdx.x == DL_CONSUMERS) produce(a, D, ring, full, empty, vecs, vfull, vempty);
        return;
    }
    const int C = a.C, I = a.I, QD = a.Hq * D, QKV = QD + 2 * a.Hkv * D;
    const int b = blockIdx.x, tid = threadIdx.x;
    unsigned g = 0;
    const DlToken tk = {a.positions[0], a.slots[0], a.block_tables + (size_t)a.token_seq[0] * a.max_blocks};
    unsigned long long barrier = counter_base(a.counter);   // the counter's value at this launch's start
    for (int l = 0; l < a.L; l++) {
        const bf16 *vec = vecs + (size_t)(l & 1) * a.vec_elems;
        const bf16 *ln1 = vec, *bias = a.layer[l].bqkv ? vec + C : NULL, *ln2 = vec + C + QKV;
        trace_point(a, l, 0);
        mbar_wait(&vfull[l & 1], (l >> 1) & 1);
        // A: q|k|v of rmsnorm(x)
        load_normed(xa, a.x, ln1, C, a.eps, red);
        consume(a, D, l, 0, 0, g, ring, full, empty, xa, part);
        consumers_sync();
        trace_point(a, l, 1);
        {
            const int r0 = split_at(QKV, b), n = split_at(QKV, b + 1) - r0;
            for (int j = tid; j < n; j += DL_CONSUMERS)
                a.qkv[r0 + j] = f2bf(row_sum(part, j) + (bias ? bf2f(bias[r0 + j]) : 0.0f));
        }
        grid_sync(a.counter, barrier);
        trace_point(a, l, 2);
        // B: attention items
        attention_items<D>(a, tk, l, xa, red);
        trace_point(a, l, 3);
        grid_sync(a.counter, barrier);
        trace_point(a, l, 4);
        // D: xmid = x + att Wo^T, the residual rows fetched while the items merge
        {
            const int r0 = split_at(C, b), n = split_at(C, b + 1) - r0;
            const float res = tid < n ? bf2f(__ldcg(a.x + r0 + tid)) : 0.0f;   // n <= C / B + 1 <= DL_CONSUMERS
            load_vec(xa, a.att, QD);
            consume(a, D, l, 1, 0, g, ring, full, empty, xa, part);
            consumers_sync();
            if (tid < n) a.xmid[r0 + tid] = f2bf(res + bf2f(f2bf(row_sum(part, tid))));
        }
        trace_point(a, l, 5);
        grid_sync(a.counter, barrier);
        trace_point(a, l, 6);
        // E: act = swiglu(rmsnorm(xmid) [Wg; Wu]^T)
        load_normed(xa, a.xmid, ln2, C, a.eps, red);
        if (tid == 0) mbar_arrive(&vempty[l & 1]);   // this layer's vectors are used up
        {
            const int j0 = split_at(I, b), n_i = split_at(I, b + 1) - j0;
            consume(a, D, l, 2, 0, g, ring, full, empty, xa, part);
            consume(a, D, l, 3, n_i, g, ring, full, empty, xa, part);
            consumers_sync();
            for (int j = tid; j < n_i; j += DL_CONSUMERS)
                a.act[j0 + j] = f2bf(silu_f(bf2f(f2bf(row_sum(part, j)))) * bf2f(f2bf(row_sum(part, n_i + j))));
        }
        trace_point(a, l, 7);
        grid_sync(a.counter, barrier);
        trace_point(a, l, 8);
        // F: x = xmid + act Wd^T
        {
            const int r0 = split_at(C, b), n = split_at(C, b + 1) - r0;
            const float res = tid < n ? bf2f(__ldcg(a.xmid + r0 + tid)) : 0.0f;
            load_vec(xa, a.act, I);
            consume(a, D, l, 4, 0, g, ring, full, empty, xa, part);
            consumers_sync();
            if (tid < n) a.x[r0 + tid] = f2bf(res + bf2f(f2bf(row_sum(part, tid))));
        }
        trace_point(a, l, 9);
        if (l + 1 < a.L) grid_sync(a.counter, barrier);
    }
#endif
}

// ---- host side ------------------------------------------------------------------------------------------

// Off unless TANDEM_DECODE_LAYERS=1: on an H100 the kernel is still slower than the sequence of ops it stands for
// (bench/notes/gpu-decode-batch1.md, tenth pass). Read once.
static int decode_layers_enabled(void) {
    static int on = -1;
    if (on < 0) {
        const char *v = getenv("TANDEM_DECODE_LAYERS");
        on = v && strcmp(v, "1") == 0;
    }
    return on;
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

template <int D>
static int launch(OpsCtx *ctx, CudaState *st, DlArgs *a, size_t smem) {
    // The attribute belongs to the function on the current device: set it on every eager launch (a recording is
    // always preceded by an eager run of the same step on the same device).
    if (!cuda_recording(st))
        CUDA_CHECK_RET(ctx, cudaFuncSetAttribute(decode_layers_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 (int)smem), 1);
    int per_sm = 0;
    CUDA_CHECK_RET(ctx, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_layers_kernel<D>, DL_THREADS,
                                                                       smem), 1);
    if (per_sm < 1) return 0;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)st->sm_count);
    cfg.blockDim = dim3(DL_THREADS);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st->stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeCooperative;   // every block resident at once: the grid barrier needs it
    attr[0].val.cooperative = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CUDA_CHECK_RET(ctx, cudaLaunchKernelEx(&cfg, decode_layers_kernel<D>, *a), 1);
    return 1;
}

// TANDEM_DECODE_LAYERS_TRACE=1 (eager steps only): after the launch, the mean time of each phase over the layers
// past the first, as block 0 and the last block saw it, to stderr.
static void print_trace(OpsCtx *ctx, CudaState *st, const unsigned long long *t, int L, int stages, size_t smem) {
    CUDA_CHECK(ctx, cudaStreamSynchronize(st->stream));
    static const char *names[DL_TRACE_POINTS] = {"F..A wait/vecs", "A norm+qkv", "A barrier", "B attention",
                                                 "B barrier", "D o", "D barrier", "E norm+gate/up",
                                                 "E barrier", "F down"};
    fprintf(stderr, "decode_layers trace: %d layers, %d stages, %zu B shared, step %.1f us\n", L, stages, smem,
            (t[(size_t)(L - 1) * DL_TRACE_POINTS + 9] - t[0]) / 1e3);
    for (int k = 0; k < DL_TRACE_POINTS; k++) {
        double sum[2] = {0, 0};
        for (int blk = 0; blk < 2; blk++)
            for (int l = 1; l < L; l++) {
                const unsigned long long *r = t + ((size_t)blk * L + l) * DL_TRACE_POINTS;
                const unsigned long long prev = k ? r[k - 1] : r[-DL_TRACE_POINTS + 9];
                sum[blk] += (double)(r[k] - prev);
            }
        fprintf(stderr, "  %-16s block 0 %7.2f us  last block %7.2f us\n", names[k], sum[0] / (L - 1) / 1e3,
                sum[1] / (L - 1) / 1e3);
    }
}

int cuda_decode_layers_fwd(OpsCtx *ctx, void *x, const OpsDecodeLayers *d) {
    if (!decode_layers_enabled()) return 0;
    const int D = d->D, G = d->Hq / d->Hkv, C = d->C, I = d->I, QD = d->Hq * D, QKV = QD + 2 * d->Hkv * D;
    if ((D != 64 && D != 128) || G > DL_MAX_G || d->Hkv > GRID_SYNC_WORDS - 1 || d->n_layers > DL_MAX_LAYERS ||
        C % 8 || I % 8 || !aligned16(x))
        return 0;
    for (int l = 0; l < d->n_layers; l++) {
        const OpsDecodeLayer *L = &d->layers[l];
        if (!aligned16(L->ln1) || !aligned16(L->wqkv) || !aligned16(L->bqkv) || !aligned16(L->wo) ||
            !aligned16(L->ln2) || !aligned16(L->wgu) || !aligned16(L->wdown) || !aligned16(L->k_cache) ||
            !aligned16(L->v_cache))
            return 0;
    }
    CudaState *st = cuda_enter(ctx);
    if (!st) return 1;   // the error is recorded
    const int nb = st->sm_count;
    int major = 0;
    CUDA_CHECK_RET(ctx, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, st->device), 1);
    // Bulk copies and mbarrier transaction counts are Hopper's; the residual rows of a block are one per thread.
    if (major < 9 || C / nb + 1 > DL_CONSUMERS) return 0;

    DlArgs *a = (DlArgs *)calloc(1, sizeof(DlArgs));
    if (!a) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "decode_layers_fwd: out of host memory");
        return 1;
    }
    // Shared memory: the ring, two layers' small vectors, xa (the widest phase input, or an attention item's
    // scratch), part (a phase's lane partials of its dot products), red, the mbarriers.
    const int wide = I > C ? (I > QD ? I : QD) : (C > QD ? C : QD);
    const int att_floats = G * D + 2 * D + DL_WARPS * G * 8 + DL_WARPS * G * (2 + D);
    a->act_floats = ((wide > att_floats ? wide : att_floats) + 3) / 4 * 4;
    const int rows_qkv = (QKV + nb - 1) / nb, rows_gu = 2 * ((I + nb - 1) / nb), rows_c = (C + nb - 1) / nb;
    const int most = rows_qkv > rows_gu ? rows_qkv : rows_gu;
    a->part_floats = ((most > rows_c ? most : rows_c) * 33 + 3) / 4 * 4;   // 32 lane partials a row, padded
    a->vec_elems = (2 * C + QKV + 7) / 8 * 8;
    a->slot_bytes = ((2 * wide > DL_SLOT_MIN ? 2 * wide : DL_SLOT_MIN) + 127) / 128 * 128;   // a whole row fits
    const size_t fixed = 2 * (size_t)a->vec_elems * 2 + (size_t)(a->act_floats + a->part_floats + 32) * 4 + 4 * 8;
    const size_t budget = st->max_smem_optin > fixed ? st->max_smem_optin - fixed : 0;
    int stages = (int)(budget / (a->slot_bytes + 16));
    if (stages > DL_MAX_STAGES) stages = DL_MAX_STAGES;
    if (stages < DL_MIN_STAGES) {
        free(a);
        return 0;
    }
    a->n_stages = stages;
    const size_t smem = (size_t)stages * a->slot_bytes + fixed + (size_t)stages * 16;

    a->L = d->n_layers;
    a->C = C;
    a->I = I;
    a->Hq = d->Hq;
    a->Hkv = d->Hkv;
    a->eps = d->eps;
    a->scale = d->scale;
    a->positions = d->positions;
    a->slots = d->slot_mapping;
    a->token_seq = d->token_seq;
    a->block_tables = d->block_tables;
    a->inv_freq = d->inv_freq;
    a->block_size = d->block_size;
    a->max_blocks = d->max_blocks;
    a->counter = st->grid_sync;
    a->head_count = st->grid_sync + 1;
    a->x = (bf16 *)x;
    for (int l = 0; l < d->n_layers; l++) {
        const OpsDecodeLayer *L = &d->layers[l];
        a->layer[l] = DlLayer{(const bf16 *)L->ln1, (const bf16 *)L->wqkv, (const bf16 *)L->bqkv,
                              (const bf16 *)L->wo,  (const bf16 *)L->ln2,  (const bf16 *)L->wgu,
                              (const bf16 *)L->wdown, (bf16 *)L->k_cache, (bf16 *)L->v_cache};
    }
    // Scratch: qkv, att, xmid, act (bf16), then the attention partials (fp32), each 256-byte aligned.
    const size_t b_qkv = ((size_t)QKV * 2 + 255) / 256 * 256, b_c = ((size_t)C * 2 + 255) / 256 * 256;
    const size_t b_att = ((size_t)QD * 2 + 255) / 256 * 256;
    const size_t b_i = ((size_t)I * 2 + 255) / 256 * 256;
    const size_t b_acc = (size_t)d->Hq * DL_MAX_PARTS * D * 4, b_ml = (size_t)d->Hq * DL_MAX_PARTS * 2 * 4;
    char *scratch = (char *)cuda_scratch(ctx, st, b_qkv + b_att + b_c + b_i + b_acc + b_ml);
    if (!scratch) {
        free(a);
        return 1;   // the error is recorded
    }
    a->qkv = (bf16 *)scratch;
    scratch += b_qkv;
    a->att = (bf16 *)scratch;
    scratch += b_att;
    a->xmid = (bf16 *)scratch;
    scratch += b_c;
    a->act = (bf16 *)scratch;
    scratch += b_i;
    a->part_acc = (float *)scratch;
    a->part_ml = (float *)(scratch + b_acc);
    const char *tr = getenv("TANDEM_DECODE_LAYERS_TRACE");
    const int tracing = tr && strcmp(tr, "0") != 0 && !cuda_recording(st);
    const size_t n_trace = 2 * (size_t)d->n_layers * DL_TRACE_POINTS;
    if (tracing) CUDA_CHECK_RET(ctx, cudaMallocManaged(&a->trace, n_trace * 8), 1);
    const int done = D == 64 ? launch<64>(ctx, st, a, smem) : launch<128>(ctx, st, a, smem);
    if (tracing) {
        print_trace(ctx, st, a->trace, d->n_layers, stages, smem);
        cudaFree(a->trace);
    }
    free(a);
    return done;
}

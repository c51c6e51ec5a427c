// dev/cuda/decode_layers.cu — an experiment, not part of tandem's build: a batch-1 decode step's whole stack of
// layers as one persistent kernel, with its own main that checks it against a CPU reference and times it.
// Build and run by hand (dev/cuda/README.md):
//   nvcc -O3 -std=c++17 -arch=sm_90 -o decode_layers dev/cuda/decode_layers.cu
//   ./decode_layers            the correctness cases, then full-depth Qwen2.5-0.5B / 1.5B steps timed
//   ./decode_layers --trace    the same, and each phase's time per layer of the timed shapes (stderr)
//
// Idea: at batch 1 a decode step reads every weight once and does little else, so its bound is HBM bandwidth;
// as separate kernels (five or six a layer) every launch pays a fixed latency before its first weight arrives
// and a tail after its last. Here the weight stream does not depend on the activations, so it runs ahead of them.
// Where it stands (bench/notes/gpu-decode-batch1.md, tenth pass, has the numbers): correct, but on an H100 still
// slower than the production sequence of kernels it would replace (shared/model_layer.c layer_decode_small,
// replayed as a CUDA graph): a grid barrier and every phase's first dependent load of another block's output
// cost about what the graph's kernel boundaries did, and the attention with its merge and the gate/up phase
// (whose rows for 1.5B do not fit the ring, so they stream on the critical path) are the longest phases. It left
// the production library so that no op carries a switch to an experiment; this file is where to try the next
// idea on it.
//
// What one step computes, for every layer l in order, x the residual stream (C), updated in place:
//   q|k|v = rmsnorm(x) Wqkv^T + bqkv ; rope(q, k) at positions[0], k and v stored to slot slots[0] of the layer's
//   caches (nowhere when negative) ; att = attention of q over the sequence's block table, positions
//   0..positions[0] ; xmid = x + att Wo^T ; x = xmid + swiglu(rmsnorm(xmid) Wgu^T) Wd^T
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
// The rounding points are the production sequence's (kernels/cuda/cuda_gemv.cu's fused projections,
// cuda_attention_paged.cu's output): h1, h2, the projections and each residual sum are rounded to bf16 where the
// sequence stores them; the sums run in another order, so results agree with it to the last bits, not bit for
// bit. The kernel is deterministic (no atomics on data: the same bits every run).
//
// The checks (each case: random bf16 weights, caches and x; the block table scattered over a pool):
//   the residual stream after the last layer and every layer's stored k / v row within TOL of the CPU reference
//   (fp32, from the same bf16 values) by max_i |gpu - cpu| / (|cpu| + rms(cpu)): each layer rounds h, q|k|v,
//   att, xmid, act and x to bf16 where the CPU keeps fp32, and the differences pass through the layers (1-3e-2
//   after two or three random layers, as the production sequence on the GPU shows too);
//   every cache row other than the token's slot left as it was, bit for bit;
//   a second run from the same inputs gives the same bits.
// Shapes: the Qwen2.5-0.5B and 1.5B layers (head dims 64 / 128, groups of 7 / 6 query heads, q/k/v bias), a
// Llama-style layer without bias, and the Qwen2.5-3B group of 8; contexts from the first position to 2,000 (one
// attention item to 32 of them, items that end mid-block), a token whose slot is -1 (stores nothing).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#define CUDA_CHECK(call)                                                                                     \
    do {                                                                                                     \
        cudaError_t e_ = (call);                                                                             \
        if (e_ != cudaSuccess) {                                                                             \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));    \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

typedef __nv_bfloat16 bf16;

// ---- device helpers (as kernels/cuda/cuda_common.cuh has them) ------------------------------------------

__device__ __forceinline__ float bf2f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 f2bf(float x) { return __float2bfloat16_rn(x); }
// RoPE's rotation with the roundings of the production kernels (cuda_rope.cu, cuda_gemv.cu).
__device__ __forceinline__ float rot1(float a, float b, float c, float s) { return __fmaf_rn(c, a, -__fmul_rn(s, b)); }
__device__ __forceinline__ float rot2(float a, float b, float c, float s) { return __fmaf_rn(s, a, __fmul_rn(c, b)); }
__device__ __forceinline__ float silu_f(float g) { return g / (1.0f + expf(-g)); }
__device__ __forceinline__ void unpack8f(uint4 u, float f[8]) {
    const __nv_bfloat162 *p = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float2 t = __bfloat1622float2(p[j]);
        f[2 * j] = t.x;
        f[2 * j + 1] = t.y;
    }
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---- the kernel and its parts (as they were in kernels/cuda/cuda_decode_layers.cu) ------------------------

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
    unsigned long long *counter; // the grid barrier's arrivals (grid_sync[0] of the host side)
    unsigned long long *head_count; // (Hkv) attention items finished per kv head (grid_sync[1..])
    const int32_t *positions, *slots, *token_seq, *block_tables;
    const float *inv_freq;
    int block_size, max_blocks;
    int n_stages, slot_bytes, act_floats, part_floats, vec_elems;
    unsigned long long *trace;  // --trace: (2 blocks, L, DL_TRACE_POINTS) globaltimer stamps, else NULL
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

// xa (C) = rmsnorm(x) * w rounded to bf16, with kernels/cuda/cuda_gemv.cu's prologue arithmetic (o = w (x r));
// w in shared memory.
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


// ---- host side: the launch --------------------------------------------------------------------------------

// One step's arguments: the layers (device pointers) and the token's inputs (device memory).
struct Step {
    int L, C, I, Hq, Hkv, D;
    float eps, scale;
    const DlLayer *layers;                                    // host array (L)
    bf16 *x;                                                  // (C)
    const int32_t *positions, *slots, *token_seq, *block_tables;
    const float *inv_freq;                                    // (D / 2)
    int block_size, max_blocks;
};

// What the launches of one device share: the grid barrier's words (zeroed once: the counter only ever grows,
// the per-kv-head counters go back to 0 after each use) and the step's scratch.
struct Device {
    int sm_count;
    size_t max_smem_optin;
    int major;
    unsigned long long *grid_sync;   // (GRID_SYNC_WORDS)
    char *scratch;
    size_t scratch_bytes;
};
#define GRID_SYNC_WORDS 64

static void device_open(Device *dv) {
    memset(dv, 0, sizeof *dv);
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    dv->sm_count = prop.multiProcessorCount;
    dv->max_smem_optin = prop.sharedMemPerBlockOptin;
    dv->major = prop.major;
    CUDA_CHECK(cudaMalloc(&dv->grid_sync, GRID_SYNC_WORDS * sizeof(unsigned long long)));
    CUDA_CHECK(cudaMemset(dv->grid_sync, 0, GRID_SYNC_WORDS * sizeof(unsigned long long)));
    printf("device: %s, %d SMs, %zu B of shared memory per block\n", prop.name, dv->sm_count, dv->max_smem_optin);
}

static void device_close(Device *dv) {
    cudaFree(dv->grid_sync);
    cudaFree(dv->scratch);
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

// The launch's configuration: 0 when the kernel does not take the step (shapes, alignment, device), else 1 with
// *a (every field but the trace) and *smem set.
static int configure(Device *dv, const Step *d, DlArgs *a, size_t *smem) {
    const int D = d->D, G = d->Hq / d->Hkv, C = d->C, I = d->I, QD = d->Hq * D, QKV = QD + 2 * d->Hkv * D;
    if ((D != 64 && D != 128) || G > DL_MAX_G || d->Hkv > GRID_SYNC_WORDS - 1 || d->L > DL_MAX_LAYERS || C % 8 ||
        I % 8 || !aligned16(d->x))
        return 0;
    for (int l = 0; l < d->L; l++) {
        const DlLayer *y = &d->layers[l];
        if (!aligned16(y->ln1) || !aligned16(y->wqkv) || !aligned16(y->bqkv) || !aligned16(y->wo) ||
            !aligned16(y->ln2) || !aligned16(y->wgu) || !aligned16(y->wdown) || !aligned16(y->k_cache) ||
            !aligned16(y->v_cache))
            return 0;
    }
    const int nb = dv->sm_count;
    // Bulk copies and mbarrier transaction counts are Hopper's; the residual rows of a block are one per thread.
    if (dv->major < 9 || C / nb + 1 > DL_CONSUMERS) return 0;
    memset(a, 0, sizeof *a);
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
    const size_t budget = dv->max_smem_optin > fixed ? dv->max_smem_optin - fixed : 0;
    int stages = (int)(budget / (a->slot_bytes + 16));
    if (stages > DL_MAX_STAGES) stages = DL_MAX_STAGES;
    if (stages < DL_MIN_STAGES) return 0;
    a->n_stages = stages;
    *smem = (size_t)stages * a->slot_bytes + fixed + (size_t)stages * 16;

    a->L = d->L;
    a->C = C;
    a->I = I;
    a->Hq = d->Hq;
    a->Hkv = d->Hkv;
    a->eps = d->eps;
    a->scale = d->scale;
    a->positions = d->positions;
    a->slots = d->slots;
    a->token_seq = d->token_seq;
    a->block_tables = d->block_tables;
    a->inv_freq = d->inv_freq;
    a->block_size = d->block_size;
    a->max_blocks = d->max_blocks;
    a->counter = dv->grid_sync;
    a->head_count = dv->grid_sync + 1;
    a->x = d->x;
    for (int l = 0; l < d->L; l++) a->layer[l] = d->layers[l];
    // Scratch: qkv, att, xmid, act (bf16), then the attention partials (fp32), each 256-byte aligned.
    const size_t b_qkv = ((size_t)QKV * 2 + 255) / 256 * 256, b_c = ((size_t)C * 2 + 255) / 256 * 256;
    const size_t b_att = ((size_t)QD * 2 + 255) / 256 * 256;
    const size_t b_i = ((size_t)I * 2 + 255) / 256 * 256;
    const size_t b_acc = (size_t)d->Hq * DL_MAX_PARTS * D * 4, b_ml = (size_t)d->Hq * DL_MAX_PARTS * 2 * 4;
    const size_t need = b_qkv + b_att + b_c + b_i + b_acc + b_ml;
    if (need > dv->scratch_bytes) {
        CUDA_CHECK(cudaFree(dv->scratch));
        CUDA_CHECK(cudaMalloc(&dv->scratch, need));
        dv->scratch_bytes = need;
    }
    char *scratch = dv->scratch;
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
    return 1;
}

template <int D> static int launch_d(Device *dv, const DlArgs *a, size_t smem, cudaStream_t stream) {
    CUDA_CHECK(cudaFuncSetAttribute(decode_layers_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_layers_kernel<D>, DL_THREADS, smem));
    if (per_sm < 1) return 0;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)dv->sm_count);
    cfg.blockDim = dim3(DL_THREADS);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeCooperative;   // every block resident at once: the grid barrier needs it
    attr[0].val.cooperative = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, decode_layers_kernel<D>, *a));
    return 1;
}

static int launch(Device *dv, const DlArgs *a, int D, size_t smem, cudaStream_t stream) {
    return D == 64 ? launch_d<64>(dv, a, smem, stream) : launch_d<128>(dv, a, smem, stream);
}

// After a traced launch: the mean time of each phase over the layers past the first, as block 0 and the last
// block saw it.
static void print_trace(const unsigned long long *t, int L, int stages, size_t smem) {
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

// ---- the cases --------------------------------------------------------------------------------------------

static uint64_t rng_state = 0x2F1B5E7A90C3D481ull;
static uint64_t rng_next(void) {   // splitmix64
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rng_uniform(void) { return (double)(rng_next() >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0; }
static int rng_below(int n) { return (int)(rng_next() % (uint64_t)n); }

static uint16_t bf16_bits(float f) {   // round to nearest even (no NaN among the inputs)
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float bf16_value(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static float round_bf16(float f) { return bf16_value(bf16_bits(f)); }

static float *random_bf16(size_t n, float center, float spread) {
    float *h = (float *)malloc(n * sizeof *h);
    for (size_t i = 0; i < n; i++) h[i] = round_bf16(center + spread * (float)rng_uniform());
    return h;
}

static bf16 *upload(const float *h, size_t n) {
    uint16_t *b = (uint16_t *)malloc(n * 2);
    for (size_t i = 0; i < n; i++) b[i] = bf16_bits(h[i]);
    void *d = NULL;
    CUDA_CHECK(cudaMalloc(&d, n * 2));
    CUDA_CHECK(cudaMemcpy(d, b, n * 2, cudaMemcpyHostToDevice));
    free(b);
    return (bf16 *)d;
}
static void download(float *h, const bf16 *d, size_t n) {
    uint16_t *b = (uint16_t *)malloc(n * 2);
    CUDA_CHECK(cudaMemcpy(b, d, n * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++) h[i] = bf16_value(b[i]);
    free(b);
}
template <typename T> static T *upload_raw(const T *h, size_t n) {
    void *d = NULL;
    CUDA_CHECK(cudaMalloc(&d, n * sizeof(T)));
    CUDA_CHECK(cudaMemcpy(d, h, n * sizeof(T), cudaMemcpyHostToDevice));
    return (T *)d;
}

struct Shape {
    const char *name;
    int L, C, I, Hq, Hkv, D, bias;
};

enum { T_LN1, T_WQKV, T_BQKV, T_WO, T_LN2, T_WGU, T_WDOWN, N_TENSORS };

// One case's host values: weights, caches (n_slots, Hkv, D) per layer, x, the block table and the token.
struct Case {
    Shape s;
    int n_slots, max_blocks, block_size, pos, slot;
    float **w[N_TENSORS];
    float **kc, **vc;
    float *x, *inv_freq;
    int32_t *table;
};

static void tensor_sizes(const Shape *s, size_t n[N_TENSORS]) {
    const size_t QD = (size_t)s->Hq * s->D, QKV = QD + 2 * (size_t)s->Hkv * s->D;
    n[T_LN1] = s->C, n[T_WQKV] = QKV * s->C, n[T_BQKV] = QKV, n[T_WO] = (size_t)s->C * QD, n[T_LN2] = s->C;
    n[T_WGU] = 2 * (size_t)s->I * s->C, n[T_WDOWN] = (size_t)s->C * s->I;
}

// A context of pos + 1 positions in blocks scattered over a pool of three spare blocks more; table entries past
// the context are -1.
static void case_make(Case *k, Shape s, int pos, int store) {
    memset(k, 0, sizeof *k);
    k->s = s;
    k->block_size = 16;
    k->pos = pos;
    const int n_ctx_blocks = (pos + 1 + k->block_size - 1) / k->block_size, n_pool = n_ctx_blocks + 3;
    k->max_blocks = n_ctx_blocks + 2;
    int *perm = (int *)malloc(n_pool * sizeof(int));
    for (int i = 0; i < n_pool; i++) perm[i] = i;
    for (int i = n_pool - 1; i > 0; i--) {
        const int j = rng_below(i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    k->table = (int32_t *)malloc(k->max_blocks * sizeof(int32_t));
    for (int b = 0; b < k->max_blocks; b++) k->table[b] = b < n_ctx_blocks ? perm[b] : -1;
    free(perm);
    k->n_slots = n_pool * k->block_size;
    k->slot = store ? k->table[pos / k->block_size] * k->block_size + pos % k->block_size : -1;
    size_t n[N_TENSORS];
    tensor_sizes(&s, n);
    const float center[N_TENSORS] = {1.0f, 0.0f, 0.0f, 0.0f, 1.0f, 0.0f, 0.0f};
    const float spread[N_TENSORS] = {0.2f, 0.06f, 0.5f, 0.06f, 0.2f, 0.06f, 0.04f};
    for (int t = 0; t < N_TENSORS; t++) {
        k->w[t] = (float **)calloc(s.L, sizeof(float *));
        for (int l = 0; l < s.L; l++) k->w[t][l] = random_bf16(n[t], center[t], spread[t]);
    }
    const size_t KVD = (size_t)s.Hkv * s.D;
    k->kc = (float **)calloc(s.L, sizeof(float *));
    k->vc = (float **)calloc(s.L, sizeof(float *));
    for (int l = 0; l < s.L; l++) {
        k->kc[l] = random_bf16((size_t)k->n_slots * KVD, 0.0f, 1.0f);
        k->vc[l] = random_bf16((size_t)k->n_slots * KVD, 0.0f, 1.0f);
    }
    k->x = random_bf16(s.C, 0.0f, 1.0f);
    k->inv_freq = (float *)malloc((size_t)s.D / 2 * sizeof(float));
    for (int i = 0; i < s.D / 2; i++) k->inv_freq[i] = powf(10000.0f, -2.0f * i / (float)s.D);
}

static void case_free(Case *k) {
    for (int t = 0; t < N_TENSORS; t++) {
        for (int l = 0; l < k->s.L; l++) free(k->w[t][l]);
        free(k->w[t]);
    }
    for (int l = 0; l < k->s.L; l++) free(k->kc[l]), free(k->vc[l]);
    free(k->kc), free(k->vc), free(k->x), free(k->inv_freq), free(k->table);
}

// ---- the CPU reference (fp32 values, sums in double) ------------------------------------------------------

static void rmsnorm(float *out, const float *x, const float *w, int C, float eps) {
    double ss = 0.0;
    for (int i = 0; i < C; i++) ss += (double)x[i] * x[i];
    const float r = (float)(1.0 / sqrt(ss / C + eps));
    for (int i = 0; i < C; i++) out[i] = x[i] * r * w[i];
}

static void matvec(float *out, const float *w, const float *x, const float *bias, int rows, int K) {
    for (int o = 0; o < rows; o++) {
        double s = bias ? bias[o] : 0.0;
        const float *row = w + (size_t)o * K;
        for (int i = 0; i < K; i++) s += (double)row[i] * x[i];
        out[o] = (float)s;
    }
}

static void rope(float *v, int pos, const float *inv_freq, int D) {
    const int half = D / 2;
    for (int i = 0; i < half; i++) {
        const double a = (double)pos * inv_freq[i], c = cos(a), s = sin(a);
        const double x1 = v[i], x2 = v[i + half];
        v[i] = (float)(x1 * c - x2 * s);
        v[i + half] = (float)(x2 * c + x1 * s);
    }
}

// The step on the case's host values: x and the caches updated in place.
static void reference_step(Case *k) {
    const Shape *s = &k->s;
    const int C = s->C, I = s->I, D = s->D, Hq = s->Hq, Hkv = s->Hkv, G = Hq / Hkv, QD = Hq * D;
    const int QKV = QD + 2 * Hkv * D, KVD = Hkv * D, pos = k->pos;
    const float eps = 1e-6f, scale = 1.0f / sqrtf((float)D);
    float *h = (float *)malloc(C * sizeof(float)), *qkv = (float *)malloc(QKV * sizeof(float));
    float *att = (float *)malloc(QD * sizeof(float)), *xmid = (float *)malloc(C * sizeof(float));
    float *gu = (float *)malloc(2 * (size_t)I * sizeof(float)), *act = (float *)malloc(I * sizeof(float));
    float *down = (float *)malloc(C * sizeof(float)), *p = (float *)malloc((pos + 1) * sizeof(float));
    for (int l = 0; l < s->L; l++) {
        rmsnorm(h, k->x, k->w[T_LN1][l], C, eps);
        matvec(qkv, k->w[T_WQKV][l], h, s->bias ? k->w[T_BQKV][l] : NULL, QKV, C);
        for (int hh = 0; hh < Hq + Hkv; hh++) rope(qkv + hh * D, pos, k->inv_freq, D);
        if (k->slot >= 0) {
            memcpy(k->kc[l] + (size_t)k->slot * KVD, qkv + QD, KVD * sizeof(float));
            memcpy(k->vc[l] + (size_t)k->slot * KVD, qkv + QD + KVD, KVD * sizeof(float));
        }
        for (int hh = 0; hh < Hq; hh++) {
            const int g = hh / G;
            const float *q = qkv + hh * D;
            double mx = -INFINITY;
            int bad = 0;
            for (int t = 0; t <= pos; t++) {
                const int blk = t / k->block_size < k->max_blocks ? k->table[t / k->block_size] : -1;
                if (blk < 0) {
                    bad = 1;
                    break;
                }
                const float *kr = k->kc[l] + ((size_t)(blk * k->block_size + t % k->block_size) * Hkv + g) * D;
                double dot = 0.0;
                for (int i = 0; i < D; i++) dot += (double)q[i] * kr[i];
                p[t] = (float)(dot * scale);
                if (p[t] > mx) mx = p[t];
            }
            double sum = 0.0;
            for (int t = 0; t <= pos && !bad; t++) sum += (p[t] = (float)exp(p[t] - mx));
            for (int i = 0; i < D; i++) {
                double o = 0.0;
                for (int t = 0; t <= pos && !bad; t++) {
                    const int blk = k->table[t / k->block_size];
                    o += (double)p[t] * k->vc[l][((size_t)(blk * k->block_size + t % k->block_size) * Hkv + g) * D + i];
                }
                att[hh * D + i] = bad ? NAN : (float)(o / sum);
            }
        }
        matvec(xmid, k->w[T_WO][l], att, NULL, C, QD);
        for (int i = 0; i < C; i++) xmid[i] += k->x[i];
        rmsnorm(h, xmid, k->w[T_LN2][l], C, eps);
        matvec(gu, k->w[T_WGU][l], h, NULL, 2 * I, C);
        for (int i = 0; i < I; i++) act[i] = gu[i] / (1.0f + expf(-gu[i])) * gu[I + i];
        matvec(down, k->w[T_WDOWN][l], act, NULL, C, I);
        for (int i = 0; i < C; i++) k->x[i] = xmid[i] + down[i];
    }
    free(h), free(qkv), free(att), free(xmid), free(gu), free(act), free(down), free(p);
}

// ---- the GPU side of a case -------------------------------------------------------------------------------

struct GpuCase {
    DlLayer *layers;   // host array of device pointers
    bf16 *x;
    int32_t *pos, *slot, *seq, *table;
    float *inv_freq;
    Step step;
};

static void gpu_case_make(GpuCase *g, const Case *k) {
    const Shape *s = &k->s;
    size_t n[N_TENSORS];
    tensor_sizes(s, n);
    const size_t KVD = (size_t)s->Hkv * s->D;
    g->layers = (DlLayer *)calloc(s->L, sizeof(DlLayer));
    for (int l = 0; l < s->L; l++) {
        DlLayer *y = &g->layers[l];
        y->ln1 = upload(k->w[T_LN1][l], n[T_LN1]);
        y->wqkv = upload(k->w[T_WQKV][l], n[T_WQKV]);
        y->bqkv = s->bias ? upload(k->w[T_BQKV][l], n[T_BQKV]) : NULL;
        y->wo = upload(k->w[T_WO][l], n[T_WO]);
        y->ln2 = upload(k->w[T_LN2][l], n[T_LN2]);
        y->wgu = upload(k->w[T_WGU][l], n[T_WGU]);
        y->wdown = upload(k->w[T_WDOWN][l], n[T_WDOWN]);
        y->k_cache = upload(k->kc[l], (size_t)k->n_slots * KVD);
        y->v_cache = upload(k->vc[l], (size_t)k->n_slots * KVD);
    }
    const int32_t pos = k->pos, slot = k->slot, seq = 0;
    g->x = upload(k->x, s->C);
    g->pos = upload_raw(&pos, 1);
    g->slot = upload_raw(&slot, 1);
    g->seq = upload_raw(&seq, 1);
    g->table = upload_raw(k->table, (size_t)k->max_blocks);
    g->inv_freq = upload_raw(k->inv_freq, (size_t)s->D / 2);
    Step st = {};
    st.L = s->L, st.C = s->C, st.I = s->I, st.Hq = s->Hq, st.Hkv = s->Hkv, st.D = s->D;
    st.eps = 1e-6f;
    st.scale = 1.0f / sqrtf((float)s->D);
    st.layers = g->layers;
    st.x = g->x;
    st.positions = g->pos, st.slots = g->slot, st.token_seq = g->seq, st.block_tables = g->table;
    st.inv_freq = g->inv_freq;
    st.block_size = k->block_size, st.max_blocks = k->max_blocks;
    g->step = st;
}

static void gpu_case_free(GpuCase *g, int L) {
    for (int l = 0; l < L; l++) {
        DlLayer *y = &g->layers[l];
        cudaFree((void *)y->ln1), cudaFree((void *)y->wqkv), cudaFree((void *)y->bqkv), cudaFree((void *)y->wo);
        cudaFree((void *)y->ln2), cudaFree((void *)y->wgu), cudaFree((void *)y->wdown);
        cudaFree(y->k_cache), cudaFree(y->v_cache);
    }
    cudaFree(g->x), cudaFree(g->pos), cudaFree(g->slot), cudaFree(g->seq), cudaFree(g->table), cudaFree(g->inv_freq);
    free(g->layers);
}

// x and every layer's caches after one launch on a fresh copy of the case: k then v, (L, n_slots * KVD) each.
struct Result {
    float *x, **kc, **vc;
};

static int gpu_run(Device *dv, const Case *k, Result *r) {
    GpuCase g;
    gpu_case_make(&g, k);
    DlArgs *a = (DlArgs *)malloc(sizeof(DlArgs));
    size_t smem = 0;
    int ran = configure(dv, &g.step, a, &smem) && launch(dv, a, k->s.D, smem, 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    const size_t n = (size_t)k->n_slots * k->s.Hkv * k->s.D;
    r->x = (float *)malloc(k->s.C * sizeof(float));
    r->kc = (float **)calloc(k->s.L, sizeof(float *));
    r->vc = (float **)calloc(k->s.L, sizeof(float *));
    download(r->x, g.x, k->s.C);
    for (int l = 0; l < k->s.L; l++) {
        r->kc[l] = (float *)malloc(n * sizeof(float));
        r->vc[l] = (float *)malloc(n * sizeof(float));
        download(r->kc[l], g.layers[l].k_cache, n);
        download(r->vc[l], g.layers[l].v_cache, n);
    }
    free(a);
    gpu_case_free(&g, k->s.L);
    return ran;
}

static void result_free(Result *r, int L) {
    for (int l = 0; l < L; l++) free(r->kc[l]), free(r->vc[l]);
    free(r->kc), free(r->vc), free(r->x);
}

// ---- checks -----------------------------------------------------------------------------------------------

static const double TOL = 5e-2;
static int failures, n_cases;
static double worst_err;

static double scaled_err(const float *g, const float *c, size_t n) {
    double ss = 0.0, worst = 0.0;
    for (size_t i = 0; i < n; i++) ss += (double)c[i] * c[i];
    const double rms = sqrt(ss / (double)n);
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)g[i] - c[i]) / (fabs(c[i]) + rms + 1e-30);
        if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
    }
    return worst;
}

static void run_case(Device *dv, Shape s, int pos, int store) {
    char what[96];
    snprintf(what, sizeof what, "%s x%d pos %d%s", s.name, s.L, pos, store ? "" : " (slot -1)");
    Case k;
    case_make(&k, s, pos, store);
    Result r1, r2;
    const int ran1 = gpu_run(dv, &k, &r1), ran2 = gpu_run(dv, &k, &r2);
    if (!ran1 || !ran2) {
        printf("FAIL %s: the kernel does not take this shape on this device\n", what);
        failures++;
        result_free(&r1, s.L), result_free(&r2, s.L);
        case_free(&k);
        return;
    }
    reference_step(&k);   // k now holds the expected x and caches (only the token's slot row changes)
    const size_t KVD = (size_t)s.Hkv * s.D;
    double e = scaled_err(r1.x, k.x, s.C);
    size_t other_bad = 0, diff = memcmp(r1.x, r2.x, s.C * sizeof(float)) != 0;
    for (int l = 0; l < s.L; l++) {
        if (k.slot >= 0) {
            e = fmax(e, scaled_err(r1.kc[l] + (size_t)k.slot * KVD, k.kc[l] + (size_t)k.slot * KVD, KVD));
            e = fmax(e, scaled_err(r1.vc[l] + (size_t)k.slot * KVD, k.vc[l] + (size_t)k.slot * KVD, KVD));
        }
        for (int sl = 0; sl < k.n_slots; sl++) {
            if (sl == k.slot) continue;
            other_bad += memcmp(r1.kc[l] + (size_t)sl * KVD, k.kc[l] + (size_t)sl * KVD, KVD * 4) != 0;
            other_bad += memcmp(r1.vc[l] + (size_t)sl * KVD, k.vc[l] + (size_t)sl * KVD, KVD * 4) != 0;
        }
        const size_t n = (size_t)k.n_slots * KVD * sizeof(float);
        diff += memcmp(r1.kc[l], r2.kc[l], n) != 0 || memcmp(r1.vc[l], r2.vc[l], n) != 0;
    }
    const int ok = e <= TOL && !other_bad && !diff;
    printf("%s %-36s error %.2e, %zu other cache rows changed, %zu buffers differ between two runs\n",
           ok ? "  ok  " : "FAIL  ", what, e, other_bad, diff);
    failures += !ok;
    n_cases++;
    if (e > worst_err) worst_err = e;
    result_free(&r1, s.L), result_free(&r2, s.L);
    case_free(&k);
}

// ---- timing -----------------------------------------------------------------------------------------------

// Mean time of a step over `iters` launches (after a warm-up) at context pos + 1; with trace, one more launch
// whose phases are printed. The launches update x and the token's cache slot in place, which changes values but
// not the work.
static void time_shape(Device *dv, Shape s, int pos, int iters, int trace) {
    Case k;
    case_make(&k, s, pos, 1);
    GpuCase g;
    gpu_case_make(&g, &k);
    DlArgs *a = (DlArgs *)malloc(sizeof(DlArgs));
    size_t smem = 0;
    if (!configure(dv, &g.step, a, &smem)) {
        printf("%s: the kernel does not take this shape on this device\n", s.name);
        failures++;
    } else {
        cudaStream_t stream;
        cudaEvent_t ev[2];
        CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        CUDA_CHECK(cudaEventCreate(&ev[0]));
        CUDA_CHECK(cudaEventCreate(&ev[1]));
        for (int i = 0; i < 10; i++) launch(dv, a, s.D, smem, stream);
        CUDA_CHECK(cudaEventRecord(ev[0], stream));
        for (int i = 0; i < iters; i++) launch(dv, a, s.D, smem, stream);
        CUDA_CHECK(cudaEventRecord(ev[1], stream));
        CUDA_CHECK(cudaEventSynchronize(ev[1]));
        float ms = 0.0f;
        CUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
        size_t n[N_TENSORS], bytes = 0;
        tensor_sizes(&s, n);
        for (int t = 0; t < N_TENSORS; t++) bytes += (t == T_BQKV && !s.bias ? 0 : n[t]) * 2;
        bytes *= s.L;
        const double step_s = ms / 1e3 / iters;
        printf("%s x%d, context %d: %.1f us a step, weights %.1f MB at %.0f GB/s (%d stages, %zu B shared)\n",
               s.name, s.L, pos + 1, step_s * 1e6, bytes / 1e6, bytes / step_s / 1e9, a->n_stages, smem);
        if (trace) {
            const size_t n_trace = 2 * (size_t)s.L * DL_TRACE_POINTS;
            unsigned long long *t_dev = NULL;
            CUDA_CHECK(cudaMalloc(&t_dev, n_trace * 8));
            a->trace = t_dev;
            launch(dv, a, s.D, smem, stream);
            CUDA_CHECK(cudaStreamSynchronize(stream));
            unsigned long long *t = (unsigned long long *)malloc(n_trace * 8);
            CUDA_CHECK(cudaMemcpy(t, t_dev, n_trace * 8, cudaMemcpyDeviceToHost));
            print_trace(t, s.L, a->n_stages, smem);
            free(t);
            cudaFree(t_dev);
        }
        cudaEventDestroy(ev[0]), cudaEventDestroy(ev[1]);
        cudaStreamDestroy(stream);
    }
    free(a);
    gpu_case_free(&g, s.L);
    case_free(&k);
}

int main(int argc, char **argv) {
    int trace = 0, iters = 200;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--trace")) trace = 1;
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--trace] [--iters N]\n", argv[0]);
            return 2;
        }
    }
    Device dv;
    device_open(&dv);
    const Shape q05 = {"qwen2.5-0.5b", 3, 896, 4864, 14, 2, 64, 1};
    const Shape q15 = {"qwen2.5-1.5b", 2, 1536, 8960, 12, 2, 128, 1};
    const Shape llama = {"llama no bias", 3, 256, 512, 4, 2, 64, 0};
    const Shape q3b = {"qwen2.5-3b group 8", 1, 2048, 11008, 16, 2, 128, 1};
    const int positions[] = {0, 63, 64, 100, 511, 2000};
    for (size_t i = 0; i < sizeof positions / sizeof positions[0]; i++) {
        run_case(&dv, q05, positions[i], 1);
        run_case(&dv, q15, positions[i], 1);
    }
    run_case(&dv, q05, 77, 0);
    run_case(&dv, llama, 0, 1);
    run_case(&dv, llama, 300, 1);
    run_case(&dv, q3b, 700, 1);
    printf("decode_layers: %d cases, worst error %.2e (tolerance %.0e), %d failure(s)\n", n_cases, worst_err, TOL,
           failures);
    Shape full05 = q05, full15 = q15;
    full05.L = 24;
    full15.L = 28;
    time_shape(&dv, full05, 511, iters, trace);
    time_shape(&dv, full15, 511, iters, trace);
    device_close(&dv);
    return failures ? 1 : 0;
}

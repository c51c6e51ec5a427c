// kernels/cuda/cuda_sample.cu — fused next-token sampling (ops_sample_rows): one block per sample reads its bf16
// logits row a few times and never sorts, so the rollout server downloads 8 bytes per sample instead of a row.
// Greedy samples take their own two kernels instead (greedy_chunks_kernel, greedy_combine_kernel): the row is
// cut into chunks that any number of blocks can share, so that a small batch is not read by a few SMs. A sample's
// mask (OpsSampleParams.mask) becomes a bitmap of the vocabulary in the stream scratch first (mask_bits_kernel),
// which both read.
//
// Same semantics and arithmetic as the CPU twin (kernels/cpu/cpu_sample.c): with z the penalised logit times
// 1/T (float, rounded as the CPU rounds it; -inf for an id the sample's mask forbids) and zm = max z, each filter
// is a cut on z:
//   min-p   z >= t0: the smallest float whose weight exp(z - zm) (double) is > 0 and >= min_p, found by
//           bisection over the float's bits with the same exp the CPU uses (so the sets agree exactly);
//   top-k   z >= the k-th largest surviving z: radix select over the order-preserving float keys, three levels
//           of 11 / 11 / 10 bits, each a shared-memory histogram of counts;
//   top-p   z > xt, or z == xt and id <= id_cut: the same radix search over the keys, with histograms of mass
//           (weights in fixed point, 2^-S of the top token, so the atomics add integers and the result does not
//           depend on their order), finds the value xt where the mass ranked above crosses top_p * total; inside
//           xt's ties the count to keep follows from the rule "keep while the mass above is below top_p", and
//           the id of the last one kept comes from a count in id order;
//   draw    the first kept id (in id order) whose running weight exceeds u * total: per-chunk sums of weights,
//           a prefix over the chunks, then one warp scans the chunk that holds the crossing. A sample with no filter
//           and no penalty (the GRPO default) draws in one read of the row (draw_one_pass) instead of two.
// Weights are exp(z - zm) in double, as on the CPU (the draw's within ~2 ulp: weight_fast), so filtered sets and
// the CDF agree with it to ~1e-15 (the one-pass draw's float weights: ~1e-6); the reported logprob log_softmax(raw / T)[token] uses an online log-sum-exp
// per thread, float exponentials summed in float by eights and then in double (within ~1e-6).
// Every reduction runs in a fixed order that depends only on V (the block size does), never on the other
// samples of the launch or on timing: the result of a sample is reproducible and batch-independent.
#include <math.h>

#include "kernels/cuda/cuda_common.cuh"

static const int SAMPLE_BINS = 2048;        // radix levels of 11, 11 and 10 bits
static const int SAMPLE_MAX_CHUNKS = 2048;  // id-order chunks of the draw (their sums share the histogram's memory)
static const int ID_VEC_CHUNK = 256;        // a chunk of 32 lanes x one 16-byte vector (id_search)

// Values computed by one thread (or a reduction) and read by the whole block.
struct SampleBcast {
    float t0;                 // min-p / underflow cut
    int alive;                // some token survives
    int bin;                  // radix_find's answer (-1: none)
    unsigned long long above; // ... and the count / mass ranked above that bin
    unsigned long long total; // ... and the total of the histogram
    double target;            // ... and the target it looked for
    unsigned long long wq;    // top-p: quantised weight of one token at xt
    long long r_keep;         // top-p: how many of xt's ties are kept (in id order)
    int cut_ties;             // top-p: keep only the first r_keep of xt's ties
    int chunk;                // locate_chunk: the chunk holding the crossing
    int last_chunk;           // locate_chunk: the last chunk with a positive sum
    int last_pos;             // id_search: largest id with a positive value
    int found;                // id_search: the answer
    double chunk_total;       // locate_chunk: sum over all chunks (the draw's total)
    double lse;               // log-sum-exp of raw / T
};

struct SampleShared {
    union {
        unsigned long long hist[SAMPLE_BINS];
        double pre[SAMPLE_MAX_CHUNKS];  // chunk sums, then their exclusive prefix
    };
    float cmax[SAMPLE_MAX_CHUNKS];  // draw_one_pass: each chunk's max z
    unsigned long long red_u[32];
    double red_d[32];
    float red_f[32];
    SampleBcast bc;
    double exp_tab[256];  // 2^(j / 256) for weight_fast
};

// The logits row of one sample as the filters see it.
struct RowView {
    const bf16 *x;
    const uint32_t *pen_bits;  // bitmap of the distinct history ids (only read when penalised)
    const uint32_t *mask_bits; // bitmap of the mask's ids (only read when masked)
    float pen, inv_t;
    bool penalised;
    bool masked;
    uint32_t mask_allow;       // 1: mask_bits are the ids that may be drawn; 0: the ids that may not

    __device__ __forceinline__ float raw(int i) const { return bf2f(x[i]); }
    // z is something else than raw / T (the one-pass draw and the greedy chunks read raw directly otherwise).
    __device__ __forceinline__ bool adjusted() const { return penalised || masked; }
    // The CPU twin's float rounding, step by step (no fused multiply-add): mask (a forbidden id is -inf), penalty,
    // then * (1/T). -0 becomes +0: the two are one value to every comparison (and to the CPU's sort) but two keys
    // to the radix search.
    __device__ __forceinline__ float z_of(int i, float v) const {
        if (masked && ((mask_bits[i >> 5] >> (i & 31) & 1u) ^ mask_allow)) return -INFINITY;
        if (penalised && (pen_bits[i >> 5] >> (i & 31) & 1u)) v = v > 0.0f ? __fdiv_rn(v, pen) : __fmul_rn(v, pen);
        v = __fmul_rn(v, inv_t);
        return v == 0.0f ? 0.0f : v;
    }
};

__device__ __forceinline__ uint32_t float_key(float f) { // larger float, larger key
    const uint32_t b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}
__device__ __forceinline__ float key_float(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? k & 0x7fffffffu : ~k);
}

// The weight of scaled logit z: exp(z - zm) in double, the CPU's expression.
__device__ __forceinline__ double weight(float z, float zm) { return exp(__dsub_rn((double)z, (double)zm)); }

// exp(z - zm) for the draw's running sums (id_search), which take one per id of the row: exp(d) = 2^(j/256) *
// 2^e * e^r with d = (256 e + j) ln2 / 256 + r, |r| <= ln2 / 512, e^r - 1 by a degree-5 polynomial (truncation
// below 1e-20) and 2^(j/256) from exp_tab (exp2 of the double, within an ulp). Within ~2 ulp of exp(), so the
// CDF still agrees with the CPU twin's to ~1e-15, and cheaper than the library's double exp in a loop that takes
// one per id (bench/bench_sample; bench/notes/gpu-passes-h100.md). The subnormal range, -inf, NaN and d > 0 take
// the library's exp.
__device__ __forceinline__ double weight_fast(float z, float zm, const double *exp_tab) {
    const double d = __dsub_rn((double)z, (double)zm);
    if (!(d >= -708.0 && d <= 0.0)) return exp(d);
    const double shifter = 0x1.8p52;                          // adding it rounds to an integer in the low bits
    const double kd = fma(d, 369.32993046757463, shifter);     // 256 / ln 2
    const int k = __double2loint(kd);
    const double kf = kd - shifter;
    double r = fma(-kf, 0x1.62e42fefa39efp-9, d);             // ln2 / 256 rounded (one rounding: an fma)
    r = fma(-kf, 0x1.abc9e3b39803fp-64, r);                   // ... and what the rounding left
    double q = fma(r, 1.0 / 120.0, 1.0 / 24.0);
    q = fma(q, r, 1.0 / 6.0);
    q = fma(q, r, 0.5);
    q = q * r * r + r;                                        // e^r - 1
    const double t = exp_tab[k & 255];
    const double m = fma(t, q, t);                            // 2^(j/256) e^r
    return m * __hiloint2double((1023 + (k >> 8)) << 20, 0);  // * 2^e, e >= -1022 here
}

__device__ __forceinline__ bool survives(float t, float zm, float min_p) {
    const double w = weight(t, zm);
    return w > 0.0 && (!(min_p > 0.0f) || w >= (double)min_p);
}

// ---- block reductions (blockDim.x a multiple of 32; each ends with every thread holding the result) ----

__device__ __forceinline__ float block_max_f(float v, float *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    return warp_max(lane < nwarps ? red[lane] : -INFINITY);
}

// Exclusive prefix over the threads in thread order (an integer: order-free; a double: a fixed tree).
// *total receives the sum over all threads.
template <typename T>
__device__ __forceinline__ T block_exclusive_scan(T v, T *red, T *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    T incl = v;
    for (int o = 1; o < 32; o <<= 1) {
        const T up = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += up;
    }
    T excl = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0) excl = 0;
    __syncthreads();
    if (lane == 31) red[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        T t = lane < nwarps ? red[lane] : (T)0;
        for (int o = 1; o < 32; o <<= 1) {
            const T up = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += up;
        }
        if (lane < nwarps) red[lane] = t; // inclusive prefix of the warp totals
    }
    __syncthreads();
    *total = red[nwarps - 1];
    return warp > 0 ? red[warp - 1] + excl : excl;
}

// Sum of exp(x[k] - m) over k < n (n <= 8, m >= every x[k], or -inf with them): the terms of a log-sum-exp
// in float by the hardware exp2 (__expf: its error grows with |x - m|, but so does the smallness of the term,
// and the terms near the max, which carry the sum, are within a few ulp), ~5e-7 relative over 8 terms of at most
// 1. x = -inf adds 0, x = m adds exactly 1, a NaN makes the sum NaN; m = -inf: nothing to add.
__device__ __forceinline__ float exp_sum(const float *x, int n, float m) {
    float sum = 0.0f;
    if (m == -INFINITY) return sum;
    for (int k = 0; k < n; k++) sum += x[k] == m ? 1.0f : __expf(x[k] - m);
    return sum;
}

// ---- reading a row ------------------------------------------------------------------------------------

// Calls f(i0, raw, n) over this thread's ids of the row in increasing order, raw[0 .. n) the logits of ids
// i0 .. i0 + n - 1. Rows whose length and start allow it are read as 16-byte vectors of 8 ids (vector c of the
// row goes to thread c mod blockDim), ROW_SCAN_VECS vectors in flight per thread: one bf16 load at a time left the
// block waiting on memory latency, which made greedy sampling a sizeable share of a small model's decode step.
// Other rows go id by id (n = 1).
static constexpr int ROW_SCAN_VECS = 2;  // 16-byte vectors in flight per thread (registers: two blocks per SM)
template <typename F> __device__ __forceinline__ void row_scan(const RowView &r, int V, F f) {
    if ((V & 7) == 0 && (reinterpret_cast<uintptr_t>(r.x) & 15u) == 0) {
        const uint4 *xv = reinterpret_cast<const uint4 *>(r.x);
        const int nv = V >> 3, B = blockDim.x;
        for (int c = threadIdx.x; c < nv; c += ROW_SCAN_VECS * B) {
            uint4 w[ROW_SCAN_VECS];
#pragma unroll
            for (int u = 0; u < ROW_SCAN_VECS; u++)
                w[u] = c + u * B < nv ? __ldg(xv + c + u * B) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int u = 0; u < ROW_SCAN_VECS; u++) {
                if (c + u * B >= nv) break;
                const bf16 *h = reinterpret_cast<const bf16 *>(&w[u]);
                float raw[8];
#pragma unroll
                for (int k = 0; k < 8; k++) raw[k] = bf2f(h[k]);
                f((c + u * B) * 8, raw, 8);
            }
        }
    } else {
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const float raw = r.raw(i);
            f(i, &raw, 1);
        }
    }
}

// ---- radix search over the keys of the survivors ---------------------------------------------------

// hist[b] = count (mass == false) or quantised weight sum (mass == true) of the tokens with z >= lo whose key
// has `prefix` in the bits at and above prefix_shift (prefix_shift 32: every key) and digit b in
// (key >> shift) & (nb - 1).
__device__ void radix_hist(SampleShared &sh, const RowView &r, int V, float lo, float zm, uint32_t prefix,
                           int prefix_shift, int shift, int nb, bool mass, double qscale) {
    for (int b = threadIdx.x; b < nb; b += blockDim.x) sh.hist[b] = 0;
    __syncthreads();
    // Integer counts and masses: the order of the adds does not change the histogram. Counts: the lanes of a warp
    // that meet the same bin together add through one atomic, the group's size by its lowest lane (the bins of a
    // level are few where logits crowd, and same-address shared atomics serialise; rows of ties are the worst).
    // Correct for any set of lanes that happen to run together: each lane is in exactly one group per id. Masses
    // keep an atomic per lane: summing a group's 64-bit masses across lanes (shuffles, or 16-bit lane reductions)
    // cost top-p more than the serialised atomics did.
    const int lane = threadIdx.x & 31;
    row_scan(r, V, [&](int i0, const float *raw, int n) {
        for (int j = 0; j < n; j++) {
            const float z = r.z_of(i0 + j, raw[j]);
            if (!(z >= lo)) continue;
            const uint32_t k = float_key(z);
            if (prefix_shift < 32 && (k >> prefix_shift) != prefix) continue;
            const int b = (int)((k >> shift) & (uint32_t)(nb - 1));
            if (mass) {
                const unsigned long long q = __double2ull_rn(weight(z, zm) * qscale);
                if (q) atomicAdd(&sh.hist[b], q);
                continue;
            }
            // Only the lanes still here (those that count at this level) group: the levels below the first drop
            // almost every id, and they must not pay for the grouping.
            const unsigned group = __match_any_sync(__activemask(), b);
            if (lane == __ffs(group) - 1) atomicAdd(&sh.hist[b], (unsigned long long)__popc(group));
        }
    });
    __syncthreads();
}

// Scanning the bins from the top (largest keys): the bin b where base + (sum above b) < target <=
// base + (sum above b) + hist[b], with target = frac * (sum of all bins) when `frac` (else as given). Sets
// bc.bin (-1 when target is outside (base, base + total]), bc.above = base + sum above b, bc.total = sum of
// all bins, bc.target = the target used. Sums are integers; converting the same integer to double gives the
// same value in both neighbours' tests, so at most one bin answers.
__device__ void radix_find(SampleShared &sh, int nb, unsigned long long base, double target, bool frac) {
    const int per = nb / blockDim.x, top = nb - 1 - threadIdx.x * per;
    if (threadIdx.x == 0) sh.bc.bin = -1;
    unsigned long long local = 0;
    for (int j = 0; j < per; j++) local += sh.hist[top - j];
    unsigned long long total;
    unsigned long long run = base + block_exclusive_scan<unsigned long long>(local, sh.red_u, &total);
    if (frac) target *= (double)total;
    for (int j = 0; j < per; j++) {
        const unsigned long long h = sh.hist[top - j];
        if ((double)run < target && target <= (double)(run + h)) {
            sh.bc.bin = top - j;
            sh.bc.above = run;
        }
        run += h;
    }
    if (threadIdx.x == 0) {
        sh.bc.total = total;
        sh.bc.target = target;
    }
    __syncthreads();
}

// The key of the value at which the running count / mass from the top reaches the target, over the tokens
// z >= lo: three levels. The target is `target`, or target * (level-one total) when `frac`; *used receives it.
// Returns false when no bin answers. *above: the count / mass strictly above the value; *at: at the value;
// *total: the first level's total.
__device__ bool radix_select(SampleShared &sh, const RowView &r, int V, float lo, float zm, bool mass, double qscale,
                             double target, bool frac, double *used, uint32_t *key, unsigned long long *above,
                             unsigned long long *at, unsigned long long *total) {
    radix_hist(sh, r, V, lo, zm, 0, 32, 21, SAMPLE_BINS, mass, qscale);
    radix_find(sh, SAMPLE_BINS, 0, target, frac);
    *total = sh.bc.total;
    *used = target = sh.bc.target;
    const int b0 = sh.bc.bin;
    const unsigned long long a0 = sh.bc.above;
    __syncthreads(); // everyone has read bc before the next level rewrites it
    if (b0 < 0) return false;
    radix_hist(sh, r, V, lo, zm, (uint32_t)b0, 21, 10, SAMPLE_BINS, mass, qscale);
    radix_find(sh, SAMPLE_BINS, a0, target, false);
    const int b1 = sh.bc.bin;
    const unsigned long long a1 = sh.bc.above;
    __syncthreads();
    if (b1 < 0) return false;
    const uint32_t prefix = (uint32_t)b0 << 11 | (uint32_t)b1;
    radix_hist(sh, r, V, lo, zm, prefix, 10, 0, SAMPLE_BINS / 2, mass, qscale);
    radix_find(sh, SAMPLE_BINS / 2, a1, target, false);
    const int b2 = sh.bc.bin;
    if (b2 >= 0) {
        *key = prefix << 10 | (uint32_t)b2;
        *above = sh.bc.above;
        *at = sh.hist[b2];
    }
    __syncthreads();
    return b2 >= 0;
}

// ---- search in id order ------------------------------------------------------------------------------

// Warp 0 scans chunk `win` (ids win * chunk .., up to V; none when win < 0) in id order, from the running sum
// sh.pre[win] at its start: the first id with v(i) > 0 whose inclusive running sum exceeds target, else the chunk's
// last id with v > 0, else `fallback`. The answer reaches the whole block.
template <typename F>
__device__ int scan_chunk(SampleShared &sh, int V, int chunk, int win, double target, int fallback, F value) {
    const int lane = threadIdx.x & 31;
    if ((threadIdx.x >> 5) == 0) {
        int found = -1, last_in_chunk = -1;
        if (win >= 0) {
            double base = sh.pre[win];
            for (int i0 = win * chunk; i0 < (win + 1) * chunk && i0 < V; i0 += 32) {
                const int i = i0 + lane;
                const double v = i < V ? value(i) : 0.0;
                double incl = v;
                for (int o = 1; o < 32; o <<= 1) {
                    const double up = __shfl_up_sync(0xffffffffu, incl, o);
                    if (lane >= o) incl += up;
                }
                const unsigned hit = __ballot_sync(0xffffffffu, v > 0.0 && base + incl > target);
                const unsigned pos = __ballot_sync(0xffffffffu, v > 0.0);
                if (hit) {
                    found = i0 + __ffs(hit) - 1;
                    break;
                }
                if (pos) last_in_chunk = i0 + 31 - __clz(pos);
                base += __shfl_sync(0xffffffffu, incl, 31);
            }
        }
        if (lane == 0) sh.bc.found = found >= 0 ? found : last_in_chunk >= 0 ? last_in_chunk : fallback;
    }
    __syncthreads();
    const int ans = sh.bc.found;
    __syncthreads();
    return ans;
}


// The chunks thread t owns in the fixed-order passes over chunk sums: [t * per, (t + 1) * per), clipped to nchunks.
__device__ __forceinline__ void own_chunks(int nchunks, int *c0, int *c1) {
    const int per = (nchunks + blockDim.x - 1) / blockDim.x;
    *c0 = threadIdx.x * per;
    *c1 = *c0 + per < nchunks ? *c0 + per : nchunks;
}

// sh.pre[0, nchunks) holds chunk sums, visible to the block, and `local` the sum of this thread's own_chunks.
// Replaces the sums with their exclusive prefix (a fixed order: integers or not, the same bits for any batch), sets
// sh.bc.chunk_total to the end of the last chunk — its owner's running sum, so that every comparison reads one stored
// number per boundary — and sh.bc.last_chunk to the last chunk with a positive sum (-1: none). Returns the first
// chunk whose end exceeds the target (u * total when `frac`, else `target`; *used receives it), or -1 when rounding
// leaves every end at or below it.
__device__ int locate_chunk(SampleShared &sh, int nchunks, double local, double target, bool frac, double *used) {
    int c0, c1;
    own_chunks(nchunks, &c0, &c1);
    if (threadIdx.x == 0) {  // read by atomics after the barriers below
        sh.bc.chunk = INT_MAX;
        sh.bc.last_chunk = -1;
    }
    double total;
    double run = block_exclusive_scan<double>(local, sh.red_d, &total);
    int last_c = -1;
    for (int c = c0; c < c1; c++) {
        const double s = sh.pre[c];
        sh.pre[c] = run;
        run += s;
        if (s > 0.0) last_c = c;
    }
    if (c0 < nchunks && c1 == nchunks) sh.bc.chunk_total = run;
    if (last_c >= 0) atomicMax(&sh.bc.last_chunk, last_c);
    __syncthreads();
    if (frac) target *= sh.bc.chunk_total;
    *used = target;
    for (int c = c0; c < c1; c++) {
        const double end = c + 1 < nchunks ? sh.pre[c + 1] : sh.bc.chunk_total;
        if (end > target) {
            atomicMin(&sh.bc.chunk, c);
            break;
        }
    }
    __syncthreads();
    return sh.bc.chunk < nchunks ? sh.bc.chunk : -1;
}

// The first id whose inclusive running sum (in id order) of v exceeds target, where v(i) is
//   draw:  exp(z - zm) for kept ids (z > xt, or z == xt and i <= id_cut), else 0; target = u * (sum of v);
//   !draw: 1 for ids with z == xt, else 0; target as given.
// When rounding leaves every running sum at or below target, the answer is the last id with v > 0 (the CPU
// twin's rule). Chunks of `chunk` ids (a multiple of 32, at most SAMPLE_MAX_CHUNKS of them): each warp sums
// whole chunks, a fixed-order prefix over the chunk sums locates the crossing, one warp scans that chunk.
__device__ int id_search(SampleShared &sh, const RowView &r, int V, int chunk, bool draw, float xt, int id_cut,
                         float zm, double u, double target) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int nchunks = (V + chunk - 1) / chunk;
    auto value_of = [&](int i, float raw) -> double {
        const float z = r.z_of(i, raw);
        if (!draw) return z == xt ? 1.0 : 0.0;
        if (!(z > xt || (z == xt && i <= id_cut))) return 0.0;
        return weight_fast(z, zm, sh.exp_tab);
    };
    auto value = [&](int i) -> double { return value_of(i, r.raw(i)); };
    if (threadIdx.x == 0) sh.bc.last_pos = -1;
    int last_pos = -1;
    // Chunk sums, each a warp tree over per-lane partial sums. Chunks of ID_VEC_CHUNK ids over a row of 16-byte
    // vectors: lane l adds ids 8 l .. 8 l + 7 of the chunk (one vector), and a warp loads ID_PREFETCH chunks
    // before summing them (eight independent weights per lane and loads in flight: lane-strided single ids kept
    // the block waiting on latency). Otherwise lane l adds ids l, l + 32, ...
    constexpr int ID_PREFETCH = 2;
    if (chunk == ID_VEC_CHUNK && (V & 7) == 0 && (reinterpret_cast<uintptr_t>(r.x) & 15u) == 0) {
        const uint4 *xv = reinterpret_cast<const uint4 *>(r.x);
        const int nv = V >> 3;
        for (int c0 = warp; c0 < nchunks; c0 += ID_PREFETCH * nwarps) {
            uint4 w[ID_PREFETCH];
#pragma unroll
            for (int u = 0; u < ID_PREFETCH; u++) {
                const int v = (c0 + u * nwarps) * 32 + lane;
                w[u] = c0 + u * nwarps < nchunks && v < nv ? __ldg(xv + v) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < ID_PREFETCH; u++) {
                const int c = c0 + u * nwarps;
                if (c >= nchunks) break;  // the same for the whole warp
                const int i0 = (c * 32 + lane) * 8;
                const bf16 *h = reinterpret_cast<const bf16 *>(&w[u]);
                double acc = 0.0;
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    if (i0 + k >= V) break;
                    const double v = value_of(i0 + k, bf2f(h[k]));
                    if (v > 0.0) {
                        acc += v;
                        last_pos = i0 + k;
                    }
                }
                acc = warp_sum_d(acc);
                if (lane == 0) sh.pre[c] = acc;
            }
        }
    } else {
        for (int c = warp; c < nchunks; c += nwarps) {
            double acc = 0.0;
            for (int i = c * chunk + lane; i < (c + 1) * chunk && i < V; i += 32) {
                const double v = value(i);
                if (v > 0.0) {
                    acc += v;
                    last_pos = i;
                }
            }
            acc = warp_sum_d(acc);
            if (lane == 0) sh.pre[c] = acc;
        }
    }
    __syncthreads();
    if (last_pos >= 0) atomicMax(&sh.bc.last_pos, last_pos);
    int c0, c1;
    own_chunks(nchunks, &c0, &c1);
    double local = 0.0;
    for (int c = c0; c < c1; c++) local += sh.pre[c];
    const int win = locate_chunk(sh, nchunks, local, draw ? u : target, draw, &target);
    return scan_chunk(sh, V, chunk, win, target, sh.bc.last_pos, value);
}

// 2^x by the hardware exp2 with subnormal results flushed to zero (no range fix-up around it).
__device__ __forceinline__ float ex2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The weight exp(d) of a scaled logit d = z - m below a chunk's max m, in float: ~2 ulp from the rounding of
// d * log2(e) and the exp2; -inf (and anything below 2^-126) weighs 0, NaN stays NaN.
__device__ __forceinline__ float chunk_weight(float z, float m) { return ex2_ftz((z - m) * 1.44269504088896341f); }

static constexpr int ONE_PASS_VECS = 2;                       // 16-byte vectors per lane in a one-pass chunk
static constexpr int ONE_PASS_CHUNK = 32 * 8 * ONE_PASS_VECS;  // its ids

// The draw of a sample without filters, penalty or mask (no top-k, top-p, min-p, repetition penalty, mask: the GRPO
// default) in one read of the row instead of pass 1 and id_search's two. Each warp takes chunks of ONE_PASS_CHUNK ids
// (lane l: vectors l and l + 32 of the chunk), the next one's loads in flight while it works on the current, and keeps
// the chunk's max m_c and its sum of exp(z - m_c), the exponentials in float (chunk_weight: the hardware exp2, which
// leaves the kernel bound by the row's bytes instead of double arithmetic), each lane's sixteen summed in float and the
// rest in double. A fixed-order prefix over the chunk sums moved to the row's max zm (times f_c = exp(m_c - zm),
// double) locates the chunk where the running sum crosses u * total, and warp 0 rescans that chunk with the same terms
// f_c * exp(z - m_c). Each weight is within ~1e-6 (relative; ~2e-7 for z - m_c near 0, where the mass is) of the CPU
// twin's exp(z - zm) in double, so the CDF is too: the token differs from the CPU's only where u lies that close to a
// boundary. Here z = raw / T, so the logprob's log-sum-exp is zm + log(total), as close. The row is read in vectors
// (the caller checks V % 8 == 0, a 16-byte aligned row and at most SAMPLE_MAX_CHUNKS chunks). Returns false, with
// nothing decided, when the row holds a NaN or zm is not finite (every logit -inf, or +inf in the row): the general
// path then answers.
__device__ bool draw_one_pass(SampleShared &sh, const RowView &r, int V, double u, int *tok, double *lse) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int nchunks = (V + ONE_PASS_CHUNK - 1) / ONE_PASS_CHUNK, nv = V >> 3;
    const uint4 *xv = reinterpret_cast<const uint4 *>(r.x);
    // Lane's vector k of chunk c: the row's vector (c * ONE_PASS_VECS + k) * 32 + lane, zero past the row.
    auto load = [&](int c, uint4 *w) {
#pragma unroll
        for (int k = 0; k < ONE_PASS_VECS; k++) {
            const int v = (c * ONE_PASS_VECS + k) * 32 + lane;
            w[k] = c < nchunks && v < nv ? __ldg(xv + v) : make_uint4(0, 0, 0, 0);
        }
    };
    int nan_seen = 0;
    uint4 cur[ONE_PASS_VECS], nxt[ONE_PASS_VECS];
    load(warp, cur);
    for (int c = warp; c < nchunks; c += nwarps) {
        load(c + nwarps, nxt);
        float z[8 * ONE_PASS_VECS], lm = -INFINITY;
#pragma unroll
        for (int k = 0; k < ONE_PASS_VECS; k++) {
            const bool valid = (c * ONE_PASS_VECS + k) * 32 + lane < nv;
            const bf16 *h = reinterpret_cast<const bf16 *>(&cur[k]);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                // Unpenalised: z is raw * (1 / T) rounded as the CPU rounds it (-0 and +0 weigh alike here).
                z[8 * k + j] = valid ? __fmul_rn(bf2f(h[j]), r.inv_t) : -INFINITY;
                lm = fmaxf(lm, z[8 * k + j]);
            }
        }
        const float m = warp_max(lm);
        float acc = 0.0f;
        if (m > -INFINITY && m < INFINITY) {
#pragma unroll
            for (int j = 0; j < 8 * ONE_PASS_VECS; j++) acc += chunk_weight(z[j], m);
            nan_seen |= acc != acc;  // a NaN logit makes its lane's sum NaN
        } else {
#pragma unroll
            for (int j = 0; j < 8 * ONE_PASS_VECS; j++) nan_seen |= z[j] != z[j];
        }
        const double sum = warp_sum_d((double)acc);
        if (lane == 0) {
            sh.pre[c] = sum;
            sh.cmax[c] = m;
        }
#pragma unroll
        for (int k = 0; k < ONE_PASS_VECS; k++) cur[k] = nxt[k];
    }
    if (__syncthreads_or(nan_seen)) return false;  // the general path's rules for NaN logits
    // The row's max over this thread's chunks and the block, then the sums moved to it and their prefix.
    int c0, c1;
    own_chunks(nchunks, &c0, &c1);
    float lm = -INFINITY;
    for (int c = c0; c < c1; c++) lm = fmaxf(lm, sh.cmax[c]);
    const float zm = block_max_f(lm, sh.red_f);
    if (!(zm > -INFINITY && zm < INFINITY)) return false;  // the same for the whole block
    double local = 0.0;
    for (int c = c0; c < c1; c++) {
        const double sc = sh.pre[c] > 0.0 ? sh.pre[c] * weight(sh.cmax[c], zm) : 0.0;
        sh.pre[c] = sc;
        local += sc;
    }
    double target;
    const int crossing = locate_chunk(sh, nchunks, local, u, true, &target);
    const double all = sh.bc.chunk_total;
    *lse = (double)zm + log(all);
    // No crossing (rounding left every running sum at or below the target): the last id with a positive weight, the
    // CPU twin's rule, which the last chunk with a positive sum holds (its max weighs f_c > 0 there).
    const bool crossed = crossing >= 0;
    const int win = crossed ? crossing : sh.bc.last_chunk;
    const float m_win = sh.cmax[win];
    const double f_win = weight(m_win, zm);
    *tok = scan_chunk(sh, V, ONE_PASS_CHUNK, win, crossed ? target : INFINITY, -1, [&](int i) -> double {
        return f_win * (double)chunk_weight(__fmul_rn(r.raw(i), r.inv_t), m_win);
    });
    return *tok >= 0;
}

// ---- greedy samples -----------------------------------------------------------------------------------

// The history bitmap of sample s (each distinct id once) in pen_bits, when the sample is penalised (the whole
// block takes part). Returns whether it is.
__device__ __forceinline__ bool build_pen_bits(uint32_t *pen_bits, const OpsSampleParams &p, const int32_t *history,
                                               const int32_t *history_offsets, int s, int V, int n_history) {
    int h0 = 0, h1 = 0;
    if (history_offsets) {
        h0 = min(max(history_offsets[s], 0), n_history);
        h1 = min(max(history_offsets[s + 1], h0), n_history);
    }
    const bool penalised = p.repetition_penalty != 1.0f && h1 > h0;
    if (penalised) {
        for (int w = threadIdx.x; w < (V + 31) / 32; w += blockDim.x) pen_bits[w] = 0u;
        __syncthreads();
        for (int h = h0 + threadIdx.x; h < h1; h += blockDim.x) {
            const int32_t t = history[h];
            if (t >= 0 && t < V) atomicOr(&pen_bits[t >> 5], 1u << (t & 31));
        }
        __syncthreads();
    }
    return penalised;
}

// Whether sample p has a mask (OpsSampleParams.mask_mode).
__device__ __forceinline__ bool has_mask(const OpsSampleParams &p) {
    return p.mask_mode == OPS_SAMPLE_MASK_BAN || p.mask_mode == OPS_SAMPLE_MASK_ALLOW;
}

// One block per sample s with a mask: the bitmap of its ids in bits + s * words (words = (V + 31) / 32), in global
// memory, which both sampling kernels read (a greedy sample's row is shared by several blocks). Unmasked samples
// leave theirs alone: nothing reads it. Kept out of shared memory so that the kernels' footprint, and with it
// how many blocks an SM holds, is the same as without masks.
__global__ void mask_bits_kernel(uint32_t *bits, const OpsSampleParams *params, int V, int words) {
    const OpsSampleParams p = params[blockIdx.x];
    if (!has_mask(p)) return;
    uint32_t *b = bits + (size_t)blockIdx.x * words;
    for (int w = threadIdx.x; w < words; w += blockDim.x) b[w] = 0u;
    __syncthreads();
    const int n = p.mask ? p.n_mask : 0;
    for (int k = threadIdx.x; k < n; k += blockDim.x) {
        const int32_t t = p.mask[k];
        if (t >= 0 && t < V) atomicOr(&b[t >> 5], 1u << (t & 31));
    }
}

// The sample's row, penalty and mask as the filters read them: pen_bits in shared memory ((V + 31) / 32 words, built
// here), the mask's bitmap of sample s from mask_bits_kernel.
__device__ __forceinline__ RowView make_row_view(const bf16 *logits, const OpsSampleParams &p, float inv_t,
                                                 uint32_t *pen_bits, const uint32_t *mask_bits,
                                                 const int32_t *history, const int32_t *history_offsets, int s, int V,
                                                 int n_history) {
    RowView r;
    r.x = logits + (size_t)p.logits_row * V;
    r.pen_bits = pen_bits;
    r.mask_bits = mask_bits + (size_t)s * ((V + 31) / 32);
    r.pen = p.repetition_penalty;
    r.inv_t = inv_t;
    r.penalised = build_pen_bits(pen_bits, p, history, history_offsets, s, V, n_history);
    r.masked = has_mask(p);
    r.mask_allow = p.mask_mode == OPS_SAMPLE_MASK_ALLOW ? 1u : 0u;
    return r;
}

// Whether sample p is greedy with a valid row: greedy_chunks_kernel and greedy_combine_kernel take it, the
// one-block kernel leaves it.
__device__ __forceinline__ bool greedy_sample(const OpsSampleParams &p, int n_rows) {
    return p.logits_row >= 0 && p.logits_row < n_rows && p.temperature < OPS_SAMPLE_GREEDY_BELOW;
}

// (value, id) over the warp by a fixed butterfly: the larger value, or on a tie the lower id.
__device__ __forceinline__ void warp_argmax(float &v, int &i) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) {
            v = ov;
            i = oi;
        }
    }
}

// One chunk of a greedy sample's row: 32 lanes x GREEDY_PER_LANE 16-byte vectors of 8 ids where the rows are read in
// vectors (lane l: the chunk's vectors l, l + 32, ...), else 32 x GREEDY_PER_LANE single ids. Its argmax of the
// penalised logits (value, id; INT_MAX when it holds no number) and the log-sum-exp of the raw logits as (max m,
// sum of exp(x - m)).
static constexpr int GREEDY_PER_LANE = 4;
static constexpr int GREEDY_WARPS = 8;  // warps of a greedy_chunks_kernel block
// Blocks per SM a greedy launch spreads its rows' chunks over: fewer left small batches short of memory
// parallelism, more gained nothing (bench/notes/gpu-passes-h100.md).
static constexpr int GREEDY_BLOCKS_PER_SM = 8;
struct GreedyChunk {
    float zmax;
    int arg;
    float m;
    double s;
};

// Grid (n, G), GREEDY_WARPS (W) warps a block: warp w of block (s, g) takes chunks W g + w, + W G, ... of sample
// s's row when the sample is greedy (others return). A chunk's result depends on its ids alone (each lane's ids
// in increasing order, then a fixed butterfly, lane 0 writes), never on G: the host spreads a small batch over many
// blocks and a large one over few, and a sample's token and logprob do not depend on the batch. chunks (n,
// n_chunks).
// Dynamic shared memory: the history bitmap, (V + 31) / 32 words; mask_bits from mask_bits_kernel.
__global__ void __launch_bounds__(GREEDY_WARPS * 32)
greedy_chunks_kernel(GreedyChunk *chunks, const bf16 *logits, const OpsSampleParams *params, const int32_t *history,
                     const int32_t *history_offsets, const uint32_t *mask_bits, int n_rows, int V, int n_history,
                     int vec, int n_chunks) {
    extern __shared__ uint32_t pen_bits[];
    const int s = blockIdx.x, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const OpsSampleParams p = params[s];
    if (!greedy_sample(p, n_rows)) return;
    const RowView r = make_row_view(logits, p, 1.0f, pen_bits, mask_bits, history, history_offsets, s, V, n_history);
    GreedyChunk *out = chunks + (size_t)s * n_chunks;
    const int e = vec ? 8 : 1, stride = gridDim.y * nwarps;
    const uint4 *xv = reinterpret_cast<const uint4 *>(r.x);
    // Lane's j-th unit (vector or id) of chunk c starts at id first(c, j); loaded a chunk ahead.
    auto first = [&](int c, int j) { return ((c * GREEDY_PER_LANE + j) * 32 + lane) * e; };
    auto load = [&](int c, uint4 *w) {
#pragma unroll
        for (int j = 0; j < GREEDY_PER_LANE; j++) {
            const int i0 = first(c, j);
            w[j] = make_uint4(0, 0, 0, 0);
            if (c < n_chunks && i0 < V) {
                if (vec) w[j] = __ldg(xv + (i0 >> 3));  // V % 8 == 0: all 8 ids exist
                else w[j].x = __bfloat16_as_ushort(r.x[i0]);
            }
        }
    };
    int c = blockIdx.y * nwarps + (threadIdx.x >> 5);
    uint4 cur[GREEDY_PER_LANE], nxt[GREEDY_PER_LANE];
    load(c, cur);
    for (; c < n_chunks; c += stride) {
        load(c + stride, nxt);
        // The argmax of z (each lane's ids in increasing order) and the max of the raw logits ...
        float zv = -INFINITY, rm = -INFINITY;
        int zi = INT_MAX;
#pragma unroll
        for (int j = 0; j < GREEDY_PER_LANE; j++) {
            const int i0 = first(c, j), n = i0 < V ? e : 0;
            const bf16 *h = reinterpret_cast<const bf16 *>(&cur[j]);
            for (int k = 0; k < n; k++) {
                const float raw = bf2f(h[k]);
                // Unpenalised and unmasked, z is the raw logit (T = 1; -0 and +0 compare equal, so no normalising
                // here).
                const float z = r.adjusted() ? r.z_of(i0 + k, raw) : raw;
                if (z > zv || (z == zv && zi == INT_MAX)) {
                    zv = z;
                    zi = i0 + k;
                }
                rm = fmaxf(rm, raw);
            }
        }
        // ... then the lane's sum of exp(raw - rm) in float (chunk_weight; a NaN logit makes it NaN), or with rm = +inf
        // the count of +inf logits (each weighs 1 against the max).
        float ls = 0.0f;
        if (rm > -INFINITY && rm < INFINITY) {
#pragma unroll
            for (int j = 0; j < GREEDY_PER_LANE; j++) {
                const int n = first(c, j) < V ? e : 0;
                const bf16 *h = reinterpret_cast<const bf16 *>(&cur[j]);
                for (int k = 0; k < n; k++) ls += chunk_weight(bf2f(h[k]), rm);
            }
        } else if (rm == INFINITY) {
            for (int j = 0; j < GREEDY_PER_LANE; j++) {
                const int n = first(c, j) < V ? e : 0;
                const bf16 *h = reinterpret_cast<const bf16 *>(&cur[j]);
                for (int k = 0; k < n; k++) ls += bf2f(h[k]) == rm ? 1.0f : 0.0f;
            }
        }
        warp_argmax(zv, zi);
        const float m = warp_max(rm);
        const double sv = warp_sum_d(ls > 0.0f ? (double)ls * exp((double)rm - (double)m) : (double)ls);
        if (lane == 0) out[c] = GreedyChunk{zv, zi, m, sv};
#pragma unroll
        for (int j = 0; j < GREEDY_PER_LANE; j++) cur[j] = nxt[j];
    }
}

// One warp per greedy sample: its token (the chunks' argmax, ties to the lower id) and logprob raw[token] - lse,
// the chunks' log-sum-exp combined lane by lane over chunks lane, lane + 32, ... and then by a fixed butterfly
// (lane 0's result is written): the same order for any batch and any G.
__global__ void greedy_combine_kernel(int32_t *tokens, float *logprobs, const GreedyChunk *chunks, const bf16 *logits,
                                      const OpsSampleParams *params, int n, int n_rows, int V, int n_chunks) {
    const int s = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
    if (s >= n) return;
    const OpsSampleParams p = params[s];
    if (!greedy_sample(p, n_rows)) return;
    const GreedyChunk *g = chunks + (size_t)s * n_chunks;
    float zv = -INFINITY, M = -INFINITY;
    int zi = INT_MAX;
    double S = 0.0;
    for (int c = lane; c < n_chunks; c += 32) {
        const GreedyChunk k = g[c];
        if (k.zmax > zv || (k.zmax == zv && k.arg < zi)) {
            zv = k.zmax;
            zi = k.arg;
        }
        if (k.m == -INFINITY) {
            S += k.s;  // 0, or NaN from a NaN logit
        } else if (k.m > M) {
            S = S * exp((double)M - (double)k.m) + k.s;  // M = -inf: S is 0 and exp(-inf) is 0
            M = k.m;
        } else {
            S += k.s * exp((double)k.m - (double)M);
        }
    }
    warp_argmax(zv, zi);
    const float M_all = warp_max(M);
    const double S_all = warp_sum_d(M == -INFINITY ? S : S * exp((double)M - (double)M_all));
    if (lane == 0) {
        const double lse = M_all == -INFINITY ? -INFINITY : (double)M_all + log(S_all);
        const int tok = zi < V ? zi : 0;  // a row of NaN has no argmax
        tokens[s] = tok;
        logprobs[s] = (float)((double)bf2f(logits[(size_t)p.logits_row * V + tok]) - lse);
    }
}

// ---- the kernel ----------------------------------------------------------------------------------------

// One block per sample s that is not greedy (a bad logits_row included). logits (n_rows, V) bf16; params (n);
// history_offsets (n + 1) or NULL; tokens, logprobs (n); mask_bits from mask_bits_kernel. Dynamic shared memory:
// the history bitmap, (V + 31) / 32 words.
__global__ void __launch_bounds__(512)
sample_rows_kernel(int32_t *tokens, float *logprobs, const bf16 *logits, const OpsSampleParams *params,
                   const int32_t *history, const int32_t *history_offsets, const uint32_t *mask_bits, int n_rows, int V,
                   int n_history, int chunk, double qscale) {
    extern __shared__ uint32_t pen_bits[];
    __shared__ SampleShared sh;
    const int s = blockIdx.x, tid = threadIdx.x;
    const OpsSampleParams p = params[s];
    if (p.logits_row < 0 || p.logits_row >= n_rows) {
        if (tid == 0) {
            tokens[s] = -1;
            logprobs[s] = __int_as_float(0x7fc00000);
        }
        return;
    }
    if (greedy_sample(p, n_rows)) return;  // greedy_chunks_kernel and greedy_combine_kernel's
    const RowView r = make_row_view(logits, p, __fdiv_rn(1.0f, p.temperature), pen_bits, mask_bits, history,
                                    history_offsets, s, V, n_history);
    // No filter, penalty or mask (the general path's tests, NaN parameters included): one read of the row.
    const bool unfiltered = !(p.top_k > 0 && p.top_k < V) && !(p.top_p < 1.0f) && !(p.min_p > 0.0f);
    const bool row_vectors = (V & 7) == 0 && (reinterpret_cast<uintptr_t>(r.x) & 15u) == 0;
    if (unfiltered && !r.adjusted() && row_vectors &&
        (V + ONE_PASS_CHUNK - 1) / ONE_PASS_CHUNK <= SAMPLE_MAX_CHUNKS) {
        int tok;
        double lse;
        if (draw_one_pass(sh, r, V, p.u, &tok, &lse)) {
            if (tid == 0) {
                tokens[s] = tok;
                logprobs[s] = (float)((double)__fmul_rn(r.raw(tok), r.inv_t) - lse);
            }
            return;
        }
    }

    // The draw's table: read after the block reductions below (each synchronises).
    for (int j = tid; j < 256; j += blockDim.x) sh.exp_tab[j] = exp2(j / 256.0);
    // Pass 1: the max of z and an online log-sum-exp of the unpenalised raw / T, each thread over its ids in
    // increasing order (row_scan).
    float zmax = -INFINITY, lm = -INFINITY;
    double ls = 0.0;
    // The max, then the log-sum-exp rescaled once to the largest of the n (an id equal to the running max adds
    // exactly 1, so +inf logits behave as id-by-id updates would); the n exponentials are summed in float, then
    // added to the double (a conversion and a double add per 8 ids, not per id).
    row_scan(r, V, [&](int i0, const float *raw, int n) {
        float q[8], qm = -INFINITY;
        for (int k = 0; k < n; k++) {
            zmax = fmaxf(zmax, r.z_of(i0 + k, raw[k]));
            q[k] = __fmul_rn(raw[k], r.inv_t);
            qm = fmaxf(qm, q[k]);
        }
        if (qm > lm) {
            ls *= (double)expf(lm - qm); // lm = -inf: ls is 0 and expf(-inf) is 0
            lm = qm;
        }
        ls += (double)exp_sum(q, n, lm);
    });
    const float m_all = block_max_f(lm, sh.red_f);
    const double s_all = block_sum_d(ls > 0.0 ? ls * exp((double)lm - (double)m_all) : ls, sh.red_d);
    const double lse = m_all == -INFINITY ? -INFINITY : (double)m_all + log(s_all);
    int tok;
    {
        const float zm = block_max_f(zmax, sh.red_f);
        // The min-p / underflow cut: bisection over the float keys in (-inf, zm], as the CPU twin does.
        if (tid == 0) {
            sh.bc.alive = survives(zm, zm, p.min_p);
            if (sh.bc.alive) {
                uint32_t lo = float_key(-INFINITY), hi = float_key(zm);
                while (hi - lo > 1) {
                    const uint32_t mid = lo + (hi - lo) / 2;
                    if (survives(key_float(mid), zm, p.min_p)) hi = mid;
                    else lo = mid;
                }
                sh.bc.t0 = key_float(hi);
            }
        }
        __syncthreads();
        if (!sh.bc.alive) {
            tok = 0; // nothing survives (every logit -inf, or min_p > 1)
        } else {
            const float t0 = sh.bc.t0;
            float x_lo = t0;
            uint32_t key;
            unsigned long long above, at, total;
            double used;
            if (p.top_k > 0 && p.top_k < V) {
                // The k-th largest surviving z; the first level's total is the number of survivors.
                const bool ok = radix_select(sh, r, V, t0, zm, false, 0.0, (double)p.top_k, false, &used, &key, &above,
                                             &at, &total);
                if (ok && total > (unsigned long long)p.top_k) x_lo = key_float(key);
            }
            float xt = x_lo;
            int id_cut = V - 1;
            if (p.top_p < 1.0f) {
                bool cut = false;
                long long r_keep = 1;
                if (!(p.top_p > 0.0f)) { // top_p <= 0: the top token alone (the first of zm's ties)
                    xt = zm;
                    cut = true;
                } else if (radix_select(sh, r, V, x_lo, zm, true, qscale, (double)p.top_p, true, &used, &key, &above,
                                        &at, &total)) {
                    // The value xt where the survivors' mass from the top reaches need = top_p * total.
                    xt = key_float(key);
                    if (tid == 0) {
                        // Tie ranks 0, 1, ... of xt have A, A + w, ... ranked above them; rank j stays while
                        // A + j * w < need (rank 0 does: A < need by the search).
                        const double need = used;
                        const unsigned long long wq = __double2ull_rn(weight(xt, zm) * qscale);
                        const long long c = wq ? (long long)(at / wq) : 1;
                        long long rk = wq ? (long long)ceil((need - (double)above) / (double)wq) : c;
                        rk = rk < 1 ? 1 : rk > c ? c : rk;
                        while (rk > 1 && (double)(above + (unsigned long long)(rk - 1) * wq) >= need) rk--;
                        while (rk < c && (double)(above + (unsigned long long)rk * wq) < need) rk++;
                        sh.bc.r_keep = rk;
                        sh.bc.cut_ties = rk < c;
                    }
                    __syncthreads();
                    r_keep = sh.bc.r_keep;
                    cut = sh.bc.cut_ties;
                    __syncthreads();
                }
                if (cut) id_cut = id_search(sh, r, V, chunk, false, xt, 0, zm, 0.0, (double)r_keep - 0.5);
            }
            tok = id_search(sh, r, V, chunk, true, xt, id_cut, zm, p.u, 0.0);
            if (tok < 0 || tok >= V) tok = 0;
        }
    }
    if (tid == 0) {
        tokens[s] = tok;
        logprobs[s] = (float)((double)__fmul_rn(r.raw(tok), r.inv_t) - lse);
    }
}

void cuda_sample_rows(OpsCtx *ctx, int32_t *tokens, float *logprobs, const void *logits, const OpsSampleParams *params,
                      const int32_t *history, const int32_t *history_offsets, int n, int n_rows, int V, int n_history) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, n >= 0 && n_rows >= 0 && V > 0 && n_history >= 0,
                   "sample_rows: bad shape n=%d n_rows=%d V=%d n_history=%d", n, n_rows, V, n_history);
    if (n == 0) return;
    // 512 threads for real vocabularies (two blocks fit an SM); fewer for small ones. A power of two that
    // divides the radix levels' 1024 and 2048 bins.
    const int threads = V >= 8192 ? 512 : V >= 1024 ? 256 : 128;
    // Chunks of the draw: ID_VEC_CHUNK ids (a vector per lane) where the row is read in vectors and that makes
    // at most SAMPLE_MAX_CHUNKS of them; else a multiple of 32 ids, at most SAMPLE_MAX_CHUNKS of them.
    const long long per_chunk = ((long long)V + SAMPLE_MAX_CHUNKS - 1) / SAMPLE_MAX_CHUNKS;
    const int chunk = V % 8 == 0 && per_chunk <= ID_VEC_CHUNK ? ID_VEC_CHUNK : (int)((per_chunk + 31) / 32 * 32);
    // Fixed-point mass: 2^S units per top-token weight, with S small enough that V weights of at most 1 sum
    // below 2^62.
    int bits = 0;
    while ((1ll << bits) < V) bits++;
    const double qscale = ldexp(1.0, 62 - bits);
    const size_t dyn = ((size_t)V + 31) / 32 * sizeof(uint32_t);
    const size_t static_bytes = sizeof(SampleShared);
    CUDA_ARG_CHECK(ctx, dyn + static_bytes <= st->max_smem_optin,
                   "sample_rows: V=%d needs %zu bytes of shared memory (device has %zu)", V, dyn + static_bytes,
                   st->max_smem_optin);
    // Greedy samples: chunks of 1024 ids (128 for rows not read in vectors), spread over about GREEDY_BLOCKS_PER_SM
    // blocks per SM for the whole launch (a block takes a chunk per warp at least).
    const int vec = V % 8 == 0 && ((uintptr_t)logits & 15u) == 0;
    const int per = 32 * GREEDY_PER_LANE * (vec ? 8 : 1), n_chunks = (V + per - 1) / per;
    // The stream scratch: the greedy chunks' results, then one mask bitmap per sample (written for masked samples
    // only, by mask_bits_kernel).
    const int words = (V + 31) / 32;
    const size_t chunk_bytes = ((size_t)n * n_chunks * sizeof(GreedyChunk) + 255) / 256 * 256;
    char *scratch = (char *)cuda_scratch(ctx, st, chunk_bytes + (size_t)n * words * sizeof(uint32_t));
    if (!scratch) return;
    GreedyChunk *chunks = (GreedyChunk *)scratch;
    uint32_t *mask_bits = (uint32_t *)(scratch + chunk_bytes);
    mask_bits_kernel<<<n, 256, 0, st->stream>>>(mask_bits, params, V, words);
    CUDA_CHECK_LAUNCH(ctx);
    if (dyn + static_bytes > 48 * 1024)
        CUDA_CHECK(ctx,
                   cudaFuncSetAttribute(sample_rows_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dyn));
    sample_rows_kernel<<<n, threads, dyn, st->stream>>>(tokens, logprobs, (const bf16 *)logits, params, history,
                                                         history_offsets, mask_bits, n_rows, V, n_history, chunk,
                                                         qscale);
    CUDA_CHECK_LAUNCH(ctx);
    const int want = (GREEDY_BLOCKS_PER_SM * st->sm_count + n - 1) / n;
    const int most = (n_chunks + GREEDY_WARPS - 1) / GREEDY_WARPS;
    const int G = want < 1 ? 1 : want > most ? most : want;
    if (dyn > 48 * 1024)
        CUDA_CHECK(ctx,
                   cudaFuncSetAttribute(greedy_chunks_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dyn));
    greedy_chunks_kernel<<<dim3((unsigned)n, (unsigned)G), GREEDY_WARPS * 32, dyn, st->stream>>>(
        chunks, (const bf16 *)logits, params, history, history_offsets, mask_bits, n_rows, V, n_history, vec,
        n_chunks);
    CUDA_CHECK_LAUNCH(ctx);
    greedy_combine_kernel<<<(unsigned)(((size_t)n * 32 + 255) / 256), 256, 0, st->stream>>>(
        tokens, logprobs, chunks, (const bf16 *)logits, params, n, n_rows, V, n_chunks);
    CUDA_CHECK_LAUNCH(ctx);
}

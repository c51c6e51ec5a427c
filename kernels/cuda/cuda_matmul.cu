// kernels/cuda/cuda_matmul.cu — the Linear layer's GEMMs through cuBLASLt: bf16 A/B, fp32 compute.
//
// Row-major tensors are handed to cuBLASLt (column-major) as their transposes: a row-major (r, c) matrix
// is a column-major (c, r) matrix with leading dimension c. With that:
//   forward  out (N, OC) = in (N, IC) @ w^T + bias   is  out^T (OC, N) = op_T(w^T (IC, OC)) @ in^T (IC, N)
//            m = OC, n = N, k = IC; bias (OC) through the BIAS epilogue; D bf16.
//   din      din (N, IC) = dout (N, OC) @ w (OC, IC) is  din^T (IC, N) = w^T (IC, OC) @ dout^T (OC, N)
//            m = IC, n = N, k = OC; D bf16, beta 1 when accumulating.
//   dw       dw (OC, IC) += dout^T @ in              is  dw^T (IC, OC) += in^T (IC, N) @ op_T(dout^T (OC, N))
//            m = IC, n = OC, k = N; C = D fp32, beta 1.
//   dbias    (OC) += column sums of dout: a two-pass deterministic reduction kernel.
// Plans (descriptors + the chosen algorithm) are cached per kind, shape, beta and pointer alignments, so the
// per-call cost is one cublasLtMatmul. Should cuBLASLt's heuristic offer no algorithm for some shape or
// alignment, the same product goes through cublasGemmEx (same layouts and types), whose contract covers any
// size and leading dimension; a bias is then added by a small kernel.
//
// Autotuning (OpsSettings.gemm_autotune: on by default, off, or on with one line per decision on stderr). The
// heuristic's first pick is not always the fastest on a transformer's shapes (thin k/v projections, dW reduced
// over 8k tokens, lm_head chunks): on the first use of a plan key the heuristic's best TUNE_CANDIDATES
// algorithms are each run on the caller's operands, twice round, and the fastest is kept if it beats the first
// pick by TUNE_MIN_GAIN (near-ties keep the heuristic's choice, so the pick does not flip with timing noise).
// Every candidate computes the same product; one that fails is skipped. Not done while the stream is being
// captured into a CUDA graph (the plan then keeps the first pick for good, so graph and eager runs use one
// algorithm), for GEMMs under TUNE_MIN_FLOP, or once a context has spent TUNE_BUDGET_S on it (a server meets
// many token counts), nor while the caller has paused it (ops_set_gemm_tuning: a server's prefill steps, whose
// token counts rarely recur, take the heuristic's pick). The pick depends on timings, so two processes may differ
// in the last bits of a GEMM (within bf16 tolerance); OPS_GEMM_AUTOTUNE_OFF gives the heuristic's deterministic
// choice.
#include <cublas_v2.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/cuda/cuda_common.cuh"

enum { GEMM_FWD = 0, GEMM_FWD_BIAS = 1, GEMM_DIN = 2, GEMM_DW = 3 };
static const char *const KIND_NAME[] = {"fwd", "fwd+bias", "din", "dw"};
// A training step of one model has ~30 keys; a server adds a few per token count it meets.
static const int MAX_PLANS = 256;

#define TUNE_CANDIDATES 16
// Smaller GEMMs are bound by their launch, not the algorithm. 5e8 takes in a 0.5B model's o projection at 512
// decode rows (0.8 GFLOP), for which tuning keeps a clearly faster algorithm than the first pick
// (bench/notes/gpu-passes-h100.md).
static const double TUNE_MIN_FLOP = 5e8;
static const double TUNE_MIN_GAIN = 0.03;   // another algorithm must be 3 % faster than the first pick
static const double TUNE_BUDGET_S = 10.0;   // host time one context may spend tuning; later keys take the first pick
static const double TUNE_ROUND_MS = 1.0;    // GPU time each candidate's timed batch aims at in the second round

struct CudaGemmPlan {
    int kind, m, n, k;
    int accumulate;  // beta 1 (din += , dw +=): the tuning then runs on a temporary output
    int no_algo;     // cuBLASLt offered nothing for this key: remembered so the heuristic is not asked again
    unsigned align_a, align_b, align_c, align_bias;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, cd;  // C and D share one layout
    cublasLtMatmulAlgo_t algo;
};

static void plan_release(CudaGemmPlan *p) {
    if (p->op) cublasLtMatmulDescDestroy(p->op);
    if (p->a) cublasLtMatrixLayoutDestroy(p->a);
    if (p->b) cublasLtMatrixLayoutDestroy(p->b);
    if (p->cd) cublasLtMatrixLayoutDestroy(p->cd);
    memset(p, 0, sizeof *p);
}

void cuda_gemm_plans_destroy(CudaState *st) {
    for (int i = 0; i < st->n_plans; i++) plan_release(&st->plans[i]);
    free(st->plans);
    st->plans = NULL;
    st->n_plans = 0;
}

// Largest power of two (up to 256) dividing the address: cuBLASLt filters algorithms by it.
static unsigned ptr_alignment(const void *p) {
    uintptr_t a = (uintptr_t)p;
    unsigned al = 256;
    while (al > 1 && (a & (al - 1))) al >>= 1;
    return al;
}

// Builds the descriptors of one plan and asks the heuristic for up to max_cand algorithms, best first, into
// cand (*n_cand of them); the plan takes the first. Returns 0, 1 when cuBLASLt has no algorithm for it (the
// caller may try another formulation), or -1 with the error recorded.
static int plan_build(OpsCtx *ctx, CudaState *st, CudaGemmPlan *p, const void *bias,
                      cublasLtMatmulHeuristicResult_t *cand, int max_cand, int *n_cand) {
    *n_cand = 0;
    const int kind = p->kind;
    const cublasOperation_t ta = (kind == GEMM_FWD || kind == GEMM_FWD_BIAS) ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = kind == GEMM_DW ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cudaDataType_t cd_type = kind == GEMM_DW ? CUDA_R_32F : CUDA_R_16BF;
    // Stored (pre-op) column-major shapes: A is (k, m) when transposed, else (m, k); likewise B.
    const int a_rows = ta == CUBLAS_OP_T ? p->k : p->m, a_cols = ta == CUBLAS_OP_T ? p->m : p->k;
    const int b_rows = tb == CUBLAS_OP_T ? p->n : p->k, b_cols = tb == CUBLAS_OP_T ? p->k : p->n;
    CUBLAS_CHECK_RET(ctx, cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), -1);
    CUBLAS_CHECK_RET(ctx, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), -1);
    CUBLAS_CHECK_RET(ctx, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), -1);
    if (kind == GEMM_FWD_BIAS) {
        const uint32_t epi = CUBLASLT_EPILOGUE_BIAS;
        const int32_t bias_type = CUDA_R_16BF;
        CUBLAS_CHECK_RET(ctx, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi), -1);
        CUBLAS_CHECK_RET(ctx,
                         cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                        sizeof bias_type),
                         -1);
        CUBLAS_CHECK_RET(ctx, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias),
                         -1);
    }
    CUBLAS_CHECK_RET(ctx, cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, a_rows, a_cols, a_rows), -1);
    CUBLAS_CHECK_RET(ctx, cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, b_rows, b_cols, b_rows), -1);
    CUBLAS_CHECK_RET(ctx, cublasLtMatrixLayoutCreate(&p->cd, cd_type, p->m, p->n, p->m), -1);

    cublasLtMatmulPreference_t pref = NULL;
    CUBLAS_CHECK_RET(ctx, cublasLtMatmulPreferenceCreate(&pref), -1);
    const uint64_t ws = st->lt_workspace_bytes;
    const uint32_t al_a = p->align_a, al_b = p->align_b, al_c = p->align_c;
    cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c);
    if (s != CUBLAS_STATUS_SUCCESS) {
        cublasLtMatmulPreferenceDestroy(pref);
        ops_set_error(ctx, -1, __FILE__, __LINE__, "cublasLtMatmulPreferenceSetAttribute failed: %s",
                      cublasLtGetStatusString(s));
        return -1;
    }
    memset(cand, 0, (size_t)max_cand * sizeof *cand);
    int returned = 0;
    s = cublasLtMatmulAlgoGetHeuristic(st->lt, p->op, p->a, p->b, p->cd, p->cd, pref, max_cand, cand, &returned);
    cublasLtMatmulPreferenceDestroy(pref);
    if (s == CUBLAS_STATUS_NOT_SUPPORTED) returned = 0;
    else if (s != CUBLAS_STATUS_SUCCESS) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "cublasLtMatmulAlgoGetHeuristic (m=%d n=%d k=%d kind %d) failed: %s",
                      p->m, p->n, p->k, kind, cublasLtGetStatusString(s));
        return -1;
    }
    // Results the heuristic marks as failed are not algorithms; drop them.
    int n = 0;
    for (int i = 0; i < returned; i++)
        if (cand[i].state == CUBLAS_STATUS_SUCCESS) cand[n++] = cand[i];
    if (n == 0) return 1;
    *n_cand = n;
    p->algo = cand[0].algo;
    return 0;
}

static double wall_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static cublasStatus_t run_algo(CudaState *st, CudaGemmPlan *p, const cublasLtMatmulAlgo_t *algo, const void *a,
                               const void *b, void *d, float beta) {
    const float alpha = 1.0f;
    return cublasLtMatmul(st->lt, p->op, &alpha, a, p->a, b, p->b, &beta, d, p->cd, d, p->cd, algo, st->lt_workspace,
                          st->lt_workspace_bytes, st->stream);
}

// Times cand[0..n) on the caller's operands and sets p->algo to the fastest (see the file comment). The plan's
// descriptors (bias pointer included) are set up for this call. Returns 0 (also when tuning had to be given up,
// e.g. no memory for a temporary output: the first pick stays) or -1 on a CUDA error, recorded.
static int plan_tune(OpsCtx *ctx, CudaState *st, CudaGemmPlan *p, const cublasLtMatmulHeuristicResult_t *cand,
                     int n, const void *a, const void *b, void *d, float beta) {
    const double t_start = wall_s();
    // Relaxed for this thread while it times: a global-mode capture on another thread's stream would otherwise
    // forbid the event synchronizations and the temporary allocation below.
    cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeRelaxed;
    CUDA_CHECK_RET(ctx, cudaThreadExchangeStreamCaptureMode(&capture_mode), -1);
    // Trial output: the caller's own when beta is 0 (the real call that follows writes every element again),
    // else a zeroed temporary of the same size so that an accumulating output is never touched.
    void *td = d, *tmp = NULL;
    const size_t bytes = (size_t)p->m * p->n * (p->kind == GEMM_DW ? sizeof(float) : sizeof(bf16));
    if (beta != 0.0f) {
        if (cudaMallocAsync(&tmp, bytes, st->stream) != cudaSuccess) {
            cudaGetLastError();  // out of memory is not sticky: keep the first pick
            cudaThreadExchangeStreamCaptureMode(&capture_mode);
            return 0;
        }
        td = tmp;
    }
    cudaEvent_t ev[2] = {NULL, NULL};
    double best_ms[TUNE_CANDIDATES];
    int rc = 0, reps = 2;
    cudaError_t e = tmp ? cudaMemsetAsync(tmp, 0, bytes, st->stream) : cudaSuccess;
    if (e == cudaSuccess) e = cudaEventCreate(&ev[0]);
    if (e == cudaSuccess) e = cudaEventCreate(&ev[1]);
    for (int i = 0; i < n; i++) best_ms[i] = INFINITY;
    // Round 0: one untimed run per candidate (weeds out failures, warms up), then `reps` timed runs. Round 1:
    // enough runs for about TUNE_ROUND_MS each, in the same order; each candidate keeps its better round.
    for (int round = 0; round < 2 && e == cudaSuccess; round++) {
        for (int i = 0; i < n && e == cudaSuccess; i++) {
            if (round == 1 && !isfinite(best_ms[i])) continue;
            if (round == 0 && run_algo(st, p, &cand[i].algo, a, b, td, beta) != CUBLAS_STATUS_SUCCESS) {
                cudaGetLastError();  // a launch the algorithm could not make; the next candidate is unaffected
                continue;
            }
            if ((e = cudaEventRecord(ev[0], st->stream)) != cudaSuccess) break;
            int ok = 1;
            for (int r = 0; r < reps && ok; r++)
                ok = run_algo(st, p, &cand[i].algo, a, b, td, beta) == CUBLAS_STATUS_SUCCESS;
            if ((e = cudaEventRecord(ev[1], st->stream)) != cudaSuccess) break;
            if ((e = cudaEventSynchronize(ev[1])) != cudaSuccess) break;
            float ms = 0.0f;
            if ((e = cudaEventElapsedTime(&ms, ev[0], ev[1])) != cudaSuccess) break;
            if (!ok) {
                cudaGetLastError();
                best_ms[i] = INFINITY;
                continue;
            }
            if (ms / reps < best_ms[i]) best_ms[i] = ms / reps;
        }
        if (round == 0 && isfinite(best_ms[0])) {
            const double want = TUNE_ROUND_MS / (best_ms[0] > 1e-4 ? best_ms[0] : 1e-4);
            reps = want < 3 ? 3 : want > 50 ? 50 : (int)want;
        }
    }
    if (e != cudaSuccess) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "timing GEMM candidates (m=%d n=%d k=%d %s) failed: %s", p->m, p->n,
                      p->k, KIND_NAME[p->kind], cudaGetErrorString(e));
        rc = -1;
    } else {
        int best = 0;
        for (int i = 1; i < n; i++)
            if (best_ms[i] < best_ms[best]) best = i;
        // The first pick stays unless another is clearly faster (or the first pick failed).
        if (best != 0 && isfinite(best_ms[0]) && best_ms[best] > best_ms[0] * (1.0 - TUNE_MIN_GAIN)) best = 0;
        if (isfinite(best_ms[best])) p->algo = cand[best].algo;
        if (st->gemm_autotune == OPS_GEMM_AUTOTUNE_LOG)
            fprintf(stderr,
                    "tandem gemm autotune: %-8s m=%d n=%d k=%d beta=%g: %d candidates, first pick %.1f us, "
                    "kept #%d %.1f us (%.2fx)\n",
                    KIND_NAME[p->kind], p->m, p->n, p->k, beta, n, best_ms[0] * 1e3, best, best_ms[best] * 1e3,
                    best_ms[0] / best_ms[best]);
    }
    for (int i = 0; i < 2; i++)
        if (ev[i]) cudaEventDestroy(ev[i]);
    if (tmp) cudaFreeAsync(tmp, st->stream);
    cudaThreadExchangeStreamCaptureMode(&capture_mode);
    st->gemm_tune_s += wall_s() - t_start;
    return rc;
}

// Whether a new plan may be tuned now: autotuning on, a GEMM big enough to care, budget left, and the stream
// not being captured into a graph (timing synchronizes, which a capture forbids). -1 on a CUDA error.
int cuda_set_gemm_tuning(OpsCtx *ctx, int allowed) {
    CudaState *st = (CudaState *)ops_backend_state(ctx);
    const int was = !st->gemm_tuning_paused;
    st->gemm_tuning_paused = !allowed;
    return was;
}

static int may_tune(OpsCtx *ctx, CudaState *st, const CudaGemmPlan *p, int n_cand) {
    if (n_cand < 2 || st->gemm_autotune == OPS_GEMM_AUTOTUNE_OFF || st->gemm_tuning_paused) return 0;
    if (2.0 * p->m * p->n * p->k < TUNE_MIN_FLOP || st->gemm_tune_s >= TUNE_BUDGET_S) return 0;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    CUDA_CHECK_RET(ctx, cudaStreamIsCapturing(st->stream, &cs), -1);
    return cs == cudaStreamCaptureStatusNone;
}

// The cached plan for D = op(A) op(B) + beta D, building (and tuning) it on first use. Returns NULL when
// cuBLASLt offers no algorithm (*unsupported = 1) or on error (recorded, *unsupported = 0).
static CudaGemmPlan *plan_get(OpsCtx *ctx, CudaState *st, int kind, int m, int n, int k, const void *a,
                              const void *b, void *d, float beta, const void *bias, int *unsupported) {
    *unsupported = 0;
    CudaGemmPlan key;
    memset(&key, 0, sizeof key);
    key.kind = kind;
    key.m = m;
    key.n = n;
    key.k = k;
    key.accumulate = beta != 0.0f;
    key.align_a = ptr_alignment(a);
    key.align_b = ptr_alignment(b);
    key.align_c = ptr_alignment(d);
    key.align_bias = bias ? ptr_alignment(bias) : 0;
    for (int i = 0; i < st->n_plans; i++) {
        CudaGemmPlan *p = &st->plans[i];
        if (p->kind == kind && p->m == m && p->n == n && p->k == k && p->accumulate == key.accumulate &&
            p->align_a == key.align_a && p->align_b == key.align_b && p->align_c == key.align_c &&
            p->align_bias == key.align_bias) {
            *unsupported = p->no_algo;
            return p->no_algo ? NULL : p;
        }
    }
    if (!st->plans) {
        st->plans = (CudaGemmPlan *)calloc(MAX_PLANS, sizeof(CudaGemmPlan));
        if (!st->plans) {
            ops_set_error(ctx, -1, __FILE__, __LINE__, "out of host memory for GEMM plans");
            return NULL;
        }
    }
    CudaGemmPlan *slot;
    if (st->n_plans < MAX_PLANS) {
        slot = &st->plans[st->n_plans];
    } else {  // full: a model has a handful of shapes, so this only happens under unusual use; evict the oldest
        plan_release(&st->plans[0]);
        memmove(&st->plans[0], &st->plans[1], (MAX_PLANS - 1) * sizeof(CudaGemmPlan));
        st->n_plans--;
        slot = &st->plans[st->n_plans];
        memset(slot, 0, sizeof *slot);
    }
    *slot = key;
    cublasLtMatmulHeuristicResult_t cand[TUNE_CANDIDATES];
    int n_cand = 0;
    int rc = plan_build(ctx, st, slot, bias, cand, TUNE_CANDIDATES, &n_cand);
    if (rc == 0) {
        int tune = may_tune(ctx, st, slot, n_cand);
        if (tune < 0 || (tune && plan_tune(ctx, st, slot, cand, n_cand, a, b, d, beta) != 0)) rc = -1;
    }
    if (rc < 0) {
        plan_release(slot);
        return NULL;
    }
    st->n_plans++;
    if (rc == 1) {  // keep the key, drop the descriptors
        plan_release(slot);
        *slot = key;
        slot->no_algo = 1;
        *unsupported = 1;
        return NULL;
    }
    return slot;
}

// Runs D = op(A) op(B) + beta C with C = D.
static int plan_run(OpsCtx *ctx, CudaState *st, CudaGemmPlan *p, const void *a, const void *b, void *d, float beta,
                    const void *bias) {
    if (p->kind == GEMM_FWD_BIAS)
        CUBLAS_CHECK_RET(ctx, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias),
                         -1);
    CUBLAS_CHECK_RET(ctx, run_algo(st, p, &p->algo, a, b, d, beta), -1);
    return 0;
}

// out (N, OC) bf16 += bias (OC), rounding once more: used only when cuBLASLt has no BIAS-epilogue algorithm
// for these pointers (e.g. a bias at an odd address) or no algorithm at all.
__global__ void add_bias_rows_kernel(bf16 *out, const bf16 *bias, size_t total, int OC) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x)
        out[i] = f2bf(bf2f(out[i]) + bf2f(bias[i % OC]));
}

// dbias partials: partials[split][c] = sum of dout[r][c] over rows r of split `blockIdx.y`.
__global__ void dbias_partial_kernel(float *partials, const bf16 *dout, int N, int OC, int rows_per_split) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= OC) return;
    const int r0 = blockIdx.y * rows_per_split;
    const int r1 = min(N, r0 + rows_per_split);
    float s = 0.0f;
    for (int r = r0; r < r1; r++) s += bf2f(dout[(size_t)r * OC + c]);
    partials[(size_t)blockIdx.y * OC + c] = s;
}

// dbias (OC) += sum over splits of partials (splits, OC), in split order (deterministic).
__global__ void dbias_final_kernel(float *dbias, const float *partials, int splits, int OC) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= OC) return;
    float s = 0.0f;
    for (int i = 0; i < splits; i++) s += partials[(size_t)i * OC + c];
    dbias[c] += s;
}

// D (m, n) = op(A) op(B) + beta D through cublasGemmEx, with the same layouts and types as the cuBLASLt plans.
// The handle is created on first need and uses the cuBLASLt workspace (both run on the one stream, never at the
// same time; set after the stream, which resets it, and so that cuBLAS allocates nothing of its own).
static cublasStatus_t blas_gemm(CudaState *st, int kind, int m, int n, int k, const void *a, const void *b, void *d,
                                float beta) {
    cublasStatus_t s;
    if (!st->blas && (s = cublasCreate(&st->blas)) != CUBLAS_STATUS_SUCCESS) {
        st->blas = NULL;
        return s;
    }
    if ((s = cublasSetStream(st->blas, st->stream)) != CUBLAS_STATUS_SUCCESS) return s;
    if ((s = cublasSetWorkspace(st->blas, st->lt_workspace, st->lt_workspace_bytes)) != CUBLAS_STATUS_SUCCESS) return s;
    const cublasOperation_t ta = (kind == GEMM_FWD || kind == GEMM_FWD_BIAS) ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = kind == GEMM_DW ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cudaDataType_t cd_type = kind == GEMM_DW ? CUDA_R_32F : CUDA_R_16BF;
    const int lda = ta == CUBLAS_OP_T ? k : m, ldb = tb == CUBLAS_OP_T ? n : k;
    const float alpha = 1.0f;
    return cublasGemmEx(st->blas, ta, tb, m, n, k, &alpha, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, &beta, d, cd_type,
                        m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

// The cublasGemmEx fallback for keys cuBLASLt has no algorithm for, errors recorded.
static int gemm_ex(OpsCtx *ctx, CudaState *st, int kind, int m, int n, int k, const void *a, const void *b, void *d,
                   float beta) {
    if (!st->blas && cuda_refuse_in_capture(ctx, st, "creating the cuBLAS handle (cublasGemmEx fallback)")) return -1;
    CUBLAS_CHECK_RET(ctx, blas_gemm(st, kind, m, n, k, a, b, d, beta), -1);
    return 0;
}

void cuda_matmul_fwd(OpsCtx *ctx, void *out, const void *in, const void *w, const void *bias, int N, int IC, int OC) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && IC > 0 && OC > 0, "matmul_fwd: bad shape N=%d IC=%d OC=%d", N, IC, OC);
    if (N == 0) return;
    if (cuda_gemv_applies(st, out, in, w, bias, N, IC)) {   // a few rows: a pass over w (cuda_gemv.cu)
        cuda_gemv_fwd(ctx, st, out, in, w, bias, N, IC, OC);
        return;
    }
    int unsupported = 0;
    if (bias) {
        CudaGemmPlan *p = plan_get(ctx, st, GEMM_FWD_BIAS, OC, N, IC, w, in, out, 0.0f, bias, &unsupported);
        if (p) {
            plan_run(ctx, st, p, w, in, out, 0.0f, bias);
            return;
        }
        if (!unsupported) return;  // a real error, already recorded
    }
    CudaGemmPlan *p = plan_get(ctx, st, GEMM_FWD, OC, N, IC, w, in, out, 0.0f, NULL, &unsupported);
    if (p) {
        if (plan_run(ctx, st, p, w, in, out, 0.0f, NULL) != 0) return;
    } else {
        if (!unsupported || gemm_ex(ctx, st, GEMM_FWD, OC, N, IC, w, in, out, 0.0f) != 0) return;
    }
    if (bias) {
        size_t total = (size_t)N * OC;
        add_bias_rows_kernel<<<cuda_grid_1d(total, 256, st), 256, 0, st->stream>>>((bf16 *)out, (const bf16 *)bias,
                                                                                   total, OC);
        CUDA_CHECK_LAUNCH(ctx);
    }
}

void cuda_matmul_bwd(OpsCtx *ctx, void *din, float *dw, float *dbias, const void *dout, const void *in,
                     const void *w, int N, int IC, int OC, int din_accumulate) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && IC > 0 && OC > 0, "matmul_bwd: bad shape N=%d IC=%d OC=%d", N, IC, OC);
    if (N == 0) return;  // nothing to add; an overwritten din of zero rows is empty too
    int unsupported = 0;
    if (din) {
        const float beta = din_accumulate ? 1.0f : 0.0f;
        CudaGemmPlan *p = plan_get(ctx, st, GEMM_DIN, IC, N, OC, w, dout, din, beta, NULL, &unsupported);
        if (p) {
            if (plan_run(ctx, st, p, w, dout, din, beta, NULL) != 0) return;
        } else {
            if (!unsupported || gemm_ex(ctx, st, GEMM_DIN, IC, N, OC, w, dout, din, beta) != 0) return;
        }
    }
    if (dw) {
        CudaGemmPlan *p = plan_get(ctx, st, GEMM_DW, IC, OC, N, in, dout, dw, 1.0f, NULL, &unsupported);
        if (p) {
            if (plan_run(ctx, st, p, in, dout, dw, 1.0f, NULL) != 0) return;
        } else {
            if (!unsupported || gemm_ex(ctx, st, GEMM_DW, IC, OC, N, in, dout, dw, 1.0f) != 0) return;
        }
    }
    if (dbias) {
        // Splits of 64 rows, at most 256 of them (more rows per split beyond that).
        int rows_per_split = 64;
        int splits = (N + rows_per_split - 1) / rows_per_split;
        if (splits > 256) {
            splits = 256;
            rows_per_split = (N + splits - 1) / splits;
            splits = (N + rows_per_split - 1) / rows_per_split;
        }
        float *partials = (float *)cuda_scratch(ctx, st, (size_t)splits * OC * sizeof(float));
        if (!partials) return;
        dim3 grid((OC + 127) / 128, splits);
        dbias_partial_kernel<<<grid, 128, 0, st->stream>>>(partials, (const bf16 *)dout, N, OC, rows_per_split);
        CUDA_CHECK_LAUNCH(ctx);
        dbias_final_kernel<<<(OC + 127) / 128, 128, 0, st->stream>>>(dbias, partials, splits, OC);
        CUDA_CHECK_LAUNCH(ctx);
    }
}

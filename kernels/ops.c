// kernels/ops.c — the context (errors, memory) and the dispatch of every op to its backend.
#include "kernels/ops.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"
#ifdef TANDEM_HAVE_CUDA
#include "kernels/cuda/cuda_ops.h"
#endif

struct OpsCtx {
    OpsBackend backend;
    int device;
    int error_code;         // first error, 0 if none
    char error_msg[512];
    void *backend_state;    // cuda: stream, cuBLAS handles, workspace
};

#define IS_CUDA(ctx) ((ctx)->backend == OPS_BACKEND_CUDA)
#define F(p) ((float *)(p))
#define CF(p) ((const float *)(p))

#ifdef TANDEM_HAVE_CUDA
#define DISPATCH(ctx, cuda_call, cpu_call)                                                                   \
    do {                                                                                                     \
        if ((ctx)->error_code) return;                                                                       \
        if (IS_CUDA(ctx)) {                                                                                  \
            const int profile_slot_ = cuda_profile_begin(ctx);                                               \
            cuda_call;                                                                                       \
            cuda_profile_end(ctx, profile_slot_, __func__);                                                  \
        } else {                                                                                             \
            cpu_call;                                                                                        \
        }                                                                                                    \
    } while (0)
#else
#define DISPATCH(ctx, cuda_call, cpu_call)                                                                   \
    do {                                                                                                     \
        if ((ctx)->error_code) return;                                                                       \
        cpu_call;                                                                                            \
    } while (0)
#endif

int ops_set_error(OpsCtx *ctx, int code, const char *file, int line, const char *fmt, ...) {
    if (code >= 0) code = -1;
    if (ctx->error_code) return code;
    ctx->error_code = code;
    int n = snprintf(ctx->error_msg, sizeof ctx->error_msg, "%s:%d: ", file, line);
    if (n < 0 || n >= (int)sizeof ctx->error_msg) n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->error_msg + n, sizeof ctx->error_msg - n, fmt, ap);
    va_end(ap);
    return code;
}

int ops_status(const OpsCtx *ctx) { return ctx->error_code; }
const char *ops_error(const OpsCtx *ctx) { return ctx->error_msg; }
void ops_clear_error(OpsCtx *ctx) { ctx->error_code = 0; ctx->error_msg[0] = 0; }
OpsBackend ops_backend(const OpsCtx *ctx) { return ctx->backend; }
size_t ops_dtype_size(const OpsCtx *ctx) { return IS_CUDA(ctx) ? 2 : 4; }
void *ops_backend_state(OpsCtx *ctx) { return ctx->backend_state; }

#ifndef TANDEM_HAVE_CUDA
// Without CUDA there is no device stream (CUDA builds define these in kernels/cuda/cuda_context.cu).
int ops_cuda_device(const OpsCtx *ctx) { (void)ctx; return -1; }
void *ops_cuda_stream(OpsCtx *ctx) { (void)ctx; return NULL; }
void *ops_cuda_recording_stream(OpsCtx *ctx) { (void)ctx; return NULL; }
int ops_memory_info(OpsCtx *ctx, size_t *free_bytes, size_t *total_bytes) {
    (void)ctx;
    *free_bytes = *total_bytes = 0;
    return -1;
}
#endif

void ops_profile_print(OpsCtx *ctx) {
#ifdef TANDEM_HAVE_CUDA
    if (IS_CUDA(ctx)) cuda_profile_print(ctx);
#else
    (void)ctx;
#endif
}

int ops_set_gemm_tuning(OpsCtx *ctx, int allowed) {
#ifdef TANDEM_HAVE_CUDA
    if (IS_CUDA(ctx)) return cuda_set_gemm_tuning(ctx, allowed);
#endif
    (void)ctx;
    (void)allowed;
    return 1;
}

int ops_cuda_device_count(void) {
#ifdef TANDEM_HAVE_CUDA
    return cuda_device_count();
#else
    return 0;
#endif
}

int ops_backend_available(OpsBackend backend) {
    if (backend == OPS_BACKEND_CPU) return 1;
#ifdef TANDEM_HAVE_CUDA
    return cuda_device_count() > 0;
#else
    return 0;
#endif
}

int ops_gemm_autotune_parse(const char *text, OpsGemmAutotune *out) {
    if (!text) return -1;
    if (!strcmp(text, "1") || !strcmp(text, "on")) *out = OPS_GEMM_AUTOTUNE_ON;
    else if (!strcmp(text, "0") || !strcmp(text, "off")) *out = OPS_GEMM_AUTOTUNE_OFF;
    else if (!strcmp(text, "2") || !strcmp(text, "log")) *out = OPS_GEMM_AUTOTUNE_LOG;
    else return -1;
    return 0;
}

int ops_create(OpsCtx **out, OpsBackend backend, int device, char *err, size_t err_len) {
    return ops_create_with_settings(out, backend, device, NULL, err, err_len);
}

int ops_create_with_settings(OpsCtx **out, OpsBackend backend, int device, const OpsSettings *settings, char *err,
                             size_t err_len) {
    *out = NULL;
    const OpsSettings defaults = {0};
    if (!settings) settings = &defaults;
    if (settings->gemm_autotune < OPS_GEMM_AUTOTUNE_ON || settings->gemm_autotune > OPS_GEMM_AUTOTUNE_LOG) {
        snprintf(err, err_len, "gemm_autotune %d is not an OpsGemmAutotune", (int)settings->gemm_autotune);
        return -1;
    }
    if (settings->gemm_workspace_mib < 0 || settings->gemm_workspace_mib > 4096) {
        snprintf(err, err_len, "gemm_workspace_mib %d is outside 0..4096", settings->gemm_workspace_mib);
        return -1;
    }
    OpsCtx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) { snprintf(err, err_len, "out of host memory creating the compute context"); return -1; }
    ctx->backend = backend;
    ctx->device = device;
    if (backend == OPS_BACKEND_CUDA) {
#ifdef TANDEM_HAVE_CUDA
        if (cuda_state_create(ctx, device, settings, &ctx->backend_state, err, err_len) != 0) {
            free(ctx);
            return -1;
        }
#else
        snprintf(err, err_len, "this build has no CUDA backend: rebuild with nvcc on PATH (cmake -DTANDEM_CUDA=ON)");
        free(ctx);
        return -1;
#endif
    } else if (backend != OPS_BACKEND_CPU) {
        snprintf(err, err_len, "unknown backend %d", (int)backend);
        free(ctx);
        return -1;
    }
    *out = ctx;
    return 0;
}

void ops_destroy(OpsCtx *ctx) {
    if (!ctx) return;
#ifdef TANDEM_HAVE_CUDA
    if (IS_CUDA(ctx)) cuda_state_destroy(ctx->backend_state);
#endif
    free(ctx);
}

// ---- memory -------------------------------------------------------------------------------------

void *ops_malloc(OpsCtx *ctx, size_t bytes) {
    if (ctx->error_code) return NULL;
#ifdef TANDEM_HAVE_CUDA
    if (IS_CUDA(ctx)) return cuda_malloc(ctx, bytes);
#endif
    // 64-byte alignment keeps AVX loads aligned and matches what a GPU allocator would give.
    size_t rounded = (bytes + 63) / 64 * 64;
    void *p = aligned_alloc(64, rounded ? rounded : 64);
    if (!p) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "out of host memory allocating %zu bytes", bytes);
        return NULL;
    }
    memset(p, 0, rounded ? rounded : 64);
    return p;
}

void ops_free(OpsCtx *ctx, void *p) {
    if (!p) return;
#ifdef TANDEM_HAVE_CUDA
    if (IS_CUDA(ctx)) { cuda_free(ctx, p); return; }
#endif
    free(p);
}

void ops_memset_zero(OpsCtx *ctx, void *p, size_t bytes) {
    DISPATCH(ctx, cuda_memset_zero(ctx, p, bytes), memset(p, 0, bytes));
}
void ops_copy_to_device(OpsCtx *ctx, void *dst, const void *src, size_t bytes) {
    DISPATCH(ctx, cuda_copy_to_device(ctx, dst, src, bytes), memcpy(dst, src, bytes));
}
void ops_copy_to_host(OpsCtx *ctx, void *dst, const void *src, size_t bytes) {
    DISPATCH(ctx, cuda_copy_to_host(ctx, dst, src, bytes), memcpy(dst, src, bytes));
}
void ops_copy(OpsCtx *ctx, void *dst, const void *src, size_t bytes) {
    DISPATCH(ctx, cuda_copy(ctx, dst, src, bytes), memmove(dst, src, bytes));
}
static void cpu_copy_2d(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t rows, size_t cols,
                        size_t es) {
    for (size_t r = 0; r < rows; r++)
        memcpy((char *)dst + r * dst_pitch * es, (const char *)src + r * src_pitch * es, cols * es);
}
void ops_copy_2d(OpsCtx *ctx, void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t rows,
                 size_t cols) {
    if (ctx->error_code || rows == 0 || cols == 0) return;
    if (!dst || !src || dst_pitch < cols || src_pitch < cols) {
        ops_set_error(ctx, -1, __FILE__, __LINE__,
                      "copy_2d: bad arguments (%zu rows of %zu elements, pitches dst %zu src %zu%s)", rows, cols,
                      dst_pitch, src_pitch, !dst || !src ? ", NULL buffer" : "");
        return;
    }
    DISPATCH(ctx, cuda_copy_2d(ctx, dst, dst_pitch, src, src_pitch, rows, cols),
             cpu_copy_2d(dst, dst_pitch, src, src_pitch, rows, cols, ops_dtype_size(ctx)));
}
static void cpu_copy_2d_batch(const OpsCopy2D *items, int n) {
    for (int k = 0; k < n; k++) {
        const OpsCopy2D *it = &items[k];
        for (size_t r = 0; r < it->rows; r++) {
            float *d = (float *)it->dst + r * it->dst_pitch;
            const float *s = (const float *)it->src + r * it->src_pitch;
            if (it->scale == 1.0f) memcpy(d, s, it->cols * sizeof(float));
            else
                for (size_t c = 0; c < it->cols; c++) d[c] = s[c] * it->scale;
        }
    }
}
void ops_copy_2d_batch(OpsCtx *ctx, const OpsCopy2D *items, int n) {
    if (ctx->error_code || n <= 0) return;
    for (int k = 0; k < n; k++) {
        const OpsCopy2D *it = &items[k];
        if (!it->dst || !it->src || it->dst_pitch < it->cols || it->src_pitch < it->cols || !isfinite(it->scale)) {
            ops_set_error(ctx, -1, __FILE__, __LINE__,
                          "copy_2d_batch: bad item %d of %d (%zu rows of %zu elements, pitches dst %zu src %zu, "
                          "scale %g%s)", k, n, it->rows, it->cols, it->dst_pitch, it->src_pitch, (double)it->scale,
                          !it->dst || !it->src ? ", NULL buffer" : "");
            return;
        }
    }
    DISPATCH(ctx, cuda_copy_2d_batch(ctx, items, n), cpu_copy_2d_batch(items, n));
}
static void cpu_fill_hashed_uniform(float *dst, size_t rows, size_t cols, uint64_t first, size_t index_pitch,
                                    uint64_t seed, float scale) {
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < cols; c++) {
            const uint32_t u = index_hash24(seed, first + r * index_pitch + c);
            dst[r * cols + c] = ((float)u * 0x1p-23f - 1.0f) * scale;
        }
}
void ops_fill_hashed_uniform(OpsCtx *ctx, void *dst, size_t rows, size_t cols, uint64_t first, size_t index_pitch,
                             uint64_t seed, float scale) {
    if (ctx->error_code || rows == 0 || cols == 0) return;
    if (!dst || (rows > 1 && index_pitch < cols) || !isfinite(scale)) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "fill_hashed_uniform: bad block (%zu rows of %zu, index pitch %zu, "
                      "scale %g%s)", rows, cols, index_pitch, (double)scale, dst ? "" : ", NULL buffer");
        return;
    }
    DISPATCH(ctx, cuda_fill_hashed_uniform(ctx, dst, rows, cols, first, index_pitch, seed, scale),
             cpu_fill_hashed_uniform(dst, rows, cols, first, index_pitch, seed, scale));
}
void ops_upload_f32(OpsCtx *ctx, void *dst, const float *src, size_t n) {
    DISPATCH(ctx, cuda_upload_f32(ctx, dst, src, n), memcpy(dst, src, n * sizeof(float)));
}
void ops_download_f32(OpsCtx *ctx, float *dst, const void *src, size_t n) {
    DISPATCH(ctx, cuda_download_f32(ctx, dst, src, n), memcpy(dst, src, n * sizeof(float)));
}
void ops_synchronize(OpsCtx *ctx) { DISPATCH(ctx, cuda_synchronize(ctx), (void)0); }

int ops_copy_peer(OpsCtx *dst_ctx, void *dst, OpsCtx *src_ctx, const void *src, size_t bytes, char *err,
                  size_t err_len) {
    if (dst_ctx->backend != src_ctx->backend) {
        snprintf(err, err_len, "copy between a cpu and a cuda context");
        return -1;
    }
    if (bytes == 0) return 0;
    if (!dst || !src) {
        snprintf(err, err_len, "copy of %zu bytes with a NULL %s", bytes, dst ? "source" : "destination");
        return -1;
    }
#ifdef TANDEM_HAVE_CUDA
    if (IS_CUDA(dst_ctx)) return cuda_copy_peer(dst_ctx, dst, src_ctx, src, bytes, err, err_len);
#endif
    memmove(dst, src, bytes);
    return 0;
}

// ---- sums across the shards of one process (kernels/ops.h) -----------------------------------

struct OpsPeerGroup {
    int n;
    size_t capacity;                    // storage elements per exchange buffer
    double timeout_s;
    OpsCtx *ctxs[OPS_PEER_MAX];
    void *buf[2][OPS_PEER_MAX];         // shard k's exchange buffers, on its context
    uint32_t *flags[OPS_PEER_MAX];      // shard k's slots (OPS_PEER_BLOCKS, OPS_PEER_MAX): [b][j] written by shard j
    uint32_t *counter[OPS_PEER_MAX];    // shard k's epochs (OPS_PEER_BLOCKS)
};

void ops_peer_group_destroy(OpsPeerGroup *g) {
    if (!g) return;
    for (int k = 0; k < g->n; k++) {
        if (!g->ctxs[k]) continue;
        ops_synchronize(g->ctxs[k]);
        ops_free(g->ctxs[k], g->buf[0][k]);
        ops_free(g->ctxs[k], g->buf[1][k]);
        ops_free(g->ctxs[k], g->flags[k]);
        ops_free(g->ctxs[k], g->counter[k]);
    }
    free(g);
}

int ops_peer_group_create(OpsPeerGroup **out, OpsCtx *const *ctxs, int n, size_t capacity, double timeout_s,
                          char *err, size_t err_len) {
    *out = NULL;
    if (n < 2 || n > OPS_PEER_MAX)
        return snprintf(err, err_len, "a peer group has 2 to %d shards, not %d", OPS_PEER_MAX, n), -1;
    if (capacity == 0 || !(timeout_s > 0))
        return snprintf(err, err_len, "a peer group needs a capacity and a timeout above 0"), -1;
    for (int k = 1; k < n; k++)
        if (ctxs[k]->backend != ctxs[0]->backend)
            return snprintf(err, err_len, "a peer group's shards are all cpu or all cuda"), -1;
#ifdef TANDEM_HAVE_CUDA
    if (IS_CUDA(ctxs[0]) && cuda_peer_enable(ctxs, n, err, err_len) != 0) return -1;
#endif
    OpsPeerGroup *g = calloc(1, sizeof *g);
    if (!g) return snprintf(err, err_len, "out of host memory for a peer group"), -1;
    g->n = n;
    g->capacity = capacity;
    g->timeout_s = timeout_s;
    for (int k = 0; k < n; k++) {
        OpsCtx *c = g->ctxs[k] = ctxs[k];
        const size_t es = ops_dtype_size(c);
        // Every size a multiple of 16 bytes: the kernel moves 8 bf16 at a time.
        g->buf[0][k] = ops_malloc(c, (capacity * es + 15) / 16 * 16);
        g->buf[1][k] = ops_malloc(c, (capacity * es + 15) / 16 * 16);
        g->flags[k] = ops_malloc(c, OPS_PEER_BLOCKS * OPS_PEER_MAX * sizeof(uint32_t));
        g->counter[k] = ops_malloc(c, OPS_PEER_BLOCKS * sizeof(uint32_t));
        ops_synchronize(c);   // the zero fills are done before any shard publishes into these
        if (!g->buf[0][k] || !g->buf[1][k] || !g->flags[k] || !g->counter[k] || c->error_code) {
            snprintf(err, err_len, "peer group buffers of shard %d (2 x %zu bytes): %s", k, capacity * es,
                     c->error_msg[0] ? c->error_msg : "out of memory");
            ops_peer_group_destroy(g);
            return -1;
        }
    }
    *out = g;
    return 0;
}

size_t ops_peer_group_capacity(const OpsPeerGroup *g) { return g ? g->capacity : 0; }

static void cpu_peer_all_reduce_ctx(OpsCtx *ctx, OpsPeerGroup *g, int rank, void *x, const void *residual,
                                    size_t count) {
    int late = -1;
    if (cpu_peer_all_reduce((float *const *)g->buf[0], (float *const *)g->buf[1], g->flags, g->counter[rank], rank,
                            g->n, F(x), CF(residual), count, g->timeout_s, &late) != 0)
        ops_set_error(ctx, -1, __FILE__, __LINE__,
                      "tensor-parallel sum: shard %d waited %.1f s for shard %d, which did not arrive (its thread "
                      "stopped; the step's results are void)", rank, g->timeout_s, late);
}

void ops_peer_all_reduce(OpsPeerGroup *g, int rank, void *x, const void *residual, size_t count) {
    OpsCtx *ctx = g->ctxs[rank];
    if (ctx->error_code) return;
    if (count > g->capacity || ((uintptr_t)x | (uintptr_t)residual) % 16) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "peer all-reduce of %zu elements (capacity %zu)%s", count,
                      g->capacity, count > g->capacity ? "" : ": x or residual not 16-byte aligned");
        return;
    }
    if (count == 0) return;
    DISPATCH(ctx,
             cuda_peer_all_reduce(ctx, g->buf[0], g->buf[1], g->flags, g->counter[rank], rank, g->n, x, residual,
                                  count, g->timeout_s),
             cpu_peer_all_reduce_ctx(ctx, g, rank, x, residual, count));
}

// ---- ops ----------------------------------------------------------------------------------------

void ops_add_inplace(OpsCtx *ctx, void *y, const void *x, size_t n) {
    DISPATCH(ctx, cuda_add_inplace(ctx, y, x, n), cpu_add_inplace(F(y), CF(x), n));
}

void ops_add_f32(OpsCtx *ctx, float *y, const float *x, size_t n) {
    DISPATCH(ctx, cuda_add_f32(ctx, y, x, n), cpu_add_f32(y, x, n));
}

void ops_scale_inplace(OpsCtx *ctx, void *x, float s, size_t n) {
    DISPATCH(ctx, cuda_scale_inplace(ctx, x, s, n), cpu_scale_inplace(F(x), s, n));
}

void ops_dropout(OpsCtx *ctx, void *out, const void *in, size_t n, float p, uint64_t seed) {
    if (!(p >= 0.0f && p < 1.0f)) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "ops_dropout: p %g must be in [0, 1)", (double)p);
        return;
    }
    DISPATCH(ctx, cuda_dropout(ctx, out, in, n, p, seed), cpu_dropout(F(out), CF(in), n, p, seed));
}

void ops_embedding_fwd(OpsCtx *ctx, void *out, const int32_t *tokens, const void *table, int N, int C, int V) {
    int bad_row = -1;
    DISPATCH(ctx, cuda_embedding_fwd(ctx, out, tokens, table, N, C, V),
             if (cpu_embedding_fwd(F(out), tokens, CF(table), N, C, V, &bad_row) != 0)
                 ops_set_error(ctx, -1, __FILE__, __LINE__, "token id %d at row %d is outside the vocabulary [0, %d)",
                               tokens[bad_row], bad_row, V));
}
void ops_embedding_shard_fwd(OpsCtx *ctx, void *out, const int32_t *tokens, const void *table, int N, int C, int begin,
                             int rows, int V) {
    int bad_row = -1;
    DISPATCH(ctx, cuda_embedding_shard_fwd(ctx, out, tokens, table, N, C, begin, rows, V),
             if (cpu_embedding_shard_fwd(F(out), tokens, CF(table), N, C, begin, rows, V, &bad_row) != 0)
                 ops_set_error(ctx, -1, __FILE__, __LINE__, "token id %d at row %d is outside the vocabulary [0, %d)",
                               tokens[bad_row], bad_row, V));
}
void ops_embedding_bwd(OpsCtx *ctx, float *dtable, const void *dout, const int32_t *tokens, int N, int C) {
    DISPATCH(ctx, cuda_embedding_bwd(ctx, dtable, dout, tokens, N, C), cpu_embedding_bwd(dtable, CF(dout), tokens, N, C));
}

void ops_rmsnorm_fwd(OpsCtx *ctx, void *out, float *rstd, const void *x, const void *w, int N, int C, float eps) {
    DISPATCH(ctx, cuda_rmsnorm_fwd(ctx, out, rstd, x, w, N, C, eps), cpu_rmsnorm_fwd(F(out), rstd, CF(x), CF(w), N, C, eps));
}
void ops_rmsnorm_bwd(OpsCtx *ctx, void *dx, float *dw, const void *dout, const void *x, const void *w,
                     const float *rstd, int N, int C) {
    DISPATCH(ctx, cuda_rmsnorm_bwd(ctx, dx, dw, dout, x, w, rstd, N, C),
             cpu_rmsnorm_bwd(F(dx), dw, CF(dout), CF(x), CF(w), rstd, N, C));
}
void ops_residual_rmsnorm_fwd(OpsCtx *ctx, void *x_out, void *out, float *rstd, const void *x, const void *residual,
                              const void *w, int N, int C, float eps) {
    if (ctx->error_code) return;
    if (N < 0 || C < 1 || (residual && !x_out)) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "residual_rmsnorm_fwd: bad arguments (N=%d, C=%d%s)", N, C,
                      residual && !x_out ? ", residual given without x_out" : "");
        return;
    }
    DISPATCH(ctx, cuda_residual_rmsnorm_fwd(ctx, x_out, out, rstd, x, residual, w, N, C, eps),
             cpu_residual_rmsnorm_fwd(F(x_out), F(out), rstd, CF(x), CF(residual), CF(w), N, C, eps));
}
void ops_residual_rmsnorm_bwd(OpsCtx *ctx, void *dres_out, float *dw, const void *dres_in, const void *dout,
                              const void *x_out, const void *w, const float *rstd, int N, int C) {
    if (ctx->error_code) return;
    if (N < 0 || C < 1) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "residual_rmsnorm_bwd: bad shape N=%d C=%d", N, C);
        return;
    }
    DISPATCH(ctx, cuda_residual_rmsnorm_bwd(ctx, dres_out, dw, dres_in, dout, x_out, w, rstd, N, C),
             cpu_residual_rmsnorm_bwd(F(dres_out), dw, CF(dres_in), CF(dout), CF(x_out), CF(w), rstd, N, C));
}

void ops_rope_fwd(OpsCtx *ctx, void *x, const int32_t *pos, const float *inv_freq, int N, int H, int D) {
    DISPATCH(ctx, cuda_rope_fwd(ctx, x, pos, inv_freq, N, H, D), cpu_rope_fwd(F(x), pos, inv_freq, N, H, D));
}
void ops_rope_bwd(OpsCtx *ctx, void *dx, const int32_t *pos, const float *inv_freq, int N, int H, int D) {
    DISPATCH(ctx, cuda_rope_bwd(ctx, dx, pos, inv_freq, N, H, D), cpu_rope_bwd(F(dx), pos, inv_freq, N, H, D));
}
// Shared checks of the fused split/pack + RoPE: returns 1 when the op has work to do, 0 when it has none or an
// error was recorded.
static int qkv_rope_args_ok(OpsCtx *ctx, const char *name, const void *a, const void *b, const void *c, const void *d,
                            int N, int Hq, int Hkv, int D) {
    if (ctx->error_code) return 0;
    if (N < 0 || Hq < 1 || Hkv < 1 || D < 1) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "%s: bad shape N=%d Hq=%d Hkv=%d D=%d", name, N, Hq, Hkv, D);
        return 0;
    }
    if (N > 0 && (!a || !b || !c || !d)) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "%s: NULL buffer", name);
        return 0;
    }
    return N > 0;
}
void ops_qkv_rope_fwd(OpsCtx *ctx, void *q, void *k, void *v, const void *qkv, const int32_t *pos,
                      const float *inv_freq, int N, int Hq, int Hkv, int D) {
    if (!qkv_rope_args_ok(ctx, "qkv_rope_fwd", q, k, v, qkv, N, Hq, Hkv, D)) return;
    DISPATCH(ctx, cuda_qkv_rope_fwd(ctx, q, k, v, qkv, pos, inv_freq, N, Hq, Hkv, D),
             cpu_qkv_rope_fwd(F(q), F(k), F(v), CF(qkv), pos, inv_freq, N, Hq, Hkv, D));
}
void ops_qkv_rope_store_fwd(OpsCtx *ctx, void *q, void *k_cache, void *v_cache, const int32_t *slot_mapping,
                            const void *qkv, const int32_t *pos, const float *inv_freq, int N, int Hq, int Hkv,
                            int D) {
    if (!qkv_rope_args_ok(ctx, "qkv_rope_store_fwd", q, k_cache, v_cache, qkv, N, Hq, Hkv, D)) return;
    if (!slot_mapping) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "qkv_rope_store_fwd: NULL slot_mapping");
        return;
    }
    DISPATCH(ctx, cuda_qkv_rope_store_fwd(ctx, q, k_cache, v_cache, slot_mapping, qkv, pos, inv_freq, N, Hq, Hkv, D),
             cpu_qkv_rope_store_fwd(F(q), F(k_cache), F(v_cache), slot_mapping, CF(qkv), pos, inv_freq, N, Hq, Hkv,
                                    D));
}
void ops_qkv_rope_bwd(OpsCtx *ctx, void *dqkv, const void *dq, const void *dk, const void *dv, const int32_t *pos,
                      const float *inv_freq, int N, int Hq, int Hkv, int D) {
    if (!qkv_rope_args_ok(ctx, "qkv_rope_bwd", dqkv, dq, dk, dv, N, Hq, Hkv, D)) return;
    DISPATCH(ctx, cuda_qkv_rope_bwd(ctx, dqkv, dq, dk, dv, pos, inv_freq, N, Hq, Hkv, D),
             cpu_qkv_rope_bwd(F(dqkv), CF(dq), CF(dk), CF(dv), pos, inv_freq, N, Hq, Hkv, D));
}

void ops_matmul_fused_fwd(OpsCtx *ctx, void *out, const void *in, const void *w, const void *bias, int N, int IC,
                          int OC, const OpsProjFusion *f) {
    if (ctx->error_code) return;
    if (!f || (f->norm_w && !f->h) || (f->swiglu && (!f->gu || OC % 2 || f->residual)) ||
        (f->residual && f->residual == out)) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "matmul_fused_fwd: %s", !f ? "NULL fusion" :
                      f->norm_w && !f->h ? "norm without its h scratch" :
                      f->residual == out ? "out is the residual (the unfused order would overwrite it first)" :
                      f->residual ? "swiglu with a residual" : "swiglu needs gu scratch and an even OC");
        return;
    }
    if (f->rope_store &&
        (f->swiglu || f->residual || !f->qkv || !f->positions || !f->slot_mapping || !f->inv_freq || !f->k_cache ||
         !f->v_cache || f->Hq < 1 || f->Hkv < 1 || f->D < 1 || (long long)OC != (long long)(f->Hq + 2 * f->Hkv) * f->D)) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "matmul_fused_fwd: rope_store %s",
                      f->swiglu || f->residual ? "with swiglu or a residual"
                      : !f->qkv || !f->positions || !f->slot_mapping || !f->inv_freq || !f->k_cache || !f->v_cache
                          ? "needs qkv scratch, positions, slot_mapping, inv_freq and both caches"
                          : "needs OC = (Hq + 2 Hkv) D");
        return;
    }
#ifdef TANDEM_HAVE_CUDA
    if (ctx->backend == OPS_BACKEND_CUDA) {
        int slot = cuda_profile_begin(ctx);
        const int done = cuda_matmul_fused_fwd(ctx, out, in, w, bias, N, IC, OC, f);
        cuda_profile_end(ctx, slot, "ops_matmul_fused_fwd");
        if (done) return;
    }
#endif
    // The unfused sequence (the CPU backend always; CUDA for shapes the fused kernel does not take), with the
    // batch-invariant GEMM of the decode steps this op serves.
    const void *x = in;
    if (f->norm_w) {
        ops_rmsnorm_fwd(ctx, f->h, NULL, in, f->norm_w, N, IC, f->eps);
        x = f->h;
    }
    if (f->swiglu) {
        ops_matmul_fwd_batch_invariant(ctx, f->gu, x, w, bias, N, IC, OC);
        ops_swiglu_fwd(ctx, out, f->gu, N, OC / 2);
        return;
    }
    if (f->rope_store) {
        ops_matmul_fwd_batch_invariant(ctx, f->qkv, x, w, bias, N, IC, OC);
        ops_qkv_rope_store_fwd(ctx, out, f->k_cache, f->v_cache, f->slot_mapping, f->qkv, f->positions, f->inv_freq, N,
                               f->Hq, f->Hkv, f->D);
        return;
    }
    ops_matmul_fwd_batch_invariant(ctx, out, x, w, bias, N, IC, OC);
    if (f->residual) ops_add_inplace(ctx, out, f->residual, (size_t)N * OC);
}

void ops_matmul_fwd(OpsCtx *ctx, void *out, const void *in, const void *w, const void *bias, int N, int IC, int OC) {
    DISPATCH(ctx, cuda_matmul_fwd(ctx, out, in, w, bias, N, IC, OC),
             cpu_matmul_fwd(F(out), CF(in), CF(w), CF(bias), N, IC, OC));
}
void ops_matmul_fwd_batch_invariant(OpsCtx *ctx, void *out, const void *in, const void *w, const void *bias, int N,
                                    int IC, int OC) {
    DISPATCH(ctx, cuda_matmul_fwd(ctx, out, in, w, bias, N, IC, OC),
             cpu_matmul_fwd_batch_invariant(F(out), CF(in), CF(w), CF(bias), N, IC, OC));
}
void ops_matmul_bwd(OpsCtx *ctx, void *din, float *dw, float *dbias, const void *dout, const void *in, const void *w,
                    int N, int IC, int OC, int din_accumulate) {
    DISPATCH(ctx, cuda_matmul_bwd(ctx, din, dw, dbias, dout, in, w, N, IC, OC, din_accumulate),
             cpu_matmul_bwd(F(din), dw, dbias, CF(dout), CF(in), CF(w), N, IC, OC, din_accumulate));
}

void ops_attention_fwd(OpsCtx *ctx, void *out, float *lse, const void *q, const void *k, const void *v,
                       const int32_t *cu_seqlens, int B, int N, int Hq, int Hkv, int D, float scale) {
    if (Hkv <= 0 || Hq % Hkv != 0) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "attention: Hq=%d is not a multiple of Hkv=%d", Hq, Hkv);
        return;
    }
    DISPATCH(ctx, cuda_attention_fwd(ctx, out, lse, q, k, v, cu_seqlens, B, N, Hq, Hkv, D, scale),
             cpu_attention_fwd(F(out), lse, CF(q), CF(k), CF(v), cu_seqlens, B, N, Hq, Hkv, D, scale));
}
void ops_attention_bwd(OpsCtx *ctx, void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                       const void *v, const void *out, const float *lse, const int32_t *cu_seqlens, int B, int N,
                       int Hq, int Hkv, int D, float scale) {
    if (Hkv <= 0 || Hq % Hkv != 0) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "attention backward: Hq=%d is not a multiple of Hkv=%d", Hq, Hkv);
        return;
    }
    DISPATCH(ctx, cuda_attention_bwd(ctx, dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, B, N, Hq, Hkv, D, scale),
             cpu_attention_bwd(F(dq), F(dk), F(dv), CF(dout), CF(q), CF(k), CF(v), CF(out), lse, cu_seqlens, B, N, Hq,
                               Hkv, D, scale));
}
void ops_kv_cache_store(OpsCtx *ctx, void *k_cache, void *v_cache, const void *k, const void *v,
                        const int32_t *slot_mapping, int N, int Hkv, int D) {
    DISPATCH(ctx, cuda_kv_cache_store(ctx, k_cache, v_cache, k, v, slot_mapping, N, Hkv, D),
             cpu_kv_cache_store(F(k_cache), F(v_cache), CF(k), CF(v), slot_mapping, N, Hkv, D));
}
void ops_attention_paged_fwd(OpsCtx *ctx, void *out, const void *q, const void *k_cache, const void *v_cache,
                             const int32_t *block_tables, const int32_t *token_seq, const int32_t *token_pos, int N,
                             int Hq, int Hkv, int D, int block_size, int max_blocks, float scale) {
    DISPATCH(ctx,
             cuda_attention_paged_fwd(ctx, out, q, k_cache, v_cache, block_tables, token_seq, token_pos, N, Hq, Hkv, D,
                                      block_size, max_blocks, scale),
             cpu_attention_paged_fwd(F(out), CF(q), CF(k_cache), CF(v_cache), block_tables, token_seq, token_pos, N, Hq,
                                     Hkv, D, block_size, max_blocks, scale));
}

void ops_attention_paged_decode_fwd(OpsCtx *ctx, void *out, void *q, void *k_cache, void *v_cache,
                                    const int32_t *slot_mapping, const void *qkv, const int32_t *block_tables,
                                    const int32_t *token_seq, const int32_t *token_pos, const float *inv_freq, int N,
                                    int Hq, int Hkv, int D, int block_size, int max_blocks, float scale) {
    if (!qkv_rope_args_ok(ctx, "attention_paged_decode_fwd", q, k_cache, v_cache, qkv, N, Hq, Hkv, D)) return;
    if (!slot_mapping || !out || Hq % Hkv != 0) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "attention_paged_decode_fwd: %s",
                      Hq % Hkv ? "Hq is not a multiple of Hkv" : "NULL slot_mapping or out");
        return;
    }
    DISPATCH(ctx,
             cuda_attention_paged_decode_fwd(ctx, out, q, k_cache, v_cache, slot_mapping, qkv, block_tables, token_seq,
                                             token_pos, inv_freq, N, Hq, Hkv, D, block_size, max_blocks, scale),
             (cpu_qkv_rope_store_fwd(F(q), F(k_cache), F(v_cache), slot_mapping, CF(qkv), token_pos, inv_freq, N, Hq,
                                     Hkv, D),
              cpu_attention_paged_fwd(F(out), CF(q), CF(k_cache), CF(v_cache), block_tables, token_seq, token_pos, N,
                                      Hq, Hkv, D, block_size, max_blocks, scale)));
}

void ops_swiglu_fwd(OpsCtx *ctx, void *out, const void *gu, int N, int I) {
    DISPATCH(ctx, cuda_swiglu_fwd(ctx, out, gu, N, I), cpu_swiglu_fwd(F(out), CF(gu), N, I));
}
void ops_swiglu_bwd(OpsCtx *ctx, void *dgu, const void *dout, const void *gu, int N, int I) {
    DISPATCH(ctx, cuda_swiglu_bwd(ctx, dgu, dout, gu, N, I), cpu_swiglu_bwd(F(dgu), CF(dout), CF(gu), N, I));
}

void ops_logprobs_fwd(OpsCtx *ctx, float *logprobs, float *lse, float *entropy, const void *logits,
                      const int32_t *targets, int N, int V, float inv_temperature) {
    DISPATCH(ctx, cuda_logprobs_fwd(ctx, logprobs, lse, entropy, logits, targets, N, V, inv_temperature),
             cpu_logprobs_fwd(logprobs, lse, entropy, CF(logits), targets, N, V, inv_temperature));
}
void ops_logprobs_bwd(OpsCtx *ctx, void *dlogits, const float *dlogprobs, const float *dentropy, const float *entropy,
                      const void *logits, const int32_t *targets, const float *lse, int N, int V,
                      float inv_temperature) {
    DISPATCH(ctx,
             cuda_logprobs_bwd(ctx, dlogits, dlogprobs, dentropy, entropy, logits, targets, lse, N, V, inv_temperature),
             cpu_logprobs_bwd(F(dlogits), dlogprobs, dentropy, entropy, CF(logits), targets, lse, N, V,
                              inv_temperature));
}

void ops_sample_rows(OpsCtx *ctx, int32_t *tokens, float *logprobs, const void *logits, const OpsSampleParams *params,
                     const int32_t *history, const int32_t *history_offsets, int n, int n_rows, int V, int n_history) {
    if (ctx->error_code) return;
    if (n < 0 || n_rows < 0 || V < 1 || n_history < 0 || (history_offsets && n_history > 0 && !history)) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "sample_rows: bad arguments (n=%d, n_rows=%d, V=%d, n_history=%d%s)",
                      n, n_rows, V, n_history, history_offsets && n_history > 0 && !history ? ", history NULL" : "");
        return;
    }
    if (n == 0) return;
    DISPATCH(ctx,
             cuda_sample_rows(ctx, tokens, logprobs, logits, params, history, history_offsets, n, n_rows, V, n_history),
             if (cpu_sample_rows(tokens, logprobs, CF(logits), params, history, history_offsets, n, n_rows, V,
                                 n_history) != 0)
                 ops_set_error(ctx, -1, __FILE__, __LINE__, "sample_rows: out of host memory for %d-wide rows", V));
}

void ops_adamw_step(OpsCtx *ctx, float *master, float *m, float *v, const float *grad, void *param_out, size_t n,
                    float lr, float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale) {
    DISPATCH(ctx,
             cuda_adamw_step(ctx, master, m, v, grad, param_out, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale),
             cpu_adamw_step(master, m, v, grad, F(param_out), n, lr, beta1, beta2, eps, weight_decay, step, grad_scale));
}
void ops_sum_squares(OpsCtx *ctx, float *out, const float *x, size_t n) {
    DISPATCH(ctx, cuda_sum_squares(ctx, out, x, n), cpu_sum_squares(out, x, n));
}

// ---- graphs -------------------------------------------------------------------------------------
// Not through DISPATCH: no per-op profiling slots, and ops_graph_end must run after an error to end the capture.

int ops_graph_supported(OpsCtx *ctx) {
#ifdef TANDEM_HAVE_CUDA
    if (IS_CUDA(ctx)) return cuda_graph_supported(ctx);
#endif
    (void)ctx;
    return 0;
}

int ops_graph_begin(OpsCtx *ctx) {
    if (ctx->error_code) return ctx->error_code;
#ifdef TANDEM_HAVE_CUDA
    if (IS_CUDA(ctx)) return cuda_graph_begin(ctx);
#endif
    return OPS_GRAPH_UNSUPPORTED;
}

int ops_graph_end(OpsCtx *ctx, OpsGraph **graph) {
    if (!graph) return ops_set_error(ctx, -1, __FILE__, __LINE__, "ops_graph_end: graph is NULL");
#ifdef TANDEM_HAVE_CUDA
    if (IS_CUDA(ctx)) return cuda_graph_end(ctx, graph);
#endif
    return ops_set_error(ctx, -1, __FILE__, __LINE__, "ops_graph_end: the %s backend records no graphs",
                         ctx->backend == OPS_BACKEND_CPU ? "cpu" : "unknown");
}

int ops_graph_launch(OpsCtx *ctx, OpsGraph *graph) {
    if (ctx->error_code) return ctx->error_code;
    if (!graph) return ops_set_error(ctx, -1, __FILE__, __LINE__, "ops_graph_launch: graph is NULL");
#ifdef TANDEM_HAVE_CUDA
    if (IS_CUDA(ctx)) return cuda_graph_launch(ctx, graph);
#endif
    return ops_set_error(ctx, -1, __FILE__, __LINE__, "ops_graph_launch: the %s backend has no graphs",
                         ctx->backend == OPS_BACKEND_CPU ? "cpu" : "unknown");
}

void ops_graph_destroy(OpsCtx *ctx, OpsGraph *graph) {
    if (!graph) return;
#ifdef TANDEM_HAVE_CUDA
    if (IS_CUDA(ctx)) cuda_graph_destroy(ctx, graph);
#else
    (void)ctx;
#endif
}

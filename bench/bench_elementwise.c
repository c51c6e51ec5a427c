// bench_elementwise — bandwidth of the memory-bound ops of a decoder layer: RMSNorm (plain and with the residual add
// fused in) forward and backward, the unfused add + norm pair they replace, and SwiGLU forward and backward.
//   bench_elementwise [--device cuda|cpu] [--tokens N] [--hidden C] [--inter I] [--iters K]
// Defaults: the Qwen2.5-1.5B shape of a training step of 8 x 1024 tokens (N 8192, C 1536, I 8960), 50 timed
// iterations after 5 warm-up ones. For each op prints the time per call and GB/s = the bytes its tensors move
// (each input read once, each output written once; dw's fp32 partial sums not counted) / time, beside a
// device-to-device copy of 2 x N x I elements as the practical ceiling. Ends with one JSON line.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_util.h"
#include "kernels/ops.h"

typedef struct {
    OpsCtx *o;
    int N, C, I, iters;
    size_t es;
    void *x, *res, *x_out, *h, *w, *dout, *dres, *gu, *act, *dact, *dgu, *copy_dst;
    float *rstd, *dw;
} Bench;

enum {
    OP_COPY, OP_RMS_FWD, OP_RES_RMS_FWD, OP_ADD_THEN_RMS, OP_RMS_BWD, OP_RES_RMS_BWD, OP_SWIGLU_FWD, OP_SWIGLU_BWD,
    OP_COUNT
};
static const char *OP_NAMES[OP_COUNT] = {"copy (ceiling)", "rmsnorm_fwd", "residual_rmsnorm_fwd", "add + rmsnorm_fwd",
                                         "rmsnorm_bwd (dres_in NULL)", "residual_rmsnorm_bwd", "swiglu_fwd",
                                         "swiglu_bwd"};

static void run_op(Bench *b, int op) {
    OpsCtx *o = b->o;
    const int N = b->N, C = b->C, I = b->I;
    const size_t nc = (size_t)N * C;
    switch (op) {
    case OP_COPY: ops_copy(o, b->copy_dst, b->gu, (size_t)N * 2 * I * b->es); break;
    case OP_RMS_FWD: ops_rmsnorm_fwd(o, b->h, b->rstd, b->x, b->w, N, C, 1e-6f); break;
    // x_out is a separate buffer so that every call sees the same inputs.
    case OP_RES_RMS_FWD:
        ops_residual_rmsnorm_fwd(o, b->x_out, b->h, b->rstd, b->x, b->res, b->w, N, C, 1e-6f);
        break;
    case OP_ADD_THEN_RMS:
        ops_add_inplace(o, b->x_out, b->res, nc);
        ops_rmsnorm_fwd(o, b->h, b->rstd, b->x_out, b->w, N, C, 1e-6f);
        break;
    case OP_RMS_BWD: ops_residual_rmsnorm_bwd(o, b->dres, b->dw, NULL, b->dout, b->x, b->w, b->rstd, N, C); break;
    // In place on dres, as the model runs it.
    case OP_RES_RMS_BWD:
        ops_residual_rmsnorm_bwd(o, b->dres, b->dw, b->dres, b->dout, b->x, b->w, b->rstd, N, C);
        break;
    case OP_SWIGLU_FWD: ops_swiglu_fwd(o, b->act, b->gu, N, I); break;
    case OP_SWIGLU_BWD: ops_swiglu_bwd(o, b->dgu, b->dact, b->gu, N, I); break;
    }
}

// Bytes the op's tensors move.
static double op_bytes(const Bench *b, int op) {
    const double nc = (double)b->N * b->C * b->es, ni = (double)b->N * b->I * b->es;
    const double rstd = 4.0 * b->N, w = (double)b->C * b->es, dw = 8.0 * b->C;
    switch (op) {
    case OP_COPY: return 2 * 2 * ni;                    // read + write of (N, 2I)
    case OP_RMS_FWD: return 2 * nc + rstd + w;          // x in, out
    case OP_RES_RMS_FWD: return 4 * nc + rstd + w;      // x, residual in; x_out, out
    case OP_ADD_THEN_RMS: return 5 * nc + rstd + w;     // add: y, x in, y out; norm: x in, out
    case OP_RMS_BWD: return 3 * nc + rstd + w + dw;     // dout, x in; dres out
    case OP_RES_RMS_BWD: return 4 * nc + rstd + w + dw; // dres_in, dout, x in; dres out
    case OP_SWIGLU_FWD: return 3 * ni;                  // gate, up in; act out
    case OP_SWIGLU_BWD: return 5 * ni;                  // dact, gate, up in; dgate, dup out
    }
    return 0;
}

static void *alloc_rand(Bench *b, size_t n, float scale, unsigned seed) {
    void *p = ops_malloc(b->o, n * b->es);
    float *h = malloc(n * sizeof *h);
    if (!p || !h) return NULL;
    unsigned s = seed;
    for (size_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        h[i] = scale * ((float)(s >> 8) / 8388608.0f - 1.0f);
    }
    ops_upload_f32(b->o, p, h, n);
    free(h);
    return p;
}

int main(int argc, char **argv) {
    Bench b = {.N = 8192, .C = 1536, .I = 8960, .iters = 50};
    OpsBackend backend = OPS_BACKEND_CUDA;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--device") && i + 1 < argc) {
            const char *d = argv[++i];
            if (!strcmp(d, "cpu")) backend = OPS_BACKEND_CPU;
            else if (strcmp(d, "cuda")) { fprintf(stderr, "bench_elementwise: --device cuda or cpu\n"); return 2; }
        } else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) b.N = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--hidden") && i + 1 < argc) b.C = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--inter") && i + 1 < argc) b.I = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) b.iters = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_elementwise [--device cuda|cpu] [--tokens 8192] [--hidden 1536] "
                            "[--inter 8960] [--iters 50]\n");
            return 2;
        }
    }
    if (b.N < 1 || b.C < 1 || b.I < 1 || b.iters < 1) {
        fprintf(stderr, "bench_elementwise: --tokens, --hidden, --inter and --iters must be positive\n");
        return 2;
    }
    char err[512];
    if (ops_create(&b.o, backend, 0, err, sizeof err) != 0) {
        fprintf(stderr, "bench_elementwise: %s\n", err);
        return 1;
    }
    b.es = ops_dtype_size(b.o);
    const size_t nc = (size_t)b.N * b.C, ni = (size_t)b.N * b.I;
    b.x = alloc_rand(&b, nc, 2.0f, 1);
    b.res = alloc_rand(&b, nc, 2.0f, 2);
    b.w = alloc_rand(&b, b.C, 1.0f, 3);
    b.dout = alloc_rand(&b, nc, 1.0f, 4);
    b.gu = alloc_rand(&b, 2 * ni, 4.0f, 5);
    b.dact = alloc_rand(&b, ni, 1.0f, 6);
    b.x_out = ops_malloc(b.o, nc * b.es);
    b.h = ops_malloc(b.o, nc * b.es);
    b.dres = ops_malloc(b.o, nc * b.es);
    b.act = ops_malloc(b.o, ni * b.es);
    b.dgu = ops_malloc(b.o, 2 * ni * b.es);
    b.copy_dst = ops_malloc(b.o, 2 * ni * b.es);
    b.rstd = ops_malloc(b.o, (size_t)b.N * 4);
    b.dw = ops_malloc(b.o, (size_t)b.C * 4);
    if (ops_status(b.o) || !b.x || !b.res || !b.w || !b.dout || !b.gu || !b.dact) {
        fprintf(stderr, "bench_elementwise: allocation failed: %s\n", ops_error(b.o));
        return 1;
    }
    ops_rmsnorm_fwd(b.o, b.h, b.rstd, b.x, b.w, b.N, b.C, 1e-6f); // a real rstd for the backward
    printf("bench_elementwise: %s, N=%d C=%d I=%d, %d iterations\n", backend == OPS_BACKEND_CUDA ? "cuda" : "cpu",
           b.N, b.C, b.I, b.iters);
    printf("%-28s %12s %12s %10s\n", "op", "us/call", "MB moved", "GB/s");
    double us[OP_COUNT], gbs[OP_COUNT];
    for (int op = 0; op < OP_COUNT; op++) {
        for (int it = 0; it < 5; it++) run_op(&b, op);
        ops_synchronize(b.o);
        const double t0 = bench_now_s();
        for (int it = 0; it < b.iters; it++) run_op(&b, op);
        ops_synchronize(b.o);
        const double dt = (bench_now_s() - t0) / b.iters;
        if (ops_status(b.o)) {
            fprintf(stderr, "bench_elementwise: %s failed: %s\n", OP_NAMES[op], ops_error(b.o));
            return 1;
        }
        us[op] = dt * 1e6;
        gbs[op] = op_bytes(&b, op) / dt / 1e9;
        printf("%-28s %12.1f %12.1f %10.1f\n", OP_NAMES[op], us[op], op_bytes(&b, op) / 1e6, gbs[op]);
    }
    printf("{\"device\": \"%s\", \"N\": %d, \"C\": %d, \"I\": %d", backend == OPS_BACKEND_CUDA ? "cuda" : "cpu", b.N,
           b.C, b.I);
    static const char *keys[OP_COUNT] = {"copy", "rmsnorm_fwd", "residual_rmsnorm_fwd", "add_then_rmsnorm",
                                         "rmsnorm_bwd", "residual_rmsnorm_bwd", "swiglu_fwd", "swiglu_bwd"};
    for (int op = 0; op < OP_COUNT; op++)
        printf(", \"%s_us\": %.1f, \"%s_GBps\": %.1f", keys[op], us[op], keys[op], gbs[op]);
    printf("}\n");
    void *bufs[] = {b.x,   b.res, b.w,   b.dout, b.gu,       b.dact, b.x_out,
                    b.h,   b.dres, b.act, b.dgu, b.copy_dst, b.rstd, b.dw};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) ops_free(b.o, bufs[i]);
    ops_destroy(b.o);
    return 0;
}

// tests/unit/test_kernels_adamw.c — AdamW of the fp32 CPU backend over ten steps against a scalar
// double-precision implementation of torch.optim.AdamW's update (decoupled weight decay, bias correction,
// eps outside the square root). Agreement with torch itself, operation order included, is checked by
// tests/reference/test_kernel_adamw.py.
// Tolerance: the fp32 state drifts from the double one by a few float roundings per step; after 10 steps the
// parameters agree to 2e-6 relative with an absolute floor of 1e-7 x max|p| (a parameter that ends near zero
// still carries the rounding of its O(1) start), the moments to 1e-5 relative with a floor of 1e-6 x their
// scale. The parameters move by ~lr = 1e-2 per step, so a mistake in the update itself would be ~1e-3.
#include "kernels/cpu/cpu_ops.h"
#include "kernels_testlib.h"

typedef struct {
    double lr, beta1, beta2, eps, wd;
} Hyper;

static void adamw_ref(double *p, double *m, double *v, const float *grad, double grad_scale, size_t n, const Hyper *h,
                      int step) {
    const double bc1 = 1.0 - pow(h->beta1, step), bc2 = 1.0 - pow(h->beta2, step);
    for (size_t i = 0; i < n; i++) {
        const double g = (double)grad[i] * grad_scale;
        p[i] *= 1.0 - h->lr * h->wd;
        m[i] = h->beta1 * m[i] + (1.0 - h->beta1) * g;
        v[i] = h->beta2 * v[i] + (1.0 - h->beta2) * g * g;
        p[i] -= h->lr / bc1 * m[i] / (sqrt(v[i]) / sqrt(bc2) + h->eps);
    }
}

static void run_case(const char *name, float lr, float beta1, float beta2, float eps, float wd, int with_param_out) {
    const size_t n = 1003;
    const int steps = 10;
    const Hyper h = {lr, beta1, beta2, eps, wd};
    float *p = kt_falloc(n), *m = kt_falloc(n), *v = kt_falloc(n), *g = kt_falloc(n), *out = kt_falloc(n);
    kt_fill(p, n, 1.0);
    double *pd = kt_to_double(p, n), *md = kt_dalloc(n), *vd = kt_dalloc(n);
    for (int step = 1; step <= steps; step++) {
        kt_fill(g, n, step % 3 == 0 ? 4.0 : 1.0);
        const float grad_scale = step % 2 ? 1.0f : 0.25f; // clipping scales some steps' gradients
        adamw_ref(pd, md, vd, g, grad_scale, n, &h, step);
        cpu_adamw_step(p, m, v, g, with_param_out ? out : NULL, n, lr, beta1, beta2, eps, wd, step, grad_scale);
    }
    char what[128];
    snprintf(what, sizeof what, "%s: master after %d steps", name, steps);
    check_close(what, p, pd, n, 2e-6, 1e-7);
    snprintf(what, sizeof what, "%s: exp_avg", name);
    check_close(what, m, md, n, 1e-5, 1e-6);
    snprintf(what, sizeof what, "%s: exp_avg_sq", name);
    check_close(what, v, vd, n, 1e-5, 1e-6);
    if (with_param_out)
        CHECK(memcmp(out, p, n * sizeof(float)) == 0, "%s: param_out must equal the updated master", name);
    free(p), free(m), free(v), free(g), free(out), free(pd), free(md), free(vd);
}

int main(void) {
    kt_seed(99);
    run_case("adamw wd=0.1", 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 1);
    run_case("adamw wd=0", 3e-3f, 0.8f, 0.95f, 1e-6f, 0.0f, 0);
    return check_exit_code("test_kernels_adamw");
}

// tests/fuzz/fuzz_safetensors.c — libFuzzer target for the safetensors header parser and tensor readers.
// Each input is one in-memory .safetensors file. Accepted files must behave (every tensor findable by name and
// readable within its bytes); refused files must come with a message. ASan/UBSan catch the rest.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "shared/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    // An exact-size heap copy, so that a read one byte past the file is an ASan report.
    unsigned char *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    SafetensorsSet *set = NULL;
    char err[512] = "";
    int rc = st_parse_buffer(&set, buf, size, "fuzz.safetensors", err, sizeof err);
    if (rc != 0) {
        if (set != NULL || err[0] == '\0' || strstr(err, "fuzz.safetensors") == NULL) abort();
    } else {
        for (size_t i = 0; i < st_count(set); i++) {
            const StTensor *t = st_tensor_at(set, i);
            if (st_find(set, t->name) != t) abort();
            const unsigned char *b = t->data;
            if (b < buf || b + t->nbytes > buf + size) abort();
            if (st_check_param(t, err, sizeof err) != 0 || t->numel > (1u << 16)) continue;
            float *f = malloc((size_t)t->numel * sizeof *f + 1);
            uint16_t *h = malloc((size_t)t->numel * sizeof *h + 1);
            if (f && h) {
                if (st_read_f32(t, f, (size_t)t->numel, err, sizeof err) != 0) abort();
                if (st_read_bf16(t, h, (size_t)t->numel, err, sizeof err) != 0) abort();
                if (st_read_f32(t, f, (size_t)t->numel + 1, err, sizeof err) == 0) abort();   // wrong count refused
            }
            free(f);
            free(h);
            int64_t shape[ST_MAX_DIMS] = {0};
            st_check_shape(t, t->ndim, t->shape, err, sizeof err);
            st_check_shape(t, 2, shape, err, sizeof err);
        }
        st_close(set);
    }
    free(buf);
    return 0;
}

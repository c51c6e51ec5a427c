// kernels/cpu/cpu_embedding.c — token embedding lookup and its gradient scatter, fp32.
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

// out (N, C) = table (V, C) rows picked by tokens (N). Every id is checked before anything is written,
// so a bad batch leaves out untouched and the caller gets the first offending row.
int cpu_embedding_fwd(float *out, const int32_t *tokens, const float *table, int N, int C, int V, int *bad_row) {
    for (int i = 0; i < N; i++) {
        if (tokens[i] < 0 || tokens[i] >= V) {
            if (bad_row) *bad_row = i;
            return -1;
        }
    }
    for (int i = 0; i < N; i++)
        memcpy(out + (size_t)i * C, table + (size_t)tokens[i] * C, (size_t)C * sizeof(float));
    return 0;
}

// The vocabulary shard [begin, begin + rows) of a V-row table: rows of other shards' ids are zeros. Ids are
// checked against V first, as above.
int cpu_embedding_shard_fwd(float *out, const int32_t *tokens, const float *table, int N, int C, int begin, int rows,
                            int V, int *bad_row) {
    for (int i = 0; i < N; i++) {
        if (tokens[i] < 0 || tokens[i] >= V) {
            if (bad_row) *bad_row = i;
            return -1;
        }
    }
    for (int i = 0; i < N; i++) {
        const int local = tokens[i] - begin;
        if (local >= 0 && local < rows)
            memcpy(out + (size_t)i * C, table + (size_t)local * C, (size_t)C * sizeof(float));
        else
            memset(out + (size_t)i * C, 0, (size_t)C * sizeof(float));
    }
    return 0;
}

// dtable (V, C) += dout (N, C) scattered by tokens (N). Rows repeat when a token repeats, so this is an
// accumulation, not a copy. V is not passed here: the ids were validated by the forward; a negative id
// (the only invalid value checkable without V) is skipped rather than written out of bounds.
void cpu_embedding_bwd(float *dtable, const float *dout, const int32_t *tokens, int N, int C) {
    for (int i = 0; i < N; i++) {
        if (tokens[i] < 0) continue;
        float *restrict dst = dtable + (size_t)tokens[i] * C;
        const float *restrict src = dout + (size_t)i * C;
        for (int c = 0; c < C; c++) dst[c] += src[c];
    }
}

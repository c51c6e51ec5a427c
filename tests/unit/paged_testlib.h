// paged_testlib.h — block tables of a paged KV cache for the paged-attention tests (test_cuda_vs_cpu,
// test_cuda_attention_paged): sequences in blocks scattered over a pool by a random permutation.
#ifndef TANDEM_TESTS_PAGED_TESTLIB_H
#define TANDEM_TESTS_PAGED_TESTLIB_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

// Tables (n_seqs, max_blocks) for n_seqs sequences of ctx_len[s] positions: the pool has *n_blk blocks (the
// sequences' plus `spare` nobody uses), shuffled by irand (irand(n) in [0, n)); entries past a context are -1,
// and hole_seq >= 0 unassigns the block in the middle of that sequence's context. NULL with a message in err
// when a sequence is empty or longer than max_blocks blocks (or out of memory). The caller frees the tables.
static int32_t *kt_paged_tables(int n_seqs, const int *ctx_len, int block_size, int max_blocks, int spare,
                                int hole_seq, int (*irand)(int), int *n_blk, char *err, size_t err_len) {
    *n_blk = spare;
    for (int s = 0; s < n_seqs; s++) {
        const int nb = (ctx_len[s] + block_size - 1) / block_size;
        if (ctx_len[s] < 1 || nb > max_blocks) {
            snprintf(err, err_len, "bad test setup: sequence %d of %d positions", s, ctx_len[s]);
            return NULL;
        }
        *n_blk += nb;
    }
    int32_t *perm = malloc((size_t)*n_blk * sizeof *perm), *tables = malloc((size_t)n_seqs * max_blocks * 4);
    if (!perm || !tables) {
        free(perm), free(tables);
        snprintf(err, err_len, "out of host memory for the block tables");
        return NULL;
    }
    for (int i = 0; i < *n_blk; i++) perm[i] = i;
    for (int i = *n_blk - 1; i > 0; i--) {
        const int j = irand(i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int used = 0;
    for (int s = 0; s < n_seqs; s++)
        for (int b = 0; b < max_blocks; b++)
            tables[(size_t)s * max_blocks + b] = b * block_size < ctx_len[s] ? perm[used++] : -1;
    if (hole_seq >= 0) tables[(size_t)hole_seq * max_blocks + (ctx_len[hole_seq] - 1) / block_size / 2] = -1;
    free(perm);
    return tables;
}

#endif

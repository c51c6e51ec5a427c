// kernels/index_hash.h — the counter-based hash behind ops_dropout's mask and ops_fill_hashed_uniform's values: 24
// random bits that are a function of (seed, element index) alone, so the CPU twin and the CUDA kernel, and any split
// of the work over threads, shards or launches, draw the same bits. Top 24 bits of splitmix64's finaliser applied to
// seed + (i + 1) * 0x9E3779B97F4A7C15.
#ifndef TANDEM_KERNELS_INDEX_HASH_H
#define TANDEM_KERNELS_INDEX_HASH_H

#include <stdint.h>

#if defined(__CUDACC__)
#define INDEX_HASH_FN static inline __host__ __device__
#else
#define INDEX_HASH_FN static inline
#endif

INDEX_HASH_FN uint32_t index_hash24(uint64_t seed, uint64_t i) {
    uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (uint32_t)(z >> 40);
}

#endif

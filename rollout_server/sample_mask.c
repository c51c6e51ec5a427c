// rollout_server/sample_mask.c — a completion's mask for its next token (see sample_mask.h).
#include "rollout_server/sample_mask.h"

#include <string.h>

// The most ids banned_ids can write for p.
static int max_bans(const SamplingParams *p, int n_eos) {
    return (p->min_tokens > 0 ? n_eos + p->n_stop_token_ids : 0) + p->n_bad_words;
}

int sample_mask_cap(const SamplingParams *p, const Guide *guide, int n_eos) {
    const int bans = max_bans(p, n_eos);
    if (guide) return guide_max_mask(guide) + bans;
    return p->n_allowed > 0 ? p->n_allowed + bans : bans;
}

// The banned ids after gen (n_gen), written to out; returns how many (repeats possible).
static int banned_ids(const SamplingParams *p, const int32_t *eos, int n_eos, const int32_t *gen, int n_gen,
                      int32_t *out) {
    int n = 0;
    if (n_gen < p->min_tokens) {
        for (int i = 0; i < n_eos; i++) out[n++] = eos[i];
        for (int i = 0; i < p->n_stop_token_ids; i++) out[n++] = p->stop_token_ids[i];
    }
    for (int w = 0; w < p->n_bad_words; w++) {
        const int32_t *word = p->bad_words_ids + p->bad_words_offsets[w];
        const int len = p->bad_words_offsets[w + 1] - p->bad_words_offsets[w];
        if (len < 1 || len - 1 > n_gen) continue;
        if (memcmp(gen + n_gen - (len - 1), word, (size_t)(len - 1) * sizeof *word) == 0) out[n++] = word[len - 1];
    }
    return n;
}

int sample_mask_build(const SamplingParams *p, const Guide *guide, const int32_t *eos, int n_eos, const int32_t *gen,
                      int n_gen, int32_t *out, int32_t *mode) {
    const int32_t *allowed = p->allowed_token_ids;
    int n_allowed = p->n_allowed, guide_bans = 0;
    if (guide) guide_mask(guide, guide_state_after(guide, gen, n_gen), &allowed, &n_allowed, &guide_bans);
    if (guide_bans) {   // the guide's banned ids, then the others
        memcpy(out, allowed, (size_t)n_allowed * sizeof *out);
        *mode = OPS_SAMPLE_MASK_BAN;
        return n_allowed + banned_ids(p, eos, n_eos, gen, n_gen, out + n_allowed);
    }
    if (!guide && n_allowed == 0) {
        const int n = banned_ids(p, eos, n_eos, gen, n_gen, out);
        *mode = n > 0 ? OPS_SAMPLE_MASK_BAN : OPS_SAMPLE_MASK_NONE;
        return n;
    }
    // The allowed ids less the banned ones: the bans go after room for the allowed ids, which are then written
    // from the front (never past the bans' start).
    int32_t *bans = out + n_allowed;
    const int n_bans = banned_ids(p, eos, n_eos, gen, n_gen, bans);
    int n = 0;
    for (int i = 0; i < n_allowed; i++) {
        int banned = 0;
        for (int j = 0; j < n_bans && !banned; j++) banned = bans[j] == allowed[i];
        if (!banned) out[n++] = allowed[i];
    }
    *mode = OPS_SAMPLE_MASK_ALLOW;
    return n;
}

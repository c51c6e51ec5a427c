// tests/fuzz/fuzz_config.c — libFuzzer target for config_parse. Accepted configs must survive
// config_to_json -> config_parse unchanged and yield rotary frequencies; refusals must come with a message.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "shared/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ModelConfig cfg, again;
    char err[512] = "";
    if (config_parse(&cfg, (const char *)data, size, err, sizeof err) != 0) {
        if (err[0] == '\0') abort();
        return 0;
    }
    if (cfg.head_dim <= 0 || cfg.head_dim % 2 || cfg.num_heads % cfg.num_kv_heads || cfg.max_seq_len <= 0 ||
        cfg.max_seq_len > cfg.max_position_embeddings)
        abort();
    char *text = config_to_json(&cfg);
    if (!text) abort();
    if (config_parse(&again, text, strlen(text), err, sizeof err) != 0 || memcmp(&cfg, &again, sizeof cfg) != 0)
        abort();
    free(text);
    float *inv = malloc((size_t)cfg.head_dim / 2 * sizeof *inv);
    if (inv) config_rope_inv_freq(&cfg, inv);
    free(inv);
    return 0;
}

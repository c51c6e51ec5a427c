// tests/reference/tools/st_tool.c — drives tandem's safetensors and config code for the Python reference tests
// (tests/reference/test_safetensors_io.py).
//   st_tool list SRC                          tensors as JSON {name: {dtype, shape, file}}
//   st_tool dump SRC OUT_DIR [DTYPE [SHARD]]  read every tensor (st_read_f32) and write it as DTYPE (F32 default,
//                                             BF16 or F16) into OUT_DIR, sharded above SHARD bytes (0: one file)
//   st_tool config DIR                        config_load + config_to_json
//   st_tool parsed DIR                        the parsed ModelConfig fields and the rotary inv_freq as JSON
// SRC is a model folder or a .safetensors file. Errors go to stderr with exit status 1.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "shared/config.h"
#include "shared/safetensors.h"

static int cmd_list(const char *src) {
    SafetensorsSet *s;
    char err[1024];
    if (st_open(&s, src, err, sizeof err)) return fprintf(stderr, "%s\n", err), 1;
    json_t *o = json_object();
    for (size_t i = 0; i < st_count(s); i++) {
        const StTensor *t = st_tensor_at(s, i);
        json_t *shape = json_array();
        for (int d = 0; d < t->ndim; d++) json_array_append_new(shape, json_integer(t->shape[d]));
        json_object_set_new(o, t->name, json_pack("{s:s, s:o, s:s}", "dtype", st_dtype_name(t->dtype), "shape",
                                                  shape, "file", t->file));
    }
    json_dumpf(o, stdout, JSON_COMPACT);
    json_decref(o);
    st_close(s);
    return 0;
}

static int cmd_dump(const char *src, const char *out, const char *dtype_name, unsigned long long shard) {
    StDtype dtype;
    if (st_dtype_from_name(dtype_name, &dtype)) return fprintf(stderr, "unknown dtype %s\n", dtype_name), 1;
    SafetensorsSet *s;
    StWriter *w;
    char err[1024];
    if (st_open(&s, src, err, sizeof err)) return fprintf(stderr, "%s\n", err), 1;
    if (st_writer_create(&w, err, sizeof err)) return fprintf(stderr, "%s\n", err), 1;
    size_t n = st_count(s);
    float **bufs = calloc(n ? n : 1, sizeof *bufs);
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        const StTensor *t = st_tensor_at(s, i);
        bufs[i] = malloc(t->numel ? t->numel * sizeof(float) : 1);
        rc = !bufs[i] || st_read_f32(t, bufs[i], (size_t)t->numel, err, sizeof err) ||
             st_writer_add(w, t->name, dtype, t->ndim, t->shape, bufs[i], ST_F32, err, sizeof err);
    }
    if (!rc) rc = st_writer_write(w, out, shard, err, sizeof err) != 0;
    if (rc) fprintf(stderr, "%s\n", err);
    for (size_t i = 0; i < n; i++) free(bufs[i]);
    free(bufs);
    st_writer_free(w);
    st_close(s);
    return rc ? 1 : 0;
}

static int cmd_config(const char *dir, int parsed) {
    ModelConfig c;
    char err[1024];
    if (config_load(&c, dir, err, sizeof err)) return fprintf(stderr, "%s\n", err), 1;
    if (!parsed) {
        char *text = config_to_json(&c);
        if (!text) return fprintf(stderr, "out of memory\n"), 1;
        puts(text);
        free(text);
        return 0;
    }
    static const char *rope_names[] = {"default", "llama3", "linear"};
    json_t *eos = json_array(), *inv = json_array();
    for (int i = 0; i < c.n_eos_token_ids; i++) json_array_append_new(eos, json_integer(c.eos_token_ids[i]));
    float *f = malloc((size_t)c.head_dim / 2 * sizeof *f);
    config_rope_inv_freq(&c, f);
    for (int i = 0; i < c.head_dim / 2; i++) json_array_append_new(inv, json_real(f[i]));
    free(f);
    json_t *o = json_pack(
        "{s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:f, s:s, s:f, s:f, s:f, s:i, s:b, s:b, "
        "s:b, s:i, s:o, s:s, s:o}",
        "arch_name", c.arch_name, "vocab_size", c.vocab_size, "hidden_size", c.hidden_size, "intermediate_size",
        c.intermediate_size, "num_layers", c.num_layers, "num_heads", c.num_heads, "num_kv_heads", c.num_kv_heads,
        "head_dim", c.head_dim, "max_position_embeddings", c.max_position_embeddings, "max_seq_len", c.max_seq_len,
        "sliding_window", c.sliding_window, "max_window_layers", c.max_window_layers, "rms_norm_eps",
        (double)c.rms_norm_eps, "rope_theta", (double)c.rope_theta, "rope_type", rope_names[c.rope_type],
        "rope_factor", (double)c.rope_factor, "rope_low_freq_factor", (double)c.rope_low_freq_factor,
        "rope_high_freq_factor", (double)c.rope_high_freq_factor, "rope_original_max_position",
        c.rope_original_max_position, "tie_word_embeddings", c.tie_word_embeddings, "attention_bias",
        c.attention_bias, "qk_norm", c.qk_norm, "bos_token_id", c.bos_token_id, "eos_token_ids", eos, "torch_dtype",
        c.torch_dtype, "inv_freq", inv);
    json_dumpf(o, stdout, JSON_COMPACT);
    json_decref(o);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "list") == 0) return cmd_list(argv[2]);
    if (argc >= 4 && argc <= 6 && strcmp(argv[1], "dump") == 0)
        return cmd_dump(argv[2], argv[3], argc > 4 ? argv[4] : "F32", argc > 5 ? strtoull(argv[5], NULL, 10) : 0);
    if (argc == 3 && strcmp(argv[1], "config") == 0) return cmd_config(argv[2], 0);
    if (argc == 3 && strcmp(argv[1], "parsed") == 0) return cmd_config(argv[2], 1);
    fprintf(stderr, "usage: st_tool list SRC | dump SRC OUT_DIR [F32|BF16|F16 [MAX_SHARD_BYTES]] | config DIR | "
                    "parsed DIR\n");
    return 2;
}

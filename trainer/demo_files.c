// trainer/demo_files.c — the demo's model folder and data sets (see trainer/demo.h).
//
// The tokenizer is a BPE with no merges over the task's alphabet: every character is one token, so the model
// sees each digit separately. No pre-tokenizer, no post-processor (no BOS), a Fuse decoder (tokens joined
// without spaces). Hugging Face `tokenizers` and transformers load the folder as they load any other.
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kernels/ops.h"
#include "shared/config.h"
#include "shared/model.h"
#include "trainer/demo.h"

// Token ids: the specials first, then one per character. Every character a prompt or answer of the task can
// contain is here; the spare operators keep the vocabulary usable for other arithmetic tasks.
static const char *const kSpecials[] = {"<pad>", "<eos>"};
static const char kChars[] = "0123456789+-*= \n";
enum { PAD_ID = 0, EOS_ID = 1 };

// The tools task (--task tools) talks in plain ChatML, so its tokenizer adds the ChatML markers (<|im_end|> is
// its eos), Hermes' <tool_call> tags (non-special, as in Qwen's tokenizers), and single tokens for the three role
// names and the fixed parts of a calculator call, {"name": "calculator", "arguments": {"expression": "...
// "}}: a call is then 2 x digits + 6 tokens, and a whole trajectory fits 64 positions. The model still has to
// write every operand digit itself.
static const char *const kToolsAdded[] = {"<pad>", "<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_call>",
                                          "user", "assistant", "tool", DEMO_CALL_PREFIX, DEMO_CALL_SUFFIX};
enum { TOOLS_N_SPECIAL = 3, TOOLS_N_ADDED = 10 };
static const char kToolsTemplate[] =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

static int vocab_size(int tools) { return (tools ? TOOLS_N_ADDED : 2) + (int)strlen(kChars); }

static int write_json(const char *dir, const char *name, json_t *j, char *err, size_t err_len) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int rc = json_dump_file(j, path, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
    json_decref(j);
    if (rc != 0) {
        snprintf(err, err_len, "cannot write %s: %s", path, strerror(errno));
        return -1;
    }
    return 0;
}

static json_t *added_token(int id, const char *content, int special) {
    return json_pack("{s:i, s:s, s:b, s:b, s:b, s:b, s:b}", "id", id, "content", content, "single_word", 0, "lstrip",
                     0, "rstrip", 0, "normalized", 0, "special", special);
}

static int write_tokenizer(const char *dir, int tools, char *err, size_t err_len) {
    json_t *added = json_array(), *vocab = json_object();
    const int n_added = tools ? TOOLS_N_ADDED : 2;
    for (int i = 0; i < n_added; i++) {
        const char *t = tools ? kToolsAdded[i] : kSpecials[i];
        json_array_append_new(added, added_token(i, t, !tools || i < TOOLS_N_SPECIAL));
        json_object_set_new(vocab, t, json_integer(i));
    }
    for (size_t i = 0; i < strlen(kChars); i++) {
        char s[2] = {kChars[i], 0};
        json_object_set_new(vocab, s, json_integer(n_added + (json_int_t)i));
    }
    json_t *model = json_pack("{s:s, s:n, s:n, s:n, s:n, s:b, s:b, s:b, s:o, s:[]}", "type", "BPE", "dropout",
                              "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", 0,
                              "byte_fallback", 0, "ignore_merges", 0, "vocab", vocab, "merges");
    json_t *tok = json_pack("{s:s, s:n, s:n, s:o, s:n, s:n, s:n, s:{s:s}, s:o}", "version", "1.0", "truncation",
                            "padding", "added_tokens", added, "normalizer", "pre_tokenizer", "post_processor",
                            "decoder", "type", "Fuse", "model", model);
    if (!tok) {
        snprintf(err, err_len, "out of memory building tokenizer.json");
        return -1;
    }
    if (write_json(dir, "tokenizer.json", tok, err, err_len) != 0) return -1;
    const char *eos = tools ? kToolsAdded[EOS_ID] : kSpecials[EOS_ID];
    json_t *cfg = json_pack("{s:s, s:n, s:s, s:s, s:n, s:b, s:b, s:i}", "tokenizer_class", "PreTrainedTokenizerFast",
                            "bos_token", "eos_token", eos, "pad_token", kSpecials[PAD_ID], "unk_token",
                            "add_bos_token", 0, "add_eos_token", 0, "model_max_length", tools ? 128 : 64);
    if (tools) json_object_set_new(cfg, "chat_template", json_string(kToolsTemplate));
    if (write_json(dir, "tokenizer_config.json", cfg, err, err_len) != 0) return -1;
    json_t *map = json_pack("{s:s, s:s}", "eos_token", eos, "pad_token", kSpecials[PAD_ID]);
    if (write_json(dir, "special_tokens_map.json", map, err, err_len) != 0) return -1;
    json_t *gen = json_pack("{s:i, s:i, s:s}", "eos_token_id", EOS_ID, "pad_token_id", PAD_ID, "transformers_version",
                            "5.0.0");
    return write_json(dir, "generation_config.json", gen, err, err_len);
}

int demo_write_model(const char *dir, const DemoModelSpec *s, size_t *n_params, char *err, size_t err_len) {
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        snprintf(err, err_len, "cannot create %s: %s", dir, strerror(errno));
        return -1;
    }
    if (s->hidden <= 0 || s->heads <= 0 || s->hidden % s->heads != 0 || (s->hidden / s->heads) % 2 != 0 ||
        s->layers <= 0 || s->intermediate <= 0) {
        snprintf(err, err_len, "model size: hidden %d must be a multiple of heads %d with an even head size; "
                               "layers and intermediate > 0", s->hidden, s->heads);
        return -1;
    }
    // The config goes through tandem's own parser, so the folder holds exactly what the trainer will read.
    json_t *cj = json_pack("{s:[s], s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:f, s:s, s:b, s:n, s:i, s:i}",
                           "architectures", "LlamaForCausalLM", "model_type", "llama", "vocab_size",
                           vocab_size(s->tools),
                           "hidden_size", s->hidden, "intermediate_size", s->intermediate, "num_hidden_layers",
                           s->layers, "num_attention_heads", s->heads, "num_key_value_heads", s->heads,
                           "max_position_embeddings", s->tools ? 128 : 64, "rms_norm_eps", 1e-5, "rope_theta", 10000.0,
                           "hidden_act",
                           "silu", "tie_word_embeddings", 0, "bos_token_id", "eos_token_id", EOS_ID, "pad_token_id",
                           PAD_ID);
    char *text = json_dumps(cj, JSON_COMPACT);
    json_decref(cj);
    ModelConfig cfg;
    if (!text || config_parse(&cfg, text, strlen(text), err, err_len) != 0) {
        if (!text) snprintf(err, err_len, "out of memory building config.json");
        free(text);
        return -1;
    }
    free(text);
    OpsCtx *ops = NULL;
    if (ops_create(&ops, OPS_BACKEND_CPU, 0, err, err_len) != 0) return -1;
    Model m;
    int rc = -1;
    float **units = NULL;
    if (model_init(&m, &cfg, ops, err, err_len) != 0) goto out_ops;
    *n_params = m.layout.n_params;
    units = calloc((size_t)m.layout.n_units, sizeof *units);
    if (!units) goto oom;
    for (int u = 0; u < m.layout.n_units; u++) {
        if (!(units[u] = malloc(m.layout.unit_numel[u] * sizeof(float)))) goto oom;
        model_random_unit_f32(&m, s->seed, s->init_std, u, units[u]);
    }
    rc = model_save_host(&m, units, dir, 0, 0, err, err_len);
    if (rc == 0) rc = write_tokenizer(dir, s->tools, err, err_len);
    goto out;
oom:
    snprintf(err, err_len, "out of memory for the random init");
out:
    if (units)
        for (int u = 0; u < m.layout.n_units; u++) free(units[u]);
    free(units);
    model_free(&m);
out_ops:
    ops_destroy(ops);
    return rc;
}

// ---- data ----------------------------------------------------------------------------------------------

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// Uniform in [0, n) (rejection sampling, no modulo bias).
static uint64_t uniform(uint64_t *s, uint64_t n) {
    uint64_t limit = UINT64_MAX - UINT64_MAX % n, v;
    do v = splitmix64(s);
    while (v >= limit);
    return v % n;
}

// Open-addressing set of problem keys a * range + b (+1, so 0 means empty).
typedef struct {
    uint64_t *slots;
    size_t cap;
} KeySet;

static int keyset_insert(KeySet *k, uint64_t key) {  // 1 = inserted, 0 = already there
    uint64_t h = key + 1;
    size_t i = (size_t)((h * 0x9E3779B97F4A7C15ULL) >> 20) & (k->cap - 1);
    while (k->slots[i]) {
        if (k->slots[i] == h) return 0;
        i = (i + 1) & (k->cap - 1);
    }
    k->slots[i] = h;
    return 1;
}

static void reverse_in_place(char *s) {
    for (size_t lo = 0, hi = strlen(s); hi > 1 && lo < hi - 1; lo++, hi--) {
        char t = s[lo];
        s[lo] = s[hi - 1], s[hi - 1] = t;
    }
}

// A row {"prompt": prompt, key: value}: prompt a list of messages (the tools task) or a string (value's reference is
// taken; prompt's is not).
static int write_json_row(FILE *f, json_t *prompt, const char *key, json_t *value) {
    json_t *row = json_pack("{s:O, s:o}", "prompt", prompt, key, value);
    char *line = row ? json_dumps(row, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(row);
    if (!line) return -1;
    int rc = fprintf(f, "%s\n", line) < 0 ? -1 : 0;
    free(line);
    return rc;
}

static int write_row(FILE *f, const char *prompt, const char *key, json_t *value) {
    json_t *text = json_string(prompt);
    int rc = text ? write_json_row(f, text, key, value) : (json_decref(value), -1);
    json_decref(text);
    return rc;
}

int demo_write_data(const char *dir, const DemoDataSpec *s, char *err, size_t err_len) {
    if (s->digits < 1 || s->digits > 9 || s->n_train < 1 || s->n_heldout < 1 || s->n_validation < 1 || s->n_sft < 1 ||
        s->n_sft > s->n_train) {
        snprintf(err, err_len, "data: need 1 <= digits <= 9, train, held-out, validation and sft sizes >= 1, "
                               "sft <= train");
        return -1;
    }
    // Operands have exactly `digits` digits (0-9 for one digit): every prompt has the same length, so a digit's
    // place is its position.
    uint64_t lo = s->digits == 1 ? 0 : 1, range = 1;
    for (int i = 1; i < s->digits; i++) lo *= 10;
    range = s->digits == 1 ? 10 : 9 * lo;
    if (s->tools) {   // operands in [5 * 10^(d-1), 10^d): the sum always has d + 1 digits, one answer length
        uint64_t top = 10 * (s->digits == 1 ? 1 : lo);
        lo = top / 2, range = top - lo;
    }
    size_t n = (size_t)s->n_heldout + (size_t)s->n_validation + (size_t)s->n_train, cap = 1;
    // Distinct problems must exist: at most 90 % of the range^2 pairs (rejection sampling stays quick).
    if ((double)n > 0.9 * (double)range * (double)range) {
        snprintf(err, err_len, "data: %zu distinct problems are too many for %d-digit operands", n, s->digits);
        return -1;
    }
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        snprintf(err, err_len, "cannot create %s: %s", dir, strerror(errno));
        return -1;
    }
    while (cap < 2 * n) cap <<= 1;
    KeySet set = {.slots = calloc(cap, sizeof(uint64_t)), .cap = cap};
    uint64_t *a = malloc(n * sizeof(uint64_t)), *b = malloc(n * sizeof(uint64_t));
    int rc = -1;
    enum { HELDOUT, VALIDATION, TRAIN, SFT, N_FILES };
    static const char *const names[N_FILES] = {"heldout.jsonl", "validation.jsonl", "train.jsonl", "sft.jsonl"};
    FILE *f[N_FILES] = {0};
    char path[N_FILES][4096];
    if (!set.slots || !a || !b) {
        snprintf(err, err_len, "out of memory generating %zu problems", n);
        goto out;
    }
    // Distinct problems, split in order: held-out, validation (only decides when SFT stops), training.
    uint64_t rng = s->seed ^ 0x5DEECE66DULL;
    for (size_t i = 0; i < n;) {
        a[i] = lo + uniform(&rng, range), b[i] = lo + uniform(&rng, range);
        if (keyset_insert(&set, (a[i] - lo) * range + (b[i] - lo))) i++;
    }
    for (int k = 0; k < N_FILES; k++) {
        snprintf(path[k], sizeof path[k], "%s/%s", dir, names[k]);
        if (!(f[k] = fopen(path[k], "w"))) {
            snprintf(err, err_len, "cannot write %s: %s", path[k], strerror(errno));
            goto out;
        }
    }
    for (size_t i = 0; i < n && s->tools; i++) {
        // The tools task: "a+b" as a user message, written as usual (most significant digit first, no padding);
        // the answer is the sum. The warm-up's transcripts call the calculator with the expression and answer
        // with what it returned: the model can only learn to hand the problem over and copy the result.
        char expr[64], sum[32], final[40];
        snprintf(expr, sizeof expr, "%llu+%llu", (unsigned long long)a[i], (unsigned long long)b[i]);
        snprintf(sum, sizeof sum, "%llu", (unsigned long long)(a[i] + b[i]));
        snprintf(final, sizeof final, "=%s", sum);   // the answer turn starts with '=': unlike the call's digits
        json_t *prompt = json_pack("[{s:s, s:s}]", "role", "user", "content", expr);
        int w;
        const int k = i < (size_t)s->n_heldout ? HELDOUT : i < (size_t)s->n_heldout + s->n_validation ? VALIDATION
                                                                                                     : TRAIN;
        w = write_json_row(f[k], prompt, "answer", json_string(sum));
        if (w == 0 && k == TRAIN && i - s->n_heldout - s->n_validation < (size_t)s->n_sft) {
            char call[160];
            snprintf(call, sizeof call, "<tool_call>%s%s%s</tool_call>", DEMO_CALL_PREFIX, expr, DEMO_CALL_SUFFIX);
            w = write_json_row(f[SFT], prompt, "completion",
                                json_pack("[{s:s, s:s}, {s:s, s:s}, {s:s, s:s}]", "role", "assistant", "content", call,
                                          "role", "tool", "content", sum, "role", "assistant", "content", final));
        }
        json_decref(prompt);
        if (w) {
            snprintf(err, err_len, "cannot write the data sets in %s", dir);
            goto out;
        }
    }
    for (size_t i = 0; i < n && !s->tools; i++) {
        // Every number least significant digit first, zero-padded ("12+34=" is written "21+43=", its sum 064 as
        // "460"): the sum's digit at place k then sits at the same distance from the operand digits at place k
        // for every k, and the carry into it is a function of the tokens one place back (the operand digits and
        // the sum's digit just written), so one rule serves every place. Written most significant digit first,
        // each digit of the sum depends on the carry chain below it, and a 2-layer model's SFT and GRPO stall
        // for seed- and rounding-dependent times (bench/notes/demo.md).
        char prompt[64], answer[32], ra[16], rb[16];
        snprintf(ra, sizeof ra, "%0*llu", s->digits, (unsigned long long)a[i]);
        snprintf(rb, sizeof rb, "%0*llu", s->digits, (unsigned long long)b[i]);
        snprintf(answer, sizeof answer, "%0*llu", s->digits + 1, (unsigned long long)(a[i] + b[i]));
        reverse_in_place(ra), reverse_in_place(rb), reverse_in_place(answer);
        snprintf(prompt, sizeof prompt, "%s+%s=", ra, rb);
        json_t *value = json_string(answer);
        int w = 0;
        if (i < (size_t)s->n_heldout) {
            w = write_row(f[HELDOUT], prompt, "answer", value);
        } else if (i < (size_t)s->n_heldout + s->n_validation) {
            w = write_row(f[VALIDATION], prompt, "answer", value);
        } else {
            w = write_row(f[TRAIN], prompt, "answer", value);
            if (w == 0 && i - s->n_heldout - s->n_validation < (size_t)s->n_sft)
                w = write_row(f[SFT], prompt, "completion", json_string(answer));
        }
        if (w) {
            snprintf(err, err_len, "cannot write the data sets in %s", dir);
            goto out;
        }
    }
    rc = 0;
out:
    for (int k = 0; k < N_FILES; k++)
        if (f[k] && fclose(f[k]) != 0 && rc == 0) {
            snprintf(err, err_len, "cannot write %s", path[k]);
            rc = -1;
        }
    free(set.slots), free(a), free(b);
    return rc;
}

// shared/zmq_msg_parse.c — decoding the ZeroMQ channel's messages (zmsg_parse, zmsg_free; docs/protocol-zmq.md) with
// strict checks: an unknown type, an unknown / missing / mistyped field, an out-of-range value, or a frame count or
// byte size that disagrees with the header is refused with a message naming it. Encoding is shared/zmq_msg.c.
#include <float.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/err.h"
#include "shared/json_get.h"
#include "shared/json_read.h"
#include "shared/zmq_msg.h"
#include "shared/zmq_msg_internal.h"

#define ZMSG_HEADER_MAX (1u << 20)   // a JSON header is small; refuse a runaway frame 0 before parsing it

// ---- parsing helpers ---------------------------------------------------------------------------------
// Fields are read through shared/json_get.h with the message type as the document's name, so every message names
// the type and the field ("generate: field \"top_p\" must be in (0, 1], got 1.5"); null is a value here, of the
// wrong type wherever it is not allowed.

// Lowercase hex digits (2 * n) into n bytes; -1 on anything else.
static int hex_decode(const char *s, uint8_t *out, int n) {
    for (int i = 0; i < 2 * n; i++) {
        char c = s[i];
        int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (v < 0) return -1;
        if (i % 2 == 0) out[i / 2] = (uint8_t)(v << 4);
        else out[i / 2] |= (uint8_t)v;
    }
    return 0;
}

static int get_hash(const JsonAt *at, const char *key, uint64_t *out) {
    const char *s = NULL;
    int rc = json_get_string(at, key, JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, NULL);
    if (rc) return rc;
    if (zmsg_hash_from_hex(s, out))
        return json_get_fail(at, key, "must be 16 lowercase hex digits, got \"%.40s\"", s);
    return 0;
}

// A required array of exactly `want` elements (want < 0: any length up to max).
static int get_array(const JsonAt *at, const char *key, int want, int max, JsonAt *arr) {
    int rc = json_get_array(at, key, JSON_GET_REQUIRED, arr);
    if (rc) return rc;
    int len = (int)json_array_size(arr->json);
    if (want >= 0 && len != want) return json_get_fail(at, key, "has %d elements, expected %d", len, want);
    if (len > max) return json_get_fail(at, key, "has %d elements, at most %d allowed", len, max);
    return 0;
}

// A required array of exactly `want` integers in [lo, hi].
static int array_i64(const JsonAt *at, const char *key, int want, int64_t lo, int64_t hi, int64_t *out) {
    JsonAt arr;
    int rc = get_array(at, key, want, want, &arr);
    for (int i = 0; i < want && !rc; i++) {
        JsonAt element = json_at_element(&arr, (size_t)i);
        rc = json_get_int64(&element, NULL, JSON_GET_REQUIRED, 0, lo, hi, &out[i]);
    }
    return rc;
}

// Refuses keys the type does not define (a misspelt option must not be silently ignored).
static int check_keys(const JsonAt *at, const char *allowed) {
    const char *key;
    json_t *v;
    json_t *header = (json_t *)at->json;   // jansson's iteration takes a non-const object; nothing is changed
    json_object_foreach(header, key, v) {
        if (!strcmp(key, "type") || !strcmp(key, "id")) continue;
        size_t kl = strlen(key);
        int found = 0;
        for (const char *s = allowed; *s && !found;) {
            while (*s == ' ') s++;
            if (*s == '?') s++;
            const char *e = s;
            while (*e && *e != ' ') e++;
            if ((size_t)(e - s) == kl && !strncmp(s, key, kl)) found = 1;
            s = e;
        }
        if (!found) return err_fail(at->err, at->err_len, "%s: unknown field \"%.64s\"", at->doc, key);
    }
    return 0;
}

// Byte size of frame i must be exactly want.
static int frame_size(const JsonAt *at, const ZmsgFrame *f, int i, size_t want, const char *what) {
    if (f[i].size != want)
        return err_fail(at->err, at->err_len, "%s: frame %d (%s) has %zu bytes, expected %zu", at->doc, i, what,
                        f[i].size, want);
    return 0;
}

// ---- per-type parsing --------------------------------------------------------------------------------

static int parse_sampling(const JsonAt *at, ZmsgSampling *s) {
    double x;
    int64_t seed;
    int rc;
    zmsg_sampling_default(s);
    if ((rc = json_get_int(at, "n", JSON_GET_OPTIONAL, 1, 1, ZMSG_MAX_COMPLETIONS, &s->n))) return rc;
    if ((rc = json_get_int(at, "max_tokens", JSON_GET_OPTIONAL, 16, 1, INT32_MAX, &s->max_tokens))) return rc;
    if ((rc = json_get_double(at, "temperature", JSON_GET_OPTIONAL, 1.0, -DBL_MAX, DBL_MAX, &x))) return rc;
    // The engine samples with floats: a finite value beyond FLT_MAX would become inf, and a positive top_p or
    // repetition_penalty below the smallest float would become 0; both are out of range.
    if (x < 0) return json_get_fail(at, "temperature", "must be >= 0, got %g", x);
    if (x > FLT_MAX) return json_get_fail(at, "temperature", "must be at most %g, got %g", FLT_MAX, x);
    s->temperature = (float)x;
    if ((rc = json_get_double(at, "top_p", JSON_GET_OPTIONAL, 1.0, -DBL_MAX, DBL_MAX, &x))) return rc;
    if (!((float)x > 0 && x <= 1)) return json_get_fail(at, "top_p", "must be in (0, 1], got %g", x);
    s->top_p = (float)x;
    if ((rc = json_get_int(at, "top_k", JSON_GET_OPTIONAL, -1, -1, INT32_MAX, &s->top_k))) return rc;
    if ((rc = json_get_double(at, "min_p", JSON_GET_OPTIONAL, 0.0, -DBL_MAX, DBL_MAX, &x))) return rc;
    if (!(x >= 0 && x <= 1)) return json_get_fail(at, "min_p", "must be in [0, 1], got %g", x);
    s->min_p = (float)x;
    if ((rc = json_get_double(at, "repetition_penalty", JSON_GET_OPTIONAL, 1.0, -DBL_MAX, DBL_MAX, &x))) return rc;
    if (x > FLT_MAX) return json_get_fail(at, "repetition_penalty", "must be at most %g, got %g", FLT_MAX, x);
    if (!((float)x > 0)) return json_get_fail(at, "repetition_penalty", "must be > 0, got %g", x);
    s->repetition_penalty = (float)x;
    json_t *sv = json_object_get(at->json, "seed");
    if (sv && !json_is_null(sv)) {
        if ((rc = json_get_int64(at, "seed", JSON_GET_REQUIRED, 0, 0, INT64_MAX, &seed))) return rc;
        s->has_seed = 1;
        s->seed = (uint64_t)seed;
    }
    if (json_object_get(at->json, "stop_token_ids")) {
        JsonAt ids;
        if ((rc = get_array(at, "stop_token_ids", -1, ZMSG_MAX_STOP, &ids))) return rc;
        for (size_t i = 0; i < json_array_size(ids.json); i++) {
            JsonAt id = json_at_element(&ids, i);
            int token;
            if ((rc = json_get_int(&id, NULL, JSON_GET_REQUIRED, 0, 0, INT32_MAX, &token))) return rc;
            s->stop_token_ids[s->n_stop_token_ids++] = token;
        }
    }
    return json_get_bool(at, "ignore_eos", JSON_GET_OPTIONAL, 0, &s->ignore_eos);
}

static int parse_generate(const JsonAt *at, ZmsgMsg *m, const ZmsgFrame *f, int nf) {
    int rc;
    if ((rc = json_get_int(at, "n_prompts", JSON_GET_REQUIRED, 0, 1, ZMSG_MAX_PROMPTS, &m->n_prompts))) return rc;
    if ((rc = parse_sampling(at, &m->sampling))) return rc;
    if (nf != 1 + m->n_prompts)
        return err_fail(at->err, at->err_len, "generate: header says n_prompts %d, so %d frames are expected, got %d",
                    m->n_prompts, 1 + m->n_prompts, nf);
    m->prompts = calloc((size_t)m->n_prompts, sizeof *m->prompts);
    m->prompt_lens = calloc((size_t)m->n_prompts, sizeof *m->prompt_lens);
    if (!m->prompts || !m->prompt_lens) return err_fail(at->err, at->err_len, "generate: out of memory");
    for (int i = 0; i < m->n_prompts; i++) {
        const ZmsgFrame *fr = &f[1 + i];
        if (fr->size == 0 || fr->size % 4 || fr->size / 4 > INT32_MAX)
            return err_fail(at->err, at->err_len,
                        "generate: frame %d (prompt %d) has %zu bytes: expected a non-empty int32 array (a multiple "
                        "of 4 bytes)", 1 + i, i, fr->size);
        int len = (int)(fr->size / 4);
        // Copied: a frame's bytes carry no alignment guarantee, and the engine wants an int32 array.
        if (!(m->prompts[i] = malloc(fr->size))) return err_fail(at->err, at->err_len, "generate: out of memory");
        memcpy(m->prompts[i], fr->data, fr->size);
        m->prompt_lens[i] = len;
        for (int t = 0; t < len; t++)
            if (m->prompts[i][t] < 0)
                return err_fail(at->err, at->err_len, "generate: prompt %d token %d is %d: token ids must be >= 0", i,
                                t, m->prompts[i][t]);
    }
    return 0;
}

// "policy_version_changes": one array per completion of [token, version] pairs: from token index `token` on
// (increasing, in [1, its length)) the completion's tokens were sampled by `version`, which differs from the version
// before it (policy_versions[i] for the first); its last version is policy_versions_end[i].
static int parse_version_changes(const JsonAt *at, ZmsgMsg *m) {
    const int n = m->n_completions;
    JsonAt all;
    int rc = get_array(at, "policy_version_changes", n, n, &all);
    if (rc) return rc;
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        JsonAt c = json_at_element(&all, (size_t)i);
        if (!json_is_array(c.json)) return json_get_fail(&c, NULL, "must be an array of [token, version] pairs");
        total += json_array_size(c.json);
    }
    m->n_version_changes = calloc((size_t)n, sizeof *m->n_version_changes);
    m->version_changes = malloc((total ? total : 1) * sizeof *m->version_changes);
    if (!m->n_version_changes || !m->version_changes) return err_fail(at->err, at->err_len, "result: out of memory");
    ZmsgVersionChange *out = m->version_changes;
    for (int i = 0; i < n; i++) {
        JsonAt c = json_at_element(&all, (size_t)i);
        const int k_n = (int)json_array_size(c.json);
        int64_t before = m->policy_versions[i];
        int token = 0;
        for (int k = 0; k < k_n; k++, out++) {
            JsonAt pair = json_at_element(&c, (size_t)k);
            if (!json_is_array(pair.json) || json_array_size(pair.json) != 2)
                return json_get_fail(&pair, NULL, "must be a [token, version] pair");
            JsonAt t = json_at_element(&pair, 0), v = json_at_element(&pair, 1);
            if ((rc = json_get_int(&t, NULL, JSON_GET_REQUIRED, 0, token + 1, m->completion_lens[i] - 1, &token)) ||
                (rc = json_get_int64(&v, NULL, JSON_GET_REQUIRED, 0, INT64_MIN, INT64_MAX, &out->version)))
                return rc;
            if (out->version == before)
                return json_get_fail(&v, NULL, "must differ from the version before it (%lld)", (long long)before);
            out->token = token;
            before = out->version;
        }
        if (k_n > 0 && before != m->policy_versions_end[i])
            return json_get_fail(&c, NULL, "ends with version %lld, but policy_versions_end says %lld",
                                 (long long)before, (long long)m->policy_versions_end[i]);
        m->n_version_changes[i] = k_n;
    }
    return 0;
}

static int parse_result(const JsonAt *at, ZmsgMsg *m, const ZmsgFrame *f, int nf) {
    int rc;
    JsonAt reasons;
    if ((rc = json_get_int(at, "n_prompts", JSON_GET_REQUIRED, 0, 1, ZMSG_MAX_PROMPTS, &m->n_prompts))) return rc;
    if ((rc = json_get_int(at, "prompt_index", JSON_GET_REQUIRED, 0, 0, m->n_prompts - 1, &m->prompt_index)) ||
        (rc = json_get_int(at, "n", JSON_GET_REQUIRED, 0, 1, ZMSG_MAX_COMPLETIONS, &m->n_completions)) ||
        (rc = json_get_int(at, "prompt_tokens", JSON_GET_REQUIRED, 0, 0, INT32_MAX, &m->prompt_tokens)) ||
        (rc = json_get_int(at, "cached_tokens", JSON_GET_REQUIRED, 0, 0, m->prompt_tokens, &m->cached_tokens)))
        return rc;
    int n = m->n_completions;
    m->completion_lens = calloc((size_t)n, sizeof *m->completion_lens);
    m->finish_reasons = calloc((size_t)n, sizeof *m->finish_reasons);
    m->policy_versions = calloc((size_t)n, sizeof *m->policy_versions);
    m->policy_versions_end = calloc((size_t)n, sizeof *m->policy_versions_end);
    int64_t *lens = calloc((size_t)n, sizeof *lens);
    if (!m->completion_lens || !m->finish_reasons || !m->policy_versions || !m->policy_versions_end || !lens) {
        free(lens);
        return err_fail(at->err, at->err_len, "result: out of memory");
    }
    rc = array_i64(at, "completion_lens", n, 0, INT32_MAX, lens);
    size_t total = 0;
    for (int i = 0; i < n && !rc; i++) {
        m->completion_lens[i] = (int)lens[i];
        total += (size_t)lens[i];
    }
    free(lens);
    if (rc) return rc;
    if ((rc = array_i64(at, "policy_versions", n, INT64_MIN, INT64_MAX, m->policy_versions))) return rc;
    if ((rc = array_i64(at, "policy_versions_end", n, INT64_MIN, INT64_MAX, m->policy_versions_end))) return rc;
    if (json_object_get(at->json, "policy_version_changes") && (rc = parse_version_changes(at, m))) return rc;
    if ((rc = get_array(at, "finish_reasons", n, n, &reasons))) return rc;
    for (int i = 0; i < n; i++) {
        JsonAt reason = json_at_element(&reasons, (size_t)i);
        const char *s = json_string_value(reason.json);
        int k = -1;
        for (int j = 0; s && j <= ZMSG_FINISH_ERROR; j++)
            if (!strcmp(s, zmsg_finish_name((ZmsgFinish)j))) k = j;
        if (k < 0) return json_get_fail(&reason, NULL, "must be \"length\", \"stop\", \"abort\" or \"error\"");
        m->finish_reasons[i] = (ZmsgFinish)k;
    }
    if (nf != 3)
        return err_fail(at->err, at->err_len, "result: expected 3 frames (header, tokens, logprobs), got %d", nf);
    if ((rc = frame_size(at, f, 1, total * 4, "int32 completion tokens"))) return rc;
    if ((rc = frame_size(at, f, 2, total * 4, "float32 logprobs"))) return rc;
    m->tokens = malloc(total ? total * 4 : 4);
    m->logprobs = malloc(total ? total * 4 : 4);
    if (!m->tokens || !m->logprobs) return err_fail(at->err, at->err_len, "result: out of memory");
    if (total) {
        memcpy(m->tokens, f[1].data, total * 4);
        memcpy(m->logprobs, f[2].data, total * 4);
    }
    return 0;
}

static int parse_hello_reply(const JsonAt *at, ZmsgMsg *m) {
    int rc;
    const char *s;
    if ((rc = json_get_int(at, "protocol_version", JSON_GET_REQUIRED, 0, 1, INT32_MAX, &m->protocol_version)))
        return rc;
    if ((rc = json_get_string(at, "model_id", JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, NULL))) return rc;
    zmsg_copy_text_(m->model_id, sizeof m->model_id, s);
    if ((rc = get_hash(at, "layout_hash", &m->layout_hash))) return rc;
    if ((rc = json_get_int(at, "n_units", JSON_GET_REQUIRED, 0, 1, 1 << 20, &m->n_units))) return rc;
    if (!(m->unit_numel = calloc((size_t)m->n_units, sizeof *m->unit_numel)))
        return err_fail(at->err, at->err_len, "hello: out of memory");
    if ((rc = array_i64(at, "unit_numel", m->n_units, 1, INT64_MAX, m->unit_numel))) return rc;
    if ((rc = json_get_int64(at, "policy_version", JSON_GET_REQUIRED, 0, INT64_MIN, INT64_MAX, &m->policy_version)) ||
        (rc = json_get_int(at, "max_seq_len", JSON_GET_REQUIRED, 0, 1, INT32_MAX, &m->max_seq_len)))
        return rc;
    if ((rc = json_get_int(at, "vocab_size", JSON_GET_REQUIRED, 0, 1, INT32_MAX, &m->vocab_size))) return rc;
    return json_get_int(at, "tensor_parallel_size", JSON_GET_OPTIONAL, 1, 1, 1024, &m->tensor_parallel_size);
}

static int parse_stats_reply(const JsonAt *at, ZmsgStats *s) {
    struct {
        const char *k;
        int64_t *v;
    } ints[] = {
        {"requests_waiting", &s->requests_waiting}, {"requests_running", &s->requests_running},
        {"sequences_running", &s->sequences_running}, {"kv_blocks_total", &s->kv_blocks_total},
        {"kv_blocks_used", &s->kv_blocks_used}, {"kv_blocks_cached", &s->kv_blocks_cached},
        {"prompt_tokens_total", &s->prompt_tokens_total}, {"generation_tokens_total", &s->generation_tokens_total},
        {"cached_prompt_tokens_total", &s->cached_prompt_tokens_total}, {"preemptions_total", &s->preemptions_total},
        {"steps_total", &s->steps_total}, {"policy_version", &s->policy_version},
        {"prompts_in_flight", &s->prompts_in_flight},
    };
    int rc;
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        const int64_t min = ints[i].v == &s->policy_version ? INT64_MIN : 0;
        if ((rc = json_get_int64(at, ints[i].k, JSON_GET_REQUIRED, 0, min, INT64_MAX, ints[i].v))) return rc;
    }
    if ((rc = json_get_double(at, "step_seconds_sum", JSON_GET_REQUIRED, 0, -DBL_MAX, DBL_MAX, &s->step_seconds_sum)))
        return rc;
    return json_get_bool(at, "paused", JSON_GET_REQUIRED, 0, &s->paused);
}

// weights_begin's optional "adapter": rank, alpha, rsLoRA and the targeted modules (names are checked by the
// server, which knows them).
static int parse_adapter(const JsonAt *at, ZmsgMsg *m) {
    JsonAt a, targets;
    int rc = json_get_object(at, "adapter", JSON_GET_OPTIONAL, &a);
    if (rc || !a.json) return rc;
    m->has_adapter = 1;
    if ((rc = json_get_int(&a, "r", JSON_GET_REQUIRED, 0, 1, 1 << 16, &m->adapter_r)) ||
        (rc = json_get_double(&a, "lora_alpha", JSON_GET_REQUIRED, 0, 0, DBL_MAX, &m->adapter_alpha)) ||
        (rc = json_get_bool(&a, "use_rslora", JSON_GET_OPTIONAL, 0, &m->adapter_rslora)) ||
        (rc = json_get_array(&a, "target_modules", JSON_GET_REQUIRED, &targets)))
        return rc;
    if (!(m->adapter_alpha > 0)) return json_get_fail(&a, "lora_alpha", "must be > 0, got %g", m->adapter_alpha);
    const size_t n = json_array_size(targets.json);
    if (n == 0) return json_get_fail(&a, "target_modules", "names no module");
    size_t used = 0;
    for (size_t i = 0; i < n; i++) {
        const JsonAt e = json_at_element(&targets, i);
        if (!json_is_string(e.json))
            return json_get_fail(&a, "target_modules", "element %zu is %s, expected a module name", i,
                                 json_kind_name(e.json));
        const char *name = json_string_value(e.json);
        const int w = snprintf(m->adapter_targets + used, sizeof m->adapter_targets - used, "%s%s", i ? "," : "", name);
        if (w < 0 || (size_t)w >= sizeof m->adapter_targets - used || strchr(name, ','))
            return json_get_fail(&a, "target_modules", "is too long or holds a name with a comma");
        used += (size_t)w;
    }
    return 0;
}

// A required string of 1 .. cap - 1 bytes without NUL, copied into out.
static int get_text(const JsonAt *at, const char *key, char *out, size_t cap) {
    const char *s;
    size_t len;
    int rc = json_get_string(at, key, JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, &len);
    if (rc) return rc;
    if (len == 0 || len >= cap || memchr(s, 0, len))
        return json_get_fail(at, key, "must be a string of 1 to %zu bytes, got %zu", cap - 1, len);
    memcpy(out, s, len + 1);
    return 0;
}

// The weights_begin reply's "ipc" (transport ipc): where the trainer ranks write the update (ZmsgIpc).
static int parse_ipc(const JsonAt *at, ZmsgIpc *ipc) {
    JsonAt o, shards;
    const char *s;
    int rc = json_get_object(at, "ipc", JSON_GET_OPTIONAL, &o);
    if (rc || !o.json) return rc;
    ipc->present = 1;
    if ((rc = check_keys(&o, "host staging_id pid memory shards")) || (rc = get_text(&o, "host", ipc->host,
                                                                                      sizeof ipc->host)) ||
        (rc = get_hash(&o, "staging_id", &ipc->staging_id)) ||
        (rc = json_get_int64(&o, "pid", JSON_GET_REQUIRED, 0, 1, INT64_MAX, &ipc->pid)) ||
        (rc = json_get_string(&o, "memory", JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, NULL)))
        return rc;
    if (strcmp(s, "cuda") && strcmp(s, "shm"))
        return json_get_fail(&o, "memory", "must be \"cuda\" or \"shm\", got \"%.32s\"", s);
    ipc->cuda = !strcmp(s, "cuda");
    if ((rc = get_array(&o, "shards", -1, ZMSG_IPC_MAX_SHARDS, &shards))) return rc;
    ipc->n_shards = (int)json_array_size(shards.json);
    if (ipc->n_shards == 0) return json_get_fail(&o, "shards", "names no shard");
    for (int k = 0; k < ipc->n_shards; k++) {
        JsonAt e = json_at_element(&shards, (size_t)k);
        ZmsgIpcShard *sh = &ipc->shards[k];
        if (!json_is_object(e.json))
            return json_get_fail(&o, "shards", "element %d is %s, expected an object", k, json_kind_name(e.json));
        if ((rc = check_keys(&e, ipc->cuda ? "handle bytes device uuid" : "handle bytes")) ||
            (rc = get_text(&e, "handle", sh->handle, sizeof sh->handle)) ||
            (rc = json_get_int64(&e, "bytes", JSON_GET_REQUIRED, 0, 1, INT64_MAX, &sh->bytes)))
            return rc;
        if (ipc->cuda && ((rc = get_text(&e, "device", sh->device, sizeof sh->device)) ||
                          (rc = get_text(&e, "uuid", sh->uuid, sizeof sh->uuid))))
            return rc;
    }
    return 0;
}

static int parse_weights(const JsonAt *at, ZmsgMsg *m, const ZmsgFrame *f, int nf) {
    int rc;
    const char *s;
    if (m->type == ZMSG_WEIGHTS_SLICE) {
        if ((rc = json_get_int(at, "unit", JSON_GET_REQUIRED, 0, 0, INT32_MAX, &m->unit))) return rc;
        if ((rc = json_get_int64(at, "offset", JSON_GET_REQUIRED, 0, 0, INT64_MAX / 4, &m->offset))) return rc;
        if ((rc = json_get_int64(at, "count", JSON_GET_REQUIRED, 0, 1, INT64_MAX / 4, &m->count))) return rc;
        // Optional: the update this slice belongs to; with it, a peer other than the opener may send slices
        // (every ZeRO rank sends its own), see docs/protocol-zmq.md.
        m->has_version = json_object_get(at->json, "version") != NULL;
        if ((rc = json_get_int64(at, "version", JSON_GET_OPTIONAL, 0, INT64_MIN, INT64_MAX, &m->version)))
            return rc;
        if ((rc = json_get_string(at, "dtype", JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, NULL))) return rc;
        if (!strcmp(s, "f32")) m->dtype = ZMSG_DTYPE_F32;
        else if (!strcmp(s, "bf16")) m->dtype = ZMSG_DTYPE_BF16;
        else return json_get_fail(at, "dtype", "must be \"f32\" or \"bf16\", got \"%.32s\"", s);
        if (nf != 2)
            return err_fail(at->err, at->err_len, "weights_slice: expected 2 frames (header, data), got %d", nf);
        char what[48];
        snprintf(what, sizeof what, "%s slice data", zmsg_dtype_name(m->dtype));
        if ((rc = frame_size(at, f, 1, (size_t)m->count * zmsg_dtype_size(m->dtype), what))) return rc;
        m->slice_data = f[1].data;
        return 0;
    }
    if ((rc = json_get_int64(at, "version", JSON_GET_REQUIRED, 0, INT64_MIN, INT64_MAX, &m->version))) return rc;
    if (m->type == ZMSG_WEIGHTS_BEGIN && m->dir == ZMSG_DIR_REQUEST) {
        if ((rc = json_get_string(at, "transport", JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, NULL))) return rc;
        if (!strcmp(s, "zmq")) m->transport = ZMSG_TRANSPORT_ZMQ;
        else if (!strcmp(s, "nccl")) m->transport = ZMSG_TRANSPORT_NCCL;
        else if (!strcmp(s, "ipc")) m->transport = ZMSG_TRANSPORT_IPC;
        else return json_get_fail(at, "transport", "must be \"zmq\", \"nccl\" or \"ipc\", got \"%.32s\"", s);
        if ((rc = get_hash(at, "layout_hash", &m->layout_hash))) return rc;
        if ((rc = parse_adapter(at, m))) return rc;
        if (m->transport != ZMSG_TRANSPORT_IPC && json_object_get(at->json, "ipc_host"))
            return json_get_fail(at, "ipc_host", "belongs to transport \"ipc\", not \"%s\"",
                                 zmsg_transport_name(m->transport));
        if (m->transport == ZMSG_TRANSPORT_IPC)
            return (rc = get_text(at, "ipc_host", m->ipc_host, sizeof m->ipc_host))
                       ? rc
                       : json_get_int(at, "tensor_parallel_size", JSON_GET_OPTIONAL, 1, 1, ZMSG_IPC_MAX_SHARDS,
                                      &m->tensor_parallel_size);
        if (m->transport != ZMSG_TRANSPORT_NCCL) return 0;
        if ((rc = json_get_int(at, "trainer_ranks", JSON_GET_REQUIRED, 0, 1, 1 << 20, &m->trainer_ranks)) ||
            (rc = json_get_int(at, "nccl_world", JSON_GET_REQUIRED, 0, m->trainer_ranks + 1, 1 << 20,
                               &m->nccl_world)) ||
            (rc = json_get_int(at, "nccl_rank", JSON_GET_REQUIRED, 0, m->trainer_ranks, m->nccl_world - 1,
                               &m->nccl_rank)))
            return rc;
        if ((rc = json_get_int(at, "tensor_parallel_size", JSON_GET_OPTIONAL, 1, 1, 1024, &m->tensor_parallel_size)))
            return rc;
        if (m->nccl_rank + m->tensor_parallel_size > m->nccl_world)
            return json_get_fail(at, "tensor_parallel_size", "%d shards from member %d do not fit in nccl_world %d",
                                 m->tensor_parallel_size, m->nccl_rank, m->nccl_world);
        if ((rc = json_get_string(at, "comm_backend", JSON_GET_OPTIONAL, "nccl", JSON_ANY_LENGTH, &s, NULL))) return rc;
        if (!strcmp(s, "host")) m->comm_backend = ZMSG_COMM_HOST;
        else if (!strcmp(s, "nccl")) m->comm_backend = ZMSG_COMM_NCCL;
        else return json_get_fail(at, "comm_backend", "must be \"nccl\" or \"host\", got \"%.32s\"", s);
        if ((rc = json_get_string(at, "nccl_id", JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, NULL))) return rc;
        if (strlen(s) != 2 * ZMSG_NCCL_ID_BYTES || hex_decode(s, m->nccl_id, ZMSG_NCCL_ID_BYTES) != 0)
            return json_get_fail(at, "nccl_id", "must be %d lowercase hex digits", 2 * ZMSG_NCCL_ID_BYTES);
        return 0;
    }
    if (m->type == ZMSG_WEIGHTS_BEGIN) return parse_ipc(at, &m->ipc);   // the reply
    if (m->type == ZMSG_WEIGHTS_END && m->dir == ZMSG_DIR_REQUEST) {
        if ((rc = json_get_string(at, "mode", JSON_GET_OPTIONAL, NULL, JSON_ANY_LENGTH, &s, NULL))) return rc;
        if (!s) return 0;
        m->has_update_mode = 1;
        for (int k = ZMSG_UPDATE_KEEP; k <= ZMSG_UPDATE_KEEP_KV; k++)
            if (!strcmp(s, zmsg_update_mode_name((ZmsgUpdateMode)k))) {
                m->update_mode = (ZmsgUpdateMode)k;
                return 0;
            }
        return json_get_fail(at, "mode", "must be \"keep\", \"abort\" or \"keep_kv\", got \"%.32s\"", s);
    }
    if (m->type == ZMSG_WEIGHTS_END && m->dir == ZMSG_DIR_REPLY) {
        if ((rc = json_get_double(at, "seconds", JSON_GET_REQUIRED, 0, -DBL_MAX, DBL_MAX, &m->seconds)) ||
            (rc = json_get_double(at, "commit_seconds", JSON_GET_REQUIRED, 0, -DBL_MAX, DBL_MAX, &m->commit_seconds)))
            return rc;
        const int kept = json_object_get(at->json, "sequences_kept") != NULL;
        if (kept != (json_object_get(at->json, "sequences_requeued") != NULL))
            return err_fail(at->err, at->err_len, "weights_end: \"sequences_kept\" and \"sequences_requeued\" come "
                            "together");
        if (!kept) return 0;
        m->has_update_report = 1;
        if ((rc = json_get_int64(at, "sequences_kept", JSON_GET_REQUIRED, 0, 0, INT64_MAX, &m->sequences_kept)))
            return rc;
        return json_get_int64(at, "sequences_requeued", JSON_GET_REQUIRED, 0, 0, INT64_MAX, &m->sequences_requeued);
    }
    return 0;
}

int zmsg_parse(ZmsgMsg *m, ZmsgDir dir, const ZmsgFrame *f, int nf, char *err, size_t err_len) {
    memset(m, 0, sizeof *m);
    m->id = -1;
    m->dir = dir;
    if (nf < 1 || !f) return err_fail(err, err_len, "empty message: frame 0 must be a JSON header");
    if (f[0].size > ZMSG_HEADER_MAX)
        return err_fail(err, err_len, "frame 0 (JSON header) has %zu bytes, more than the %u allowed", f[0].size,
                    ZMSG_HEADER_MAX);
    json_error_t je;
    json_t *h = json_read_buffer(f[0].data, f[0].size, JSON_REJECT_DUPLICATES, &je);
    if (!h)
        return err_fail(err, err_len, "frame 0 is not valid JSON: %s (line %d, column %d)", je.text, je.line, je.column);
    JsonAt at = json_at_document(h, "message", 0, -1, err, err_len);
    int rc = -1;
    if (!json_is_object(h)) {
        err_fail(err, err_len, "frame 0 must be a JSON object with \"type\" and \"id\"");
        goto done;
    }
    json_t *jid = json_object_get(h, "id");
    if (json_is_integer(jid) && json_integer_value(jid) >= 0) m->id = json_integer_value(jid);
    json_t *jt = json_object_get(h, "type");
    if (!json_is_string(jt)) {
        err_fail(err, err_len, "header: field \"type\" %s", jt ? "must be a string" : "is missing");
        goto done;
    }
    int t = -1;
    for (int i = 0; i < ZMSG_N_TYPES; i++)
        if (!strcmp(json_string_value(jt), zmsg_type_name((ZmsgType)i))) t = i;
    if (t < 0) {
        err_fail(err, err_len, "unknown message type \"%.64s\"", json_string_value(jt));
        goto done;
    }
    m->type = (ZmsgType)t;
    at.doc = zmsg_type_name((ZmsgType)t);
    const char *keys = zmsg_keys_((ZmsgType)t, dir);
    if (!keys) {
        err_fail(err, err_len, "message type \"%s\" is not valid as a %s", at.doc,
             dir == ZMSG_DIR_REQUEST ? "request" : "reply");
        goto done;
    }
    // The id: a non-negative integer; an error reply may carry null (its request had none we could read).
    if (!(json_is_integer(jid) && json_integer_value(jid) >= 0) && !(t == ZMSG_ERROR && json_is_null(jid))) {
        err_fail(err, err_len, "%s: field \"id\" %s", at.doc, jid ? "must be an integer >= 0" : "is missing");
        goto done;
    }
    if ((rc = check_keys(&at, keys))) goto done;
    m->owned_ = 1;
    switch (m->type) {
    case ZMSG_HELLO:
        rc = dir == ZMSG_DIR_REQUEST ? json_get_int(&at, "protocol_version", JSON_GET_OPTIONAL, 0, 1, INT32_MAX,
                                                    &m->protocol_version)
                                     : parse_hello_reply(&at, m);
        break;
    case ZMSG_GENERATE: rc = parse_generate(&at, m, f, nf); break;
    case ZMSG_RESULT: rc = parse_result(&at, m, f, nf); break;
    case ZMSG_STATS: rc = dir == ZMSG_DIR_REPLY ? parse_stats_reply(&at, &m->stats) : 0; break;
    case ZMSG_WEIGHTS_BEGIN:
    case ZMSG_WEIGHTS_SLICE:
    case ZMSG_WEIGHTS_END: rc = parse_weights(&at, m, f, nf); break;
    case ZMSG_ERROR: {
        const char *s;
        if ((rc = json_get_string(&at, "code", JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, NULL))) break;
        zmsg_copy_text_(m->code, sizeof m->code, s);
        if ((rc = json_get_string(&at, "message", JSON_GET_REQUIRED, NULL, JSON_ANY_LENGTH, &s, NULL))) break;
        zmsg_copy_text_(m->message, sizeof m->message, s);
        break;
    }
    default: rc = 0; break;
    }
    // Types without data frames must come alone (those with frames checked their count above).
    if (rc == 0 && m->type != ZMSG_GENERATE && m->type != ZMSG_RESULT && m->type != ZMSG_WEIGHTS_SLICE && nf != 1)
        rc = err_fail(err, err_len, "%s: expected 1 frame (the header), got %d", at.doc, nf);
done:
    json_decref(h);
    if (rc) {
        int64_t id = m->id;
        zmsg_free(m);
        m->id = id;
        return -1;
    }
    return 0;
}

void zmsg_free(ZmsgMsg *m) {
    if (!m) return;
    if (m->owned_) {
        for (int i = 0; m->prompts && i < m->n_prompts; i++) free(m->prompts[i]);
        free(m->prompts);
        free(m->prompt_lens);
        free(m->unit_numel);
        free(m->completion_lens);
        free(m->finish_reasons);
        free(m->policy_versions);
        free(m->policy_versions_end);
        free(m->n_version_changes);
        free(m->version_changes);
        free(m->tokens);
        free(m->logprobs);
    }
    ZmsgType t = m->type;
    ZmsgDir d = m->dir;
    memset(m, 0, sizeof *m);
    m->type = t;
    m->dir = d;
    m->id = -1;
}

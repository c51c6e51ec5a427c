// shared/zmq_msg.c — the ZeroMQ channel's messages (docs/protocol-zmq.md): names, defaults, the header keys of each
// type, and encoding (zmsg_build). Decoding, with its strict checks, is shared/zmq_msg_parse.c.
#include "shared/zmq_msg.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shared/err.h"
#include "shared/zmq_msg_internal.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "zmq_msg frames are little-endian arrays copied as they are: a big-endian host needs byte swapping"
#endif

static const char *const TYPE_NAMES[ZMSG_N_TYPES] = {
    "hello", "generate", "result", "pause", "resume", "reset_cache", "stats", "shutdown",
    "weights_begin", "weights_slice", "weights_end", "error",
};
static const char *const FINISH_NAMES[] = {"length", "stop", "abort", "error"};

// Header keys allowed besides "type" and "id", per type, for requests and for replies (zmsg_keys_).
static const char *const KEYS_REQ[ZMSG_N_TYPES] = {
    [ZMSG_HELLO] = "?protocol_version",
    [ZMSG_GENERATE] = "n_prompts ?n ?max_tokens ?temperature ?top_p ?top_k ?min_p ?repetition_penalty ?seed "
                      "?stop_token_ids ?ignore_eos",
    [ZMSG_PAUSE] = "", [ZMSG_RESUME] = "", [ZMSG_RESET_CACHE] = "", [ZMSG_STATS] = "", [ZMSG_SHUTDOWN] = "",
    [ZMSG_WEIGHTS_BEGIN] = "version transport layout_hash ?nccl_id ?nccl_world ?nccl_rank ?trainer_ranks ?comm_backend "
                           "?tensor_parallel_size ?adapter ?ipc_host",
    [ZMSG_WEIGHTS_SLICE] = "unit offset count dtype ?version",
    [ZMSG_WEIGHTS_END] = "version ?mode",
};
static const char *const KEYS_REP[ZMSG_N_TYPES] = {
    [ZMSG_HELLO] = "protocol_version model_id layout_hash n_units unit_numel policy_version max_seq_len vocab_size "
                   "?tensor_parallel_size",
    [ZMSG_RESULT] = "prompt_index n_prompts n completion_lens finish_reasons policy_versions policy_versions_end "
                    "prompt_tokens cached_tokens ?policy_version_changes",
    [ZMSG_PAUSE] = "", [ZMSG_RESUME] = "", [ZMSG_RESET_CACHE] = "", [ZMSG_SHUTDOWN] = "",
    [ZMSG_STATS] = "requests_waiting requests_running sequences_running kv_blocks_total kv_blocks_used "
                   "kv_blocks_cached prompt_tokens_total generation_tokens_total cached_prompt_tokens_total "
                   "preemptions_total steps_total step_seconds_sum policy_version paused prompts_in_flight",
    [ZMSG_WEIGHTS_BEGIN] = "version ?ipc",
    [ZMSG_WEIGHTS_END] = "version seconds commit_seconds ?sequences_kept ?sequences_requeued",
    [ZMSG_ERROR] = "code message",
};

const char *zmsg_keys_(ZmsgType t, ZmsgDir d) {
    if (t < 0 || t >= ZMSG_N_TYPES) return NULL;
    return d == ZMSG_DIR_REQUEST ? KEYS_REQ[t] : KEYS_REP[t];
}

const char *zmsg_type_name(ZmsgType t) { return (t >= 0 && t < ZMSG_N_TYPES) ? TYPE_NAMES[t] : NULL; }
const char *zmsg_finish_name(ZmsgFinish f) { return (f >= 0 && f <= ZMSG_FINISH_ERROR) ? FINISH_NAMES[f] : "?"; }
const char *zmsg_transport_name(ZmsgTransport t) {
    return t == ZMSG_TRANSPORT_NCCL ? "nccl" : t == ZMSG_TRANSPORT_IPC ? "ipc" : "zmq";
}
const char *zmsg_dtype_name(ZmsgDtype d) { return d == ZMSG_DTYPE_BF16 ? "bf16" : "f32"; }
size_t zmsg_dtype_size(ZmsgDtype d) { return d == ZMSG_DTYPE_BF16 ? 2 : 4; }
static const char *const UPDATE_MODE_NAMES[] = {"keep", "abort", "keep_kv"};
const char *zmsg_update_mode_name(ZmsgUpdateMode u) {
    return (u >= ZMSG_UPDATE_KEEP && u <= ZMSG_UPDATE_KEEP_KV) ? UPDATE_MODE_NAMES[u] : "?";
}

void zmsg_sampling_default(ZmsgSampling *s) {
    memset(s, 0, sizeof *s);
    s->n = 1;
    s->max_tokens = 16;
    s->temperature = 1.0f;
    s->top_p = 1.0f;
    s->top_k = -1;
    s->repetition_penalty = 1.0f;
}

void zmsg_init(ZmsgMsg *m, ZmsgType type, ZmsgDir dir, int64_t id) {
    memset(m, 0, sizeof *m);
    m->type = type;
    m->dir = dir;
    m->id = id;
    zmsg_sampling_default(&m->sampling);
}

// (shared/zmq_msg_internal.h)
void zmsg_copy_text_(char *dst, size_t cap, const char *src) {
    size_t n = strlen(src);
    if (n >= cap) {
        n = cap - 1;
        // src[n] is the first byte left out: while it continues a character (its top two bits are 10), leave that
        // character out too (a character has at most 3 continuation bytes).
        for (int k = 0; k < 3 && n > 0 && ((unsigned char)src[n] & 0xC0) == 0x80; k++) n--;
    }
    memcpy(dst, src, n);
    dst[n] = '\0';
}

void zmsg_error(ZmsgMsg *m, int64_t id, const char *code, const char *message) {
    zmsg_init(m, ZMSG_ERROR, ZMSG_DIR_REPLY, id);
    zmsg_copy_text_(m->code, sizeof m->code, code ? code : "error");
    zmsg_copy_text_(m->message, sizeof m->message, message ? message : "");
}

void zmsg_hash_to_hex(uint64_t h, char out[17]) { snprintf(out, 17, "%016llx", (unsigned long long)h); }

int zmsg_hash_from_hex(const char *s, uint64_t *h) {
    if (!s || strlen(s) != 16) return -1;
    uint64_t v = 0;
    for (int i = 0; i < 16; i++) {
        char c = s[i];
        int d = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = (v << 4) | (uint64_t)d;
    }
    *h = v;
    return 0;
}

// ---- building ----------------------------------------------------------------------------------------

static void set_i(json_t *h, const char *k, int64_t v) { json_object_set_new(h, k, json_integer(v)); }
static void set_r(json_t *h, const char *k, double v) { json_object_set_new(h, k, json_real(isfinite(v) ? v : 0.0)); }

// jansson refuses invalid UTF-8; text that quotes a peer's bytes or a folder name must still produce a message.
static json_t *utf8_or(const char *s, const char *fallback) {
    json_t *v = json_string(s);
    return v ? v : json_string(fallback);
}

static json_t *i64_array(const int64_t *v, int n) {
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_integer(v[i]));
    return a;
}

// The weights_begin reply's "ipc" object (transport ipc). Returns 0, or -1 for a shard count out of range.
static int build_ipc(json_t *h, const ZmsgIpc *ipc) {
    if (ipc->n_shards < 1 || ipc->n_shards > ZMSG_IPC_MAX_SHARDS) return -1;
    json_t *o = json_object(), *shards = json_array();
    char hex[17];
    json_object_set_new(o, "host", json_string(ipc->host));
    zmsg_hash_to_hex(ipc->staging_id, hex);
    json_object_set_new(o, "staging_id", json_string(hex));
    set_i(o, "pid", ipc->pid);
    json_object_set_new(o, "memory", json_string(ipc->cuda ? "cuda" : "shm"));
    for (int k = 0; k < ipc->n_shards; k++) {
        const ZmsgIpcShard *sh = &ipc->shards[k];
        json_t *one = json_object();
        json_object_set_new(one, "handle", json_string(sh->handle));
        set_i(one, "bytes", sh->bytes);
        if (ipc->cuda) {
            json_object_set_new(one, "device", json_string(sh->device));
            json_object_set_new(one, "uuid", json_string(sh->uuid));
        }
        json_array_append_new(shards, one);
    }
    json_object_set_new(o, "shards", shards);
    json_object_set_new(h, "ipc", o);
    return 0;
}

int zmsg_build(const ZmsgMsg *m, ZmsgOut *out, char *err, size_t err_len) {
    memset(out, 0, sizeof *out);
    const char *tname = zmsg_type_name(m->type);
    if (!tname) return err_fail(err, err_len, "zmsg_build: invalid message type %d", (int)m->type);
    const char *keys = zmsg_keys_(m->type, m->dir);
    if (!keys) return err_fail(err, err_len, "zmsg_build: \"%s\" is not valid as a %s", tname,
                           m->dir == ZMSG_DIR_REQUEST ? "request" : "reply");
    if (m->id < 0 && m->type != ZMSG_ERROR) return err_fail(err, err_len, "zmsg_build: %s: id must be >= 0", tname);
    int req = m->dir == ZMSG_DIR_REQUEST;
    int n_frames = 1;
    ZmsgFrame data[2] = {{0}};   // the data frames of result / weights_slice (generate's come from prompts)
    json_t *h = json_object();
    json_object_set_new(h, "type", json_string(tname));
    json_object_set_new(h, "id", m->id >= 0 ? json_integer(m->id) : json_null());
    char hex[17];
    switch (m->type) {
    case ZMSG_HELLO:
        if (req) {
            if (m->protocol_version > 0) set_i(h, "protocol_version", m->protocol_version);
            break;
        }
        if (m->n_units < 1 || !m->unit_numel) goto bad_units;
        set_i(h, "protocol_version", m->protocol_version > 0 ? m->protocol_version : ZMSG_PROTOCOL_VERSION);
        json_object_set_new(h, "model_id", utf8_or(m->model_id, "(model id was not valid UTF-8)"));
        zmsg_hash_to_hex(m->layout_hash, hex);
        json_object_set_new(h, "layout_hash", json_string(hex));
        set_i(h, "n_units", m->n_units);
        json_object_set_new(h, "unit_numel", i64_array(m->unit_numel, m->n_units));
        set_i(h, "policy_version", m->policy_version);
        set_i(h, "max_seq_len", m->max_seq_len);
        set_i(h, "vocab_size", m->vocab_size);
        if (m->tensor_parallel_size > 1) set_i(h, "tensor_parallel_size", m->tensor_parallel_size);
        break;
    case ZMSG_GENERATE: {
        const ZmsgSampling *s = &m->sampling;
        if (m->n_prompts < 1 || m->n_prompts > ZMSG_MAX_PROMPTS || !m->prompts || !m->prompt_lens) {
            json_decref(h);
            return err_fail(err, err_len, "zmsg_build: generate needs 1..%d prompts", ZMSG_MAX_PROMPTS);
        }
        for (int i = 0; i < m->n_prompts; i++)
            if (m->prompt_lens[i] < 1 || !m->prompts[i]) {
                json_decref(h);
                return err_fail(err, err_len, "zmsg_build: generate prompt %d is empty", i);
            }
        if (s->n_stop_token_ids < 0 || s->n_stop_token_ids > ZMSG_MAX_STOP) {
            json_decref(h);
            return err_fail(err, err_len, "zmsg_build: generate has %d stop_token_ids, at most %d", s->n_stop_token_ids,
                        ZMSG_MAX_STOP);
        }
        set_i(h, "n_prompts", m->n_prompts);
        set_i(h, "n", s->n);
        set_i(h, "max_tokens", s->max_tokens);
        set_r(h, "temperature", s->temperature);
        set_r(h, "top_p", s->top_p);
        set_i(h, "top_k", s->top_k);
        set_r(h, "min_p", s->min_p);
        set_r(h, "repetition_penalty", s->repetition_penalty);
        json_object_set_new(h, "seed", s->has_seed ? json_integer((json_int_t)s->seed) : json_null());
        json_t *st = json_array();
        for (int i = 0; i < s->n_stop_token_ids; i++) json_array_append_new(st, json_integer(s->stop_token_ids[i]));
        json_object_set_new(h, "stop_token_ids", st);
        json_object_set_new(h, "ignore_eos", json_boolean(s->ignore_eos));
        n_frames = 1 + m->n_prompts;
        break;
    }
    case ZMSG_RESULT: {
        int n = m->n_completions;
        if (n < 1 || !m->completion_lens || !m->finish_reasons || !m->policy_versions || !m->policy_versions_end) {
            json_decref(h);
            return err_fail(err, err_len, "zmsg_build: result needs n >= 1 and its per-completion arrays");
        }
        size_t total = 0;
        json_t *lens = json_array(), *fin = json_array();
        for (int i = 0; i < n; i++) {
            total += (size_t)(m->completion_lens[i] > 0 ? m->completion_lens[i] : 0);
            json_array_append_new(lens, json_integer(m->completion_lens[i]));
            json_array_append_new(fin, json_string(zmsg_finish_name(m->finish_reasons[i])));
        }
        set_i(h, "prompt_index", m->prompt_index);
        set_i(h, "n_prompts", m->n_prompts);
        set_i(h, "n", n);
        json_object_set_new(h, "completion_lens", lens);
        json_object_set_new(h, "finish_reasons", fin);
        json_object_set_new(h, "policy_versions", i64_array(m->policy_versions, n));
        json_object_set_new(h, "policy_versions_end", i64_array(m->policy_versions_end, n));
        set_i(h, "prompt_tokens", m->prompt_tokens);
        set_i(h, "cached_tokens", m->cached_tokens);
        size_t n_changes = 0;
        for (int i = 0; m->n_version_changes && i < n; i++) n_changes += (size_t)m->n_version_changes[i];
        if (n_changes && !m->version_changes) {
            json_decref(h);
            return err_fail(err, err_len, "zmsg_build: result has %zu version changes but no array", n_changes);
        }
        if (n_changes) { // only then: a result without changes reads as before for peers that predate the field
            json_t *all = json_array();
            const ZmsgVersionChange *c = m->version_changes;
            for (int i = 0; i < n; i++) {
                json_t *one = json_array();
                for (int k = 0; k < m->n_version_changes[i]; k++, c++)
                    json_array_append_new(one, json_pack("[iI]", (int)c->token, (json_int_t)c->version));
                json_array_append_new(all, one);
            }
            json_object_set_new(h, "policy_version_changes", all);
        }
        if (total && (!m->tokens || !m->logprobs)) {
            json_decref(h);
            return err_fail(err, err_len, "zmsg_build: result has %zu tokens but no token / logprob array", total);
        }
        data[0] = (ZmsgFrame){m->tokens ? (const void *)m->tokens : "", total * 4};
        data[1] = (ZmsgFrame){m->logprobs ? (const void *)m->logprobs : "", total * 4};
        n_frames = 3;
        break;
    }
    case ZMSG_STATS:
        if (req) break;
        set_i(h, "requests_waiting", m->stats.requests_waiting);
        set_i(h, "requests_running", m->stats.requests_running);
        set_i(h, "sequences_running", m->stats.sequences_running);
        set_i(h, "kv_blocks_total", m->stats.kv_blocks_total);
        set_i(h, "kv_blocks_used", m->stats.kv_blocks_used);
        set_i(h, "kv_blocks_cached", m->stats.kv_blocks_cached);
        set_i(h, "prompt_tokens_total", m->stats.prompt_tokens_total);
        set_i(h, "generation_tokens_total", m->stats.generation_tokens_total);
        set_i(h, "cached_prompt_tokens_total", m->stats.cached_prompt_tokens_total);
        set_i(h, "preemptions_total", m->stats.preemptions_total);
        set_i(h, "steps_total", m->stats.steps_total);
        set_r(h, "step_seconds_sum", m->stats.step_seconds_sum);
        set_i(h, "policy_version", m->stats.policy_version);
        json_object_set_new(h, "paused", json_boolean(m->stats.paused));
        set_i(h, "prompts_in_flight", m->stats.prompts_in_flight);
        break;
    case ZMSG_WEIGHTS_BEGIN:
        set_i(h, "version", m->version);
        if (!req) {
            if (m->ipc.present && build_ipc(h, &m->ipc) != 0) {
                json_decref(h);
                return err_fail(err, err_len, "zmsg_build: weights_begin reply: \"ipc\" needs 1..%d shards",
                                ZMSG_IPC_MAX_SHARDS);
            }
            break;
        }
        json_object_set_new(h, "transport", json_string(zmsg_transport_name(m->transport)));
        if (m->transport == ZMSG_TRANSPORT_IPC) {
            json_object_set_new(h, "ipc_host", json_string(m->ipc_host));
            if (m->tensor_parallel_size > 1) set_i(h, "tensor_parallel_size", m->tensor_parallel_size);
        }
        zmsg_hash_to_hex(m->layout_hash, hex);
        json_object_set_new(h, "layout_hash", json_string(hex));
        if (m->transport == ZMSG_TRANSPORT_NCCL) {
            char idhex[2 * ZMSG_NCCL_ID_BYTES + 1];
            for (int i = 0; i < ZMSG_NCCL_ID_BYTES; i++) snprintf(idhex + 2 * i, 3, "%02x", m->nccl_id[i]);
            json_object_set_new(h, "nccl_id", json_string(idhex));
            set_i(h, "nccl_world", m->nccl_world);
            set_i(h, "nccl_rank", m->nccl_rank);
            set_i(h, "trainer_ranks", m->trainer_ranks);
            if (m->comm_backend == ZMSG_COMM_HOST) json_object_set_new(h, "comm_backend", json_string("host"));
            if (m->tensor_parallel_size > 1) set_i(h, "tensor_parallel_size", m->tensor_parallel_size);
        }
        if (m->has_adapter) {
            json_t *a = json_object(), *targets = json_array();
            set_i(a, "r", m->adapter_r);
            json_object_set_new(a, "lora_alpha", json_real(m->adapter_alpha));
            json_object_set_new(a, "use_rslora", json_boolean(m->adapter_rslora));
            for (const char *p = m->adapter_targets; *p;) {
                const char *end = strchr(p, ',');
                size_t n = end ? (size_t)(end - p) : strlen(p);
                json_array_append_new(targets, json_stringn(p, n));
                p += n + (end != NULL);
            }
            json_object_set_new(a, "target_modules", targets);
            json_object_set_new(h, "adapter", a);
        }
        break;
    case ZMSG_WEIGHTS_SLICE:
        if (m->count < 1 || m->offset < 0 || m->unit < 0 || !m->slice_data) {
            json_decref(h);
            return err_fail(err, err_len, "zmsg_build: weights_slice needs unit >= 0, offset >= 0, count >= 1 and data");
        }
        set_i(h, "unit", m->unit);
        set_i(h, "offset", m->offset);
        set_i(h, "count", m->count);
        json_object_set_new(h, "dtype", json_string(zmsg_dtype_name(m->dtype)));
        if (m->has_version) set_i(h, "version", m->version);
        data[0] = (ZmsgFrame){m->slice_data, (size_t)m->count * zmsg_dtype_size(m->dtype)};
        n_frames = 2;
        break;
    case ZMSG_WEIGHTS_END:
        set_i(h, "version", m->version);
        if (req) {
            if (m->has_update_mode) json_object_set_new(h, "mode", json_string(zmsg_update_mode_name(m->update_mode)));
            break;
        }
        set_r(h, "seconds", m->seconds);
        set_r(h, "commit_seconds", m->commit_seconds);
        if (m->has_update_report) {
            set_i(h, "sequences_kept", m->sequences_kept);
            set_i(h, "sequences_requeued", m->sequences_requeued);
        }
        break;
    case ZMSG_ERROR:
        json_object_set_new(h, "code", utf8_or(m->code, "error"));
        json_object_set_new(h, "message", utf8_or(m->message, "(message was not valid UTF-8)"));
        break;
    default: break;
    }
    out->header = json_dumps(h, JSON_COMPACT);
    json_decref(h);
    out->frames = calloc((size_t)n_frames, sizeof *out->frames);
    if (!out->header || !out->frames) {
        zmsg_out_free(out);
        return err_fail(err, err_len, "zmsg_build: out of memory");
    }
    out->header_len = strlen(out->header);
    out->frames[0] = (ZmsgFrame){out->header, out->header_len};
    out->n_frames = n_frames;
    if (m->type == ZMSG_GENERATE)
        for (int i = 0; i < m->n_prompts; i++)
            out->frames[1 + i] = (ZmsgFrame){m->prompts[i], (size_t)m->prompt_lens[i] * 4};
    else
        for (int i = 1; i < n_frames; i++) out->frames[i] = data[i - 1];
    return 0;
bad_units:
    json_decref(h);
    return err_fail(err, err_len, "zmsg_build: hello reply needs n_units >= 1 and unit_numel");
}

void zmsg_out_free(ZmsgOut *out) {
    if (!out) return;
    free(out->header);
    free(out->frames);
    memset(out, 0, sizeof *out);
}

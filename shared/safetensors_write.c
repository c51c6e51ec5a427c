// shared/safetensors_write.c — safetensors writer: one file or shards plus index, HF-loadable.
//
// Layout of each file, as the reference serializer writes it: u64 little-endian header length, the JSON header
// {"__metadata__": {"format": "pt"}, tensors...} padded with spaces so that the data section starts on an 8-byte
// boundary, then the tensors' bytes back to back in header order. "format": "pt" is what transformers'
// from_pretrained checks for before it trusts a safetensors checkpoint.
#include "shared/err.h"
#include "shared/safetensors.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "shared/dtype.h"

#define CONVERT_CHUNK 16384   // elements converted per fwrite

typedef struct {
    char *name;
    StDtype dtype;       // stored dtype
    StDtype src_dtype;   // dtype of `data`
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    uint64_t numel;
    uint64_t nbytes;     // stored bytes
    const void *data;
    int shard;           // assigned by st_writer_write
    uint64_t begin;      // offset inside its shard's data section
} WTensor;

struct StWriter {
    WTensor *tensors;
    size_t n, cap;
};

int st_writer_create(StWriter **out, char *err, size_t err_len) {
    *out = calloc(1, sizeof(StWriter));
    return *out ? 0 : err_fail_code(ST_ERR_NOMEM, err, err_len, "safetensors writer: out of memory");
}

void st_writer_free(StWriter *w) {
    if (!w) return;
    for (size_t i = 0; i < w->n; i++) free(w->tensors[i].name);
    free(w->tensors);
    free(w);
}

static int storable(StDtype d) { return d == ST_F32 || d == ST_BF16 || d == ST_F16; }

int st_writer_add(StWriter *w, const char *name, StDtype dtype, int ndim, const int64_t *shape, const void *data,
                  StDtype src_dtype, char *err, size_t err_len) {
    if (!name || !name[0] || strcmp(name, "__metadata__") == 0)
        return err_fail_code(ST_ERR_INVALID, err, err_len, "safetensors writer: invalid tensor name \"%s\"", name ? name : "");
    if (!storable(dtype) || !storable(src_dtype))
        return err_fail_code(ST_ERR_INVALID, err, err_len, "safetensors writer: tensor \"%s\": dtype %s from %s is not "
                    "supported (F32, BF16, F16)", name, st_dtype_name(dtype), st_dtype_name(src_dtype));
    if (ndim < 0 || ndim > ST_MAX_DIMS)
        return err_fail_code(ST_ERR_INVALID, err, err_len, "safetensors writer: tensor \"%s\": %d dims", name, ndim);
    uint64_t numel = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0 || __builtin_mul_overflow(numel, (uint64_t)shape[d], &numel) || numel > (UINT64_MAX >> 3))
            return err_fail_code(ST_ERR_INVALID, err, err_len, "safetensors writer: tensor \"%s\": bad shape", name);
    }
    if (numel && !data)
        return err_fail_code(ST_ERR_INVALID, err, err_len, "safetensors writer: tensor \"%s\": no data", name);
    if (w->n == w->cap) {
        size_t cap = w->cap ? 2 * w->cap : 64;
        WTensor *nt = realloc(w->tensors, cap * sizeof *nt);
        if (!nt) return err_fail_code(ST_ERR_NOMEM, err, err_len, "safetensors writer: out of memory");
        w->tensors = nt;
        w->cap = cap;
    }
    WTensor *t = &w->tensors[w->n];
    memset(t, 0, sizeof *t);
    if (!(t->name = strdup(name))) return err_fail_code(ST_ERR_NOMEM, err, err_len, "safetensors writer: out of memory");
    t->dtype = dtype;
    t->src_dtype = src_dtype;
    t->ndim = ndim;
    for (int d = 0; d < ndim; d++) t->shape[d] = shape[d];
    t->numel = numel;
    t->nbytes = numel * (uint64_t)(st_dtype_bits(dtype) / 8);
    t->data = data;
    w->n++;
    return 0;
}

static int cmp_wtensor(const void *a, const void *b) {
    return strcmp(((const WTensor *)a)->name, ((const WTensor *)b)->name);
}

// Writes elements [0, numel) of t converted to its stored dtype.
static int write_data(FILE *fp, const WTensor *t, void *buf) {
    const unsigned char *src = t->data;
    const size_t ssz = (size_t)st_dtype_bits(t->src_dtype) / 8, dsz = (size_t)st_dtype_bits(t->dtype) / 8;
    if (t->src_dtype == t->dtype)
        return t->nbytes && fwrite(src, 1, (size_t)t->nbytes, fp) != t->nbytes ? -1 : 0;
    float tmp[CONVERT_CHUNK];
    for (uint64_t i = 0; i < t->numel; i += CONVERT_CHUNK) {
        size_t k = (size_t)(t->numel - i < CONVERT_CHUNK ? t->numel - i : CONVERT_CHUNK);
        const unsigned char *s = src + i * ssz;
        // Through fp32: exact from BF16/F16, then one rounding (nearest even) to the stored dtype.
        if (t->src_dtype == ST_F32)
            memcpy(tmp, s, k * 4);
        else if (t->src_dtype == ST_BF16)
            dtype_bf16_to_f32_n(tmp, s, k);
        else
            dtype_f16_to_f32_n(tmp, s, k);
        if (t->dtype == ST_F32)
            memcpy(buf, tmp, k * 4);
        else if (t->dtype == ST_BF16)
            dtype_f32_to_bf16_n(buf, tmp, k);
        else
            dtype_f32_to_f16_n(buf, tmp, k);
        if (fwrite(buf, dsz, k, fp) != k) return -1;
    }
    return 0;
}

// Writes the tensors of shard `shard` (in w's order) to path via path.tmp.
static int write_file(const StWriter *w, int shard, const char *path, char *err, size_t err_len) {
    json_t *hdr = json_object();
    json_t *meta = json_object();
    json_object_set_new(meta, "format", json_string("pt"));
    json_object_set_new(hdr, "__metadata__", meta);
    for (size_t i = 0; i < w->n; i++) {
        const WTensor *t = &w->tensors[i];
        if (t->shard != shard) continue;
        json_t *shape = json_array(), *off = json_array(), *e = json_object();
        for (int d = 0; d < t->ndim; d++) json_array_append_new(shape, json_integer(t->shape[d]));
        json_array_append_new(off, json_integer((json_int_t)t->begin));
        json_array_append_new(off, json_integer((json_int_t)(t->begin + t->nbytes)));
        json_object_set_new(e, "dtype", json_string(st_dtype_name(t->dtype)));
        json_object_set_new(e, "shape", shape);
        json_object_set_new(e, "data_offsets", off);
        // json_object_set_new refuses a key that is not valid UTF-8 (safetensors headers are UTF-8 JSON).
        if (json_object_set_new(hdr, t->name, e) != 0) {
            json_decref(hdr);
            return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor name \"%s\" is not valid UTF-8", path, t->name);
        }
    }
    char *text = json_dumps(hdr, JSON_COMPACT);
    json_decref(hdr);
    if (!text) return err_fail_code(ST_ERR_NOMEM, err, err_len, "%s: out of memory", path);
    size_t tlen = strlen(text);
    size_t hlen = (tlen + 7) / 8 * 8;   // pad with spaces: data starts 8-byte aligned (8 + hlen)

    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    void *buf = malloc(CONVERT_CHUNK * 4);
    FILE *fp = buf ? fopen(tmp, "wb") : NULL;
    if (!fp) {
        int e = errno;
        free(text);
        free(buf);
        return buf ? err_fail_code(ST_ERR_IO, err, err_len, "%s: cannot create: %s", tmp, strerror(e))
                   : err_fail_code(ST_ERR_NOMEM, err, err_len, "%s: out of memory", path);
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    int bad = fwrite(len8, 1, 8, fp) != 8 || fwrite(text, 1, tlen, fp) != tlen;
    for (size_t i = tlen; i < hlen && !bad; i++) bad = fputc(' ', fp) == EOF;
    free(text);
    for (size_t i = 0; i < w->n && !bad; i++)
        if (w->tensors[i].shard == shard) bad = write_data(fp, &w->tensors[i], buf) != 0;
    free(buf);
    bad |= fflush(fp) != 0;
    bad |= fsync(fileno(fp)) != 0;
    int e = errno;
    bad |= fclose(fp) != 0;
    if (bad) {
        unlink(tmp);
        return err_fail_code(ST_ERR_IO, err, err_len, "%s: write failed: %s", tmp, strerror(e));
    }
    if (rename(tmp, path) != 0) {
        e = errno;
        unlink(tmp);
        return err_fail_code(ST_ERR_IO, err, err_len, "%s: cannot rename into place: %s", path, strerror(e));
    }
    return 0;
}

// model.safetensors.index.json as transformers writes it: {"metadata": {"total_size": bytes}, "weight_map": {}}.
static int write_index(const StWriter *w, const char *dir, char **names, uint64_t total, char *err, size_t err_len) {
    json_t *root = json_object(), *meta = json_object(), *wm = json_object();
    json_object_set_new(meta, "total_size", json_integer((json_int_t)total));
    json_object_set_new(root, "metadata", meta);
    for (size_t i = 0; i < w->n; i++) json_object_set_new(wm, w->tensors[i].name, json_string(names[w->tensors[i].shard]));
    json_object_set_new(root, "weight_map", wm);
    char path[4200], tmp[4300];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int rc = json_dump_file(root, tmp, JSON_INDENT(2));
    json_decref(root);
    if (rc != 0) {
        unlink(tmp);
        return err_fail_code(ST_ERR_IO, err, err_len, "%s: write failed", tmp);
    }
    if (rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return err_fail_code(ST_ERR_IO, err, err_len, "%s: cannot rename into place: %s", path, strerror(e));
    }
    return 0;
}

int st_writer_write(StWriter *w, const char *dir, uint64_t max_shard_bytes, char *err, size_t err_len) {
    if (strlen(dir) > 4000) return err_fail_code(ST_ERR_IO, err, err_len, "%.64s...: path too long", dir);
    if (w->n > 1) qsort(w->tensors, w->n, sizeof *w->tensors, cmp_wtensor);
    for (size_t i = 1; i < w->n; i++)
        if (strcmp(w->tensors[i - 1].name, w->tensors[i].name) == 0)
            return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor \"%s\" was added twice", dir, w->tensors[i].name);
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return err_fail_code(ST_ERR_IO, err, err_len, "%s: cannot create folder: %s", dir, strerror(errno));

    // Greedy shard assignment in name order: start a new shard when the next tensor would overflow this one.
    uint64_t total = 0, cur = 0;
    int n_shards = 1;
    for (size_t i = 0; i < w->n; i++) {
        WTensor *t = &w->tensors[i];
        if (max_shard_bytes && cur > 0 && cur + t->nbytes > max_shard_bytes) {
            n_shards++;
            cur = 0;
        }
        t->shard = n_shards - 1;
        t->begin = cur;
        cur += t->nbytes;
        total += t->nbytes;
    }

    char single[4200], index[4200];
    snprintf(single, sizeof single, "%s/model.safetensors", dir);
    snprintf(index, sizeof index, "%s/model.safetensors.index.json", dir);
    if (n_shards == 1) {
        int rc = write_file(w, 0, single, err, err_len);
        if (!rc) unlink(index);   // a stale index would describe other files
        return rc;
    }
    if (n_shards > 99999) return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: %d shards is too many", dir, n_shards);
    char **names = calloc((size_t)n_shards, sizeof *names);
    if (!names) return err_fail_code(ST_ERR_NOMEM, err, err_len, "%s: out of memory", dir);
    int rc = 0;
    for (int s = 0; s < n_shards && !rc; s++) {
        char name[64], path[4300];
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, n_shards);
        if (!(names[s] = strdup(name))) {
            rc = err_fail_code(ST_ERR_NOMEM, err, err_len, "%s: out of memory", dir);
            break;
        }
        snprintf(path, sizeof path, "%s/%s", dir, name);
        rc = write_file(w, s, path, err, err_len);
    }
    if (!rc) rc = write_index(w, dir, names, total, err, err_len);
    // transformers loads model.safetensors before the index: a stale one would shadow the shards just written.
    if (!rc) unlink(single);
    for (int s = 0; s < n_shards; s++) free(names[s]);
    free(names);
    return rc;
}

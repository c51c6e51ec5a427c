// shared/safetensors_read.c — safetensors reader: mmap, header validation, shard index, dtype conversion.
//
// Validation mirrors the reference implementation (huggingface/safetensors): header length inside the file and
// below 100 MB, a JSON object whose entries have a known dtype, non-negative dims whose product does not overflow,
// begin <= end inside the data section, end - begin == numel * dtype size, and no two tensors sharing bytes.
// Anything else is refused with a message that names the file and the tensor, never a crash.
#include "shared/err.h"
#include "shared/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "shared/dtype.h"
#include "shared/json_read.h"

#define INDEX_FILE_MAX (64u << 20)

typedef struct {
    char *name;        // file name inside the folder
    char *path;        // as opened, for messages
    const unsigned char *bytes;
    size_t size;
    int mapped;        // 1: munmap on close; 0: caller's buffer (st_parse_buffer)
} StFile;

struct SafetensorsSet {
    StFile *files;
    int n_files;
    StTensor *tensors;  // sorted by name once every file is parsed
    size_t n_tensors, cap_tensors;
};

static const struct {
    const char *name;
    int bits;
} DTYPES[ST_DTYPE_COUNT] = {
    [ST_BOOL] = {"BOOL", 8},         [ST_U8] = {"U8", 8},           [ST_I8] = {"I8", 8},
    [ST_F8_E5M2] = {"F8_E5M2", 8},   [ST_F8_E4M3] = {"F8_E4M3", 8}, [ST_F8_E5M2FNUZ] = {"F8_E5M2FNUZ", 8},
    [ST_F8_E4M3FNUZ] = {"F8_E4M3FNUZ", 8}, [ST_F8_E8M0] = {"F8_E8M0", 8},
    [ST_F4] = {"F4", 4},             [ST_F6_E2M3] = {"F6_E2M3", 6}, [ST_F6_E3M2] = {"F6_E3M2", 6},
    [ST_I16] = {"I16", 16},          [ST_U16] = {"U16", 16},        [ST_F16] = {"F16", 16},
    [ST_BF16] = {"BF16", 16},        [ST_I32] = {"I32", 32},        [ST_U32] = {"U32", 32},
    [ST_F32] = {"F32", 32},          [ST_I64] = {"I64", 64},        [ST_U64] = {"U64", 64},
    [ST_F64] = {"F64", 64},          [ST_C64] = {"C64", 64},
};

const char *st_dtype_name(StDtype dtype) {
    return (unsigned)dtype < ST_DTYPE_COUNT ? DTYPES[dtype].name : "?";
}

int st_dtype_bits(StDtype dtype) {
    return (unsigned)dtype < ST_DTYPE_COUNT ? DTYPES[dtype].bits : 0;
}

int st_dtype_from_name(const char *name, StDtype *out) {
    for (int i = 0; i < ST_DTYPE_COUNT; i++)
        if (strcmp(name, DTYPES[i].name) == 0) {
            *out = (StDtype)i;
            return 0;
        }
    return -1;
}

void st_close(SafetensorsSet *set) {
    if (!set) return;
    for (int i = 0; i < set->n_files; i++) {
        StFile *f = &set->files[i];
        if (f->mapped && f->size) munmap((void *)f->bytes, f->size);
        free(f->name);
        free(f->path);
    }
    for (size_t i = 0; i < set->n_tensors; i++) free((char *)set->tensors[i].name);
    free(set->files);
    free(set->tensors);
    free(set);
}

size_t st_count(const SafetensorsSet *set) { return set ? set->n_tensors : 0; }

const StTensor *st_tensor_at(const SafetensorsSet *set, size_t i) {
    return (set && i < set->n_tensors) ? &set->tensors[i] : NULL;
}

static int cmp_tensor_name(const void *a, const void *b) {
    return strcmp(((const StTensor *)a)->name, ((const StTensor *)b)->name);
}

const StTensor *st_find(const SafetensorsSet *set, const char *name) {
    if (!set || !name || !set->n_tensors) return NULL;
    StTensor key = {.name = name};
    return bsearch(&key, set->tensors, set->n_tensors, sizeof key, cmp_tensor_name);
}

// Adds a file record (name/path copied). Returns its index, or -1 on out of memory.
static int add_file(SafetensorsSet *set, const char *name, const char *path) {
    StFile *nf = realloc(set->files, (size_t)(set->n_files + 1) * sizeof *nf);
    if (!nf) return -1;
    set->files = nf;
    StFile *f = &set->files[set->n_files];
    memset(f, 0, sizeof *f);
    f->name = strdup(name);
    f->path = strdup(path);
    if (!f->name || !f->path) {
        free(f->name);
        free(f->path);
        return -1;
    }
    return set->n_files++;
}

static StTensor *push_tensor(SafetensorsSet *set) {
    if (set->n_tensors == set->cap_tensors) {
        size_t cap = set->cap_tensors ? 2 * set->cap_tensors : 64;
        StTensor *nt = realloc(set->tensors, cap * sizeof *nt);
        if (!nt) return NULL;
        set->tensors = nt;
        set->cap_tensors = cap;
    }
    StTensor *t = &set->tensors[set->n_tensors];
    memset(t, 0, sizeof *t);
    return t;
}

// Reads one non-negative JSON integer (shape dim or offset).
static int json_u63(json_t *v, uint64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return -1;
    *out = (uint64_t)json_integer_value(v);
    return 0;
}

// Parses one header entry into t (name already set). Offsets are checked against data_len.
static int parse_entry(StTensor *t, json_t *info, const StFile *f, const unsigned char *data, uint64_t data_len,
                       char *err, size_t err_len) {
    const char *P = f->path, *N = t->name;
    if (!json_is_object(info))
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor \"%s\": header entry is not an object", P, N);
    json_t *dt = json_object_get(info, "dtype"), *sh = json_object_get(info, "shape"),
           *off = json_object_get(info, "data_offsets");
    if (!json_is_string(dt))
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor \"%s\": \"dtype\" missing or not a string", P, N);
    if (st_dtype_from_name(json_string_value(dt), &t->dtype))
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor \"%s\": unknown dtype \"%.16s\"", P, N,
                    json_string_value(dt));
    if (!json_is_array(sh))
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor \"%s\": \"shape\" missing or not an array", P, N);
    if (json_array_size(sh) > ST_MAX_DIMS)
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor \"%s\": %zu dims, at most %d are supported", P, N,
                    json_array_size(sh), ST_MAX_DIMS);
    t->ndim = (int)json_array_size(sh);
    uint64_t numel = 1;
    int overflow = 0;
    for (int d = 0; d < t->ndim; d++) {
        uint64_t dim;
        if (json_u63(json_array_get(sh, d), &dim))
            return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor \"%s\": shape[%d] is not a non-negative integer",
                        P, N, d);
        t->shape[d] = (int64_t)dim;
        // A zero dim makes the product 0 whatever follows, but an overflow before it is still a corrupt header.
        if (__builtin_mul_overflow(numel, dim, &numel) || numel > (UINT64_MAX >> 3)) overflow = 1;
    }
    if (overflow)
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor \"%s\": the element count overflows", P, N);
    t->numel = numel;
    uint64_t bits = numel * (uint64_t)st_dtype_bits(t->dtype);   // numel < 2^61, bits <= 64: no overflow
    if (bits % 8)
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor \"%s\": %llu elements of %s do not fill whole bytes",
                    P, N, (unsigned long long)numel, st_dtype_name(t->dtype));
    if (!json_is_array(off) || json_array_size(off) != 2)
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor \"%s\": \"data_offsets\" must be [begin, end]", P,
                    N);
    uint64_t begin, end;
    if (json_u63(json_array_get(off, 0), &begin) || json_u63(json_array_get(off, 1), &end))
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor \"%s\": data_offsets are not non-negative integers",
                    P, N);
    if (begin > end)
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor \"%s\": data_offsets [%llu, %llu] are reversed", P,
                    N, (unsigned long long)begin, (unsigned long long)end);
    if (end > data_len)
        return err_fail_code(ST_ERR_INVALID, err, err_len,
                    "%s: tensor \"%s\": data_offsets [%llu, %llu] run past the data section (%llu bytes; file "
                    "truncated?)",
                    P, N, (unsigned long long)begin, (unsigned long long)end, (unsigned long long)data_len);
    if (end - begin != bits / 8)
        return err_fail_code(ST_ERR_INVALID, err, err_len,
                    "%s: tensor \"%s\": data_offsets span %llu bytes but shape and dtype %s need %llu", P, N,
                    (unsigned long long)(end - begin), st_dtype_name(t->dtype), (unsigned long long)(bits / 8));
    t->data = data + begin;
    t->nbytes = (size_t)(end - begin);
    t->file = f->name;
    t->path = f->path;
    return 0;
}

static int cmp_tensor_data(const void *a, const void *b) {
    const StTensor *x = *(const StTensor *const *)a, *y = *(const StTensor *const *)b;
    const unsigned char *px = x->data, *py = y->data;
    return px < py ? -1 : px > py ? 1 : 0;
}

// Two tensors of one file may not share bytes (the reference requires them to tile the data section).
static int check_overlap(SafetensorsSet *set, size_t first, const StFile *f, char *err, size_t err_len) {
    size_t n = set->n_tensors - first;
    if (n < 2) return 0;
    const StTensor **order = malloc(n * sizeof *order);
    if (!order) return err_fail_code(ST_ERR_NOMEM, err, err_len, "%s: out of memory", f->path);
    for (size_t i = 0; i < n; i++) order[i] = &set->tensors[first + i];
    qsort(order, n, sizeof *order, cmp_tensor_data);
    int rc = 0;
    const StTensor *prev = NULL;
    for (size_t i = 0; i < n && !rc; i++) {
        const StTensor *t = order[i];
        if (t->nbytes == 0) continue;
        if (prev && (const unsigned char *)t->data < (const unsigned char *)prev->data + prev->nbytes)
            rc = err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor \"%s\" overlaps tensor \"%s\" in the data section",
                      f->path, t->name, prev->name);
        prev = t;
    }
    free(order);
    return rc;
}

// Validates file `fi`'s header and appends its tensors to set.
static int parse_file(SafetensorsSet *set, int fi, char *err, size_t err_len) {
    const StFile *f = &set->files[fi];
    const char *P = f->path;
    if (f->size < 8)
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: %zu bytes is too small for a safetensors file (truncated?)",
                    P, f->size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | f->bytes[i];   // little-endian u64
    if (hlen > ST_MAX_HEADER_BYTES)
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: header length %llu exceeds the 100 MB limit", P,
                    (unsigned long long)hlen);
    if (hlen > f->size - 8)
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: header length %llu runs past the end of the file (%zu bytes; "
                    "truncated?)", P, (unsigned long long)hlen, f->size);
    const char *hdr = (const char *)f->bytes + 8;
    if (hlen == 0 || hdr[0] != '{')
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: header is not a JSON object", P);
    json_error_t je;
    // Duplicate keys would silently drop a tensor; jansson's message quotes the repeated name.
    json_t *root = json_read_buffer(hdr, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: header is not valid JSON (byte %d): %s", P, je.position,
                    je.text);
    int rc = 0;
    if (!json_is_object(root)) rc = err_fail_code(ST_ERR_INVALID, err, err_len, "%s: header is not a JSON object", P);
    const unsigned char *data = f->bytes + 8 + hlen;
    const uint64_t data_len = f->size - 8 - hlen;
    const size_t first = set->n_tensors;
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (rc) break;
        if (strcmp(key, "__metadata__") == 0) {
            // str -> str only, as the format defines it.
            if (!json_is_object(val)) {
                rc = err_fail_code(ST_ERR_INVALID, err, err_len, "%s: \"__metadata__\" is not an object", P);
                break;
            }
            const char *mk;
            json_t *mv;
            json_object_foreach(val, mk, mv) {
                if (!json_is_string(mv)) {
                    rc = err_fail_code(ST_ERR_INVALID, err, err_len, "%s: \"__metadata__\".\"%s\" is not a string", P, mk);
                    break;
                }
            }
            continue;
        }
        StTensor *t = push_tensor(set);
        if (!t) {
            rc = err_fail_code(ST_ERR_NOMEM, err, err_len, "%s: out of memory", P);
            break;
        }
        if (!(t->name = strdup(key))) {
            rc = err_fail_code(ST_ERR_NOMEM, err, err_len, "%s: out of memory", P);
            break;
        }
        set->n_tensors++;   // counted now so that st_close frees the name even if the entry is refused
        rc = parse_entry(t, val, f, data, data_len, err, err_len);
    }
    json_decref(root);
    if (!rc) rc = check_overlap(set, first, f, err, err_len);
    return rc;
}

// Sorts all tensors by name and refuses a name that appears twice (within a file jansson already refuses it).
static int finish_set(SafetensorsSet *set, char *err, size_t err_len) {
    if (set->n_tensors > 1) qsort(set->tensors, set->n_tensors, sizeof *set->tensors, cmp_tensor_name);
    for (size_t i = 1; i < set->n_tensors; i++)
        if (strcmp(set->tensors[i - 1].name, set->tensors[i].name) == 0)
            return err_fail_code(ST_ERR_INVALID, err, err_len, "tensor \"%s\" appears in both %s and %s",
                        set->tensors[i].name, set->tensors[i - 1].path, set->tensors[i].path);
    return 0;
}

static SafetensorsSet *new_set(void) { return calloc(1, sizeof(SafetensorsSet)); }

int st_parse_buffer(SafetensorsSet **out, const void *buf, size_t len, const char *file_name, char *err,
                    size_t err_len) {
    *out = NULL;
    SafetensorsSet *set = new_set();
    if (!set) return err_fail_code(ST_ERR_NOMEM, err, err_len, "%s: out of memory", file_name);
    int fi = add_file(set, file_name, file_name);
    if (fi < 0) {
        st_close(set);
        return err_fail_code(ST_ERR_NOMEM, err, err_len, "%s: out of memory", file_name);
    }
    set->files[fi].bytes = buf;
    set->files[fi].size = len;
    int rc = parse_file(set, fi, err, err_len);
    if (!rc) rc = finish_set(set, err, err_len);
    if (rc) {
        st_close(set);
        return rc;
    }
    *out = set;
    return 0;
}

// Maps folder/name read-only into a new file record and validates its header.
static int open_shard(SafetensorsSet *set, const char *dir, const char *name, char *err, size_t err_len) {
    char path[4096];
    if (dir)
        snprintf(path, sizeof path, "%s/%s", dir, name);
    else
        snprintf(path, sizeof path, "%s", name);
    int fi = add_file(set, name, path);
    if (fi < 0) return err_fail_code(ST_ERR_NOMEM, err, err_len, "%s: out of memory", path);
    StFile *f = &set->files[fi];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return err_fail_code(ST_ERR_IO, err, err_len, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return err_fail_code(ST_ERR_IO, err, err_len, "%s: not a regular file", path);
    }
    f->size = (size_t)st.st_size;
    if (f->size > 0) {
        void *m = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            int e = errno;
            close(fd);
            f->size = 0;
            return err_fail_code(ST_ERR_IO, err, err_len, "%s: cannot mmap: %s", path, strerror(e));
        }
        f->bytes = m;
        f->mapped = 1;
    }
    close(fd);
    return parse_file(set, fi, err, err_len);
}

static int is_plain_file_name(const char *s) {
    return s[0] && strchr(s, '/') == NULL && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

// model.safetensors.index.json: {"metadata": {...}, "weight_map": {"tensor": "shard file", ...}}.
static int open_index(SafetensorsSet *set, const char *dir, char *err, size_t err_len) {
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    FILE *fp = fopen(path, "rb");
    if (!fp) return err_fail_code(ST_ERR_IO, err, err_len, "%s: cannot open: %s", path, strerror(errno));
    char *text = malloc(INDEX_FILE_MAX + 1);
    size_t n = text ? fread(text, 1, INDEX_FILE_MAX + 1, fp) : 0;
    int bad_read = ferror(fp);
    fclose(fp);
    if (!text || bad_read || n > INDEX_FILE_MAX) {
        free(text);
        return err_fail_code(text ? ST_ERR_IO : ST_ERR_NOMEM, err, err_len, "%s: %s", path,
                    !text ? "out of memory" : bad_read ? "read error" : "larger than 64 MiB, refused");
    }
    json_error_t je;
    json_t *root = json_read_buffer(text, n, JSON_REJECT_DUPLICATES, &je);
    free(text);
    if (!root)
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: invalid JSON at line %d column %d: %s", path, je.line,
                    je.column, je.text);
    int rc = 0;
    json_t *wm = json_is_object(root) ? json_object_get(root, "weight_map") : NULL;
    if (!json_is_object(wm)) rc = err_fail_code(ST_ERR_INVALID, err, err_len, "%s: \"weight_map\" missing or not an object", path);
    const char *tname;
    json_t *fname;
    // Open each distinct shard once, in first-mention order.
    json_object_foreach(wm, tname, fname) {
        if (rc) break;
        const char *fn = json_string_value(fname);
        if (!fn || !is_plain_file_name(fn)) {
            rc = err_fail_code(ST_ERR_INVALID, err, err_len, "%s: weight_map entry for tensor \"%s\" is not a file name in "
                      "the folder", path, tname);
            break;
        }
        int seen = 0;
        for (int i = 0; i < set->n_files && !seen; i++) seen = strcmp(set->files[i].name, fn) == 0;
        if (seen) continue;
        char msg[1024];
        rc = open_shard(set, dir, fn, msg, sizeof msg);
        if (rc) err_fail_code(rc, err, err_len, "%s (listed for tensor \"%s\" in %s)", msg, tname, path);
    }
    if (!rc) rc = finish_set(set, err, err_len);
    // Every tensor the index names must be in the shard the index names.
    json_object_foreach(wm, tname, fname) {
        if (rc) break;
        const StTensor *t = st_find(set, tname);
        if (!t)
            rc = err_fail_code(ST_ERR_INVALID, err, err_len, "tensor \"%s\": %s lists it in %s/%s, which does not contain it",
                      tname, path, dir, json_string_value(fname));
        else if (strcmp(t->file, json_string_value(fname)) != 0)
            rc = err_fail_code(ST_ERR_INVALID, err, err_len, "tensor \"%s\": %s lists it in %s but it is in %s", tname, path,
                      json_string_value(fname), t->path);
    }
    json_decref(root);
    return rc;
}

int st_open(SafetensorsSet **out, const char *model_dir, char *err, size_t err_len) {
    *out = NULL;
    if (strlen(model_dir) > 3000) return err_fail_code(ST_ERR_IO, err, err_len, "%.64s...: path too long", model_dir);
    SafetensorsSet *set = new_set();
    if (!set) return err_fail_code(ST_ERR_NOMEM, err, err_len, "%s: out of memory", model_dir);
    struct stat st;
    int rc;
    char single[4096], index[4096];
    snprintf(single, sizeof single, "%s/model.safetensors", model_dir);
    snprintf(index, sizeof index, "%s/model.safetensors.index.json", model_dir);
    if (stat(model_dir, &st) != 0) {
        rc = err_fail_code(ST_ERR_IO, err, err_len, "%s: %s", model_dir, strerror(errno));
    } else if (S_ISREG(st.st_mode)) {
        rc = open_shard(set, NULL, model_dir, err, err_len);
        if (!rc) rc = finish_set(set, err, err_len);
    } else if (stat(single, &st) == 0) {
        rc = open_shard(set, model_dir, "model.safetensors", err, err_len);
        if (!rc) rc = finish_set(set, err, err_len);
    } else if (stat(index, &st) == 0) {
        rc = open_index(set, model_dir, err, err_len);
    } else {
        rc = err_fail_code(ST_ERR_IO, err, err_len, "%s: neither model.safetensors nor model.safetensors.index.json found",
                  model_dir);
    }
    if (rc) {
        st_close(set);
        return rc;
    }
    *out = set;
    return 0;
}

// ---- typed access ------------------------------------------------------------------------------------------

static void shape_str(char *buf, size_t len, int ndim, const int64_t *shape) {
    size_t k = (size_t)snprintf(buf, len, "[");
    for (int d = 0; d < ndim && k < len; d++)
        k += (size_t)snprintf(buf + k, len - k, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (k < len) snprintf(buf + k, len - k, "]");
}

int st_check_param(const StTensor *t, char *err, size_t err_len) {
    if (t->dtype == ST_F32 || t->dtype == ST_F16 || t->dtype == ST_BF16) return 0;
    return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor \"%s\" has dtype %s; parameters must be BF16, F16 or F32",
                t->path, t->name, st_dtype_name(t->dtype));
}

int st_check_shape(const StTensor *t, int ndim, const int64_t *shape, char *err, size_t err_len) {
    int same = t->ndim == ndim;
    for (int d = 0; same && d < ndim; d++) same = t->shape[d] == shape[d];
    if (same) return 0;
    char have[160], want[160];
    shape_str(have, sizeof have, t->ndim, t->shape);
    shape_str(want, sizeof want, ndim, shape);
    return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor \"%s\" has shape %s, expected %s", t->path, t->name, have,
                want);
}

static int check_read(const StTensor *t, size_t n, char *err, size_t err_len) {
    int rc = st_check_param(t, err, err_len);
    if (rc) return rc;
    if ((uint64_t)n != t->numel)
        return err_fail_code(ST_ERR_INVALID, err, err_len, "%s: tensor \"%s\" has %llu elements, the destination holds %zu",
                    t->path, t->name, (unsigned long long)t->numel, n);
    return 0;
}

int st_read_f32(const StTensor *t, float *dst, size_t n, char *err, size_t err_len) {
    int rc = check_read(t, n, err, err_len);
    if (rc) return rc;
    if (t->dtype == ST_F32)
        memcpy(dst, t->data, n * sizeof(float));
    else if (t->dtype == ST_BF16)
        dtype_bf16_to_f32_n(dst, t->data, n);
    else
        dtype_f16_to_f32_n(dst, t->data, n);
    return 0;
}

int st_read_bf16(const StTensor *t, uint16_t *dst, size_t n, char *err, size_t err_len) {
    int rc = check_read(t, n, err, err_len);
    if (rc) return rc;
    const unsigned char *src = t->data;
    if (t->dtype == ST_BF16) {
        memcpy(dst, src, n * 2);
    } else if (t->dtype == ST_F32) {
        for (size_t i = 0; i < n; i++) {
            float f;
            memcpy(&f, src + 4 * i, 4);
            dst[i] = dtype_f32_to_bf16(f);
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            dst[i] = dtype_f32_to_bf16(dtype_f16_to_f32(h));
        }
    }
    return 0;
}

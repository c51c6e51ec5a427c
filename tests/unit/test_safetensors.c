// tests/unit/test_safetensors.c — safetensors writer/reader round trips (single file and sharded), the dtype
// conversions (exhaustive over all 16-bit patterns), and every corruption class: each must be refused with a
// message naming the tensor and/or the file, never a crash.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "check_macros.h"
#include "shared/dtype.h"
#include "shared/safetensors.h"
#include "testlib.h"

static char root_dir[] = "/tmp/tandem_test_st_XXXXXX";

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void path_in(char *out, size_t len, const char *sub) { snprintf(out, len, "%s/%s", root_dir, sub); }

// Writes a raw safetensors file: u64 header length, header text, then `data`.
static void write_raw(const char *path, uint64_t hlen, const char *header, const void *data, size_t data_len) {
    FILE *f = fopen(path, "wb");
    unsigned char l8[8];
    for (int i = 0; i < 8; i++) l8[i] = (unsigned char)(hlen >> (8 * i));
    fwrite(l8, 1, 8, f);
    fwrite(header, 1, strlen(header), f);
    if (data_len) fwrite(data, 1, data_len, f);
    fclose(f);
}

// Expects st_open(path) to fail with a message containing both needles (NULL: not checked).
static void expect_refusal(int line, const char *path, const char *needle1, const char *needle2) {
    SafetensorsSet *s = NULL;
    char err[1024] = "";
    int rc = st_open(&s, path, err, sizeof err);
    int ok = rc < 0 && s == NULL && (!needle1 || strstr(err, needle1)) && (!needle2 || strstr(err, needle2));
    if (!ok) {
        fprintf(stderr, "line %d: expected a refusal naming '%s' and '%s', got rc=%d: %s\n", line,
                needle1 ? needle1 : "", needle2 ? needle2 : "", rc, err);
        failures++;
    }
    st_close(s);
}

// ---- conversions -------------------------------------------------------------------------------------------

static void test_dtype_conversions(void) {
    // Every bf16 and fp16 pattern survives 16 -> 32 -> 16 (signalling NaNs come back quiet, still NaN).
    int bad_bf16 = 0, bad_f16 = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = dtype_bf16_to_f32((uint16_t)h);
        uint16_t back = dtype_f32_to_bf16(f);
        if (isnan(f) ? !isnan(dtype_bf16_to_f32(back)) : back != h) bad_bf16++;
        float g = dtype_f16_to_f32((uint16_t)h);
        uint16_t back16 = dtype_f32_to_f16(g);
        if (isnan(g) ? !isnan(dtype_f16_to_f32(back16)) : back16 != h) bad_f16++;
    }
    CHECK(bad_bf16 == 0 && bad_f16 == 0);
    // The array forms (branch-free, vectorized) give the scalar functions' bits: every bf16 pattern decoded, and
    // 2^20 fp32 patterns (every 4096th, plus the neighbours of ties and of the NaN boundary) encoded.
    {
        enum { N = 1 << 20 };
        uint16_t *h = malloc(65536 * sizeof *h), *e = malloc((size_t)N * 4 * sizeof *e);
        float *d = malloc(65536 * sizeof *d), *x = malloc((size_t)N * 4 * sizeof *x);
        int bad = 0;
        for (uint32_t i = 0; i < 65536; i++) h[i] = (uint16_t)i;
        dtype_bf16_to_f32_n(d, h, 65536);
        for (uint32_t i = 0; i < 65536; i++) bad += f32_bits(d[i]) != f32_bits(dtype_bf16_to_f32((uint16_t)i));
        for (uint32_t i = 0; i < N; i++) {
            const uint32_t base = i << 12;
            x[4 * i] = bits_f32(base), x[4 * i + 1] = bits_f32(base | 0x7fffu);
            x[4 * i + 2] = bits_f32(base | 0x8000u), x[4 * i + 3] = bits_f32(base | 0x8001u);
        }
        dtype_f32_to_bf16_n(e, x, (size_t)N * 4);
        for (size_t i = 0; i < (size_t)N * 4; i++) bad += e[i] != dtype_f32_to_bf16(x[i]);
        CHECK(bad == 0, "%d array conversions differ from the scalar ones", bad);
        free(h), free(e), free(d), free(x);
    }
    // fp16 decoding of special patterns
    CHECK(dtype_f16_to_f32(0x0001) == 0x1p-24f && dtype_f16_to_f32(0x03ff) == 1023 * 0x1p-24f);
    CHECK(dtype_f16_to_f32(0x0400) == 0x1p-14f && dtype_f16_to_f32(0x7bff) == 65504.0f);
    CHECK(dtype_f16_to_f32(0x3c00) == 1.0f && dtype_f16_to_f32(0xc000) == -2.0f);
    CHECK(isinf(dtype_f16_to_f32(0x7c00)) && dtype_f16_to_f32(0xfc00) < 0 && isnan(dtype_f16_to_f32(0x7e01)));
    CHECK(f32_bits(dtype_f16_to_f32(0x8000)) == 0x80000000u);
    // bf16 rounding: to nearest, ties to even, overflow to inf, NaN kept
    CHECK(dtype_f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80);                  // tie -> even (1.0)
    CHECK(dtype_f32_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3f82);              // tie -> even (1 + 2^-6)
    CHECK(dtype_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81);       // above the tie -> up
    CHECK(dtype_f32_to_bf16(-1.0f - 0x1p-9f) == 0xbf80);                 // below the tie -> down
    CHECK(dtype_f32_to_bf16(3.4028235e38f) == 0x7f80);                   // FLT_MAX rounds to inf
    CHECK(dtype_f32_to_bf16(-INFINITY) == 0xff80 && dtype_f32_to_bf16(-0.0f) == 0x8000);
    uint16_t qnan = dtype_f32_to_bf16(bits_f32(0x7f800001u));              // NaN with payload only in low bits
    CHECK(isnan(dtype_bf16_to_f32(qnan)));
    CHECK(isnan(dtype_bf16_to_f32(dtype_f32_to_bf16(bits_f32(0xffc00000u)))));
    // fp16 rounding
    CHECK(dtype_f32_to_f16(65519.0f) == 0x7bff && dtype_f32_to_f16(65520.0f) == 0x7c00);
    CHECK(dtype_f32_to_f16(0x1p-25f) == 0x0000);                          // tie between 0 and 2^-24 -> 0
    CHECK(dtype_f32_to_f16(0x1p-25f * 1.0001f) == 0x0001);
    CHECK(dtype_f32_to_f16(3 * 0x1p-25f) == 0x0002);                      // tie between 1 and 2 steps -> 2
    CHECK(dtype_f32_to_f16(1023.5f * 0x1p-24f) == 0x0400);                // subnormal rounds up into the normals
    CHECK(dtype_f32_to_f16(1.0f + 0x1p-11f) == 0x3c00 && dtype_f32_to_f16(1.0f + 3 * 0x1p-11f) == 0x3c02);
    CHECK(dtype_f32_to_f16(-0x1p-30f) == 0x8000 && isnan(dtype_f16_to_f32(dtype_f32_to_f16(NAN))));
}

// ---- round trips ---------------------------------------------------------------------------------------------

// Tensors used by the round-trip tests (contents fixed, names unsorted on purpose).
static float w_a[6] = {1.0f, -2.5f, 3.25f, 0.0f, -0.0f, 1e-30f};               // (2, 3) F32
static float w_b[5];                                                            // (5) -> BF16
static uint16_t w_c_f16[4] = {0x3c00, 0x0001, 0xfbff, 0x7c00};                   // (2, 2) F16 source -> F32
static float w_d = 42.0f;                                                       // scalar

static void fill_b(void) {
    w_b[0] = 1.0f + 0x1p-8f;
    w_b[1] = 1.0f + 3 * 0x1p-8f;
    w_b[2] = NAN;
    w_b[3] = -INFINITY;
    w_b[4] = 3.14159265f;
}

static StWriter *make_writer(void) {
    StWriter *w;
    char err[256];
    CHECK(st_writer_create(&w, err, sizeof err) == 0);
    int64_t sa[2] = {2, 3}, sb[1] = {5}, sc[2] = {2, 2}, se[2] = {0, 7};
    CHECK(st_writer_add(w, "model.layers.0.a", ST_F32, 2, sa, w_a, ST_F32, err, sizeof err) == 0);
    CHECK(st_writer_add(w, "b_bf16", ST_BF16, 1, sb, w_b, ST_F32, err, sizeof err) == 0);
    CHECK(st_writer_add(w, "c_from_f16", ST_F32, 2, sc, w_c_f16, ST_F16, err, sizeof err) == 0);
    CHECK(st_writer_add(w, "d_scalar", ST_F32, 0, NULL, &w_d, ST_F32, err, sizeof err) == 0);
    CHECK(st_writer_add(w, "e_empty", ST_BF16, 2, se, NULL, ST_F32, err, sizeof err) == 0);
    CHECK(st_writer_add(w, "f_f16", ST_F16, 1, sb, w_b, ST_F32, err, sizeof err) == 0);
    return w;
}

static void check_contents(const SafetensorsSet *s) {
    char err[512];
    CHECK(st_count(s) == 6);
    for (size_t i = 1; i < st_count(s); i++) CHECK(strcmp(st_tensor_at(s, i - 1)->name, st_tensor_at(s, i)->name) < 0);
    const StTensor *a = st_find(s, "model.layers.0.a"), *b = st_find(s, "b_bf16"), *c = st_find(s, "c_from_f16"),
                   *d = st_find(s, "d_scalar"), *e = st_find(s, "e_empty"), *f = st_find(s, "f_f16");
    CHECK(a && b && c && d && e && f && !st_find(s, "missing"));
    if (!(a && b && c && d && e && f)) return;
    CHECK(a->dtype == ST_F32 && a->ndim == 2 && a->shape[0] == 2 && a->shape[1] == 3 && a->nbytes == 24);
    float out[8];
    CHECK(st_read_f32(a, out, 6, err, sizeof err) == 0 && memcmp(out, w_a, sizeof w_a) == 0);
    CHECK(b->dtype == ST_BF16 && b->nbytes == 10 && st_read_f32(b, out, 5, err, sizeof err) == 0);
    CHECK(out[0] == 1.0f && out[1] == 1.0f + 0x1p-6f && isnan(out[2]) && out[3] == -INFINITY);
    CHECK(out[4] == dtype_bf16_to_f32(0x4049));   // pi in bf16: 0x4049 (3.140625)
    uint16_t hb[5];
    CHECK(st_read_bf16(b, hb, 5, err, sizeof err) == 0 && hb[0] == 0x3f80 && hb[1] == 0x3f82);
    CHECK(st_read_f32(c, out, 4, err, sizeof err) == 0);
    CHECK(c->dtype == ST_F32 && out[0] == 1.0f && out[1] == 0x1p-24f && out[2] == -65504.0f && isinf(out[3]));
    CHECK(d->ndim == 0 && d->numel == 1 && st_read_f32(d, out, 1, err, sizeof err) == 0 && out[0] == 42.0f);
    CHECK(e->numel == 0 && e->nbytes == 0 && e->shape[0] == 0 && e->shape[1] == 7);
    CHECK(st_read_f32(e, out, 0, err, sizeof err) == 0);
    CHECK(f->dtype == ST_F16 && st_read_f32(f, out, 5, err, sizeof err) == 0);
    CHECK(out[0] == 1.0f + 0x1p-8f && isnan(out[2]) && out[3] == -INFINITY && out[4] == dtype_f16_to_f32(0x4248));
    CHECK(st_read_bf16(f, hb, 5, err, sizeof err) == 0 && hb[4] == dtype_f32_to_bf16(dtype_f16_to_f32(0x4248)));
    // wrong element count and shape checks name tensor and file
    CHECK(st_read_f32(a, out, 5, err, sizeof err) < 0 && strstr(err, "model.layers.0.a") && strstr(err, a->path));
    int64_t want[2] = {3, 2};
    CHECK(st_check_shape(a, 2, want, err, sizeof err) < 0 && strstr(err, "model.layers.0.a") &&
          strstr(err, "[2, 3]") && strstr(err, "[3, 2]"));
    want[0] = 2;
    want[1] = 3;
    CHECK(st_check_shape(a, 2, want, err, sizeof err) == 0 && st_check_param(a, err, sizeof err) == 0);
}

// Reads the raw header of a written file: length multiple of 8, "__metadata__": {"format": "pt"}.
static void check_header_format(const char *path) {
    FILE *f = fopen(path, "rb");
    CHECK(f != NULL);
    if (!f) return;
    unsigned char l8[8];
    CHECK(fread(l8, 1, 8, f) == 8);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | l8[i];
    CHECK(hlen % 8 == 0 && hlen < 100000);
    char *h = calloc(1, hlen + 1);
    CHECK(fread(h, 1, hlen, f) == hlen);
    fclose(f);
    json_t *j = json_loads(h, 0, NULL);
    CHECK(j && strcmp(json_string_value(json_object_get(json_object_get(j, "__metadata__"), "format")), "pt") == 0);
    json_decref(j);
    free(h);
}

static void test_round_trip_single(void) {
    char dir[512], file[600], err[512];
    path_in(dir, sizeof dir, "single");
    StWriter *w = make_writer();
    CHECK(st_writer_write(w, dir, 0, err, sizeof err) == 0);
    st_writer_free(w);
    snprintf(file, sizeof file, "%s/model.safetensors", dir);
    check_header_format(file);
    SafetensorsSet *s = NULL;
    CHECK(st_open(&s, dir, err, sizeof err) == 0);
    if (s) check_contents(s);
    if (s) CHECK(strcmp(st_find(s, "b_bf16")->file, "model.safetensors") == 0);
    st_close(s);
    // the file can also be opened by its own path
    CHECK(st_open(&s, file, err, sizeof err) == 0);
    if (s) check_contents(s);
    st_close(s);
    // no temporary file is left behind
    char tmp[700];
    snprintf(tmp, sizeof tmp, "%s.tmp", file);
    CHECK(access(tmp, F_OK) != 0);
}

static void test_round_trip_sharded(void) {
    char dir[512], p[700], err[512];
    path_in(dir, sizeof dir, "sharded");
    StWriter *w = make_writer();
    // 64 bytes in all, at most 20 per shard (a 24-byte tensor gets a shard of its own)
    CHECK(st_writer_write(w, dir, 20, err, sizeof err) == 0);
    st_writer_free(w);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    json_t *idx = json_load_file(p, 0, NULL);
    CHECK(idx != NULL);
    json_t *wm = json_object_get(idx, "weight_map");
    CHECK(json_object_size(wm) == 6);
    CHECK(json_integer_value(json_object_get(json_object_get(idx, "metadata"), "total_size")) == 64);
    // sorted order b(10) c(16) d(4) e(0) f(10) a(24): [b], [c d e], [f], [a] -> 4 shards
    const char *last = json_string_value(json_object_get(wm, "model.layers.0.a"));
    CHECK(last && strcmp(last, "model-00004-of-00004.safetensors") == 0);
    CHECK(strcmp(json_string_value(json_object_get(wm, "d_scalar")), "model-00002-of-00004.safetensors") == 0);
    json_decref(idx);
    for (int i = 1; i <= 4; i++) {
        snprintf(p, sizeof p, "%s/model-%05d-of-00004.safetensors", dir, i);
        check_header_format(p);
    }
    SafetensorsSet *s = NULL;
    CHECK(st_open(&s, dir, err, sizeof err) == 0);
    if (s) {
        check_contents(s);
        CHECK(strcmp(st_find(s, "model.layers.0.a")->file, "model-00004-of-00004.safetensors") == 0);
    }
    st_close(s);

    // re-saving the same folder unsharded removes the index; sharded again removes model.safetensors
    w = make_writer();
    CHECK(st_writer_write(w, dir, 1 << 20, err, sizeof err) == 0);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    CHECK(access(p, F_OK) != 0);
    CHECK(st_writer_write(w, dir, 20, err, sizeof err) == 0);
    CHECK(access(p, F_OK) == 0);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    CHECK(access(p, F_OK) != 0);
    st_writer_free(w);
}

static void test_writer_refusals(void) {
    StWriter *w;
    char err[512], dir[512];
    CHECK(st_writer_create(&w, err, sizeof err) == 0);
    int64_t sh[2] = {2, -1};
    float x[4] = {0};
    CHECK(st_writer_add(w, "neg", ST_F32, 2, sh, x, ST_F32, err, sizeof err) < 0 && strstr(err, "neg"));
    sh[1] = 2;
    CHECK(st_writer_add(w, "", ST_F32, 2, sh, x, ST_F32, err, sizeof err) < 0);
    CHECK(st_writer_add(w, "__metadata__", ST_F32, 2, sh, x, ST_F32, err, sizeof err) < 0);
    CHECK(st_writer_add(w, "i64", ST_I64, 2, sh, x, ST_F32, err, sizeof err) < 0 && strstr(err, "i64"));
    CHECK(st_writer_add(w, "many_dims", ST_F32, 9, sh, x, ST_F32, err, sizeof err) < 0);
    CHECK(st_writer_add(w, "nodata", ST_F32, 2, sh, NULL, ST_F32, err, sizeof err) < 0 && strstr(err, "nodata"));
    CHECK(st_writer_add(w, "dup", ST_F32, 2, sh, x, ST_F32, err, sizeof err) == 0);
    CHECK(st_writer_add(w, "dup", ST_F32, 2, sh, x, ST_F32, err, sizeof err) == 0);
    path_in(dir, sizeof dir, "dup");
    CHECK(st_writer_write(w, dir, 0, err, sizeof err) < 0 && strstr(err, "\"dup\""));
    st_writer_free(w);
    CHECK(st_writer_create(&w, err, sizeof err) == 0);
    CHECK(st_writer_add(w, "bad\xff", ST_F32, 2, sh, x, ST_F32, err, sizeof err) == 0);
    path_in(dir, sizeof dir, "utf8");
    CHECK(st_writer_write(w, dir, 0, err, sizeof err) < 0 && strstr(err, "UTF-8"));
    CHECK(st_writer_write(w, "/proc/no/such/dir", 0, err, sizeof err) == ST_ERR_IO);
    st_writer_free(w);
}

// ---- corruption classes --------------------------------------------------------------------------------------

static void test_corrupt_single_files(void) {
    char p[512], q[64];
    float data[6] = {1, 2, 3, 4, 5, 6};
    const char *good = "{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}";
    path_in(p, sizeof p, "good.safetensors");
    write_raw(p, strlen(good), good, data, 24);
    SafetensorsSet *s = NULL;
    char err[512];
    CHECK(st_open(&s, p, err, sizeof err) == 0 && st_count(s) == 1);
    st_close(s);

    // truncated data section: the tensor's bytes run past the end
    path_in(p, sizeof p, "truncated.safetensors");
    write_raw(p, strlen(good), good, data, 20);
    expect_refusal(__LINE__, p, "\"w\"", "truncated.safetensors");
    // truncated inside the length prefix
    path_in(p, sizeof p, "tiny.safetensors");
    write_text_file(p, "abc");
    expect_refusal(__LINE__, p, "tiny.safetensors", "too small");
    // header length beyond the file, and beyond the 100 MB limit
    path_in(p, sizeof p, "hlen.safetensors");
    write_raw(p, strlen(good) + 100, good, data, 24);
    expect_refusal(__LINE__, p, "hlen.safetensors", "header length");
    write_raw(p, 200000000ull, good, data, 24);
    expect_refusal(__LINE__, p, "hlen.safetensors", "100 MB");
    write_raw(p, UINT64_MAX, good, data, 24);
    expect_refusal(__LINE__, p, "hlen.safetensors", "header length");
    // bad JSON / not an object / empty header
    path_in(p, sizeof p, "badjson.safetensors");
    write_raw(p, 20, "{\"w\":{\"dtype\":\"F32\",", data, 24);
    expect_refusal(__LINE__, p, "badjson.safetensors", "JSON");
    write_raw(p, 3, "[1]", NULL, 0);
    expect_refusal(__LINE__, p, "badjson.safetensors", "object");
    write_raw(p, 0, "", NULL, 0);
    expect_refusal(__LINE__, p, "badjson.safetensors", "object");

    struct {
        const char *header;
        const char *needle;
    } cases[] = {
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,28]}}", "run past"},       // end > data
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[24,0]}}", "reversed"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,20]}}", "need 24"},        // size mismatch
        {"{\"w\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[0,24]}}", "need 12"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2,-3],\"data_offsets\":[0,24]}}", "shape[1]"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3.0],\"data_offsets\":[0,24]}}", "shape[1]"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":\"2x3\",\"data_offsets\":[0,24]}}", "shape"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,6],\"data_offsets\":[0,24]}}", "dims"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,16],\"data_offsets\":[0,24]}}", "overflow"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[9223372036854775807,9223372036854775807,0],\"data_offsets\":[0,0]}}",
         "overflow"},
        {"{\"w\":{\"dtype\":\"Q4_K\",\"shape\":[2,3],\"data_offsets\":[0,24]}}", "Q4_K"},
        {"{\"w\":{\"dtype\":7,\"shape\":[2,3],\"data_offsets\":[0,24]}}", "dtype"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3]}}", "data_offsets"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24,48]}}", "data_offsets"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[-4,20]}}", "data_offsets"},
        {"{\"w\":[1,2]}", "not an object"},
        {"{\"w\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,2]}}", "whole bytes"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
         "\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}", "duplicate"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"v\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", "overlaps"},
        {"{\"__metadata__\":{\"format\":1},\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}",
         "__metadata__"},
        {"{\"__metadata__\":[],\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}", "__metadata__"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(q, sizeof q, "case%02zu.safetensors", i);
        path_in(p, sizeof p, q);
        write_raw(p, strlen(cases[i].header), cases[i].header, data, 24);
        // every message names the file; tensor-level messages name "w" (or "v", the overlapping one)
        expect_refusal(__LINE__ + (int)i * 1000, p, q, cases[i].needle);
        if (strstr(cases[i].header, "__metadata__") == NULL) expect_refusal(__LINE__ + (int)i * 1000, p, "\"", "w");
    }

    // listed but not a parameter dtype: opening works, reading as a parameter is refused naming it
    const char *ints = "{\"__metadata__\":{\"format\":\"pt\"},\"ids\":{\"dtype\":\"I64\",\"shape\":[3],"
                       "\"data_offsets\":[0,24]},\"half\":{\"dtype\":\"F16\",\"shape\":[0],\"data_offsets\":[24,24]}}";
    path_in(p, sizeof p, "ints.safetensors");
    write_raw(p, strlen(ints), ints, data, 24);
    CHECK(st_open(&s, p, err, sizeof err) == 0);
    if (s) {
        const StTensor *t = st_find(s, "ids");
        float out[3];
        CHECK(t && t->dtype == ST_I64 && st_read_f32(t, out, 3, err, sizeof err) < 0);
        CHECK(strstr(err, "\"ids\"") && strstr(err, "I64") && strstr(err, "ints.safetensors"));
        CHECK(st_check_param(t, err, sizeof err) < 0);
    }
    st_close(s);

    // a missing file and a folder with neither entry file
    path_in(p, sizeof p, "nope.safetensors");
    expect_refusal(__LINE__, p, "nope.safetensors", NULL);
    path_in(p, sizeof p, "emptydir");
    mkdir(p, 0755);
    expect_refusal(__LINE__, p, "emptydir", "model.safetensors");
}

static void test_corrupt_shards(void) {
    char dir[512], p[700];
    float data[6] = {1, 2, 3, 4, 5, 6};
    const char *h1 = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
    const char *h2 = "{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
    const char *h2dup = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                        "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}";
    path_in(dir, sizeof dir, "badshards");
    mkdir(dir, 0755);
    snprintf(p, sizeof p, "%s/s1.safetensors", dir);
    write_raw(p, strlen(h1), h1, data, 8);
    snprintf(p, sizeof p, "%s/s2.safetensors", dir);
    write_raw(p, strlen(h2), h2, data, 8);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);

    write_text_file(p, "{\"weight_map\": {\"a\": \"s1.safetensors\", \"b\": \"s2.safetensors\"}}");
    SafetensorsSet *s = NULL;
    char err[512];
    CHECK(st_open(&s, dir, err, sizeof err) == 0 && st_count(s) == 2);
    st_close(s);

    // index naming a missing shard: the message names the file and the tensor
    write_text_file(p, "{\"weight_map\": {\"a\": \"s1.safetensors\", \"b\": \"s3.safetensors\"}}");
    expect_refusal(__LINE__, dir, "s3.safetensors", "\"b\"");
    // index naming a tensor its shard lacks
    write_text_file(p, "{\"weight_map\": {\"a\": \"s1.safetensors\", \"c\": \"s2.safetensors\"}}");
    expect_refusal(__LINE__, dir, "\"c\"", "s2.safetensors");
    // index naming the wrong shard
    write_text_file(p, "{\"weight_map\": {\"a\": \"s2.safetensors\", \"b\": \"s1.safetensors\"}}");
    expect_refusal(__LINE__, dir, "\"a\"", "s1.safetensors");
    // a path outside the folder, a non-string, bad JSON, no weight_map
    write_text_file(p, "{\"weight_map\": {\"a\": \"../s1.safetensors\"}}");
    expect_refusal(__LINE__, dir, "\"a\"", "file name");
    write_text_file(p, "{\"weight_map\": {\"a\": 5}}");
    expect_refusal(__LINE__, dir, "\"a\"", "index.json");
    write_text_file(p, "{\"weight_map\": {\"a\": \"s1.safetensors\",}");
    expect_refusal(__LINE__, dir, "index.json", "JSON");
    write_text_file(p, "{\"metadata\": {}}");
    expect_refusal(__LINE__, dir, "index.json", "weight_map");
    // the same tensor in two shards
    snprintf(p, sizeof p, "%s/s2.safetensors", dir);
    write_raw(p, strlen(h2dup), h2dup, data, 16);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    write_text_file(p, "{\"weight_map\": {\"a\": \"s1.safetensors\", \"b\": \"s2.safetensors\"}}");
    expect_refusal(__LINE__, dir, "\"a\"", "s2.safetensors");
    // a corrupt shard: the message names that shard
    snprintf(p, sizeof p, "%s/s2.safetensors", dir);
    write_raw(p, strlen(h2), h2, data, 4);
    expect_refusal(__LINE__, dir, "s2.safetensors", "\"b\"");
}

// Random byte flips and truncations of a valid in-memory file: every outcome is 0 or a refusal with a message.
static void test_mutations(void) {
    StWriter *w = make_writer();
    char dir[512], p[700], err[512];
    path_in(dir, sizeof dir, "mut");
    CHECK(st_writer_write(w, dir, 0, err, sizeof err) == 0);
    st_writer_free(w);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    FILE *f = fopen(p, "rb");
    unsigned char buf[4096];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    unsigned char mut[4096];
    unsigned seed = 12345;
    int accepted = 0, refused = 0;
    for (int it = 0; it < 3000; it++) {
        memcpy(mut, buf, n);
        size_t len = n;
        seed = seed * 1103515245u + 12345u;
        int flips = 1 + (seed >> 16) % 4;
        for (int k = 0; k < flips; k++) {
            seed = seed * 1103515245u + 12345u;
            size_t pos = (seed >> 8) % n;
            seed = seed * 1103515245u + 12345u;
            mut[pos] = (unsigned char)(seed >> 16);
        }
        if (it % 3 == 0) len = (seed >> 4) % (n + 1);
        SafetensorsSet *s = NULL;
        err[0] = '\0';
        int rc = st_parse_buffer(&s, mut, len, "mutant.safetensors", err, sizeof err);
        if (rc == 0) {
            accepted++;
            float out[64];
            for (size_t i = 0; i < st_count(s); i++) {
                const StTensor *t = st_tensor_at(s, i);
                if (t->numel <= 64) st_read_f32(t, out, (size_t)t->numel, err, sizeof err);
            }
        } else {
            refused++;
            CHECK(s == NULL && strstr(err, "mutant.safetensors") != NULL);
        }
        st_close(s);
    }
    CHECK(accepted > 0 && refused > 0);
}

static void remove_tree(const char *path) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", path);
}

int main(void) {
    if (!mkdtemp(root_dir)) {
        perror("mkdtemp");
        return 1;
    }
    fill_b();
    test_dtype_conversions();
    test_round_trip_single();
    test_round_trip_sharded();
    test_writer_refusals();
    test_corrupt_single_files();
    test_corrupt_shards();
    test_mutations();
    remove_tree(root_dir);
    return check_exit_code("test_safetensors");
}

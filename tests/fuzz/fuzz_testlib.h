// tests/fuzz/fuzz_testlib.h — what several fuzz targets share: REQUIRE (an invariant that must hold: a trap, so
// libFuzzer keeps the input), a UTF-8 validity check, and a small real tokenizer (byte-level BPE, one id per
// byte 0..255, "<s>" = 256 added in front by the post-processor, "</s>" = 257 the EOS token) loaded from a
// folder written once per process, as a model folder's tokenizer.json + tokenizer_config.json are.
#ifndef TANDEM_TESTS_FUZZ_TESTLIB_H
#define TANDEM_TESTS_FUZZ_TESTLIB_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shared/tokenizer/tokenizer.h"

#define REQUIRE(c) do { if (!(c)) { fprintf(stderr, "invariant failed: %s\n", #c); __builtin_trap(); } } while (0)

#define FUZZ_TOKENIZER_VOCAB 258

static inline int fuzz_valid_utf8(const char *s, size_t n) {
    size_t l = 0;
    char *r = tokenizer_utf8_repair(s, n, &l);
    int ok = r && l == n && memcmp(r, s, n) == 0;
    free(r);
    return ok;
}

// Byte b's character in byte-level BPE's vocabulary (GPT-2's bytes_to_unicode).
static inline unsigned fuzz_byte_char(int b) {
    int keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    if (keep) return (unsigned)b;
    unsigned n = 0;
    for (int x = 0; x < b; x++)
        if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) n++;
    return 256 + n;
}

// Writes the tokenizer into a new folder under /tmp, loads it and removes the folder. Traps on failure (the
// target cannot run without it).
static inline Tokenizer *fuzz_load_tokenizer(void) {
    char dir[] = "/tmp/tandem-fuzz-tokXXXXXX", path[64], cfg[64], err[512];
    REQUIRE(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", dir);
    FILE *f = fopen(path, "w");
    REQUIRE(f);
    fprintf(f, "{\"version\":\"1.0\",\"added_tokens\":["
               "{\"id\":256,\"content\":\"<s>\",\"single_word\":false,\"lstrip\":false,\"rstrip\":false,"
               "\"normalized\":false,\"special\":true},"
               "{\"id\":257,\"content\":\"</s>\",\"single_word\":false,\"lstrip\":false,\"rstrip\":false,"
               "\"normalized\":false,\"special\":true}],"
               "\"normalizer\":null,\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false,"
               "\"trim_offsets\":true,\"use_regex\":false},\"post_processor\":{\"type\":\"TemplateProcessing\","
               "\"single\":[{\"SpecialToken\":{\"id\":\"<s>\",\"type_id\":0}},{\"Sequence\":{\"id\":\"A\","
               "\"type_id\":0}}],\"pair\":[],\"special_tokens\":{\"<s>\":{\"id\":\"<s>\",\"ids\":[256],"
               "\"tokens\":[\"<s>\"]}}},\"decoder\":{\"type\":\"ByteLevel\"},"
               "\"model\":{\"type\":\"BPE\",\"dropout\":null,\"unk_token\":null,\"byte_fallback\":false,\"vocab\":{");
    for (int b = 0; b < 256; b++) {
        unsigned cp = fuzz_byte_char(b);
        fputc('"', f);
        if (cp == '"' || cp == '\\') fputc('\\', f);
        if (cp < 0x80) fputc((int)cp, f);
        else fprintf(f, "%c%c", (char)(0xC0 | (cp >> 6)), (char)(0x80 | (cp & 0x3F)));
        fprintf(f, "\":%d%s", b, b < 255 ? "," : "");
    }
    fprintf(f, "},\"merges\":[]}}");
    REQUIRE(fclose(f) == 0);
    f = fopen(cfg, "w");
    REQUIRE(f);
    fprintf(f, "{\"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}");
    REQUIRE(fclose(f) == 0);
    Tokenizer *tok = NULL;
    if (tokenizer_load(&tok, dir, err, sizeof err) != 0) {
        fprintf(stderr, "fuzz setup: %s\n", err);
        __builtin_trap();
    }
    unlink(path);
    unlink(cfg);
    rmdir(dir);
    return tok;
}

#endif

// tests/fuzz/fuzz_trainer_checkpoint_state.c — libFuzzer target for what a resume reads (trainer/checkpoint.h):
// trainer_state.json (checkpoint_state_from_json) and a rank's optimizer.safetensors (st_parse_buffer, then
// checkpoint_read_unit_state for each unit), with the readers checkpoint_load uses.
//
// Input: byte 0 = bits 0-1: units - 1, bits 2-5: elements per unit slice (0..15); the rest is the text of
// trainer_state.json, then optionally the 4 bytes FF FF FF FF (bytes a JSON text never holds) and the bytes of
// optimizer.safetensors.
// Checks: a refusal comes with a message naming the file; an accepted state has the documented ranges and
// survives checkpoint_state_to_json -> checkpoint_state_from_json unchanged; reading a unit's slices either
// fails with a message or succeeds within the file's bytes (ASan sees the rest).
// Built by CMake when configured with CC=clang -DTANDEM_FUZZ=ON -DTANDEM_CUDA=OFF.
#define _GNU_SOURCE   // memmem
#include <stdint.h>

#include "fuzz_testlib.h"
#include "shared/json_read.h"
#include "trainer/checkpoint.h"

static const unsigned char SEP[4] = {0xff, 0xff, 0xff, 0xff};

static void state(const char *text, size_t len) {
    json_error_t je;
    json_t *j = json_read_buffer(text, len, 0, &je);   // checkpoint_load: json_read_file(path, 0, ...)
    if (!j) return;
    CheckpointState st, again;
    char err[1024] = "";
    if (checkpoint_state_from_json(j, "trainer_state.json", &st, err, sizeof err) != 0) {
        REQUIRE(strstr(err, "trainer_state.json"));
        json_decref(j);
        return;
    }
    json_decref(j);
    const TrainProgress *p = &st.progress;
    REQUIRE(p->step >= 0 && p->epoch >= 0 && p->data_position >= 0 && st.world_size >= 1);
    json_t *out = checkpoint_state_to_json(&st);
    REQUIRE(out);
    REQUIRE(checkpoint_state_from_json(out, "again", &again, err, sizeof err) == 0);
    REQUIRE(memcmp(&st, &again, sizeof st) == 0);
    json_decref(out);
}

static void optimizer(const unsigned char *bytes, size_t len, int units, size_t n) {
    // An exact-size heap copy, so that a read one byte past the file is an ASan report.
    unsigned char *buf = malloc(len ? len : 1);
    REQUIRE(buf);
    if (len) memcpy(buf, bytes, len);
    SafetensorsSet *set = NULL;
    char err[1024] = "";
    if (st_parse_buffer(&set, buf, len, "optimizer.safetensors", err, sizeof err) == 0) {
        float master[16], adam_m[16], adam_v[16];
        for (int u = 0; u < units; u++) {
            err[0] = '\0';
            if (checkpoint_read_unit_state(set, "optimizer.safetensors", u, n, master, adam_m, adam_v, err,
                                           sizeof err) != 0)
                REQUIRE(err[0] != '\0');
        }
        st_close(set);
    } else {
        REQUIRE(err[0] != '\0');
    }
    free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const int units = 1 + (data[0] & 3);
    const size_t n = (data[0] >> 2) & 15;
    const uint8_t *rest = data + 1, *end = data + size;
    const uint8_t *sep = memmem(rest, (size_t)(end - rest), SEP, sizeof SEP);
    size_t json_len = (size_t)((sep ? sep : end) - rest);
    char *text = malloc(json_len ? json_len : 1);
    REQUIRE(text);
    memcpy(text, rest, json_len);
    state(text, json_len);
    free(text);
    if (sep) optimizer(sep + sizeof SEP, (size_t)(end - sep - sizeof SEP), units, n);
    return 0;
}

// tests/fuzz/fuzz_trainer_data_row.c — libFuzzer target for the training data (trainer/data.h): JSONL records as
// tandem-train reads them, one at a time (data_parse_row) and as whole files (data_open + data_next).
//
// Input: byte 0 = options: bit 0 sft, bit 1 a chat template (chatml; without one a message prompt is an error),
// bit 2 the whole-file mode, bits 3-4 world_size - 1 (the reader is rank world_size - 1), bit 5 shuffle. The rest
// is the text: one record (bit 2 clear), or a whole .jsonl file (bit 2 set: written to a memfd and opened by
// path, so the line scan and the re-reads are the reader's own). The tokenizer is fuzz_testlib.h's.
// Checks:
//   - one record: a refusal comes with a message naming the record and leaves the row empty; an accepted row has
//     ids in the vocabulary, a prompt of at least one token (sft: and at least one completion token after it),
//     valid UTF-8 prompt text, and columns without "prompt" / "messages";
//   - a file: data_open refuses with a message, or counts every line with a non-blank byte as a record, keeps
//     this rank's share (record % world_size == rank), and data_next hands out exactly those records, each the
//     row data_parse_row makes of its line.
// Built by CMake when configured with CC=clang -DTANDEM_FUZZ=ON -DTANDEM_CUDA=OFF.
#define _GNU_SOURCE   // memfd_create
#include <stdint.h>
#include <sys/mman.h>

#include "fuzz_testlib.h"
#include "trainer/data.h"

static Tokenizer *g_tok;
static ChatTemplate *g_chat;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    char err[512];
    g_tok = fuzz_load_tokenizer();
    if (chat_template_create(&g_chat, NULL, "chatml", "<s>", "</s>", err, sizeof err) != 0) {
        fprintf(stderr, "fuzz setup: %s\n", err);
        __builtin_trap();
    }
    return 0;
}

static void check_row(const DataOptions *opt, const DataRow *row) {
    REQUIRE(row->ids && row->n_ids >= 1 && row->prompt_len >= 1 && row->prompt_len <= row->n_ids);
    if (opt->sft) REQUIRE(row->prompt_len < row->n_ids);
    else REQUIRE(row->prompt_len == row->n_ids);
    for (size_t i = 0; i < row->n_ids; i++) REQUIRE(row->ids[i] >= 0 && row->ids[i] < FUZZ_TOKENIZER_VOCAB);
    REQUIRE(row->prompt_text && fuzz_valid_utf8(row->prompt_text, strlen(row->prompt_text)));
    REQUIRE(json_is_string(row->prompt) || json_is_array(row->prompt));
    REQUIRE(json_is_object(row->columns) && !json_object_get(row->columns, "prompt") &&
            !json_object_get(row->columns, "messages"));
}

static int same_row(const DataRow *a, const DataRow *b) {
    return a->n_ids == b->n_ids && a->prompt_len == b->prompt_len &&
           memcmp(a->ids, b->ids, a->n_ids * sizeof *a->ids) == 0 && strcmp(a->prompt_text, b->prompt_text) == 0 &&
           json_equal(a->prompt, b->prompt) && json_equal(a->columns, b->columns);
}

static void one_record(const DataOptions *opt, const char *text, size_t len) {
    DataRow row;
    char err[1024] = "";
    if (data_parse_row(opt, text, len, &row, "fuzz.jsonl:1", err, sizeof err) != 0) {
        REQUIRE(strstr(err, "fuzz.jsonl:1"));
        REQUIRE(!row.prompt && !row.prompt_text && !row.ids && !row.columns && row.n_ids == 0);
        return;
    }
    check_row(opt, &row);
    data_row_clear(&row);
}

// Where record r (0-based) of the file starts, counted as the reader documents it (data.h): every line with a
// byte other than ' ', '\t', '\r' is a record. Returns the number of records; starts[] gets the first ones.
static size_t count_records(const char *text, size_t len, size_t *starts, size_t max_starts) {
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        size_t e = i;
        int blank = 1;
        while (e < len && text[e] != '\n') blank &= text[e] == ' ' || text[e] == '\t' || text[e] == '\r', e++;
        if (!blank) {
            if (n < max_starts) starts[n] = i;
            n++;
        }
        i = e + 1;
    }
    return n;
}

static void whole_file(const DataOptions *opt, const char *text, size_t len) {
    int fd = memfd_create("fuzz.jsonl", MFD_CLOEXEC);
    REQUIRE(fd >= 0);
    REQUIRE(len == 0 || write(fd, text, len) == (ssize_t)len);
    char path[64], err[2048] = "";
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    enum { MAX_STARTS = 4096 };
    static size_t starts[MAX_STARTS];
    size_t total = count_records(text, len, starts, MAX_STARTS);
    DataReader *d = NULL;
    if (data_open(&d, path, opt, err, sizeof err) != 0) {
        REQUIRE(!d && err[0] != '\0');
        close(fd);
        return;
    }
    size_t world = (size_t)opt->world_size, rank = (size_t)opt->rank;
    REQUIRE(data_total_records(d) == total);
    REQUIRE(data_shard_records(d) == total / world + (rank < total % world));
    size_t handed = 0;
    DataRow row;
    int rc;
    while ((rc = data_next(d, &row, err, sizeof err)) == 1) {
        check_row(opt, &row);
        REQUIRE(row.record < total && row.record % world == rank);
        if (row.record < MAX_STARTS) {
            // The same row as the record's own text gives.
            size_t b = starts[row.record], e = b;
            while (e < len && text[e] != '\n') e++;
            DataRow again;
            REQUIRE(data_parse_row(opt, text + b, e - b, &again, "again", err, sizeof err) == 0);
            REQUIRE(same_row(&row, &again));
            data_row_clear(&again);
        }
        data_row_clear(&row);
        handed++;
    }
    REQUIRE(rc == 0 && handed == data_shard_records(d) && data_skipped(d) == 0);
    data_close(d);
    close(fd);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    DataOptions opt = {.tok = g_tok, .chat = (data[0] & 2) ? g_chat : NULL, .sft = data[0] & 1,
                       .world_size = 1 + ((data[0] >> 3) & 3), .seed = 7, .shuffle = (data[0] >> 5) & 1};
    opt.rank = opt.world_size - 1;
    // An exact-size heap copy, so that a read past the record is an ASan report.
    size_t len = size - 1;
    char *text = malloc(len ? len : 1);
    REQUIRE(text);
    memcpy(text, data + 1, len);
    if (data[0] & 4) whole_file(&opt, text, len);
    else one_record(&opt, text, len);
    free(text);
    return 0;
}

// tests/unit/test_trainer_data.c — the JSONL reader: sharding (rank r gets exactly the records g % N == r,
// across files of a folder, blank lines not counted), deterministic per-epoch shuffling and resume by
// data_seek, text and chat prompts (tokenized as TRL does), columns kept for rewards, max_prompt_length
// skip/refuse, sft rows (prompt/completion split, EOS appended), and every malformed line named by file:line
// when the reader opens, before any row is handed out (a bad line near the end of a long file included).
#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check_macros.h"
#include "trainer/data.h"
#include "testlib.h"
#include "trainer/remove_tree.h"

static char dir[64];

// A byte-level tokenizer with no merges: one id per byte (0..255), "<s>" = 256 added in front by the
// post-processor, "</s>" = 257. So a text prompt of n bytes has n + 1 ids.
static void write_tokenizer(const char *folder, int with_config) {
    char path[256];
    snprintf(path, sizeof path, "%s/tokenizer.json", folder);
    FILE *f = fopen(path, "w");
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
        int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        unsigned cp = (unsigned)b;
        if (!printable) {
            unsigned n = 0;
            for (int x = 0; x < b; x++)
                if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) n++;
            cp = 256 + n;
        }
        fputc('"', f);
        if (cp == '"' || cp == '\\') fputc('\\', f);
        if (cp < 0x80) fputc((int)cp, f);
        else fprintf(f, "%c%c", (char)(0xC0 | (cp >> 6)), (char)(0x80 | (cp & 0x3F)));
        fprintf(f, "\":%d%s", b, b < 255 ? "," : "");
    }
    fprintf(f, "},\"merges\":[]}}");
    fclose(f);
    if (with_config) {
        snprintf(path, sizeof path, "%s/tokenizer_config.json", folder);
        write_text_file(path, "{\"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}");
    }
}

static char *path_of(const char *name) {
    static char p[256];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return p;
}

static void write_file(const char *name, const char *text) { write_text_file(path_of(name), text); }

static DataOptions opts(const Tokenizer *tok, const ChatTemplate *ct) {
    DataOptions o = {.tok = tok, .chat = ct, .world_size = 1, .seed = 7};
    return o;
}

// Reads every row of the current epoch; returns the count and fills rec[] with the global record indices.
static int read_all(DataReader *d, uint64_t *rec, int cap) {
    DataRow row;
    char err[512];
    int n = 0, rc;
    while ((rc = data_next(d, &row, err, sizeof err)) == 1) {
        if (n < cap) rec[n] = row.record;
        n++;
        data_row_clear(&row);
    }
    if (rc < 0) {
        fprintf(stderr, "data_next: %s\n", err);
        failures++;
    }
    return n;
}

static void test_sharding(const Tokenizer *tok) {
    // 10 records in a.jsonl (blank and whitespace-only lines, CRLF, no final newline) + 5 in b.jsonl.
    write_file("shards/a.jsonl", "{\"prompt\": \"p0\"}\n\n{\"prompt\": \"p1\"}\r\n   \n{\"prompt\": \"p2\"}\n"
               "{\"prompt\": \"p3\"}\n{\"prompt\": \"p4\"}\n{\"prompt\": \"p5\"}\n{\"prompt\": \"p6\"}\n"
               "{\"prompt\": \"p7\"}\n{\"prompt\": \"p8\"}\n{\"prompt\": \"p9\"}");
    write_file("shards/b.jsonl", "{\"prompt\": \"p10\"}\n{\"prompt\": \"p11\"}\n{\"prompt\": \"p12\"}\n"
               "{\"prompt\": \"p13\"}\n{\"prompt\": \"p14\"}\n");
    write_file("shards/notes.txt", "not a shard\n");
    char err[512];
    for (int world = 1; world <= 4; world++) {
        int seen[15] = {0};
        for (int rank = 0; rank < world; rank++) {
            DataOptions o = opts(tok, NULL);
            o.rank = rank, o.world_size = world;
            DataReader *d = NULL;
            CHECK(data_open(&d, path_of("shards"), &o, err, sizeof err) == 0);
            if (!d) {
                fprintf(stderr, "open: %s\n", err);
                return;
            }
            CHECK(data_total_records(d) == 15);
            CHECK(data_shard_records(d) == (size_t)((15 - rank + world - 1) / world));
            uint64_t rec[15];
            int n = read_all(d, rec, 15);
            CHECK(n == (int)data_shard_records(d));
            for (int i = 0; i < n; i++) {
                CHECK(rec[i] % (uint64_t)world == (uint64_t)rank);
                if (rec[i] < 15) seen[rec[i]]++;
                if (i) CHECK(rec[i] > rec[i - 1]);  // no shuffle: stored order
            }
            data_close(d);
        }
        for (int g = 0; g < 15; g++) CHECK(seen[g] == 1);
    }
    // The record text and its source: record 12 is "p12" on line 3 of b.jsonl; line numbers count blanks.
    DataOptions o = opts(tok, NULL);
    DataReader *d = NULL;
    CHECK(data_open(&d, path_of("shards"), &o, err, sizeof err) == 0);
    DataRow row;
    for (int i = 0; i <= 12; i++) {
        CHECK(data_next(d, &row, err, sizeof err) == 1);
        if (i == 2) CHECK(strstr(row.source, "a.jsonl:5") != NULL);
        if (i < 12) data_row_clear(&row);
    }
    CHECK(row.record == 12 && strcmp(row.prompt_text, "p12") == 0 && strstr(row.source, "b.jsonl:3"));
    CHECK(row.n_ids == 4 && row.ids[0] == 256 && row.ids[1] == 'p' && row.ids[3] == '2' && row.prompt_len == 4);
    CHECK(json_is_object(row.columns) && json_object_size(row.columns) == 0);
    data_row_clear(&row);
    data_close(d);
    // More ranks than records: the empty rank is named.
    o.world_size = 16, o.rank = 15;
    CHECK(data_open(&d, path_of("shards"), &o, err, sizeof err) != 0 && strstr(err, "rank 15 has none"));
}

static void test_shuffle(const Tokenizer *tok) {
    char text[4096] = "";
    for (int i = 0; i < 40; i++) sprintf(text + strlen(text), "{\"prompt\": \"q%d\"}\n", i);
    write_file("shuf.jsonl", text);
    char err[512];
    DataOptions o = opts(tok, NULL);
    o.shuffle = 1, o.rank = 1, o.world_size = 2;
    uint64_t e0[20], e0b[20], e1[20], tail[20];
    DataReader *d = NULL, *d2 = NULL;
    CHECK(data_open(&d, path_of("shuf.jsonl"), &o, err, sizeof err) == 0);
    CHECK(data_open(&d2, path_of("shuf.jsonl"), &o, err, sizeof err) == 0);
    if (!d || !d2) return;
    CHECK(read_all(d, e0, 20) == 20);
    CHECK(read_all(d2, e0b, 20) == 20);
    CHECK(memcmp(e0, e0b, sizeof e0) == 0);  // same seed, epoch, rank: same order
    int sorted = 1, hits[40] = {0};
    for (int i = 0; i < 20; i++) {
        CHECK(e0[i] % 2 == 1);
        hits[e0[i]]++;
        if (i && e0[i] < e0[i - 1]) sorted = 0;
    }
    for (int g = 1; g < 40; g += 2) CHECK(hits[g] == 1);  // a permutation of the shard
    CHECK(!sorted);
    CHECK(data_seek(d, 1, 0, err, sizeof err) == 0);
    CHECK(read_all(d, e1, 20) == 20);
    CHECK(memcmp(e0, e1, sizeof e0) != 0);  // another epoch, another order
    // Resume in the middle of epoch 1: the rest equals the uninterrupted run.
    CHECK(data_seek(d2, 1, 7, err, sizeof err) == 0);
    uint64_t ep;
    size_t pos;
    data_tell(d2, &ep, &pos);
    CHECK(ep == 1 && pos == 7);
    CHECK(read_all(d2, tail, 20) == 13);
    CHECK(memcmp(tail, e1 + 7, 13 * sizeof(uint64_t)) == 0);
    data_tell(d2, &ep, &pos);
    CHECK(pos == 20);
    CHECK(data_seek(d2, 1, 21, err, sizeof err) != 0 && strstr(err, "past the end"));
    data_close(d2);
    // Another seed gives another order.
    o.seed = 8;
    CHECK(data_open(&d2, path_of("shuf.jsonl"), &o, err, sizeof err) == 0);
    CHECK(read_all(d2, e0b, 20) == 20);
    CHECK(memcmp(e0, e0b, sizeof e0) != 0);
    data_close(d2);
    data_close(d);
}

static void test_prompts(const Tokenizer *tok, const ChatTemplate *ct) {
    write_file("chat.jsonl",
               "{\"prompt\": [{\"role\": \"user\", \"content\": \"hi\"}], \"answer\": \"42\", \"id\": 7}\n"
               "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"q\"}]}\n"
               "{\"prompt\": \"0123456789\", \"answer\": 5}\n"
               "{\"prompt\": \"short\"}\n");
    char err[512];
    DataOptions o = opts(tok, ct);
    o.max_prompt_length = 8;  // "0123456789" is 11 ids with BOS: skipped
    DataReader *d = NULL;
    CHECK(data_open(&d, path_of("chat.jsonl"), &o, err, sizeof err) == 0);
    if (!d) return;
    DataRow row;
    // The chatml rendering is longer than 8 ids too: only "short" (6 ids) passes.
    CHECK(data_next(d, &row, err, sizeof err) == 1);
    CHECK(strcmp(row.prompt_text, "short") == 0 && row.n_ids == 6);
    data_row_clear(&row);
    CHECK(data_next(d, &row, err, sizeof err) == 0);
    CHECK(data_skipped(d) == 3);
    data_close(d);

    o.max_prompt_length = 0;
    CHECK(data_open(&d, path_of("chat.jsonl"), &o, err, sizeof err) == 0);
    CHECK(data_next(d, &row, err, sizeof err) == 1);
    const char *want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    CHECK(strcmp(row.prompt_text, want) == 0);
    // Chat prompts are tokenized without special tokens: no BOS, one id per byte.
    CHECK(row.n_ids == strlen(want) && row.ids[0] == '<');
    CHECK(json_is_array(row.prompt) && json_array_size(row.prompt) == 1);
    CHECK(json_object_size(row.columns) == 2);
    CHECK(strcmp(json_string_value(json_object_get(row.columns, "answer")), "42") == 0);
    CHECK(json_integer_value(json_object_get(row.columns, "id")) == 7);
    data_row_clear(&row);
    CHECK(data_next(d, &row, err, sizeof err) == 1);
    CHECK(strcmp(row.prompt_text, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
                                  "<|im_start|>assistant\n") == 0);
    data_row_clear(&row);
    CHECK(data_next(d, &row, err, sizeof err) == 1);
    CHECK(json_integer_value(json_object_get(row.columns, "answer")) == 5 && row.n_ids == 11);
    data_row_clear(&row);
    data_close(d);

    // Every valid JSON number is read (shared/json_read.h): a column beyond int64 (jansson alone called the line
    // invalid JSON) is kept as the nearest double.
    write_file("bignum.jsonl", "{\"prompt\": \"p\", \"id\": 1000000000000000019884624838656, \"w\": 1e400}\n");
    CHECK(data_open(&d, path_of("bignum.jsonl"), &o, err, sizeof err) == 0);
    if (d) {
        CHECK(data_next(d, &row, err, sizeof err) == 1);
        CHECK(json_is_real(json_object_get(row.columns, "id")) &&
              json_real_value(json_object_get(row.columns, "id")) == 1e30);
        CHECK(json_real_value(json_object_get(row.columns, "w")) == DBL_MAX);
        data_row_clear(&row);
        data_close(d);
    }

    // refuse_overlong: an error at open naming file:line, the length and the option, and the other two.
    o.max_prompt_length = 8, o.refuse_overlong = 1;
    CHECK(data_open(&d, path_of("chat.jsonl"), &o, err, sizeof err) != 0 && d == NULL);
    CHECK(strstr(err, "chat.jsonl:1") && strstr(err, "max_prompt_length 8") && strstr(err, "tokens"));
    CHECK(strstr(err, "and 2 more bad lines") && strstr(err, "the next at") && strstr(err, "chat.jsonl:2"));
}

static void expect_bad_line(const Tokenizer *tok, const ChatTemplate *ct, int sft, const char *line,
                            const char *needle, int lineno) {
    char text[1024];
    snprintf(text, sizeof text, "{\"prompt\": \"ok\", \"completion\": \"c\"}\n\n%s\n", line);
    write_file("bad.jsonl", text);
    DataOptions o = opts(tok, ct);
    o.sft = sft;
    DataReader *d = NULL;
    char err[512] = "", where[64];
    snprintf(where, sizeof where, "bad.jsonl:3");
    int rc = data_open(&d, path_of("bad.jsonl"), &o, err, sizeof err);
    if (rc == 0 || d != NULL || !strstr(err, where) || !strstr(err, needle) || strstr(err, "more bad line")) {
        fprintf(stderr, "line %d: expected data_open to fail at %s mentioning '%s'; got rc %d '%s'\n", lineno, where,
                needle, rc, err);
        failures++;
    }
    data_close(d);
}

// A bad line near the end of a long file stops data_open, before any row is read (it used to surface only when
// the reader reached it, hundreds of steps in); the message counts the other bad lines and names the next one.
// With 2 ranks, each checks its own share: the rank that does not read the bad lines opens fine.
static void test_bad_line_near_the_end(const Tokenizer *tok) {
    FILE *f = fopen(path_of("long.jsonl"), "w");
    for (int line = 1; line <= 500; line++) {
        if (line == 497 || line == 499) fprintf(f, "{\"prompt\": \"row %d\", }\n", line);
        else fprintf(f, "{\"prompt\": \"row %d\", \"answer\": %d}\n", line, line);
    }
    fclose(f);
    DataOptions o = opts(tok, NULL);
    DataReader *d = NULL;
    char err[512] = "";
    CHECK(data_open(&d, path_of("long.jsonl"), &o, err, sizeof err) != 0 && d == NULL);
    CHECK(strstr(err, "long.jsonl:497: invalid JSON") != NULL);
    CHECK(strstr(err, "and 1 more bad line in this rank's share, the next at") && strstr(err, "long.jsonl:499)"));
    // Records 496 and 498 (lines 497 and 499) are rank 0's of 2: rank 1 never reads them.
    o.world_size = 2, o.rank = 1;
    CHECK(data_open(&d, path_of("long.jsonl"), &o, err, sizeof err) == 0 && data_shard_records(d) == 250);
    data_close(d);
    o.rank = 0;
    CHECK(data_open(&d, path_of("long.jsonl"), &o, err, sizeof err) != 0 && strstr(err, "long.jsonl:497"));
}

static void test_bad_lines(const Tokenizer *tok, const ChatTemplate *ct) {
    expect_bad_line(tok, ct, 0, "{\"prompt\": \"x\",}", "invalid JSON", __LINE__);
    expect_bad_line(tok, ct, 0, "[1, 2]", "must be a JSON object", __LINE__);
    expect_bad_line(tok, ct, 0, "{\"prompt\": \"a\", \"prompt\": \"b\"}", "invalid JSON", __LINE__);
    expect_bad_line(tok, ct, 0, "{\"question\": \"x\"}", "no \"prompt\" or \"messages\"", __LINE__);
    expect_bad_line(tok, ct, 0, "{\"prompt\": \"x\", \"messages\": []}", "both", __LINE__);
    expect_bad_line(tok, ct, 0, "{\"prompt\": 5}", "\"prompt\" must be a string or a list", __LINE__);
    expect_bad_line(tok, ct, 0, "{\"messages\": \"hi\"}", "\"messages\" must be a list", __LINE__);
    expect_bad_line(tok, ct, 0, "{\"prompt\": []}", "empty list", __LINE__);
    expect_bad_line(tok, ct, 0, "{\"prompt\": [{\"role\": \"user\"}]}", "\"prompt\"[0]", __LINE__);
    expect_bad_line(tok, ct, 0, "{\"prompt\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\"}]}]}",
                    "string \"role\" and \"content\"", __LINE__);
    expect_bad_line(tok, ct, 0, "{\"prompt\": [{\"role\": \"robot\", \"content\": \"x\"}]}", "chat template",
                    __LINE__);
    expect_bad_line(tok, NULL, 0, "{\"prompt\": [{\"role\": \"user\", \"content\": \"x\"}]}",
                    "no chat template is loaded", __LINE__);
    expect_bad_line(tok, ct, 1, "{\"prompt\": \"x\"}", "sft needs a \"completion\"", __LINE__);
    expect_bad_line(tok, ct, 1, "{\"prompt\": \"x\", \"completion\": [{\"role\": \"assistant\", \"content\": \"y\"}]}",
                    "\"completion\" must be a string for a text prompt", __LINE__);
    expect_bad_line(tok, ct, 1, "{\"prompt\": \"x\", \"completion\": 3}", "\"completion\" must be", __LINE__);
    expect_bad_line(tok, ct, 1, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}",
                    "ending with an assistant message", __LINE__);
    expect_bad_line(tok, ct, 1, "{\"question\": \"x\"}", "no \"prompt\", \"messages\" or \"text\" (dataset_text_field)",
                    __LINE__);
    expect_bad_line(tok, ct, 1, "{\"text\": 3}", "\"text\" (dataset_text_field) must be a string", __LINE__);
}

static void test_sft(const Tokenizer *tok, const ChatTemplate *ct) {
    write_file("sft.jsonl",
               "{\"prompt\": \"Q:\", \"completion\": \" A\"}\n"
               "{\"prompt\": \"Q:\", \"completion\": \" A</s>\"}\n"
               "{\"prompt\": [{\"role\": \"user\", \"content\": \"hi\"}], \"completion\": \"yo\"}\n"
               "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": "
               "\"yo\"}], \"tag\": 1}\n");
    char err[512];
    DataOptions o = opts(tok, ct);
    o.sft = 1;
    DataReader *d = NULL;
    CHECK(data_open(&d, path_of("sft.jsonl"), &o, err, sizeof err) == 0);
    if (!d) {
        fprintf(stderr, "open: %s\n", err);
        return;
    }
    DataRow row;
    // "<s>Q: A</s>": BOS, 'Q', ':', ' ', 'A', EOS (257); the completion starts after "Q:".
    for (int k = 0; k < 2; k++) {  // the second row already ends with the EOS text: not doubled
        CHECK(data_next(d, &row, err, sizeof err) == 1);
        CHECK(row.n_ids == 6 && row.prompt_len == 3 && row.loss_start == 3);
        if (row.n_ids == 6)
            CHECK(row.ids[0] == 256 && row.ids[1] == 'Q' && row.ids[3] == ' ' && row.ids[4] == 'A' && row.ids[5] == 257);
        data_row_clear(&row);
    }
    const char *p = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    const char *full = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n";
    for (int k = 0; k < 2; k++) {  // a string completion after messages, and a conversation's last turn
        CHECK(data_next(d, &row, err, sizeof err) == 1);
        CHECK(row.prompt_len == strlen(p) && row.n_ids == strlen(full));
        // A prompt/completion row learns its completion; a conversation (TRL's language modelling) every token.
        CHECK(row.loss_start == (k == 0 ? strlen(p) : 0));
        CHECK(row.n_ids == strlen(full) && memcmp(row.ids + row.prompt_len, (const int32_t[]){'y', 'o'}, 8) == 0);
        CHECK(strcmp(row.prompt_text, p) == 0 && json_array_size(row.prompt) == 1);
        if (k == 1) CHECK(json_integer_value(json_object_get(row.columns, "tag")) == 1);
        data_row_clear(&row);
    }
    CHECK(data_next(d, &row, err, sizeof err) == 0);
    data_close(d);
}

// SFTConfig's dataset_text_field, completion_only_loss false, max_length with either truncation_mode.
static void test_sft_trl_options(const Tokenizer *tok, const ChatTemplate *ct) {
    write_file("sft_lm.jsonl",
               "{\"body\": \"abc\"}\n"
               "{\"prompt\": \"Q:\", \"completion\": \" A\"}\n"
               "{\"prompt\": \"0123456789\", \"completion\": \"x\"}\n");
    char err[512];
    DataOptions o = opts(tok, ct);
    o.sft = 1, o.text_field = "body", o.prompt_loss = 1;
    DataReader *d = NULL;
    CHECK(data_open(&d, path_of("sft_lm.jsonl"), &o, err, sizeof err) == 0);
    if (!d) {
        fprintf(stderr, "open: %s\n", err);
        return;
    }
    DataRow row;
    // "<s>abc</s>": BOS, a, b, c, EOS; every token learned.
    CHECK(data_next(d, &row, err, sizeof err) == 1);
    CHECK(row.n_ids == 5 && row.ids[0] == 256 && row.ids[1] == 'a' && row.ids[4] == 257 && row.loss_start == 0);
    data_row_clear(&row);
    // completion_only_loss false: the prompt is learned too.
    CHECK(data_next(d, &row, err, sizeof err) == 1);
    CHECK(row.n_ids == 6 && row.prompt_len == 3 && row.loss_start == 0);
    data_row_clear(&row);
    data_close(d);

    // max_length 5, completion only: "<s>Q: A</s>" keeps "<s>Q: A"; "<s>0123456789x</s>" keeps only prompt
    // tokens, nothing to learn: dropped as TRL drops it (counted as skipped).
    o.prompt_loss = 0, o.max_length = 5;
    CHECK(data_open(&d, path_of("sft_lm.jsonl"), &o, err, sizeof err) == 0);
    CHECK(data_next(d, &row, err, sizeof err) == 1);
    CHECK(row.n_ids == 5 && row.loss_start == 0);
    data_row_clear(&row);
    CHECK(data_next(d, &row, err, sizeof err) == 1);
    CHECK(row.n_ids == 5 && row.prompt_len == 3 && row.loss_start == 3 && row.ids[4] == 'A');
    data_row_clear(&row);
    CHECK(data_next(d, &row, err, sizeof err) == 0 && data_skipped(d) == 1);
    data_close(d);
    // keep_end: the last 5 tokens, "789x</s>" of the long row; its prompt and loss start move with the cut.
    o.keep_end = 1;
    CHECK(data_open(&d, path_of("sft_lm.jsonl"), &o, err, sizeof err) == 0);
    for (int k = 0; k < 3; k++) {
        CHECK(data_next(d, &row, err, sizeof err) == 1);
        if (k == 1) CHECK(row.n_ids == 5 && row.ids[0] == 'Q' && row.prompt_len == 2 && row.loss_start == 2);
        if (k == 2)
            CHECK(row.n_ids == 5 && row.ids[0] == '7' && row.ids[3] == 'x' && row.ids[4] == 257 && row.prompt_len == 3 &&
                  row.loss_start == 3);
        data_row_clear(&row);
    }
    data_close(d);
}

static void test_open_errors(const Tokenizer *tok) {
    char err[512];
    DataOptions o = opts(tok, NULL);
    DataReader *d = NULL;
    CHECK(data_open(&d, path_of("missing.jsonl"), &o, err, sizeof err) != 0 && strstr(err, "missing.jsonl") &&
          strstr(err, "train_file"));
    CHECK(data_open(&d, path_of("empty_dir"), &o, err, sizeof err) != 0 && strstr(err, "holds no *.jsonl"));
    write_file("blank.jsonl", "\n  \n\t\n");
    CHECK(data_open(&d, path_of("blank.jsonl"), &o, err, sizeof err) != 0 && strstr(err, "holds no record"));
    CHECK(data_open(&d, "", &o, err, sizeof err) != 0 && strstr(err, "train_file"));
    o.rank = 2;
    CHECK(data_open(&d, path_of("blank.jsonl"), &o, err, sizeof err) != 0 && strstr(err, "rank"));
    CHECK(d == NULL);
}

int main(void) {
    snprintf(dir, sizeof dir, "/tmp/tandem_data_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    char sub[128];
    snprintf(sub, sizeof sub, "%s/shards", dir);
    mkdir(sub, 0700);
    snprintf(sub, sizeof sub, "%s/shards/nested.jsonl", dir);  // a folder named like a shard is not read
    mkdir(sub, 0700);
    snprintf(sub, sizeof sub, "%s/empty_dir", dir);
    mkdir(sub, 0700);
    snprintf(sub, sizeof sub, "%s/model", dir);
    mkdir(sub, 0700);
    write_tokenizer(sub, 1);

    char err[512];
    Tokenizer *tok = NULL;
    ChatTemplate *ct = NULL;
    if (tokenizer_load(&tok, sub, err, sizeof err) != 0 ||
        chat_template_create(&ct, NULL, "chatml", "<s>", "</s>", err, sizeof err) != 0) {
        fprintf(stderr, "setup: %s\n", err);
        remove_tree(dir, NULL, 0);
        return 1;
    }
    test_sharding(tok);
    test_shuffle(tok);
    test_prompts(tok, ct);
    test_bad_lines(tok, ct);
    test_sft_trl_options(tok, ct);
    test_bad_line_near_the_end(tok);
    test_sft(tok, ct);
    test_open_errors(tok);
    chat_template_free(ct);
    tokenizer_free(tok);
    remove_tree(dir, NULL, 0);
    return check_exit_code("test_trainer_data");
}

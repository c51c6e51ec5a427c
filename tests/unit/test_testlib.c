// test_testlib.c — the unit tests' own library: check_macros.h and testlib.c.
//   - every check passes on what is right and counts exactly one failure on what is wrong (NaN included for the
//     float checks); REQUIRE ends the process with exit code 1; check_exit_code follows the failure count;
//   - a tiny model written to a folder loads back (model_load, CPU) with the weights tiny_model_init gives for the
//     same seed, bit for bit; its tokenizer encodes one id per character and decodes back to the text; a character
//     that is not printable ASCII is refused;
//   - text files round-trip, a long one too; a missing file reads as NULL;
//   - a loopback listening socket takes a connection on the port it reports.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_macros.h"
#include "kernels/ops.h"
#include "shared/model.h"
#include "shared/tokenizer/tokenizer.h"
#include "testlib.h"

static const char *LLAMA =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 40, \"hidden_size\": 32, \"intermediate_size\": 48,"
    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2,"
    " \"max_position_embeddings\": 64, \"rms_norm_eps\": 1e-6, \"tie_word_embeddings\": false}";
static const char *CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .\"\\";

// Sends fd (stdout or stderr) to /dev/null; returns a copy of what it was, for unsilence.
static int silence(int fd) {
    fflush(stdout);
    fflush(stderr);
    const int saved = dup(fd), null_fd = open("/dev/null", O_WRONLY);
    REQUIRE(saved >= 0 && null_fd >= 0, "cannot redirect fd %d", fd);
    dup2(null_fd, fd);
    close(null_fd);
    return saved;
}

static void unsilence(int fd, int saved) {
    fflush(stdout);
    fflush(stderr);
    dup2(saved, fd);
    close(saved);
}

static int quiet_stderr = -1, quiet_from = 0;

// The failures counted between quiet_begin and quiet_end (expected ones: their FAIL lines go to /dev/null), taken
// back out of the test's count.
static void quiet_begin(void) {
    quiet_stderr = silence(STDERR_FILENO);
    quiet_from = failures;
}

static int quiet_end(void) {
    unsilence(STDERR_FILENO, quiet_stderr);
    const int counted = failures - quiet_from;
    failures = quiet_from;
    return counted;
}

static void test_checks_pass(void) {
    const int before = failures;
    const double want[3] = {1.0, -2.0, 1000.0};
    const float got[3] = {1.0f, -2.0f, 1000.0001f};
    CHECK(1 + 1 == 2);
    CHECK(1 + 1 == 2, "with a message %d", 2);
    CHECK_EQ((size_t)7, 7);
    CHECK_EQ(UINT64_MAX, UINT64_MAX);
    CHECK_NEAR(0.1 + 0.2, 0.3, 1e-12);
    CHECK(check_close_abs("exact", got, want, 2, 0.0, 0.0) == 1);
    CHECK(check_close_abs("relative", got, want, 3, 1e-6, 0.0) == 1);
    CHECK(check_close("scaled", got, want, 3, 0.0, 1e-6) == 1);
    CHECK(check_close_abs("empty", got, want, 0, 0.0, 0.0) == 1);
    REQUIRE(1, "never");
    CHECK_EQ(failures, before);
}

static void test_checks_fail(void) {
    const double want[3] = {1.0, -2.0, 1000.0};
    const float off[3] = {1.0f, -2.5f, 1000.0f}, nan_row[3] = {1.0f, NAN, 1000.0f};
    quiet_begin();
    CHECK(1 + 1 == 3);
    int caught = quiet_end();
    CHECK_EQ(caught, 1);
    quiet_begin();
    CHECK(1 + 1 == 3, "with a message %s", "and an argument");
    CHECK_EQ(2 + 2, 5);
    CHECK_EQ(-1, UINT64_MAX - 1);
    CHECK_NEAR(1.0, 1.1, 0.01);
    CHECK_NEAR(NAN, NAN, 1.0);
    CHECK_NEAR(1.0, NAN, 1.0);
    caught = quiet_end();
    CHECK_EQ(caught, 6);
    quiet_begin();
    const int off_passed = check_close_abs("off", off, want, 3, 1e-3, 1e-3);
    const int nan_passed = check_close_abs("nan", nan_row, want, 3, 1.0, 1.0);
    const int scaled_passed = check_close("scaled", off, want, 3, 0.0, 1e-4);
    caught = quiet_end();
    CHECK_EQ(caught, 3);
    CHECK(!off_passed && !nan_passed && !scaled_passed, "a failed comparison returned 1");

    const int counted = failures, saved_stdout = silence(STDOUT_FILENO), saved_stderr = silence(STDERR_FILENO);
    failures = 2;
    const int failed_code = check_exit_code("test_testlib (a count of 2)");
    failures = 0;
    const int passed_code = check_exit_code("test_testlib (a count of 0)");
    failures = counted;
    unsilence(STDERR_FILENO, saved_stderr);
    unsilence(STDOUT_FILENO, saved_stdout);
    CHECK(failed_code == 1 && passed_code == 0, "check_exit_code: %d with failures, %d without", failed_code,
          passed_code);

    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    if (pid == 0) {
        silence(STDERR_FILENO);
        REQUIRE(1 + 1 == 3, "expected to end the child");
        _exit(0);
    }
    int st = 0;
    CHECK(pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 1,
          "REQUIRE on a false condition: the child did not exit with 1");
}

static void test_tiny_model(const char *root) {
    char err[512], dir[4096];
    snprintf(dir, sizeof dir, "%s/model", root);
    REQUIRE(tiny_model_write_random(dir, LLAMA, 17, 0.1f, err, sizeof err) == 0, "%s", err);
    OpsCtx *ops;
    Model made, loaded;
    ResidentWeights made_w, loaded_w;
    REQUIRE(ops_create(&ops, OPS_BACKEND_CPU, 0, err, sizeof err) == 0, "%s", err);
    REQUIRE(tiny_model_init(&made, &made_w, ops, LLAMA, 0, 17, 0.1f, err, sizeof err) == 0, "%s", err);
    REQUIRE(model_load(&loaded, &loaded_w, ops, dir, err, sizeof err) == 0, "%s", err);
    CHECK_EQ(loaded.cfg.vocab_size, 40);
    CHECK_EQ(loaded.cfg.num_layers, 2);
    CHECK_EQ(loaded.layout.n_units, made.layout.n_units);
    for (int u = 0; u < made.layout.n_units && u < loaded.layout.n_units; u++)
        CHECK(memcmp(made_w.params[u], loaded_w.params[u], made.layout.unit_numel[u] * sizeof(float)) == 0,
              "unit %d differs after a write and a load", u);
    // Another seed gives other weights: the comparison above can fail.
    Model other;
    ResidentWeights other_w;
    REQUIRE(tiny_model_init(&other, &other_w, ops, LLAMA, 0, 18, 0.1f, err, sizeof err) == 0, "%s", err);
    CHECK(memcmp(made_w.params[0], other_w.params[0], made.layout.unit_numel[0] * sizeof(float)) != 0,
          "seeds 17 and 18 gave the same unit 0");
    tiny_model_free(&other, &other_w);
    tiny_model_free(&loaded, &loaded_w);
    tiny_model_free(&made, &made_w);
    ops_destroy(ops);

    Tokenizer *tok = NULL;
    REQUIRE(tiny_tokenizer_write(dir, CHARS, err, sizeof err) == 0, "%s", err);
    REQUIRE(tokenizer_load(&tok, dir, err, sizeof err) == 0, "%s", err);
    const char *text = "a \"b\\\" 9.";
    int32_t *ids = NULL;
    size_t n = 0, len = 0;
    char *back = NULL;
    CHECK(tokenizer_encode(tok, text, strlen(text), 0, &ids, &n, err, sizeof err) == 0, "%s", err);
    CHECK_EQ(n, strlen(text));
    for (size_t i = 0; i < n && i < strlen(text); i++)
        CHECK(ids[i] == (int32_t)(strchr(CHARS, text[i]) - CHARS), "id %zu is %d for '%c'", i, ids[i], text[i]);
    CHECK(tokenizer_decode(tok, ids, n, 0, &back, &len, err, sizeof err) == 0 && strcmp(back, text) == 0,
          "decoded \"%s\", want \"%s\" (%s)", back ? back : "", text, err);
    free(back);
    free(ids);
    tokenizer_free(tok);
    CHECK(tiny_tokenizer_write(dir, "ab\tc", err, sizeof err) != 0 && strstr(err, "character 2"),
          "a tab was taken: %s", err);
}

static void test_text_files(const char *root) {
    char path[4096];
    snprintf(path, sizeof path, "%s/notes.txt", root);
    write_text_file(path, "one\ntwo\n");
    char *text = read_text_file(path);
    CHECK(text && strcmp(text, "one\ntwo\n") == 0, "read back \"%s\"", text ? text : "(null)");
    free(text);
    const size_t n = 20000;
    char *long_text = xmalloc(n + 1);
    for (size_t i = 0; i < n; i++) long_text[i] = (char)('a' + i % 26);
    long_text[n] = '\0';
    write_text_file(path, long_text);
    text = read_text_file(path);
    CHECK(text && strcmp(text, long_text) == 0, "a %zu-byte file read back as %zu bytes", n, text ? strlen(text) : 0);
    free(text);
    free(long_text);
    snprintf(path, sizeof path, "%s/missing.txt", root);
    CHECK(read_text_file(path) == NULL);
}

static void test_listen_loopback(void) {
    int port = 0;
    const int lfd = listen_loopback(1, &port);
    CHECK(lfd >= 0 && port > 0, "listening fd %d, port %d", lfd, port);
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    CHECK(fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0, "cannot connect to port %d", port);
    close(fd);
    close(lfd);
}

int main(void) {
    test_checks_pass();
    test_checks_fail();
    char root[64];
    REQUIRE(temp_dir_make("tandem_testlib", root, sizeof root) == 0, "temp_dir_make");
    test_tiny_model(root);
    test_text_files(root);
    test_listen_loopback();
    static const char *const written[] = {"model/config.json", "model/model.safetensors", "model/tokenizer.json",
                                          "model", "notes.txt"};
    for (size_t i = 0; i < sizeof written / sizeof *written; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", root, written[i]);
        CHECK(remove(path) == 0, "cannot remove %s: the folder holds something else", path);
    }
    CHECK(rmdir(root) == 0, "%s holds more than the test wrote", root);
    return check_exit_code("test_testlib");
}

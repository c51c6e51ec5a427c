// test_trainer_metrics_trim.c — at resume from checkpoint-N, metrics.jsonl keeps only the rows of steps <= N
// (issue 22: a resumed run appended steps N+1.. a second time).
//
// A file with rows 1..6, a blank line and a row cut short by the stop, trimmed at step 4: rows 1..4 stay byte for
// byte, the two later rows and the cut one are counted and removed, no .tmp is left. A file with nothing to
// remove is not rewritten (same inode); a missing file is fine.
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check_macros.h"
#include "testlib.h"
#include "trainer/metrics_trim.h"
#include "trainer/remove_tree.h"

static const char *ROWS_1_TO_4 =
    "{\"loss\":1.5,\"step\":1,\"elapsed\":0.1}\n"
    "{\"step\":2,\"loss\":1.25}\n"
    "{\"loss\":1e400,\"step\":3}\n"
    "{\"step\":4,\"rewards/x/mean\":0.5}\n";

// Checks that the file at path holds exactly `want`.
static void check_holds(const char *path, const char *want) {
    char *text = read_text_file(path);
    REQUIRE(text, "read %s", path);
    CHECK(strcmp(text, want) == 0, "%s holds:\n%s\nwant:\n%s", path, text, want);
    free(text);
}

int main(void) {
    char root[] = "/tmp/tandem_metrics_trim_XXXXXX";
    REQUIRE(mkdtemp(root), "mkdtemp");
    char path[PATH_MAX], tmp[PATH_MAX + 8], err[512];
    snprintf(path, sizeof path, "%s/metrics.jsonl", root);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);

    char text[4096];
    snprintf(text, sizeof text, "%s{\"step\":5,\"loss\":1}\n\n{\"step\":6,\"loss\":0.9}\n{\"step\":7,\"lo", ROWS_1_TO_4);
    write_text_file(path, text);
    MetricsTrim t;
    CHECK(metrics_trim_after_step(path, 4, &t, err, sizeof err) == 0, "trim: %s", err);
    CHECK(t.kept == 4 && t.later == 2 && t.unreadable == 1, "counts: kept %zu, later %zu, unreadable %zu", t.kept,
          t.later, t.unreadable);
    check_holds(path, ROWS_1_TO_4);
    CHECK(access(tmp, F_OK) != 0, "%s left behind", tmp);

    // Nothing to remove: the file is not rewritten.
    struct stat before, after;
    REQUIRE(stat(path, &before) == 0, "stat");
    CHECK(metrics_trim_after_step(path, 4, &t, err, sizeof err) == 0, "second trim: %s", err);
    REQUIRE(stat(path, &after) == 0, "stat");
    CHECK(t.kept == 4 && t.later == 0 && t.unreadable == 0, "second trim counts");
    CHECK(before.st_ino == after.st_ino, "a file with nothing to remove was rewritten");

    // Trimming to an earlier step; then a file that does not exist.
    CHECK(metrics_trim_after_step(path, 1, &t, err, sizeof err) == 0 && t.kept == 1 && t.later == 3, "trim at 1");
    check_holds(path, "{\"loss\":1.5,\"step\":1,\"elapsed\":0.1}\n");
    remove(path);
    CHECK(metrics_trim_after_step(path, 3, &t, err, sizeof err) == 0 && t.kept == 0, "a missing file: %s", err);
    CHECK(access(path, F_OK) != 0, "a missing file was created");

    remove_tree(root, NULL, 0);
    return check_exit_code("test_trainer_metrics_trim");
}

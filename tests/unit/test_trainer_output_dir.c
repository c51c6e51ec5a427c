// test_trainer_output_dir.c — what a new run does about an earlier run in its --output-dir (trainer/output_dir.h):
// a folder with a non-empty metrics.jsonl or checkpoint-N folders is refused (the message names them and the
// three ways on), resume passes, --overwrite-output-dir deletes exactly tandem-train's files (other files, a
// folder merely named checkpoint-best, and what a symbolic link points to stay), an empty metrics.jsonl is no
// earlier run, and a resume folder inside the folder to clear is refused.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check_macros.h"
#include "testlib.h"
#include "trainer/output_dir.h"
#include "trainer/remove_tree.h"

static char root[64];

static const char *at(const char *name) {
    static char p[8][256];
    static int k;
    k = (k + 1) % 8;
    snprintf(p[k], sizeof p[k], "%s/%s", root, name);
    return p[k];
}

static int exists(const char *path) { return access(path, F_OK) == 0; }

// out/ as an earlier run leaves it, with a user's file and a folder that only looks like a checkpoint.
static void earlier_run(void) {
    mkdir(at("out"), 0755);
    write_text_file(at("out/metrics.jsonl"), "{\"step\": 1}\n");
    const char *dirs[] = {"out/checkpoint-3", "out/checkpoint-12", "out/checkpoint-15.tmp", "out/checkpoint-best"};
    for (size_t i = 0; i < sizeof dirs / sizeof *dirs; i++) {
        mkdir(at(dirs[i]), 0755);
        char f[300];
        snprintf(f, sizeof f, "%s/trainer_state.json", at(dirs[i]));
        write_text_file(f, "{}");
    }
    write_text_file(at("out/notes.txt"), "mine\n");
}

static void test_new_and_foreign_folders(void) {
    char err[1024], removed[512];
    CHECK(output_dir_prepare(at("missing/deeper"), NULL, 0, removed, sizeof removed, err, sizeof err) == 0,
          "a folder that does not exist yet: %s", err);
    mkdir(at("mine"), 0755);
    write_text_file(at("mine/notes.txt"), "x");
    write_text_file(at("mine/metrics.jsonl"), "");  // a run that stopped before its first step
    mkdir(at("mine/checkpoint-best"), 0755);
    CHECK(output_dir_prepare(at("mine"), NULL, 0, removed, sizeof removed, err, sizeof err) == 0,
          "no earlier run there: %s", err);
    CHECK(exists(at("mine/notes.txt")) && exists(at("mine/checkpoint-best")), "nothing is deleted");
}

static void test_refused_without_resume(void) {
    char err[1024] = "", removed[512];
    earlier_run();
    CHECK(output_dir_prepare(at("out"), NULL, 0, removed, sizeof removed, err, sizeof err) != 0, "refused");
    CHECK(strstr(err, "holds an earlier run (metrics.jsonl, checkpoint-3, checkpoint-12, checkpoint-15.tmp)") != NULL,
          "the files, in step order: %s", err);
    CHECK(strstr(err, "--resume latest") && strstr(err, "--overwrite-output-dir") && strstr(err, "another --output-dir"),
          "what to do: %s", err);
    CHECK(!strstr(err, "checkpoint-best") && !strstr(err, "notes.txt"), "only tandem-train's files: %s", err);
    CHECK(exists(at("out/metrics.jsonl")) && exists(at("out/checkpoint-12")), "nothing deleted when refused");
    CHECK(output_dir_prepare(at("out"), "latest", 0, removed, sizeof removed, err, sizeof err) == 0,
          "resume continues the run: %s", err);
    CHECK(exists(at("out/checkpoint-12")) && removed[0] == '\0', "resume deletes nothing");
}

static void test_overwrite(void) {
    char err[1024] = "", removed[512] = "";
    earlier_run();
    // A link named like a checkpoint: the link goes, the folder it points to stays whole.
    mkdir(at("elsewhere"), 0755);
    write_text_file(at("elsewhere/keep.txt"), "keep");
    CHECK(symlink(at("elsewhere"), at("out/checkpoint-20")) == 0, "symlink");
    CHECK(output_dir_prepare(at("out"), NULL, 1, removed, sizeof removed, err, sizeof err) == 0, "overwrite: %s", err);
    CHECK(strcmp(removed, "metrics.jsonl, checkpoint-3, checkpoint-12, checkpoint-15.tmp, checkpoint-20") == 0,
          "removed: %s", removed);
    CHECK(!exists(at("out/metrics.jsonl")) && !exists(at("out/checkpoint-3")) && !exists(at("out/checkpoint-12")) &&
              !exists(at("out/checkpoint-15.tmp")) && !exists(at("out/checkpoint-20")),
          "the earlier run's files are gone");
    CHECK(exists(at("out/notes.txt")) && exists(at("out/checkpoint-best/trainer_state.json")), "the others stay");
    CHECK(exists(at("elsewhere/keep.txt")), "a link's target is not deleted");
    CHECK(output_dir_prepare(at("out"), NULL, 0, removed, sizeof removed, err, sizeof err) == 0,
          "the cleared folder takes a new run: %s", err);
}

static void test_overwrite_with_resume(void) {
    char err[1024] = "", removed[512];
    earlier_run();
    CHECK(output_dir_prepare(at("out"), at("out/checkpoint-12"), 1, removed, sizeof removed, err, sizeof err) != 0,
          "a resume folder inside the folder to clear is refused");
    CHECK(strstr(err, "lies inside --output-dir") && strstr(err, "drop --overwrite-output-dir"), "why: %s", err);
    CHECK(exists(at("out/checkpoint-12/trainer_state.json")), "and kept");
    mkdir(at("other"), 0755);
    mkdir(at("other/checkpoint-4"), 0755);
    CHECK(output_dir_prepare(at("out"), at("other/checkpoint-4"), 1, removed, sizeof removed, err, sizeof err) == 0,
          "a resume folder elsewhere: %s", err);
}

int main(void) {
    snprintf(root, sizeof root, "/tmp/tandem_outdir_XXXXXX");
    REQUIRE(mkdtemp(root), "mkdtemp");
    test_new_and_foreign_folders();
    test_refused_without_resume();
    test_overwrite();
    test_overwrite_with_resume();
    char err[512];
    CHECK(remove_tree(root, err, sizeof err) == 0 && !exists(root), "remove_tree: %s", err);
    return check_exit_code("test_trainer_output_dir");
}

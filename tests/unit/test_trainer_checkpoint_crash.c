// test_trainer_checkpoint_crash.c — a run stopped at any point of checkpoint_save leaves the newest complete
// checkpoint loadable, and --resume latest picks it.
//
// checkpoint_save used to delete an existing checkpoint-N before renaming the new one in (a stop there lost
// step N), and --resume latest took any checkpoint-N folder, complete or not. Here every save runs in a forked
// child whose phase_hook calls _exit at one CheckpointPhase (a process that dies there leaves exactly what a
// crash would; what only a power loss could lose, unflushed data, is not simulated). Then a second child resumes
// "latest" and checks the step and the master weights it got against the state that was saved there, and the
// parent checks that no .tmp or .old folder is left and that the loader said what it removed.
//
// Scenarios, for every phase:
//   new step:     checkpoint-2 and checkpoint-4 exist; saving step 6 with save_total_limit 2 stops. Until the
//                 rename, resume gets step 4; from the rename on, step 6.
//   replacement:  checkpoint-2 and checkpoint-4 exist; step 4 is saved again from other weights (a run resumed
//                 from checkpoint-2 reaches step 4 again) and stops. Until the old copy is moved aside, resume
//                 gets the old weights; from then on, the new ones.
// And a checkpoint-8 folder without trainer_state.json (a partial folder) is skipped by --resume latest.
//
// Every child sets up its own backend and model: the parent holds no thread or socket a fork would cut in half.
#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_macros.h"
#include "kernels/ops.h"
#include "shared/comm/comm.h"
#include "shared/model.h"
#include "testlib.h"
#include "trainer/checkpoint.h"
#include "trainer/make_dirs.h"
#include "trainer/remove_tree.h"
#include "trainer/zero3.h"

static const char *CONFIG =
    "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 61, \"hidden_size\": 32, "
    "\"intermediate_size\": 40, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
    "\"num_key_value_heads\": 2, \"head_dim\": 8, \"max_position_embeddings\": 64, "
    "\"tie_word_embeddings\": true, \"attention_bias\": true, \"hidden_act\": \"silu\"}";

enum { EXIT_STOPPED = 3, EXIT_BAD = 4 };

static const char *PHASE_NAMES[] = {"tmp_created", "model_written", "rank_written", "complete", "old_aside",
                                    "renamed", "durable", "old_removed", "prune_aside", "pruned"};
#define N_PHASES ((int)(sizeof PHASE_NAMES / sizeof *PHASE_NAMES))

static char root[64];

// One process's world: CPU backend, host communicator of one rank, the tiny model, a ZeRO-3 state.
typedef struct {
    OpsCtx *ops;
    Comm *comm;
    Model model;
    Zero3 *z;
} World;

static int world_open(World *w, uint64_t seed) {
    char err[1024];
    CommInit ci;
    ModelConfig cfg;
    memset(w, 0, sizeof *w);
    if (comm_init_from_env(&ci, 10000, err, sizeof err) != 0 || ops_create(&w->ops, OPS_BACKEND_CPU, 0, err, sizeof err) != 0 ||
        comm_create(&w->comm, COMM_BACKEND_HOST, &ci, w->ops, err, sizeof err) != 0 ||
        config_parse(&cfg, CONFIG, strlen(CONFIG), err, sizeof err) != 0 ||
        model_init(&w->model, &cfg, w->ops, err, sizeof err) != 0 ||
        zero3_create(&w->z, &w->model, w->comm, 3, err, sizeof err) != 0 ||
        zero3_init_random(w->z, seed, 0.2f, err, sizeof err) != 0) {
        fprintf(stderr, "child setup: %s\n", err);
        return -1;
    }
    return 0;
}

static void world_close(World *w) {
    zero3_destroy(w->z);
    model_free(&w->model);
    comm_destroy(w->comm);
    ops_destroy(w->ops);
}

typedef struct {
    int stop_at;  // a CheckpointPhase, or -1: run to the end
} StopPlan;

static void stop_here(CheckpointPhase phase, long long step, void *arg) {
    (void)step;
    if ((int)phase == ((StopPlan *)arg)->stop_at) _exit(EXIT_STOPPED);
}

// Child: saves step with weights from seed, stopping at stop_at. Exits 0 (saved), EXIT_STOPPED or EXIT_BAD.
static void save_child(const char *out, long long step, uint64_t seed, int keep_last, int stop_at) {
    World w;
    if (world_open(&w, seed) != 0) _exit(EXIT_BAD);
    StopPlan plan = {.stop_at = stop_at};
    CheckpointOptions co = {.output_dir = out, .base_model_dir = root, .keep_last = keep_last,
                            .phase_hook = stop_here, .phase_arg = &plan};
    TrainProgress p = {.step = step, .epoch = 0, .data_position = step, .rng = {1, 2}, .policy_version = step};
    char err[1024];
    if (checkpoint_save(w.z, &w.model, w.comm, &co, &p, NULL, err, sizeof err) != 0) {
        fprintf(stderr, "save step %lld: %s\n", step, err);
        _exit(EXIT_BAD);
    }
    world_close(&w);
    _exit(0);
}

// Child: resumes "latest" and checks it got want_step with the master weights of want_seed. Exits 0 or EXIT_BAD.
static void load_child(const char *out, long long want_step, uint64_t want_seed) {
    World got, want;
    if (world_open(&got, 999) != 0 || world_open(&want, want_seed) != 0) _exit(EXIT_BAD);
    CheckpointOptions co = {.output_dir = out, .base_model_dir = root};
    TrainProgress p = {0};
    char err[1024], loaded[PATH_MAX];
    if (checkpoint_load(got.z, &got.model, got.comm, &co, "latest", &p, loaded, err, sizeof err) != 0) {
        fprintf(stderr, "resume latest in %s: %s\n", out, err);
        _exit(EXIT_BAD);
    }
    if (p.step != want_step || p.data_position != want_step) {
        fprintf(stderr, "resume latest in %s: got step %lld (%s), want %lld\n", out, (long long)p.step, loaded,
                want_step);
        _exit(EXIT_BAD);
    }
    for (int u = 0; u < got.model.layout.n_units; u++) {
        size_t n = zero3_shard_count(got.z, u);
        float *a = malloc((n ? n : 1) * sizeof(float)), *b = malloc((n ? n : 1) * sizeof(float));
        ops_copy_to_host(got.ops, a, zero3_master_shard(got.z, u), n * sizeof(float));
        ops_copy_to_host(want.ops, b, zero3_master_shard(want.z, u), n * sizeof(float));
        ops_synchronize(got.ops);
        ops_synchronize(want.ops);
        if (memcmp(a, b, n * sizeof(float)) != 0) {
            fprintf(stderr, "resume latest in %s: unit %d is not the weights saved at step %lld\n", out, u, want_step);
            _exit(EXIT_BAD);
        }
        free(a);
        free(b);
    }
    world_close(&got);
    world_close(&want);
    _exit(0);
}

// Runs fn in a child with stderr going to log_path (NULL: inherited); returns its exit status (-1: killed).
typedef struct {
    int kind;  // 0 save, 1 load
    const char *out;
    long long step;
    uint64_t seed;
    int keep_last, stop_at;
} ChildJob;

static int run_child(const ChildJob *job, const char *log_path) {
    fflush(NULL);
    pid_t pid = fork();
    REQUIRE(pid >= 0, "fork");
    if (pid == 0) {
        if (log_path) {  // on the descriptor, so that stderr stays unbuffered and nothing is lost at _exit
            int fd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            if (fd < 0 || dup2(fd, STDERR_FILENO) < 0) _exit(EXIT_BAD);
            close(fd);
        }
        if (job->kind == 0) save_child(job->out, job->step, job->seed, job->keep_last, job->stop_at);
        load_child(job->out, job->step, job->seed);
    }
    int status;
    REQUIRE(waitpid(pid, &status, 0) == pid, "waitpid");
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void save_ok(const char *out, long long step, uint64_t seed) {
    ChildJob j = {.kind = 0, .out = out, .step = step, .seed = seed, .stop_at = -1};
    REQUIRE(run_child(&j, NULL) == 0, "saving step %lld in %s", step, out);
}

// Names in out that end in .tmp or .old, comma-separated into list ("" when none).
static void leftovers(const char *out, char *list, size_t cap) {
    list[0] = '\0';
    DIR *d = opendir(out);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (n > 4 && (!strcmp(e->d_name + n - 4, ".tmp") || !strcmp(e->d_name + n - 4, ".old"))) {
            size_t used = strlen(list);
            snprintf(list + used, cap - used, "%s%s", used ? "," : "", e->d_name);
        }
    }
    closedir(d);
}

static int file_mentions(const char *path, const char *needle) {
    char *text = read_text_file(path);
    const int found = text && strstr(text, needle);
    free(text);
    return found;
}

// Stops a save at phase, then checks that resume picks want_step with want_seed's weights, cleaning up (and
// naming) every leftover, and that the run can then save the same step again.
static void stop_then_resume(const char *scenario, int phase, const char *out, long long step, uint64_t seed,
                             int keep_last, int phase_applies, long long want_step, uint64_t want_seed) {
    ChildJob save = {.kind = 0, .out = out, .step = step, .seed = seed, .keep_last = keep_last, .stop_at = phase};
    int st = run_child(&save, NULL);
    CHECK(st == (phase_applies ? EXIT_STOPPED : 0), "%s, stop at %s: the save exited %d", scenario,
          PHASE_NAMES[phase], st);
    char left[1024], log_path[PATH_MAX + 16];
    leftovers(out, left, sizeof left);
    snprintf(log_path, sizeof log_path, "%s.load.log", out);
    ChildJob load = {.kind = 1, .out = out, .step = want_step, .seed = want_seed};
    CHECK(run_child(&load, log_path) == 0, "%s, stop at %s: resume latest did not get step %lld as saved (%s)",
          scenario, PHASE_NAMES[phase], want_step, log_path);
    char after[1024];
    leftovers(out, after, sizeof after);
    CHECK(after[0] == '\0', "%s, stop at %s: left behind after resume: %s", scenario, PHASE_NAMES[phase], after);
    for (char *name = strtok(left, ","); name; name = strtok(NULL, ","))
        CHECK(file_mentions(log_path, name), "%s, stop at %s: the resume did not say what it did with %s",
              scenario, PHASE_NAMES[phase], name);
    // The run goes on: saving that step again works and is what resume then gets.
    save.stop_at = -1;
    CHECK(run_child(&save, NULL) == 0, "%s, stop at %s: saving step %lld again failed", scenario,
          PHASE_NAMES[phase], step);
    load.step = step, load.seed = seed;
    CHECK(run_child(&load, NULL) == 0, "%s, stop at %s: after saving again, resume did not get step %lld", scenario,
          PHASE_NAMES[phase], step);
    remove(log_path);
}

static void fresh_run(const char *out) {
    char err[512];
    remove_tree(out, NULL, 0);
    REQUIRE(make_dirs(out, err, sizeof err) == 0, "%s", err);
    save_ok(out, 2, 2);
    save_ok(out, 4, 4);
}

int main(void) {
    static const char *const contract[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"};
    for (size_t i = 0; i < sizeof contract / sizeof *contract; i++) unsetenv(contract[i]);
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    snprintf(root, sizeof root, "/tmp/tandem_ckpt_crash_XXXXXX");
    REQUIRE(mkdtemp(root), "mkdtemp");
    char out[PATH_MAX];
    for (int ph = 0; ph < N_PHASES; ph++) {
        // New step 6 with save_total_limit 2: checkpoint-2 is pruned once step 6 is durable.
        snprintf(out, sizeof out, "%s/new-%s", root, PHASE_NAMES[ph]);
        fresh_run(out);
        int applies = ph != CHECKPOINT_PHASE_OLD_ASIDE && ph != CHECKPOINT_PHASE_OLD_REMOVED;
        int renamed = ph >= CHECKPOINT_PHASE_RENAMED || !applies;  // a phase the save does not pass: it finished
        stop_then_resume("new step", ph, out, 6, 6, 2, applies, renamed ? 6 : 4, renamed ? 6 : 4);
        // Step 4 saved again from other weights; nothing pruned.
        snprintf(out, sizeof out, "%s/replace-%s", root, PHASE_NAMES[ph]);
        fresh_run(out);
        int moved = ph >= CHECKPOINT_PHASE_OLD_ASIDE;
        stop_then_resume("replacement", ph, out, 4, 44, 0, ph != CHECKPOINT_PHASE_PRUNE_ASIDE, 4, moved ? 44 : 4);
    }
    // A checkpoint-8 folder that is not complete (no trainer_state.json) is not what --resume latest picks.
    snprintf(out, sizeof out, "%s/partial", root);
    fresh_run(out);
    char partial[PATH_MAX + 32], err[512];
    snprintf(partial, sizeof partial, "%s/checkpoint-8", out);
    REQUIRE(make_dirs(partial, err, sizeof err) == 0, "%s", err);
    char log_path[PATH_MAX + 16];
    snprintf(log_path, sizeof log_path, "%s.load.log", out);
    ChildJob load = {.kind = 1, .out = out, .step = 4, .seed = 4};
    CHECK(run_child(&load, log_path) == 0, "a partial checkpoint-8 beside checkpoint-4: resume did not get step 4");
    CHECK(file_mentions(log_path, "checkpoint-8"), "resume did not say it skipped the partial checkpoint-8");
    remove_tree(root, NULL, 0);
    return check_exit_code("test_trainer_checkpoint_crash");
}

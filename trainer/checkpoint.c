// trainer/checkpoint.c — consolidated HF checkpoints and sharded trainer state (see trainer/checkpoint.h).
#include "trainer/checkpoint.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shared/json_read.h"
#include "shared/safetensors.h"
#include "trainer/fsync_tree.h"
#include "trainer/make_dirs.h"
#include "trainer/remove_tree.h"

static const char *TOKENIZER_FILES[] = {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
                                        "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt"};

static int copy_file(const char *from, const char *to, char *err, size_t err_len) {
    FILE *in = fopen(from, "rb");
    if (!in) return 0; // optional file
    FILE *out = fopen(to, "wb");
    if (!out) {
        fclose(in);
        snprintf(err, err_len, "cannot write %s: %s", to, strerror(errno));
        return -1;
    }
    char buf[1 << 16];
    size_t n;
    int rc = 0;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0)
        if (fwrite(buf, 1, n, out) != n) rc = -1;
    if (fclose(out) != 0) rc = -1;
    fclose(in);
    if (rc) snprintf(err, err_len, "cannot write %s: %s", to, strerror(errno));
    return rc;
}

int checkpoint_copy_tokenizer(const char *base_model_dir, const char *dir, char *err, size_t err_len) {
    for (size_t i = 0; i < sizeof TOKENIZER_FILES / sizeof *TOKENIZER_FILES; i++) {
        char from[PATH_MAX + 64], to[PATH_MAX + 128];
        snprintf(from, sizeof from, "%s/%s", base_model_dir, TOKENIZER_FILES[i]);
        snprintf(to, sizeof to, "%s/%s", dir, TOKENIZER_FILES[i]);
        if (copy_file(from, to, err, err_len) != 0) return -1;
    }
    return 0;
}

static int write_json(const char *path, json_t *j, char *err, size_t err_len) {
    char tmp[PATH_MAX + 64];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (json_dump_file(j, tmp, JSON_INDENT(2)) != 0 || rename(tmp, path) != 0) {
        snprintf(err, err_len, "cannot write %s: %s", path, strerror(errno));
        return -1;
    }
    return 0;
}

json_t *checkpoint_state_to_json(const CheckpointState *st) {
    char hash[17], rng0[17], rng1[17];
    const TrainProgress *p = &st->progress;
    snprintf(hash, sizeof hash, "%016llx", (unsigned long long)st->layout_hash);
    snprintf(rng0, sizeof rng0, "%016llx", (unsigned long long)p->rng[0]);
    snprintf(rng1, sizeof rng1, "%016llx", (unsigned long long)p->rng[1]);
    return json_pack("{s:I, s:I, s:I, s:[s,s], s:I, s:I, s:i, s:i, s:s, s:s}", "global_step", (json_int_t)p->step,
                     "epoch", (json_int_t)p->epoch, "data_position", (json_int_t)p->data_position, "rng", rng0, rng1,
                     "policy_version", (json_int_t)p->policy_version, "num_input_tokens_seen",
                     (json_int_t)p->num_input_tokens_seen, "world_size", st->world_size, "zero_stage",
                     st->zero_stage, "zero_slicing", st->zero_slicing[0] ? st->zero_slicing : "full_shard",
                     "layout_hash", hash);
}

// 16 lowercase hex digits, as checkpoint_state_to_json writes them, into *out; -1 on anything else.
static int hex64(const char *s, uint64_t *out) {
    uint64_t v = 0;
    for (int i = 0; i < 16; i++) {
        int d = s[i] >= '0' && s[i] <= '9' ? s[i] - '0' : s[i] >= 'a' && s[i] <= 'f' ? s[i] - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = v << 4 | (uint64_t)d;
    }
    if (s[16] != '\0') return -1;
    *out = v;
    return 0;
}

int checkpoint_state_from_json(const json_t *j, const char *name, CheckpointState *st, char *err, size_t err_len) {
    memset(st, 0, sizeof *st);
    json_error_t je;
    json_int_t step, epoch, pos, version, tokens_seen = 0;
    int world, stage = 0;
    const char *hash, *r0, *r1, *slicing = "full_shard";
    // zero_stage is optional: checkpoints are resumable under any stage (trainer/zero3.h), it is only recorded.
    // zero_slicing is optional: checkpoints from before node-aware ZeRO were all cut flat.
    // num_input_tokens_seen is optional: checkpoints from before it count from 0.
    if (json_unpack_ex((json_t *)j, &je, 0, "{s:I, s:I, s:I, s:[s,s], s:I, s?I, s:i, s?i, s?s, s:s}", "global_step",
                       &step, "epoch", &epoch, "data_position", &pos, "rng", &r0, &r1, "policy_version", &version,
                       "num_input_tokens_seen", &tokens_seen, "world_size", &world, "zero_stage", &stage, "zero_slicing", &slicing, "layout_hash",
                       &hash) != 0) {
        snprintf(err, err_len, "%s: %s", name, je.text);
        return -1;
    }
    // What a save writes: counts from 0, at least one rank, hex of 64-bit values. Anything else is a damaged or
    // hand-made file, which must not resume at a negative step or with a made-up random state.
    if (step < 0 || epoch < 0 || pos < 0 || world < 1 || tokens_seen < 0) {
        snprintf(err, err_len, "%s: global_step, epoch, data_position and num_input_tokens_seen must be >= 0 and "
                 "world_size >= 1 (got %lld, %lld, %lld, %lld, %d)", name, (long long)step, (long long)epoch,
                 (long long)pos, (long long)tokens_seen, world);
        return -1;
    }
    TrainProgress *p = &st->progress;
    if (hex64(r0, &p->rng[0]) != 0 || hex64(r1, &p->rng[1]) != 0 || hex64(hash, &st->layout_hash) != 0) {
        snprintf(err, err_len, "%s: rng and layout_hash must be 16 lowercase hex digits each", name);
        memset(st, 0, sizeof *st);
        return -1;
    }
    p->step = step, p->epoch = epoch, p->data_position = pos, p->policy_version = version;
    p->num_input_tokens_seen = tokens_seen;
    st->world_size = world, st->zero_stage = stage;
    snprintf(st->zero_slicing, sizeof st->zero_slicing, "%s", slicing);
    return 0;
}

int checkpoint_read_unit_state(const SafetensorsSet *set, const char *path, int unit, size_t n, float *master,
                               float *adam_m, float *adam_v, char *err, size_t err_len) {
    static const char *const kind[3] = {"master", "adam_m", "adam_v"};
    float *dst[3] = {master, adam_m, adam_v};
    for (int k = 0; k < 3; k++) {
        char name[48];
        snprintf(name, sizeof name, "%s.%d", kind[k], unit);
        const StTensor *t = st_find(set, name);
        int64_t shape[1] = {(int64_t)n};
        if (!t) {
            snprintf(err, err_len, "%s lacks %s", path, name);
            return -1;
        }
        if (st_check_shape(t, 1, shape, err, err_len) != 0 || st_read_f32(t, dst[k], n, err, err_len) != 0) return -1;
    }
    return 0;
}

// This rank's optimizer state, written to rank_dir/optimizer.safetensors: master, adam_m, adam_v slices of every
// unit as 1-D f32 tensors.
static int save_rank_state(Zero3 *z, const Model *m, const char *rank_dir, char *err, size_t err_len) {
    int U = m->layout.n_units, rc = -1;
    StWriter *w = NULL;
    float **host = calloc((size_t)U * 3, sizeof(float *));
    char (*names)[48] = calloc((size_t)U * 3, sizeof *names);
    if (!host || !names || st_writer_create(&w, err, err_len) != 0) {
        if (!host || !names) snprintf(err, err_len, "out of memory saving the trainer state");
        goto out;
    }
    for (int u = 0; u < U; u++) {
        size_t n = zero3_shard_count(z, u);
        float *src[3] = {zero3_master_shard(z, u), zero3_adam_m_shard(z, u), zero3_adam_v_shard(z, u)};
        const char *kind[3] = {"master", "adam_m", "adam_v"};
        for (int k = 0; k < 3; k++) {
            float **h = &host[u * 3 + k];
            if (!(*h = malloc((n ? n : 1) * sizeof(float)))) {
                snprintf(err, err_len, "out of memory saving the trainer state");
                goto out;
            }
            ops_copy_to_host(m->ops, *h, src[k], n * 4);
            snprintf(names[u * 3 + k], sizeof names[0], "%s.%d", kind[k], u);
            int64_t shape[1] = {(int64_t)n};
            if (st_writer_add(w, names[u * 3 + k], ST_F32, 1, shape, *h, ST_F32, err, err_len) != 0) goto out;
        }
    }
    ops_synchronize(m->ops);
    char from[PATH_MAX + 96], to[PATH_MAX + 96];
    if (make_dirs(rank_dir, err, err_len) != 0 || st_writer_write(w, rank_dir, 0, err, err_len) != 0) goto out;
    snprintf(from, sizeof from, "%s/model.safetensors", rank_dir);
    snprintf(to, sizeof to, "%s/optimizer.safetensors", rank_dir);
    if (rename(from, to) != 0) {
        snprintf(err, err_len, "cannot write %s: %s", to, strerror(errno));
        goto out;
    }
    rc = 0;
out:
    if (host)
        for (int i = 0; i < U * 3; i++) free(host[i]);
    free(host);
    free(names);
    st_writer_free(w);
    return rc;
}

// Folder names of one step: the checkpoint, the folder it is written in, and where a copy being replaced or
// deleted goes first (so that a stop half-way through a removal never leaves a partial checkpoint-N).
typedef struct {
    char final_dir[PATH_MAX], tmp_dir[PATH_MAX + 8], old_dir[PATH_MAX + 8];
} StepDirs;

static void step_dirs(const char *output_dir, long long step, StepDirs *d) {
    snprintf(d->final_dir, sizeof d->final_dir, "%s/checkpoint-%lld", output_dir, step);
    snprintf(d->tmp_dir, sizeof d->tmp_dir, "%s.tmp", d->final_dir);
    snprintf(d->old_dir, sizeof d->old_dir, "%s.old", d->final_dir);
}

static int exists(const char *path) {
    struct stat st;
    return lstat(path, &st) == 0;
}

// trainer_state.json is the last file a checkpoint gets: a folder without it is not complete.
static int is_complete(const char *dir) {
    char path[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/trainer_state.json", dir);
    return exists(path);
}

static void phase(const CheckpointOptions *o, CheckpointPhase ph, long long step) {
    if (o->phase_hook) o->phase_hook(ph, step, o->phase_arg);
}

// Which of checkpoint-<digits>, checkpoint-<digits>.tmp and checkpoint-<digits>.old name is: the kind
// (0 final, 1 tmp, 2 old) or -1 for anything else; *step receives the digits' value.
static int checkpoint_name_kind(const char *name, long long *step) {
    if (strncmp(name, "checkpoint-", 11) != 0 || !isdigit((unsigned char)name[11])) return -1;
    char *end;
    errno = 0;
    *step = strtoll(name + 11, &end, 10);
    if (errno) return -1;
    if (*end == '\0') return 0;
    if (strcmp(end, ".tmp") == 0) return 1;
    if (strcmp(end, ".old") == 0) return 2;
    return -1;
}

// Rank 0: finishes or removes what a stopped save or prune left in output_dir, saying so:
//   checkpoint-N.old beside checkpoint-N        the replaced copy, not yet removed: removed;
//   checkpoint-N.old, complete checkpoint-N.tmp a replacement stopped between its two renames: the new copy
//                                               (complete, flushed) becomes checkpoint-N, the old is removed;
//   checkpoint-N.old alone                      a checkpoint being deleted by save_total_limit: removed;
//   checkpoint-N.tmp otherwise                  an unfinished checkpoint: removed.
// A checkpoint-N folder is never touched here.
static int recover_leftovers(const char *output_dir, char *err, size_t err_len) {
    DIR *d = opendir(output_dir);
    if (!d) {
        if (errno == ENOENT) return 0;  // nothing written yet
        snprintf(err, err_len, "cannot list %s: %s", output_dir, strerror(errno));
        return -1;
    }
    long long *olds = NULL, *tmps = NULL;
    size_t n_old = 0, n_tmp = 0, cap_old = 0, cap_tmp = 0;
    int rc = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        long long step;
        int kind = checkpoint_name_kind(e->d_name, &step);
        long long **list = kind == 1 ? &tmps : kind == 2 ? &olds : NULL;
        if (!list) continue;
        size_t *n = kind == 1 ? &n_tmp : &n_old, *cap = kind == 1 ? &cap_tmp : &cap_old;
        if (*n == *cap) {
            size_t grown = *cap ? *cap * 2 : 8;
            long long *g = realloc(*list, grown * sizeof **list);
            if (!g) {
                snprintf(err, err_len, "out of memory listing %s", output_dir);
                rc = -1;
                break;
            }
            *list = g, *cap = grown;
        }
        (*list)[(*n)++] = step;
    }
    closedir(d);
    int changed = 0;
    char rerr[PATH_MAX + 128];
    for (size_t i = 0; rc == 0 && i < n_old; i++) {
        StepDirs s;
        step_dirs(output_dir, olds[i], &s);
        if (!exists(s.final_dir) && is_complete(s.tmp_dir)) {
            if (rename(s.tmp_dir, s.final_dir) != 0) {
                snprintf(err, err_len, "cannot rename %s to %s: %s", s.tmp_dir, s.final_dir, strerror(errno));
                rc = -1;
                break;
            }
            fprintf(stderr, "tandem-train: a run stopped while replacing %s; its new copy (%s) was complete and "
                    "is now %s; removing the old copy %s\n", s.final_dir, s.tmp_dir, s.final_dir, s.old_dir);
        } else {
            fprintf(stderr, "tandem-train: removing %s, a checkpoint a stopped run was replacing or deleting "
                    "(save_total_limit)\n", s.old_dir);
        }
        if (remove_tree(s.old_dir, rerr, sizeof rerr) != 0) {
            snprintf(err, err_len, "%s: delete it by hand", rerr);
            rc = -1;
        }
        changed = 1;
    }
    for (size_t i = 0; rc == 0 && i < n_tmp; i++) {
        StepDirs s;
        step_dirs(output_dir, tmps[i], &s);
        if (!exists(s.tmp_dir)) continue;  // renamed above
        fprintf(stderr, "tandem-train: removing %s, an unfinished checkpoint of a run that stopped while writing "
                "it\n", s.tmp_dir);
        if (remove_tree(s.tmp_dir, rerr, sizeof rerr) != 0) {
            snprintf(err, err_len, "%s: delete it by hand", rerr);
            rc = -1;
        }
        changed = 1;
    }
    free(olds);
    free(tmps);
    if (rc == 0 && changed) rc = fsync_path(output_dir, err, err_len);
    return rc;
}

// Removes checkpoint-N folders beyond the newest keep_last: each is renamed to checkpoint-N.old first, so that a
// stop in the middle of the removal leaves no partial checkpoint-N behind (recover_leftovers removes the rest).
static int prune(const CheckpointOptions *o, char *err, size_t err_len) {
    if (o->keep_last <= 0) return 0;
    DIR *d = opendir(o->output_dir);
    if (!d) {
        snprintf(err, err_len, "cannot list %s: %s", o->output_dir, strerror(errno));
        return -1;
    }
    long long *steps = NULL;
    size_t n = 0, cap = 0;
    int rc = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        long long step;
        if (checkpoint_name_kind(e->d_name, &step) != 0) continue;
        if (n == cap) {
            size_t grown = cap ? cap * 2 : 16;
            long long *g = realloc(steps, grown * sizeof *steps);
            if (!g) {
                snprintf(err, err_len, "out of memory listing %s", o->output_dir);
                rc = -1;
                break;
            }
            steps = g, cap = grown;
        }
        steps[n++] = step;
    }
    closedir(d);
    char rerr[PATH_MAX + 128];
    for (size_t i = 0; rc == 0 && i < n; i++) {
        size_t newer = 0;
        for (size_t j = 0; j < n; j++) newer += steps[j] > steps[i];
        if (newer < (size_t)o->keep_last) continue;
        StepDirs s;
        step_dirs(o->output_dir, steps[i], &s);
        if (rename(s.final_dir, s.old_dir) != 0) {
            snprintf(err, err_len, "save_total_limit: cannot rename %s to %s: %s", s.final_dir, s.old_dir,
                     strerror(errno));
            rc = -1;
            break;
        }
        phase(o, CHECKPOINT_PHASE_PRUNE_ASIDE, steps[i]);
        if (remove_tree(s.old_dir, rerr, sizeof rerr) != 0) {
            snprintf(err, err_len, "save_total_limit: %s", rerr);
            rc = -1;
        }
    }
    free(steps);
    return rc == 0 ? fsync_path(o->output_dir, err, err_len) : rc;
}

// Rank 0, once every rank's part of s->tmp_dir is written and flushed: writes trainer_state.json (the mark of a
// complete checkpoint), flushes it, renames the folder to checkpoint-N without ever removing an existing
// checkpoint-N first (it is moved aside and removed once the new one is durable), then prunes.
static int publish(const CheckpointOptions *o, const StepDirs *s, json_t *state, long long step, char *err,
                   size_t err_len) {
    char path[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/trainer_state.json", s->tmp_dir);
    if (fsync_tree(s->tmp_dir, err, err_len) != 0 || write_json(path, state, err, err_len) != 0 ||
        fsync_path(path, err, err_len) != 0 || fsync_path(s->tmp_dir, err, err_len) != 0)
        return -1;
    phase(o, CHECKPOINT_PHASE_COMPLETE, step);
    int replacing = exists(s->final_dir);
    if (replacing) {
        if (rename(s->final_dir, s->old_dir) != 0) {
            snprintf(err, err_len, "cannot rename %s to %s: %s", s->final_dir, s->old_dir, strerror(errno));
            return -1;
        }
        phase(o, CHECKPOINT_PHASE_OLD_ASIDE, step);
    }
    if (rename(s->tmp_dir, s->final_dir) != 0) {
        snprintf(err, err_len, "cannot rename %s to %s: %s", s->tmp_dir, s->final_dir, strerror(errno));
        return -1;
    }
    phase(o, CHECKPOINT_PHASE_RENAMED, step);
    if (fsync_path(o->output_dir, err, err_len) != 0) return -1;
    phase(o, CHECKPOINT_PHASE_DURABLE, step);
    if (replacing) {
        char rerr[PATH_MAX + 128];
        if (remove_tree(s->old_dir, rerr, sizeof rerr) != 0) {
            snprintf(err, err_len, "%s was saved, but its earlier copy could not be removed: %s", s->final_dir, rerr);
            return -1;
        }
        phase(o, CHECKPOINT_PHASE_OLD_REMOVED, step);
    }
    if (prune(o, err, err_len) != 0) return -1;
    phase(o, CHECKPOINT_PHASE_PRUNED, step);
    return 0;
}

// Rank 0's outcome of a step every rank waits for: 0 on every rank when it worked, else -1 (rank 0 keeps its
// message; the others get one saying where to look).
static int share_outcome(Comm *c, int rc, const char *what, char *err, size_t err_len) {
    int32_t ok = rc == 0;
    if (comm_broadcast(c, &ok, 1, COMM_I32, 0) != 0) {
        snprintf(err, err_len, "checkpoint: %s", comm_error(c));
        return -1;
    }
    if (!ok && comm_rank(c) != 0) snprintf(err, err_len, "checkpoint: rank 0 could not %s (its message says why)", what);
    return ok ? 0 : -1;
}

int checkpoint_save(Zero3 *z, Model *m, Comm *c, const CheckpointOptions *o, const TrainProgress *p, char *saved_dir,
                    char *err, size_t err_len) {
    const int rank = comm_rank(c), world = comm_world_size(c), U = m->layout.n_units;
    const long long step = (long long)p->step;
    StepDirs s;
    step_dirs(o->output_dir, step, &s);
    int rc = 0;
    if (rank == 0) {
        rc = recover_leftovers(o->output_dir, err, err_len);
        if (rc == 0) rc = make_dirs(s.tmp_dir, err, err_len);
        if (rc == 0) phase(o, CHECKPOINT_PHASE_TMP_CREATED, step);
    }
    // Every rank learns whether rank 0 could create the folder before anyone writes into it.
    if (share_outcome(c, rc, "create the checkpoint folder", err, err_len) != 0) return -1;
    // Consolidated model: every rank takes part in each unit's gather; rank 0 keeps the values.
    float **units = calloc((size_t)U, sizeof(float *));
    if (!units) {
        snprintf(err, err_len, "out of memory for the checkpoint");
        return -1;
    }
    float *scratch = NULL;
    for (int u = 0; u < U && rc == 0; u++) {
        size_t padded = zero3_shard_count(z, u) * (size_t)world;
        float *dst = rank == 0 ? (units[u] = malloc(padded * sizeof(float))) : (scratch = realloc(scratch, padded * 4));
        if (!dst) {
            snprintf(err, err_len, "out of memory gathering unit %d for the checkpoint", u);
            rc = -1;
            break;
        }
        rc = zero3_gather_unit_f32(z, u, dst, err, err_len);
    }
    free(scratch);
    if (rc == 0 && rank == 0) {
        rc = model_save_host(m, units, s.tmp_dir, o->save_bf16, o->max_shard_bytes, err, err_len);
        if (rc == 0) rc = checkpoint_copy_tokenizer(o->base_model_dir, s.tmp_dir, err, err_len);
        if (rc == 0) phase(o, CHECKPOINT_PHASE_MODEL_WRITTEN, step);
    }
    for (int u = 0; u < U; u++) free(units[u]);
    free(units);
    if (rc == 0) {
        char rank_dir[PATH_MAX + 64];
        snprintf(rank_dir, sizeof rank_dir, "%s/trainer_state/rank-%05d", s.tmp_dir, rank);
        rc = save_rank_state(z, m, rank_dir, err, err_len);
        // Each rank flushes what it wrote: on a shared file system the ranks of other nodes wrote theirs there.
        if (rc == 0) rc = fsync_tree(rank_dir, err, err_len);
        if (rc == 0) phase(o, CHECKPOINT_PHASE_RANK_WRITTEN, step);
    }
    // All ranks must have written before rank 0 publishes: agree on success first.
    int32_t all_ok = rc == 0;
    if (comm_all_reduce(c, &all_ok, 1, COMM_I32, COMM_SUM) != 0) {
        snprintf(err, err_len, "checkpoint: %s", comm_error(c));
        return -1;
    }
    if (all_ok != world) {
        if (rc == 0) snprintf(err, err_len, "checkpoint %s: another rank failed to write its part", s.final_dir);
        return -1;
    }
    if (rank == 0) {
        CheckpointState cs = {.progress = *p, .world_size = world, .zero_stage = zero3_stage(z),
                              .layout_hash = m->layout.hash};
        zero3_slicing(z, cs.zero_slicing, sizeof cs.zero_slicing);
        json_t *state = checkpoint_state_to_json(&cs);
        rc = state ? publish(o, &s, state, step, err, err_len) : -1;
        if (!state) snprintf(err, err_len, "out of memory writing %s/trainer_state.json", s.tmp_dir);
        json_decref(state);
    }
    if (share_outcome(c, rc, "publish the checkpoint", err, err_len) != 0) return -1;
    if (saved_dir) snprintf(saved_dir, PATH_MAX, "%s", s.final_dir);
    return 0;
}

int checkpoint_save_adapter(Comm *c, const CheckpointOptions *o, const TrainProgress *p, const Model *m,
                            int (*write)(const char *dir, void *arg, char *err, size_t err_len), void *arg,
                            char *saved_dir, char *err, size_t err_len) {
    const long long step = (long long)p->step;
    StepDirs s;
    step_dirs(o->output_dir, step, &s);
    int rc = 0;
    if (comm_rank(c) == 0) {
        rc = recover_leftovers(o->output_dir, err, err_len);
        if (rc == 0) rc = make_dirs(s.tmp_dir, err, err_len);
        if (rc == 0) phase(o, CHECKPOINT_PHASE_TMP_CREATED, step);
        if (rc == 0) rc = write(s.tmp_dir, arg, err, err_len);
        if (rc == 0) rc = checkpoint_copy_tokenizer(o->base_model_dir, s.tmp_dir, err, err_len);
        if (rc == 0) phase(o, CHECKPOINT_PHASE_MODEL_WRITTEN, step);
        if (rc == 0) {
            CheckpointState cs = {.progress = *p, .world_size = comm_world_size(c), .layout_hash = m->layout.hash};
            snprintf(cs.zero_slicing, sizeof cs.zero_slicing, "lora");
            json_t *state = checkpoint_state_to_json(&cs);
            if (state) json_object_set_new(state, "peft_adapter", json_true());
            rc = state ? publish(o, &s, state, step, err, err_len) : -1;
            if (!state) snprintf(err, err_len, "out of memory writing %s/trainer_state.json", s.tmp_dir);
            json_decref(state);
        }
    }
    if (share_outcome(c, rc, "write the adapter checkpoint", err, err_len) != 0) return -1;
    if (saved_dir) snprintf(saved_dir, PATH_MAX, "%s", s.final_dir);
    return 0;
}

// Rank 0: the highest checkpoint-N under output_dir that is complete (a checkpoint-N without trainer_state.json
// is skipped, saying so). 0 with the folder in out, or -1 when there is none.
static int latest_checkpoint(const char *output_dir, char *out, size_t out_len) {
    DIR *d = opendir(output_dir);
    if (!d) return -1;
    long long best = -1;
    struct dirent *e;
    while ((e = readdir(d))) {
        long long step;
        if (checkpoint_name_kind(e->d_name, &step) != 0 || step <= best) continue;
        char dir[PATH_MAX];
        snprintf(dir, sizeof dir, "%s/%s", output_dir, e->d_name);
        if (!is_complete(dir)) {
            fprintf(stderr, "tandem-train: --resume latest: skipping %s, which has no trainer_state.json (not a "
                    "complete checkpoint)\n", dir);
            continue;
        }
        best = step;
    }
    closedir(d);
    if (best < 0) return -1;
    snprintf(out, out_len, "%s/checkpoint-%lld", output_dir, best);
    return 0;
}

int checkpoint_find_latest(const char *output_dir, char *path, size_t path_len, char *err, size_t err_len) {
    if (recover_leftovers(output_dir, err, err_len) != 0) return -1;
    return latest_checkpoint(output_dir, path, path_len) == 0;
}

// Rank 0 settles what a stopped run left (trainer/checkpoint.h) and picks the folder (dir, or "latest"); every rank
// then reads the one it picked (on a shared file system another node's listing could lag behind): path (PATH_MAX)
// and its trainer_state.json, which must be an adapter checkpoint's (peft_adapter true) or a full one's as `adapter`
// says. All ranks call together.
static int resolve_checkpoint(Comm *c, const CheckpointOptions *o, const char *dir, int adapter, char *path,
                              CheckpointState *cs, char *err, size_t err_len) {
    int rc = 0;
    path[0] = '\0';
    if (comm_rank(c) == 0) {
        rc = recover_leftovers(o->output_dir, err, err_len);
        if (rc == 0 && strcmp(dir, "latest") == 0 && latest_checkpoint(o->output_dir, path, PATH_MAX) != 0) {
            snprintf(err, err_len, "--resume latest: no complete checkpoint-N folder in %s", o->output_dir);
            rc = -1;
        } else if (rc == 0 && strcmp(dir, "latest") != 0) {
            snprintf(path, PATH_MAX, "%s", dir);
        }
    }
    if (share_outcome(c, rc, "find the checkpoint to resume from", err, err_len) != 0) return -1;
    if (comm_broadcast(c, path, PATH_MAX, COMM_U8, 0) != 0) {
        snprintf(err, err_len, "resume: %s", comm_error(c));
        return -1;
    }
    char state_path[PATH_MAX + 32];
    snprintf(state_path, sizeof state_path, "%s/trainer_state.json", path);
    json_error_t je;
    json_t *j = json_read_file(state_path, 0, &je);
    if (!j) {
        snprintf(err, err_len, "cannot read %s: %s", state_path, je.text);
        return -1;
    }
    const int is_adapter = json_is_true(json_object_get(j, "peft_adapter"));
    if (is_adapter != adapter) {
        json_decref(j);
        if (is_adapter)
            snprintf(err, err_len, "%s is a LoRA adapter checkpoint (use_peft): it holds the adapters only; resume it "
                     "with --use-peft and the same LoRA options, or load it with PEFT", path);
        else
            snprintf(err, err_len, "%s is a full-model checkpoint: a use_peft run resumes LoRA adapter checkpoints "
                     "only; drop --use-peft to resume it", path);
        return -1;
    }
    rc = checkpoint_state_from_json(j, state_path, cs, err, err_len);
    json_decref(j);
    return rc;
}

// Whether a checkpoint of cs->world_size ranks can continue on `world`: each rank's data_position counts its own
// interleaved shard (data.h), so the records consumed so far must split evenly over the new ranks, and a shuffled
// epoch under way (each rank's order a permutation of its own shard) cannot continue on another number. 0, or -1
// with a message naming both sides. Resuming on the same number always can.
static int check_resize(const CheckpointState *cs, int world, const CheckpointOptions *o, const char *path, char *err,
                        size_t err_len) {
    if (cs->world_size == world) return 0;
    if (cs->progress.data_position > 0 && o->data_order_per_rank) {
        snprintf(err, err_len, "%s was written by %d ranks at position %lld of epoch %lld; this run has %d ranks and "
                 "shuffle_dataset on, whose order is per rank's shard: the epoch cannot continue in the same order. "
                 "Resume with WORLD_SIZE=%d, from a checkpoint at an epoch boundary, or with --shuffle-dataset false "
                 "on both runs", path, cs->world_size, (long long)cs->progress.data_position,
                 (long long)cs->progress.epoch, world, cs->world_size);
        return -1;
    }
    if ((cs->progress.data_position * cs->world_size) % world != 0) {
        snprintf(err, err_len, "%s was written by %d ranks at data_position %lld (per rank: %lld records in all); "
                 "this run's %d ranks cannot split that evenly: resume with WORLD_SIZE=%d or a number of ranks that "
                 "divides %lld", path, cs->world_size, (long long)cs->progress.data_position,
                 (long long)(cs->progress.data_position * cs->world_size), world, cs->world_size,
                 (long long)(cs->progress.data_position * cs->world_size));
        return -1;
    }
    return 0;
}

int checkpoint_load_adapter(Comm *c, const CheckpointOptions *o, const char *dir, const Model *m,
                            int (*read)(const char *dir, void *arg, char *err, size_t err_len), void *arg,
                            TrainProgress *p, char *loaded_dir, char *err, size_t err_len) {
    char path[PATH_MAX];
    CheckpointState cs;
    if (resolve_checkpoint(c, o, dir, 1, path, &cs, err, err_len) != 0) return -1;
    // The adapters' state is saved whole (rank 0 collects it), so any number of ranks reads it back; each rank's data
    // position counts its own shard's records and is rescaled as for a ZeRO checkpoint.
    const int world = comm_world_size(c);
    if (check_resize(&cs, world, o, path, err, err_len) != 0) return -1;
    if (cs.layout_hash != m->layout.hash) {
        snprintf(err, err_len, "%s has layout hash %016llx, this model's is %016llx: resume with the same --model", path,
                 (unsigned long long)cs.layout_hash, (unsigned long long)m->layout.hash);
        return -1;
    }
    if (read(path, arg, err, err_len) != 0) return -1;
    *p = cs.progress;
    if (cs.world_size != world) {
        p->data_position = cs.progress.data_position * cs.world_size / world;
        if (comm_rank(c) == 0)
            fprintf(stderr, "tandem-train: %s was written by %d ranks; its adapters continue on %d ranks "
                    "(data_position %lld per rank becomes %lld)\n", path, cs.world_size, world,
                    (long long)cs.progress.data_position, (long long)p->data_position);
    }
    if (loaded_dir) snprintf(loaded_dir, PATH_MAX, "%s", path);
    return 0;
}

int checkpoint_load(Zero3 *z, Model *m, Comm *c, const CheckpointOptions *o, const char *dir, TrainProgress *p,
                    char *loaded_dir, char *err, size_t err_len) {
    const int rank = comm_rank(c), world = comm_world_size(c);
    char path[PATH_MAX];
    CheckpointState cs;
    if (resolve_checkpoint(c, o, dir, 0, path, &cs, err, err_len) != 0) return -1;
    int rc = 0;
    char slicing[32];
    zero3_slicing(z, slicing, sizeof slicing);
    const int resize = cs.world_size != world, reslice = resize || strcmp(cs.zero_slicing, slicing) != 0;
    if (check_resize(&cs, world, o, path, err, err_len) != 0) return -1;
    if (cs.layout_hash != m->layout.hash) {
        snprintf(err, err_len, "%s has layout hash %016llx, this model's is %016llx: resume with the same --model", path,
                 (unsigned long long)cs.layout_hash, (unsigned long long)m->layout.hash);
        return -1;
    }
    *p = cs.progress;
    if (reslice) {
        p->data_position = cs.progress.data_position * cs.world_size / world;
        if (rank == 0)
            fprintf(stderr, "tandem-train: %s was written by %d ranks cutting the ZeRO state %s; re-slicing it for %d "
                    "ranks cutting it %s (data_position %lld per rank becomes %lld)\n", path, cs.world_size,
                    cs.zero_slicing, world, slicing, (long long)cs.progress.data_position, (long long)p->data_position);
    }

    char opt_path[PATH_MAX + 64];
    snprintf(opt_path, sizeof opt_path, "%s/trainer_state/rank-%05d/optimizer.safetensors", path, rank);
    SafetensorsSet *set = NULL;
    CheckpointReslice *rs = NULL;
    if (reslice ? checkpoint_reslice_open(&rs, path, cs.world_size, cs.zero_slicing, err, err_len) != 0
                : st_open(&set, opt_path, err, err_len) != 0)
        return -1;
    float *buf[3] = {0};
    for (int u = 0; u < m->layout.n_units && rc == 0; u++) {
        size_t n = zero3_shard_count(z, u);
        for (int k = 0; k < 3 && rc == 0; k++) {
            float *grown = realloc(buf[k], (n ? n : 1) * sizeof(float));
            if (grown) {
                buf[k] = grown;
            } else {
                snprintf(err, err_len, "out of memory restoring unit %d", u);
                rc = -1;
            }
        }
        if (rc == 0 && rs)
            rc = checkpoint_read_resliced_unit(rs, &m->layout, u, zero3_shard_offset(z, u), n, buf[0], buf[1], buf[2],
                                               err, err_len);
        else if (rc == 0)
            rc = checkpoint_read_unit_state(set, opt_path, u, n, buf[0], buf[1], buf[2], err, err_len);
        if (rc == 0 && zero3_restore_shard(z, u, buf[0], buf[1], buf[2]) != 0) {
            snprintf(err, err_len, "restoring unit %d: %s", u, ops_error(m->ops));
            rc = -1;
        }
    }
    for (int k = 0; k < 3; k++) free(buf[k]);
    if (set) st_close(set);
    checkpoint_reslice_close(rs);
    int32_t ok = rc == 0;
    if (comm_all_reduce(c, &ok, 1, COMM_I32, COMM_SUM) != 0) {
        snprintf(err, err_len, "resume: %s", comm_error(c));
        return -1;
    }
    if (ok != world) {
        if (rc == 0) snprintf(err, err_len, "resume from %s: another rank failed to restore its state", path);
        return -1;
    }
    if (zero3_republish(z, err, err_len) != 0) return -1;
    if (loaded_dir) snprintf(loaded_dir, PATH_MAX, "%s", path);
    return 0;
}

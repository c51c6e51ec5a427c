// trainer/checkpoint.c — consolidated HF checkpoints and sharded trainer state (see trainer/checkpoint.h).
#include "trainer/checkpoint.h"

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

static int write_json(const char *path, json_t *j, char *err, size_t err_len) {
    char tmp[PATH_MAX + 64];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (json_dump_file(j, tmp, JSON_INDENT(2)) != 0 || rename(tmp, path) != 0) {
        snprintf(err, err_len, "cannot write %s: %s", path, strerror(errno));
        return -1;
    }
    return 0;
}

static json_t *progress_json(const TrainProgress *p, const Model *m, int world, int stage) {
    char hash[17], rng0[17], rng1[17];
    snprintf(hash, sizeof hash, "%016llx", (unsigned long long)m->layout.hash);
    snprintf(rng0, sizeof rng0, "%016llx", (unsigned long long)p->rng[0]);
    snprintf(rng1, sizeof rng1, "%016llx", (unsigned long long)p->rng[1]);
    return json_pack("{s:I, s:I, s:I, s:[s,s], s:I, s:i, s:i, s:s}", "global_step", (json_int_t)p->step, "epoch",
                     (json_int_t)p->epoch, "data_position", (json_int_t)p->data_position, "rng", rng0, rng1,
                     "policy_version", (json_int_t)p->policy_version, "world_size", world, "zero_stage", stage,
                     "layout_hash", hash);
}

// Rank r's optimizer state: master, adam_m, adam_v slices of every unit as 1-D f32 tensors.
static int save_rank_state(Zero3 *z, const Model *m, int rank, const char *dir, char *err, size_t err_len) {
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
    char rank_dir[PATH_MAX + 64], from[PATH_MAX + 96], to[PATH_MAX + 96];
    snprintf(rank_dir, sizeof rank_dir, "%s/trainer_state/rank-%05d", dir, rank);
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

// Removes checkpoint-N folders beyond the newest keep_last.
static void prune(const char *output_dir, int keep_last) {
    if (keep_last <= 0) return;
    DIR *d = opendir(output_dir);
    if (!d) return;
    long steps[4096];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 4096) {
        char *end;
        if (strncmp(e->d_name, "checkpoint-", 11) != 0) continue;
        long s = strtol(e->d_name + 11, &end, 10);
        if (*end == 0) steps[n++] = s;
    }
    closedir(d);
    for (int i = 0; i < n; i++) {
        int newer = 0;
        for (int j = 0; j < n; j++) newer += steps[j] > steps[i];
        if (newer >= keep_last) {
            char path[PATH_MAX];
            snprintf(path, sizeof path, "%s/checkpoint-%ld", output_dir, steps[i]);
            remove_tree(path, NULL, 0);
        }
    }
}

int checkpoint_save(Zero3 *z, Model *m, Comm *c, const CheckpointOptions *o, const TrainProgress *p, char *saved_dir,
                    char *err, size_t err_len) {
    const int rank = comm_rank(c), world = comm_world_size(c), U = m->layout.n_units;
    char final_dir[PATH_MAX], tmp_dir[PATH_MAX + 8];
    snprintf(final_dir, sizeof final_dir, "%s/checkpoint-%lld", o->output_dir, (long long)p->step);
    snprintf(tmp_dir, sizeof tmp_dir, "%s.tmp", final_dir);
    int rc = 0;
    if (rank == 0) {
        remove_tree(tmp_dir, NULL, 0);
        rc = make_dirs(tmp_dir, err, err_len);
    }
    // Every rank learns whether rank 0 could create the folder before anyone writes into it.
    int32_t ok = rc == 0;
    if (comm_broadcast(c, &ok, 1, COMM_I32, 0) != 0) {
        snprintf(err, err_len, "checkpoint: %s", comm_error(c));
        return -1;
    }
    if (!ok) {
        if (rank != 0) snprintf(err, err_len, "checkpoint: rank 0 could not create %s", tmp_dir);
        return -1;
    }
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
        rc = model_save_host(m, units, tmp_dir, o->save_bf16, o->max_shard_bytes, err, err_len);
        for (size_t i = 0; rc == 0 && i < sizeof TOKENIZER_FILES / sizeof *TOKENIZER_FILES; i++) {
            char from[PATH_MAX + 64], to[PATH_MAX + 128];
            snprintf(from, sizeof from, "%s/%s", o->base_model_dir, TOKENIZER_FILES[i]);
            snprintf(to, sizeof to, "%s/%s", tmp_dir, TOKENIZER_FILES[i]);
            rc = copy_file(from, to, err, err_len);
        }
        if (rc == 0) {
            char path[PATH_MAX + 32];
            snprintf(path, sizeof path, "%s/trainer_state.json", tmp_dir);
            json_t *j = progress_json(p, m, world, zero3_stage(z));
            rc = write_json(path, j, err, err_len);
            json_decref(j);
        }
    }
    for (int u = 0; u < U; u++) free(units[u]);
    free(units);
    if (rc == 0) rc = save_rank_state(z, m, rank, tmp_dir, err, err_len);
    // All ranks must have written before rank 0 renames: agree on success first.
    int32_t all_ok = rc == 0;
    if (comm_all_reduce(c, &all_ok, 1, COMM_I32, COMM_SUM) != 0) {
        snprintf(err, err_len, "checkpoint: %s", comm_error(c));
        return -1;
    }
    if (all_ok != world) {
        if (rc == 0) snprintf(err, err_len, "checkpoint %s: another rank failed to write its part", final_dir);
        return -1;
    }
    if (rank == 0) {
        remove_tree(final_dir, NULL, 0);
        if (rename(tmp_dir, final_dir) != 0) {
            snprintf(err, err_len, "cannot rename %s to %s: %s", tmp_dir, final_dir, strerror(errno));
            rc = -1;
        }
        prune(o->output_dir, o->keep_last);
    }
    if (comm_barrier(c) != 0) {
        snprintf(err, err_len, "checkpoint: %s", comm_error(c));
        return -1;
    }
    if (saved_dir) snprintf(saved_dir, PATH_MAX, "%s", final_dir);
    return rc;
}

static int latest_checkpoint(const char *output_dir, char *out, size_t out_len) {
    DIR *d = opendir(output_dir);
    if (!d) return -1;
    long best = -1;
    struct dirent *e;
    while ((e = readdir(d))) {
        char *end;
        if (strncmp(e->d_name, "checkpoint-", 11) != 0) continue;
        long s = strtol(e->d_name + 11, &end, 10);
        if (*end == 0 && s > best) best = s;
    }
    closedir(d);
    if (best < 0) return -1;
    snprintf(out, out_len, "%s/checkpoint-%ld", output_dir, best);
    return 0;
}

int checkpoint_load(Zero3 *z, Model *m, Comm *c, const CheckpointOptions *o, const char *dir, TrainProgress *p,
                    char *loaded_dir, char *err, size_t err_len) {
    const int rank = comm_rank(c), world = comm_world_size(c);
    char path[PATH_MAX];
    if (strcmp(dir, "latest") == 0) {
        if (latest_checkpoint(o->output_dir, path, sizeof path) != 0) {
            snprintf(err, err_len, "--resume latest: no checkpoint-N folder in %s", o->output_dir);
            return -1;
        }
    } else {
        snprintf(path, sizeof path, "%s", dir);
    }
    char state_path[PATH_MAX + 32];
    snprintf(state_path, sizeof state_path, "%s/trainer_state.json", path);
    json_error_t je;
    json_t *j = json_read_file(state_path, 0, &je);
    if (!j) {
        snprintf(err, err_len, "cannot read %s: %s", state_path, je.text);
        return -1;
    }
    json_int_t step, epoch, pos, version;
    int saved_world;
    const char *hash, *r0, *r1;
    int bad = json_unpack_ex(j, &je, 0, "{s:I, s:I, s:I, s:[s,s], s:I, s:i, s:s}", "global_step", &step, "epoch",
                             &epoch, "data_position", &pos, "rng", &r0, &r1, "policy_version", &version, "world_size",
                             &saved_world, "layout_hash", &hash);
    if (bad) {
        snprintf(err, err_len, "%s: %s", state_path, je.text);
        json_decref(j);
        return -1;
    }
    char mine[17];
    snprintf(mine, sizeof mine, "%016llx", (unsigned long long)m->layout.hash);
    int rc = 0;
    if (saved_world != world) {
        snprintf(err, err_len, "%s was written by %d ranks; this run has %d: resume with WORLD_SIZE=%d", path,
                 saved_world, world, saved_world);
        rc = -1;
    } else if (strcmp(hash, mine) != 0) {
        snprintf(err, err_len, "%s has layout hash %s, this model's is %s: resume with the same --model", path, hash, mine);
        rc = -1;
    }
    if (rc == 0) {
        *p = (TrainProgress){.step = step, .epoch = epoch, .data_position = pos, .policy_version = version};
        p->rng[0] = strtoull(r0, NULL, 16);
        p->rng[1] = strtoull(r1, NULL, 16);
    }
    json_decref(j);
    if (rc != 0) return -1;

    char opt_path[PATH_MAX + 64];
    snprintf(opt_path, sizeof opt_path, "%s/trainer_state/rank-%05d/optimizer.safetensors", path, rank);
    SafetensorsSet *set;
    if (st_open(&set, opt_path, err, err_len) != 0) return -1;
    float *buf[3] = {0};
    for (int u = 0; u < m->layout.n_units && rc == 0; u++) {
        size_t n = zero3_shard_count(z, u);
        const char *kind[3] = {"master", "adam_m", "adam_v"};
        for (int k = 0; k < 3 && rc == 0; k++) {
            char name[48];
            snprintf(name, sizeof name, "%s.%d", kind[k], u);
            const StTensor *t = st_find(set, name);
            int64_t shape[1] = {(int64_t)n};
            buf[k] = realloc(buf[k], (n ? n : 1) * sizeof(float));
            if (!t) {
                snprintf(err, err_len, "%s lacks %s", opt_path, name);
                rc = -1;
            } else if (st_check_shape(t, 1, shape, err, err_len) != 0 || st_read_f32(t, buf[k], n, err, err_len) != 0) {
                rc = -1;
            }
        }
        if (rc == 0 && zero3_restore_shard(z, u, buf[0], buf[1], buf[2]) != 0) {
            snprintf(err, err_len, "restoring unit %d: %s", u, ops_error(m->ops));
            rc = -1;
        }
    }
    for (int k = 0; k < 3; k++) free(buf[k]);
    st_close(set);
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

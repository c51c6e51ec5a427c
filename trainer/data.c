// trainer/data.c — sharded, shuffled JSONL reader (record format, sharding and order in data.h).
#include "trainer/data.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "shared/json_read.h"
#include "shared/err.h"

// Where one of this rank's records starts.
typedef struct {
    uint32_t file;      // index into DataReader.files
    uint64_t offset;    // byte offset of the line
    uint64_t line;      // 1-based line number (for messages)
    uint64_t record;    // global record index g
} RecordRef;

struct DataReader {
    DataOptions opt;
    char **files;
    size_t n_files;
    RecordRef *recs;        // (n_recs) this rank's records in stored order
    size_t n_recs, cap_recs;
    size_t total;           // records of every rank
    size_t *order;          // (n_recs) the current epoch's order: indices into recs
    uint64_t epoch;
    size_t pos;
    size_t skipped;
    FILE *fp;               // the file last read from (records are read one at a time)
    uint32_t fp_file;
    char *line;             // getline buffer
    size_t line_cap;
};

// ---- file list --------------------------------------------------------------------------------------

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int add_file(DataReader *d, const char *path) {
    char **nf = realloc(d->files, (d->n_files + 1) * sizeof *nf);
    if (!nf) return -1;
    d->files = nf;
    if (!(d->files[d->n_files] = strdup(path))) return -1;
    d->n_files++;
    return 0;
}

static int list_files(DataReader *d, const char *path, char *err, size_t err_len) {
    struct stat st;
    if (stat(path, &st) != 0) {
        err_fail(err, err_len, "train_file: %s: %s", path, strerror(errno));
        return -1;
    }
    if (!S_ISDIR(st.st_mode)) {
        if (add_file(d, path) != 0) goto oom;
        return 0;
    }
    DIR *dir = opendir(path);
    if (!dir) {
        err_fail(err, err_len, "train_file: %s: %s", path, strerror(errno));
        return -1;
    }
    struct dirent *de;
    size_t plen = strlen(path);
    while ((de = readdir(dir))) {
        size_t nl = strlen(de->d_name);
        if (nl < 7 || strcmp(de->d_name + nl - 6, ".jsonl") != 0) continue;
        char *full = malloc(plen + nl + 2);
        if (!full) {
            closedir(dir);
            goto oom;
        }
        snprintf(full, plen + nl + 2, "%s%s%s", path, (plen && path[plen - 1] == '/') ? "" : "/", de->d_name);
        struct stat fs;
        int regular = stat(full, &fs) == 0 && S_ISREG(fs.st_mode);
        int rc = regular ? add_file(d, full) : 0;
        free(full);
        if (rc != 0) {
            closedir(dir);
            goto oom;
        }
    }
    closedir(dir);
    if (d->n_files == 0) {
        err_fail(err, err_len, "train_file: the folder %s holds no *.jsonl file", path);
        return -1;
    }
    qsort(d->files, d->n_files, sizeof *d->files, cmp_str);
    return 0;
oom:
    err_fail(err, err_len, "train_file: out of memory");
    return -1;
}

// ---- scan: line starts of this rank's records -------------------------------------------------------

static int keep_record(DataReader *d, uint32_t file, uint64_t offset, uint64_t line) {
    uint64_t g = d->total++;
    if (g % (uint64_t)d->opt.world_size != (uint64_t)d->opt.rank) return 0;
    if (d->n_recs == d->cap_recs) {
        size_t cap = d->cap_recs ? d->cap_recs * 2 : 1024;
        RecordRef *nr = realloc(d->recs, cap * sizeof *nr);
        if (!nr) return -1;
        d->recs = nr, d->cap_recs = cap;
    }
    d->recs[d->n_recs++] = (RecordRef){.file = file, .offset = offset, .line = line, .record = g};
    return 0;
}

static int scan_file(DataReader *d, uint32_t fi, char *err, size_t err_len) {
    FILE *f = fopen(d->files[fi], "rb");
    if (!f) {
        err_fail(err, err_len, "train_file: %s: %s", d->files[fi], strerror(errno));
        return -1;
    }
    enum { CHUNK = 1 << 20 };
    char *buf = malloc(CHUNK);
    if (!buf) {
        fclose(f);
        err_fail(err, err_len, "train_file: out of memory");
        return -1;
    }
    uint64_t base = 0, line_start = 0, line_no = 1;
    int nonblank = 0, rc = 0;
    size_t n;
    while ((n = fread(buf, 1, CHUNK, f)) > 0) {
        size_t i = 0;
        while (i < n) {
            if (!nonblank) {  // still looking for the line's first non-whitespace byte
                char c = buf[i];
                if (c == '\n') {
                    line_start = base + i + 1, line_no++, i++;
                    continue;
                }
                if (c == ' ' || c == '\t' || c == '\r') {
                    i++;
                    continue;
                }
                nonblank = 1;
            }
            char *nl = memchr(buf + i, '\n', n - i);
            if (!nl) {
                i = n;
                break;
            }
            if (keep_record(d, fi, line_start, line_no) != 0) rc = -1;
            i = (size_t)(nl - buf) + 1;
            line_start = base + i, line_no++, nonblank = 0;
        }
        base += n;
        if (rc) break;
    }
    if (rc == 0 && ferror(f)) {
        err_fail(err, err_len, "train_file: %s: read error", d->files[fi]);
        rc = -1;
    } else if (rc == 0 && nonblank && keep_record(d, fi, line_start, line_no) != 0) {
        rc = -1;  // last line without a newline
    }
    if (rc && err && !err[0]) err_fail(err, err_len, "train_file: out of memory");
    free(buf);
    fclose(f);
    return rc;
}

// ---- order ------------------------------------------------------------------------------------------

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static void build_order(DataReader *d, uint64_t epoch) {
    for (size_t i = 0; i < d->n_recs; i++) d->order[i] = i;
    if (d->opt.shuffle && d->n_recs > 1) {
        uint64_t s = d->opt.seed ^ (0x9E3779B97F4A7C15ULL * (epoch + 1)) ^
                     (0xD1B54A32D192ED03ULL * ((uint64_t)d->opt.rank + 1));
        for (size_t i = d->n_recs - 1; i > 0; i--) {
            uint64_t range = (uint64_t)i + 1, limit = (UINT64_MAX / range) * range, x;
            do x = splitmix64(&s);
            while (x >= limit);  // rejection keeps j exactly uniform
            size_t j = (size_t)(x % range);
            size_t t = d->order[i];
            d->order[i] = d->order[j];
            d->order[j] = t;
        }
    }
    d->epoch = epoch;
    d->pos = 0;
}

void data_close(DataReader *d) {
    if (!d) return;
    for (size_t i = 0; i < d->n_files; i++) free(d->files[i]);
    free(d->files);
    free(d->recs);
    free(d->order);
    if (d->fp) fclose(d->fp);
    free(d->line);
    free(d);
}

size_t data_total_records(const DataReader *d) { return d->total; }
size_t data_shard_records(const DataReader *d) { return d->n_recs; }
size_t data_skipped(const DataReader *d) { return d->skipped; }

int data_seek(DataReader *d, uint64_t epoch, size_t position, char *err, size_t err_len) {
    if (position > d->n_recs) {
        err_fail(err, err_len, "data position %zu is past the end of this rank's %zu records", position, d->n_recs);
        return -1;
    }
    build_order(d, epoch);  // deterministic: rebuilding equals continuing
    d->pos = position;
    return 0;
}

void data_tell(const DataReader *d, uint64_t *epoch, size_t *position) {
    *epoch = d->epoch;
    *position = d->pos;
}

// ---- one record -------------------------------------------------------------------------------------

void data_row_clear(DataRow *row) {
    if (!row) return;
    json_decref(row->prompt);
    json_decref(row->columns);
    free(row->prompt_text);
    free(row->ids);
    memset(row, 0, sizeof *row);
}

// Reads the line of a record into d->line. Returns its length or -1.
static ssize_t read_line(DataReader *d, const RecordRef *r, char *err, size_t err_len, const char *src) {
    if (!d->fp || d->fp_file != r->file) {
        if (d->fp) fclose(d->fp);
        d->fp = fopen(d->files[r->file], "rb");
        d->fp_file = r->file;
        if (!d->fp) {
            err_fail(err, err_len, "%s: %s", src, strerror(errno));
            return -1;
        }
    }
    if (fseeko(d->fp, (off_t)r->offset, SEEK_SET) != 0) {
        err_fail(err, err_len, "%s: seek failed: %s", src, strerror(errno));
        return -1;
    }
    ssize_t n = getline(&d->line, &d->line_cap, d->fp);
    if (n < 0) {
        err_fail(err, err_len, "%s: the file changed since it was opened (line missing)", src);
        return -1;
    }
    return n;
}

// Checks a message list and fills msgs (n entries). 0, or -1 with a message.
static int read_messages(const json_t *list, const char *key, ChatMessage *msgs, const char *src, char *err,
                         size_t err_len) {
    size_t i;
    json_t *m;
    json_array_foreach(list, i, m) {
        const json_t *role = json_object_get(m, "role"), *content = json_object_get(m, "content");
        if (!json_is_object(m) || !json_is_string(role) || !json_is_string(content)) {
            err_fail(err, err_len, "%s: \"%s\"[%zu] must be an object with string \"role\" and \"content\"", src, key,
                    i);
            return -1;
        }
        msgs[i].role = json_string_value(role);
        msgs[i].content = json_string_value(content);
    }
    return 0;
}

// Renders messages (n) with the chat template. *out malloc'd.
static int render(const DataOptions *opt, const ChatMessage *msgs, size_t n, int add_gen, char **out, const char *src,
                  char *err, size_t err_len) {
    if (!opt->chat) {
        err_fail(err, err_len, "%s: the prompt is a list of messages but no chat template is loaded", src);
        return -1;
    }
    char terr[512];
    if (chat_render_ex(opt->chat, msgs, n, add_gen, opt->render, out, NULL, terr, sizeof terr) != 0) {
        err_fail(err, err_len, "%s: chat template: %s", src, terr);
        return -1;
    }
    return 0;
}

static int encode(const DataOptions *opt, const char *text, int add_special, int32_t **ids, size_t *n, const char *src,
                  char *err, size_t err_len) {
    char terr[512];
    if (tokenizer_encode(opt->tok, text, strlen(text), add_special, ids, n, terr, sizeof terr) != 0) {
        err_fail(err, err_len, "%s: tokenizer: %s", src, terr);
        return -1;
    }
    return 0;
}

// Builds row->prompt_text / ids / prompt_len from the parsed prompt (and completion in sft mode).
static int tokenize_row(const DataOptions *opt, DataRow *row, const json_t *prompt, const json_t *completion,
                        const char *src, char *err, size_t err_len) {
    int rc = -1;
    ChatMessage *msgs = NULL;
    char *full = NULL;
    int32_t *full_ids = NULL;
    size_t n_full = 0;
    if (json_is_string(prompt)) {
        if (!(row->prompt_text = strdup(json_string_value(prompt)))) goto oom;
        if (encode(opt, row->prompt_text, 1, &row->ids, &row->n_ids, src, err, err_len) != 0) goto out;
        if (opt->sft) {
            const char *eos = tokenizer_eos_token(opt->tok);
            const char *c = json_string_value(completion);
            size_t pl = strlen(row->prompt_text), cl = strlen(c), el = eos ? strlen(eos) : 0;
            // TRL appends the EOS token text unless the completion already ends with it.
            int add_eos = el && !(cl >= el && memcmp(c + cl - el, eos, el) == 0);
            if (!(full = malloc(pl + cl + el + 1))) goto oom;
            memcpy(full, row->prompt_text, pl);
            memcpy(full + pl, c, cl);
            if (add_eos) memcpy(full + pl + cl, eos, el);
            full[pl + cl + (add_eos ? el : 0)] = '\0';
            if (encode(opt, full, 1, &full_ids, &n_full, src, err, err_len) != 0) goto out;
        }
    } else {
        size_t np = json_array_size(prompt), nc = completion ? json_array_size(completion) : 0;
        if (!(msgs = calloc(np + nc + 1, sizeof *msgs))) goto oom;
        if (read_messages(prompt, "prompt", msgs, src, err, err_len) != 0) goto out;
        if (render(opt, msgs, np, 1, &row->prompt_text, src, err, err_len) != 0) goto out;
        if (encode(opt, row->prompt_text, 0, &row->ids, &row->n_ids, src, err, err_len) != 0) goto out;
        if (opt->sft) {
            if (read_messages(completion, "completion", msgs + np, src, err, err_len) != 0) goto out;
            if (render(opt, msgs, np + nc, 0, &full, src, err, err_len) != 0) goto out;
            if (encode(opt, full, 0, &full_ids, &n_full, src, err, err_len) != 0) goto out;
        }
    }
    row->prompt_len = row->n_ids;
    if (opt->sft) {
        // The completion starts where the prompt's ids and the full ids first differ (TRL's
        // common_prefix_length): a template or a merge across the boundary can change the prompt's tail.
        size_t k = 0;
        while (k < row->n_ids && k < n_full && row->ids[k] == full_ids[k]) k++;
        if (k >= n_full) {
            err_fail(err, err_len, "%s: the completion adds no token after the prompt", src);
            goto out;
        }
        free(row->ids);
        row->ids = full_ids, row->n_ids = n_full, row->prompt_len = k;
        full_ids = NULL;
    }
    rc = 0;
    goto out;
oom:
    err_fail(err, err_len, "%s: out of memory", src);
out:
    free(msgs);
    free(full);
    free(full_ids);
    return rc;
}

int data_parse_row(const DataOptions *opt, const char *text, size_t len, DataRow *row, const char *src, char *err,
                   size_t err_len) {
    memset(row, 0, sizeof *row);
    if (len >= 3 && (unsigned char)text[0] == 0xEF && (unsigned char)text[1] == 0xBB && (unsigned char)text[2] == 0xBF)
        text += 3, len -= 3;  // UTF-8 byte order mark at the start of a file
    json_error_t je;
    json_t *obj = json_read_buffer(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!obj) {
        err_fail(err, err_len, "%s: invalid JSON: %s (column %d)", src, je.text, je.column);
        return -1;
    }
    int rc = -1;
    json_t *prompt = json_object_get(obj, "prompt"), *messages = json_object_get(obj, "messages");
    json_t *completion = json_object_get(obj, "completion"), *owned_completion = NULL, *owned_prompt = NULL;
    if (!json_is_object(obj)) {
        err_fail(err, err_len, "%s: a record must be a JSON object", src);
        goto out;
    }
    if (prompt && messages) {
        err_fail(err, err_len, "%s: has both \"prompt\" and \"messages\" (give one)", src);
        goto out;
    }
    const char *text_field = opt->text_field ? opt->text_field : "text";
    json_t *lm_text = opt->sft && !prompt && !messages ? json_object_get(obj, text_field) : NULL;
    if (lm_text) {
        // Language modelling: the text is an empty prompt's completion, so it gets the prompt's BOS and the EOS
        // text, and every token is learned.
        if (!json_is_string(lm_text)) {
            err_fail(err, err_len, "%s: \"%s\" (dataset_text_field) must be a string", src, text_field);
            goto out;
        }
        if (!(owned_prompt = json_string(""))) goto oom;
        if (tokenize_row(opt, row, owned_prompt, lm_text, src, err, err_len) != 0) goto out;
        row->loss_start = 0;
        row->prompt = json_incref(lm_text);
        if (!(row->columns = json_object())) goto oom;
        rc = 0;
        goto out;
    }
    if (!prompt && !messages) {
        if (opt->sft)
            err_fail(err, err_len, "%s: no \"prompt\", \"messages\" or \"%s\" (dataset_text_field) key", src,
                     text_field);
        else
            err_fail(err, err_len, "%s: no \"prompt\" or \"messages\" key", src);
        goto out;
    }
    const char *pkey = prompt ? "prompt" : "messages";
    if (!prompt) prompt = messages;
    if (messages && !json_is_array(messages)) {
        err_fail(err, err_len, "%s: \"messages\" must be a list of chat messages", src);
        goto out;
    }
    if (!json_is_string(prompt) && !json_is_array(prompt)) {
        err_fail(err, err_len, "%s: \"prompt\" must be a string or a list of chat messages", src);
        goto out;
    }
    if (json_is_array(prompt) && json_array_size(prompt) == 0) {
        err_fail(err, err_len, "%s: \"%s\" is an empty list", src, pkey);
        goto out;
    }
    if (opt->sft) {
        if (!completion && messages) {
            // A conversation: its last message is the target.
            size_t n = json_array_size(messages);
            const json_t *last = json_array_get(messages, n - 1);
            const json_t *role = json_is_object(last) ? json_object_get(last, "role") : NULL;
            if (n < 2 || !json_is_string(role) || strcmp(json_string_value(role), "assistant") != 0) {
                err_fail(err, err_len, "%s: sft needs a \"completion\", or \"messages\" ending with an assistant "
                        "message after at least one other", src);
                goto out;
            }
            owned_prompt = json_array();
            owned_completion = json_array();
            if (!owned_prompt || !owned_completion) goto oom;
            for (size_t i = 0; i < n; i++)
                if (json_array_append(i + 1 < n ? owned_prompt : owned_completion, json_array_get(messages, i)))
                    goto oom;
            prompt = owned_prompt, completion = owned_completion;
        } else if (!completion) {
            err_fail(err, err_len, "%s: sft needs a \"completion\"", src);
            goto out;
        } else if (json_is_array(prompt) && json_is_string(completion)) {
            owned_completion = json_pack("[{s:s, s:O}]", "role", "assistant", "content", completion);
            if (!owned_completion) goto oom;
            completion = owned_completion;
        } else if (json_is_string(prompt) != json_is_string(completion) || !(json_is_string(completion) ||
                                                                            json_is_array(completion))) {
            err_fail(err, err_len, "%s: \"completion\" must be a string for a text prompt, or a list of messages "
                    "for a message prompt", src);
            goto out;
        }
    }
    if (tokenize_row(opt, row, prompt, completion, src, err, err_len) != 0) goto out;
    // A conversation is language modelling in TRL (every token learned); a prompt/completion row learns its
    // completion unless completion_only_loss is false.
    row->loss_start = (opt->sft && (owned_prompt || opt->prompt_loss)) ? 0 : row->prompt_len;
    row->prompt = json_incref(prompt);
    row->columns = json_object();
    if (!row->columns) goto oom;
    const char *key;
    json_t *val;
    json_object_foreach(obj, key, val) {
        if (strcmp(key, "prompt") == 0 || strcmp(key, "messages") == 0) continue;
        if (json_object_set(row->columns, key, val) != 0) goto oom;
    }
    rc = 0;
    goto out;
oom:
    err_fail(err, err_len, "%s: out of memory", src);
out:
    json_decref(owned_prompt);
    json_decref(owned_completion);
    json_decref(obj);
    if (rc != 0) data_row_clear(row);
    return rc;
}

// Reads and parses record r into row, naming it src ("file:line", src_len bytes). 1: a row; 0: its prompt is over
// max_prompt_length, or (sft) max_length left it nothing to learn, and it is skipped (row cleared); -1: an error naming src (row cleared), the over-long prompt
// included with refuse_overlong.
static int load_record(DataReader *d, const RecordRef *r, DataRow *row, char *src, size_t src_len, char *err,
                       size_t err_len) {
    memset(row, 0, sizeof *row);
    snprintf(src, src_len, "%s:%llu", d->files[r->file], (unsigned long long)r->line);
    ssize_t n = read_line(d, r, err, err_len, src);
    if (n < 0) return -1;
    if (data_parse_row(&d->opt, d->line, (size_t)n, row, src, err, err_len) != 0) return -1;
    if (d->opt.max_prompt_length > 0 && row->prompt_len > (size_t)d->opt.max_prompt_length) {
        if (d->opt.refuse_overlong)
            err_fail(err, err_len, "%s: the prompt has %zu tokens, more than max_prompt_length %d", src, row->prompt_len,
                    d->opt.max_prompt_length);
        data_row_clear(row);
        return d->opt.refuse_overlong ? -1 : 0;
    }
    if (d->opt.sft && d->opt.max_length > 0 && row->n_ids > (size_t)d->opt.max_length) {
        const size_t keep = (size_t)d->opt.max_length, cut = row->n_ids - keep;
        if (d->opt.keep_end) {
            memmove(row->ids, row->ids + cut, keep * sizeof *row->ids);
            row->prompt_len = row->prompt_len > cut ? row->prompt_len - cut : 0;
            row->loss_start = row->loss_start > cut ? row->loss_start - cut : 0;
        } else {
            if (row->prompt_len > keep) row->prompt_len = keep;
            if (row->loss_start > keep) row->loss_start = keep;
        }
        row->n_ids = keep;
        if (row->loss_start >= row->n_ids) {  // nothing left to learn: TRL drops the row
            data_row_clear(row);
            return 0;
        }
    }
    row->record = r->record;
    snprintf(row->source, sizeof row->source, "%s", src);
    return 1;
}

int data_next(DataReader *d, DataRow *row, char *err, size_t err_len) {
    memset(row, 0, sizeof *row);
    while (d->pos < d->n_recs) {
        char src[320];
        int rc = load_record(d, &d->recs[d->order[d->pos]], row, src, sizeof src, err, err_len);
        if (rc < 0) return -1;
        d->pos++;
        if (rc == 1) return 1;
        d->skipped++;
    }
    return 0;
}

// ---- opening ----------------------------------------------------------------------------------------

// Every record of this rank's share goes once through what data_next will do to it, so that a malformed line
// stops the run before its first step instead of when the reader reaches it, maybe hours in. The first bad line's
// message is kept in err, followed by how many more there are and where the next one is.
static int validate_records(DataReader *d, char *err, size_t err_len) {
    size_t bad = 0;
    char next_bad[320] = "", scratch[1024];
    for (size_t i = 0; i < d->n_recs; i++) {
        DataRow row;
        char src[320];
        int rc = load_record(d, &d->recs[i], &row, src, sizeof src, bad ? scratch : err, bad ? sizeof scratch : err_len);
        if (rc >= 0) {
            data_row_clear(&row);
            continue;
        }
        if (bad++ == 1) snprintf(next_bad, sizeof next_bad, "%s", src);
    }
    if (bad > 1 && err) {
        size_t used = strlen(err);
        snprintf(err + used, err_len - used, " (and %zu more bad line%s in this rank's share, the next at %s)", bad - 1,
                 bad == 2 ? "" : "s", next_bad);
    }
    return bad ? -1 : 0;
}

int data_open(DataReader **out, const char *path, const DataOptions *opt, char *err, size_t err_len) {
    *out = NULL;
    if (err && err_len) err[0] = '\0';
    if (!path || !path[0]) {
        err_fail(err, err_len, "train_file: no dataset path given");
        return -1;
    }
    if (!opt || !opt->tok || opt->world_size < 1 || opt->rank < 0 || opt->rank >= opt->world_size) {
        err_fail(err, err_len, "data_open: needs a tokenizer and 0 <= rank < world_size");
        return -1;
    }
    DataReader *d = calloc(1, sizeof *d);
    if (!d) {
        err_fail(err, err_len, "train_file: out of memory");
        return -1;
    }
    d->opt = *opt;
    if (list_files(d, path, err, err_len) != 0) goto fail;
    for (uint32_t i = 0; i < d->n_files; i++)
        if (scan_file(d, i, err, err_len) != 0) goto fail;
    if (d->total == 0) {
        err_fail(err, err_len, "train_file: %s holds no record", path);
        goto fail;
    }
    if (d->n_recs == 0) {
        err_fail(err, err_len, "train_file: %s has %zu records, fewer than the %d ranks: rank %d has none", path,
                d->total, opt->world_size, opt->rank);
        goto fail;
    }
    d->order = malloc(d->n_recs * sizeof *d->order);
    if (!d->order) {
        err_fail(err, err_len, "train_file: out of memory");
        goto fail;
    }
    if (validate_records(d, err, err_len) != 0) goto fail;
    build_order(d, 0);
    *out = d;
    return 0;
fail:
    data_close(d);
    return -1;
}


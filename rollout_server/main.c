// rollout_server/main.c — tandem-serve: loads a model into the engine (one engine per device with --devices),
// serves HTTP (and the trainer's ZeroMQ control channel with --control), and on SIGTERM / SIGINT (or a ZeroMQ
// `shutdown`) stops accepting, lets the work in flight finish within --drain-timeout, and exits 0. A signal that
// comes during start-up ends the process at once with status 128 + signal (rollout_server/stop_request.h).
#include <errno.h>
#include <inttypes.h>
#include <stddef.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "rollout_server/engine_group.h"
#include "rollout_server/http_server.h"
#include "rollout_server/stop_request.h"
#include "rollout_server/zmq_control.h"
#include "shared/cli.h"
#include "shared/version.h"

// Defaults of the options that are not engine or HTTP settings.
#define DEFAULT_DRAIN_TIMEOUT_S 30.0
#define DEFAULT_WEIGHT_SYNC_TIMEOUT_S 600.0
#define ABORT_ANSWER_GRACE_MS 2000 // after the drain timeout: time to write the aborted requests' answers

typedef struct {
    EngineConfig engine;
    HttpConfig http;
    const char *control;
    const char *control_key_file;          // --control-key-file, else TANDEM_CONTROL_KEY_FILE
    const char *control_authorized_keys;   // --control-authorized-keys, else TANDEM_CONTROL_AUTHORIZED_KEYS
    int control_insecure;
    double drain_timeout_s;
    double weight_sync_timeout_s;
    EngineUpdateMode weight_update_mode;   // --weight-update-mode
    int device_given;
    const char *devices_arg;        // --devices as given, NULL when absent
    EngineDevice devices[ENGINE_GROUP_MAX];
    int n_devices;
    // --lora NAME=DIR: the names and folders, split (the EngineConfig points at these)
    char lora_name_buf[CLI_LIST_MAX][256];
    const char *lora_names[CLI_LIST_MAX], *lora_dirs[CLI_LIST_MAX];
} Options;

static void human_bytes(size_t b, char *out, size_t cap) {
    const char *unit[] = {"", "K", "M", "G", "T"};
    int u = 0;
    while (u < 4 && b >= 1024 && b % 1024 == 0) b /= 1024, u++;
    snprintf(out, cap, "%zu%s", b, unit[u]);
}

// A number of seconds as people write it: "30", "0.5", "600" (no exponent, no trailing zeros; millisecond
// precision, which is what the timeouts resolve to).
static void human_seconds(double s, char *out, size_t cap) {
    snprintf(out, cap, "%.3f", s);
    size_t n = strlen(out);
    while (n > 0 && out[n - 1] == '0') out[--n] = '\0';
    if (n > 0 && out[n - 1] == '.') out[--n] = '\0';
}

// The options as given (text for the ones parsed further below: devices, byte counts, the seed).
typedef struct {
    const char *model, *host, *control, *control_key_file, *control_authorized_keys, *device, *devices, *kv,
        *body, *api_key, *served_name, *chat_template, *seed, *update_mode, *adapter_mode, *load_format;
    int port, tp, block_size, max_num_seqs, max_batched, max_queued, max_connections, max_per_client, graph_max_batch;
    double gpu_util, read_timeout, drain_timeout, sync_timeout;
    CliList loras;
    int control_insecure, enforce_eager, prefix_on, prefix_off;
    char kv_default[32], body_default[32], seed_default[32];
} ServeArgs;

#define TEXT(flag_, field, value, help_, note) \
    {.flag = flag_, .type = CLI_TEXT, .offset = offsetof(ServeArgs, field), .value_name = value, .help = help_, \
     .default_note = note}
#define INT(flag_, field, lo, hi, help_, note) \
    {.flag = flag_, .type = CLI_INT, .offset = offsetof(ServeArgs, field), .help = help_, \
     .bounds = CLI_BOUND_MIN | CLI_BOUND_MAX, .min = lo, .max = hi, .default_note = note}
#define SECONDS(flag_, field, lo, hi, help_, note) \
    {.flag = flag_, .type = CLI_DOUBLE, .offset = offsetof(ServeArgs, field), .value_name = "SECONDS", \
     .help = help_, .bounds = CLI_BOUND_MIN | CLI_BOUND_MAX, .min = lo, .max = hi, .default_note = note}
#define SWITCH(flag_, field, help_, note) \
    {.flag = flag_, .type = CLI_SWITCH, .offset = offsetof(ServeArgs, field), .help = help_, .default_note = note}

enum { N_SERVE_OPTIONS = 35 };

// The option table; prefix_default says whether prefix caching is on by default (engine_config_default).
static void serve_options(CliOption out[N_SERVE_OPTIONS], int prefix_default) {
    const CliOption table[N_SERVE_OPTIONS] = {
        {.flag = "--model", .type = CLI_TEXT, .offset = offsetof(ServeArgs, model), .value_name = "DIR",
         .help = "model folder: config.json, *.safetensors, tokenizer.json", .required = 1},
        TEXT("--host", host, "ADDR", "address to listen on", NULL),
        INT("--port", port, 0, 65535, "HTTP port; 0 picks a free one and logs it", NULL),
        TEXT("--control", control, "ENDPOINT",
             "ZeroMQ ROUTER endpoint, e.g. tcp://127.0.0.1:5555; one that other machines can reach "
             "(tcp://0.0.0.0:5555) needs keys", NULL),
        TEXT("--control-key-file", control_key_file, "PATH",
             "this server's CURVE key pair (tandem-train keygen writes one): the control channel then admits only the "
             "clients listed in --control-authorized-keys", "env TANDEM_CONTROL_KEY_FILE, else none"),
        TEXT("--control-authorized-keys", control_authorized_keys, "PATH",
             "client public keys allowed on the control channel, one a line",
             "env TANDEM_CONTROL_AUTHORIZED_KEYS, else none"),
        SWITCH("--control-insecure", control_insecure,
               "allow --control on an address other machines can reach without keys (anyone reaching it can pause, "
               "replace the weights, shut down); without it such a --control needs the two options above", NULL),
        TEXT("--device", device, "cpu|cuda[:N]", "compute backend and device index", NULL),
        TEXT("--devices", devices, "LIST",
             "one engine per listed device, each with its own copy of the model and KV pool (data parallel); "
             "requests go to the least loaded engine, weight updates to all: cuda:0,cuda:1 or 0,1 (CUDA devices), "
             "cpu,cpu; not with --device", "none, one engine on --device"),
        INT("--tensor-parallel-size", tp, 1, 64,
            "split the model over N devices (cuda: --device's index and the next N-1; cpu: N compute contexts), "
            "Megatron-style: attention heads, KV heads, MLP columns and vocabulary rows per device, one all-reduce "
            "after o_proj and after down_proj; with --devices, each listed device starts a group of N", NULL),
        INT("-tp", tp, 1, 64, "the same as --tensor-parallel-size", NULL),
        TEXT("--kv-cache-memory", kv, "BYTES", "KV cache pool size (per device with --tensor-parallel-size); suffixes "
             "K, M, G, T (x1024)", NULL),
        {.flag = "--gpu-memory-utilization", .type = CLI_DOUBLE, .offset = offsetof(ServeArgs, gpu_util),
         .value_name = "F",
         .help = "cuda: size the KV pool so that this server's GPU (each engine's, with --devices) stays within "
                 "fraction F of its memory, counting the weights, the step workspace, memory other processes hold "
                 "and (with --control) the copy NCCL weight updates land in; replaces --kv-cache-memory",
         .bounds = CLI_BOUND_MIN | CLI_BOUND_MAX, .min = 0, .max = 1, .min_exclusive = 1, .default_note = "off"},
        INT("--block-size", block_size, 1, 4096, "tokens per KV cache block", NULL),
        INT("--max-num-seqs", max_num_seqs, 1, 1 << 20, "sequences decoded together per step", NULL),
        INT("--max-num-batched-tokens", max_batched, 1, 1 << 24,
            "tokens per engine step, decodes plus prefill chunks", NULL),
        INT("--cuda-graph-max-batch", graph_max_batch, 0, 1 << 20,
            "cuda: decode-only steps (one new token per sequence) of up to N sequences are padded to a ladder of "
            "batch sizes (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ..., N) and replayed as CUDA graphs, all recorded at "
            "start-up; larger steps and steps with prompt tokens run op by op; 0 = never pad", NULL),
        SWITCH("--enforce-eager", enforce_eager,
               "cuda: run decode-only steps op by op instead of replaying CUDA graphs, still padded: the same kernels "
               "and shapes as the graphs", NULL),
        INT("--max-queued-requests", max_queued, 1, 1 << 24, "queued requests beyond which new ones get 429", NULL),
        TEXT("--max-body-bytes", body, "BYTES", "largest HTTP request body; larger gets 413", NULL),
        INT("--max-connections", max_connections, 1, 1 << 16,
            "concurrent HTTP connections, one thread each; more are accepted and closed at once", NULL),
        INT("--max-connections-per-client", max_per_client, 0, 1 << 16,
            "concurrent connections from one client address; more are closed at once. A trainer needs its peak "
            "concurrent requests plus its idle kept-alive connections; 0 = as --max-connections",
            "as --max-connections"),
        SECONDS("--request-read-timeout", read_timeout, 0, 86400,
                "a request's headers and body must arrive within this time of the connect (or of its request line, "
                "on a kept-alive connection), however steadily bytes trickle in: a slower request gets 408 or its "
                "connection closed; 0 = no limit", NULL),
        TEXT("--api-key", api_key, "KEY",
             "require 'Authorization: Bearer KEY' on every route but /health and /health/",
             "env TANDEM_API_KEY, else none (no auth)"),
        SECONDS("--drain-timeout", drain_timeout, 0, 86400,
                "on SIGTERM/SIGINT, time given to requests in flight; those still running are then aborted (OpenAI "
                "answers carry what they had, finish_reason \"abort\")", NULL),
        SECONDS("--weight-sync-timeout", sync_timeout, 1, 86400,
                "a weight update over NCCL (joining the trainer's communicator, each receive) that stalls this long "
                "fails; the server keeps its weights", NULL),
        TEXT("--weight-update-mode", update_mode, "keep|abort|keep_kv",
             "what a weight update (weights_end without \"mode\") does with the sequences in flight: keep (they go on, "
             "their tokens recomputed under the new weights, the rest sampled by the new version), abort (generate "
             "prompts of the control channel and non-streamed HTTP requests start over from their prompt under the "
             "new weights; streams are kept) or keep_kv (they go on with the K/V the old weights computed: no "
             "recompute)", NULL),
        SWITCH("--enable-prefix-caching", prefix_on, "reuse KV blocks of identical prompt prefixes across requests",
               prefix_default ? "on" : "off"),
        SWITCH("--no-prefix-caching", prefix_off, "do not reuse them", prefix_default ? "off" : "on"),
        TEXT("--seed", seed, "N", "seed for requests that carry none", NULL),
        TEXT("--load-format", load_format, "auto|random",
             "auto: the folder's safetensors; random: random weights of the folder's config.json (uniform, std 0.02; "
             "norms 1), the same for every tensor-parallel size, no weight file read: benchmarks of shapes whose files "
             "would not fit the disk", NULL),
        TEXT("--served-model-name", served_name, "NAME", "model id in /v1/models and answers", "the folder's name"),
        TEXT("--adapter-update-mode", adapter_mode, "merge|lowrank",
             "how the trainer's LoRA adapter updates (tandem-train lora_sync adapter) are served: merge (into the served "
             "weights, decode at the base model's speed; keeps a copy of the base's decoder layers, and falls back to "
             "lowrank when it does not fit) or lowrank (two more GEMMs per projection beside the base weights, no "
             "copy, slower decode); with --lora adapters always lowrank", NULL),
        {.flag = "--lora", .type = CLI_LIST, .offset = offsetof(ServeArgs, loras), .value_name = "NAME=DIR",
         .help = "serve the PEFT LoRA adapter folder DIR (adapter_config.json, adapter_model.safetensors) beside the "
                 "base model: requests whose \"model\" is NAME run through it (vLLM's --lora-modules); repeat for "
                 "several, up to 64; one device per engine (no --tensor-parallel-size)",
         .default_note = "none"},
        TEXT("--chat-template", chat_template, "NAME",
             "force a chat template family: chatml, qwen3, llama3, llama3.1, llama2, mistral, mistral-v1, zephyr",
             "recognised from the model"),
    };
    memcpy(out, table, sizeof table);
}
#undef TEXT
#undef INT
#undef SECONDS
#undef SWITCH

static const char kDescription[] =
    "Serves a Hugging Face model folder over HTTP (OpenAI-compatible and TRL vllm-serve routes, see\n"
    "docs/http-api.md) and, with --control, over the trainer's ZeroMQ channel (docs/protocol-zmq.md).";
static const char kEpilog[] =
    "Exit status: 0 after a drain (SIGTERM, SIGINT or a ZeroMQ shutdown once listening); 1 when start-up\n"
    "fails; 2 on a usage error; 128 + N (143 for SIGTERM, 130 for SIGINT) when signal N arrives before the\n"
    "server listens: start-up stops at once, nothing was served.";

static int bad(const char *opt, const char *val, const char *why) {
    fprintf(stderr, "tandem-serve: --%s %s: %s (see --help)\n", opt, val, why);
    return -1;
}

static int parse_long(const char *opt, const char *s, long long min, long long max, long long *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end) return bad(opt, s, "not an integer");
    if (v < min || v > max) {
        char why[96];
        snprintf(why, sizeof why, "must be in [%lld, %lld]", min, max);
        return bad(opt, s, why);
    }
    *out = v;
    return 0;
}

// "4096", "512K", "64M", "2G", "1T" (binary multiples; an optional trailing "B" or "iB" is accepted).
static int parse_bytes(const char *opt, const char *s, size_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || s[0] == '-') return bad(opt, s, "not a byte count (e.g. 512M, 2G)");
    unsigned shift = 0;
    switch (*end) {
    case 'k': case 'K': shift = 10, end++; break;
    case 'm': case 'M': shift = 20, end++; break;
    case 'g': case 'G': shift = 30, end++; break;
    case 't': case 'T': shift = 40, end++; break;
    default: break;
    }
    if (shift && strcasecmp(end, "iB") == 0) end += 2;
    if (strcasecmp(end, "B") == 0) end++;
    if (*end) return bad(opt, s, "unknown suffix (use K, M, G or T)");
    if (shift && v > (~0ULL >> shift)) return bad(opt, s, "too large");
    *out = (size_t)(v << shift);
    return 0;
}

// Who may reach the control channel: keys come as a pair of files; without keys, only a local endpoint, unless
// --control-insecure says the network is trusted (issue 22: a plain client paused, zeroed and stopped a server).
static int check_control_security(const Options *o) {
    int have_key = o->control_key_file != NULL, have_auth = o->control_authorized_keys != NULL;
    if (have_key != have_auth) {
        fprintf(stderr, "tandem-serve: %s needs %s as well: the server's key pair and the clients it admits go "
                        "together (tandem-train keygen DIR writes both: DIR/server.key, DIR/authorized_keys)\n",
                have_key ? "--control-key-file" : "--control-authorized-keys",
                have_key ? "--control-authorized-keys" : "--control-key-file");
        return -1;
    }
    if (have_key && !o->control) {
        fprintf(stderr, "tandem-serve: --control-key-file secures the control channel, but there is none: add "
                        "--control ENDPOINT\n");
        return -1;
    }
    if (have_key && o->control_insecure) {
        fprintf(stderr, "tandem-serve: --control-insecure and --control-key-file contradict each other: drop one\n");
        return -1;
    }
    if (o->control && !have_key && !o->control_insecure && !zmq_control_endpoint_is_local(o->control)) {
        fprintf(stderr, "tandem-serve: --control %s can be reached from other machines and no keys were given: anyone "
                        "who reaches it could pause the engine, replace the weights or shut the server down. Give "
                        "--control-key-file and --control-authorized-keys (tandem-train keygen DIR writes them), "
                        "bind a loopback address (tcp://127.0.0.1:PORT), or pass --control-insecure on a network "
                        "you trust\n", o->control);
        return -1;
    }
    return 0;
}

// Reads the key files into keys. Returns 0, or -1 after logging why.
static int load_control_keys(const Options *o, ZmqControlKeys *keys) {
    char err[1024];
    memset(keys, 0, sizeof *keys);
    if (control_keypair_read(o->control_key_file, &keys->server, err, sizeof err) != 0 ||
        control_authorized_keys_read(o->control_authorized_keys, keys->authorized, &keys->n_authorized, err,
                                     sizeof err) != 0) {
        serve_log("cannot read the control channel's keys: %s", err);
        return -1;
    }
    keys->authorized_path = o->control_authorized_keys;
    return 0;
}

static int parse_options(int argc, char **argv, Options *o) {
    memset(o, 0, sizeof *o);
    engine_config_default(&o->engine);
    http_config_default(&o->http);
    o->drain_timeout_s = DEFAULT_DRAIN_TIMEOUT_S;
    o->weight_sync_timeout_s = DEFAULT_WEIGHT_SYNC_TIMEOUT_S;
    const char *env_tune = getenv("TANDEM_GEMM_AUTOTUNE");   // kernels/cuda/README.md
    if (env_tune && env_tune[0] && ops_gemm_autotune_parse(env_tune, &o->engine.ops.gemm_autotune) != 0) {
        fprintf(stderr, "tandem-serve: TANDEM_GEMM_AUTOTUNE=%s: expected 0 (off), 1 (on) or 2 (on, logged)\n",
                env_tune);
        return -1;
    }
    // The defaults as --help prints them, then the options given.
    ServeArgs a = {.host = o->http.host, .device = "cpu", .port = o->http.port, .tp = 1,
                   .block_size = o->engine.block_size,
                   .max_num_seqs = o->engine.max_num_seqs, .max_batched = o->engine.max_num_batched_tokens,
                   .max_queued = o->engine.max_queued_requests, .max_connections = o->http.max_connections,
                   .max_per_client = o->http.max_connections_per_client,
                   .graph_max_batch = o->engine.cuda_graph_max_batch, .read_timeout = o->http.request_read_timeout_s,
                   .drain_timeout = o->drain_timeout_s, .sync_timeout = o->weight_sync_timeout_s,
                   .update_mode = engine_update_mode_name(ENGINE_UPDATE_KEEP), .adapter_mode = "merge",
                   .load_format = "auto"};
    human_bytes(o->engine.kv_cache_bytes, a.kv_default, sizeof a.kv_default);
    human_bytes(o->http.max_body_bytes, a.body_default, sizeof a.body_default);
    snprintf(a.seed_default, sizeof a.seed_default, "%" PRIu64, o->engine.seed);
    a.kv = a.kv_default, a.body = a.body_default, a.seed = a.seed_default;
    const ServeArgs defaults = a;
    CliOption options[N_SERVE_OPTIONS];
    serve_options(options, o->engine.enable_prefix_caching);
    const CliSpec spec = {.command = "tandem-serve", .synopsis = "--model DIR [options]", .description = kDescription,
                          .epilog = kEpilog, .options = options, .n_options = N_SERVE_OPTIONS};
    char err[512];
    int rest = argc, pr = cli_parse(&spec, &a, argc, argv, &rest, err, sizeof err);
    if (pr == CLI_HELP || pr == CLI_VERSION) {
        if (pr == CLI_HELP) cli_usage(&spec, &defaults, stdout);
        else tandem_print_version(stdout, "tandem-serve");
        exit(0);
    }
    if (pr == CLI_ERROR) {
        fprintf(stderr, "%s\n", err);
        return -1;
    }
    if (rest < argc) {
        fprintf(stderr, "tandem-serve: unexpected argument '%s' after -- (see --help)\n", argv[rest]);
        return -1;
    }
    // The environment fills what the options left empty.
    const char *env_key = getenv("TANDEM_API_KEY");
    const char *env_ckey = getenv("TANDEM_CONTROL_KEY_FILE"), *env_cauth = getenv("TANDEM_CONTROL_AUTHORIZED_KEYS");
    o->http.api_key = a.api_key ? a.api_key : env_key && env_key[0] ? env_key : NULL;
    o->control_key_file = a.control_key_file ? a.control_key_file : env_ckey && env_ckey[0] ? env_ckey : NULL;
    o->control_authorized_keys = a.control_authorized_keys ? a.control_authorized_keys
                                 : env_cauth && env_cauth[0] ? env_cauth : NULL;
    o->engine.model_dir = a.model;
    o->http.host = a.host;
    o->http.port = a.port;
    o->control = a.control;
    o->control_insecure = a.control_insecure;
    long long v;
    if (a.device != defaults.device) {
        if (strcmp(a.device, "cpu") == 0) {
            o->engine.backend = OPS_BACKEND_CPU, o->engine.device = 0;
        } else if (strncmp(a.device, "cuda", 4) == 0 && (a.device[4] == 0 || a.device[4] == ':')) {
            o->engine.backend = OPS_BACKEND_CUDA, o->engine.device = 0;
            if (a.device[4] == ':' && parse_long("device", a.device + 5, 0, 1023, &v)) return -1;
            if (a.device[4] == ':') o->engine.device = (int)v;
        } else {
            return bad("device", a.device, "expected cpu, cuda or cuda:N");
        }
        o->device_given = 1;
    }
    if (a.devices) {
        char why[256];
        o->n_devices = engine_devices_parse(a.devices, o->devices, ENGINE_GROUP_MAX, why, sizeof why);
        if (o->n_devices < 0) return bad("devices", a.devices, why);
        o->devices_arg = a.devices;
    }
    if (a.gpu_util > 0) o->engine.gpu_memory_utilization = a.gpu_util;
    if (parse_bytes("kv-cache-memory", a.kv, &o->engine.kv_cache_bytes)) return -1;
    if (o->engine.kv_cache_bytes == 0) return bad("kv-cache-memory", a.kv, "must be > 0");
    if (parse_bytes("max-body-bytes", a.body, &o->http.max_body_bytes)) return -1;
    if (o->http.max_body_bytes == 0) return bad("max-body-bytes", a.body, "must be > 0");
    o->engine.block_size = a.block_size;
    o->engine.tensor_parallel_size = a.tp;
    o->engine.max_num_seqs = a.max_num_seqs;
    o->engine.max_num_batched_tokens = a.max_batched;
    o->engine.max_queued_requests = a.max_queued;
    o->http.max_connections = a.max_connections;
    o->http.max_connections_per_client = a.max_per_client;
    o->http.request_read_timeout_s = a.read_timeout;
    o->drain_timeout_s = a.drain_timeout;
    o->weight_sync_timeout_s = a.sync_timeout;
    if (engine_update_mode_parse(a.update_mode, &o->weight_update_mode) != 0)
        return bad("weight-update-mode", a.update_mode, "expected keep, abort or keep_kv");
    if (a.prefix_on && a.prefix_off) {
        fprintf(stderr, "tandem-serve: --enable-prefix-caching and --no-prefix-caching contradict each other: drop one "
                        "(see --help)\n");
        return -1;
    }
    if (a.prefix_on) o->engine.enable_prefix_caching = 1;
    if (a.prefix_off) o->engine.enable_prefix_caching = 0;
    {
        char *end;
        errno = 0;
        unsigned long long seed = strtoull(a.seed, &end, 10);
        if (errno || end == a.seed || *end || a.seed[0] == '-') return bad("seed", a.seed, "expected an unsigned integer");
        o->engine.seed = (uint64_t)seed;
    }
    if (a.served_name) {
        if (!a.served_name[0]) return bad("served-model-name", "\"\"", "must not be empty");
        o->http.served_model_name = a.served_name;
    }
    o->http.chat_template = a.chat_template;
    for (int i = 0; i < a.loras.n; i++) {
        const char *spec = a.loras.items[i], *eq = strchr(spec, '=');
        if (!eq || eq == spec || !eq[1]) return bad("lora", spec, "expected NAME=DIR");
        if ((size_t)(eq - spec) >= sizeof o->lora_name_buf[i]) return bad("lora", spec, "the name is too long");
        snprintf(o->lora_name_buf[i], sizeof o->lora_name_buf[i], "%.*s", (int)(eq - spec), spec);
        for (int j = 0; j < i; j++)
            if (strcmp(o->lora_name_buf[i], o->lora_name_buf[j]) == 0) return bad("lora", spec, "a second adapter of that name");
        o->lora_names[i] = o->lora_name_buf[i];
        o->lora_dirs[i] = eq + 1;
    }
    o->engine.lora_names = o->lora_names;
    o->engine.lora_dirs = o->lora_dirs;
    o->engine.n_loras = a.loras.n;
    if (strcmp(a.adapter_mode, "merge") == 0) o->engine.adapter_updates_lowrank = 0;
    else if (strcmp(a.adapter_mode, "lowrank") == 0) o->engine.adapter_updates_lowrank = 1;
    else return bad("adapter-update-mode", a.adapter_mode, "expected merge or lowrank");
    if (strcmp(a.load_format, "random") == 0) o->engine.load_random = 1;
    else if (strcmp(a.load_format, "auto") != 0) return bad("load-format", a.load_format, "expected auto or random");
    o->engine.enforce_eager = a.enforce_eager;
    if (!o->engine.model_dir) {
        fprintf(stderr, "tandem-serve: --model DIR is required (see --help)\n");
        return -1;
    }
    if (o->device_given && o->devices_arg) {
        fprintf(stderr, "tandem-serve: --device and --devices %s cannot be used together: --device runs one engine, "
                        "--devices one engine per listed device (see --help)\n", o->devices_arg);
        return -1;
    }
    if (!o->devices_arg) { // one engine, on --device
        o->devices[0] = (EngineDevice){o->engine.backend, o->engine.device};
        o->n_devices = 1;
    }
    // Each engine's shards take its device and the next tp - 1: the groups must not overlap.
    for (int i = 0; i < o->n_devices && a.tp > 1; i++)
        for (int j = 0; j < i; j++) {
            const EngineDevice *x = &o->devices[i], *y = &o->devices[j];
            if (x->backend != OPS_BACKEND_CUDA || y->backend != OPS_BACKEND_CUDA) continue;
            if (x->device < y->device + a.tp && y->device < x->device + a.tp) {
                fprintf(stderr, "tandem-serve: --devices %s with --tensor-parallel-size %d: the engines on cuda:%d and "
                                "cuda:%d would share GPUs (each takes its device and the next %d); list devices %d "
                                "apart, e.g. cuda:0,cuda:%d\n", o->devices_arg, a.tp, y->device, x->device, a.tp - 1,
                        a.tp, a.tp);
                return -1;
            }
        }
    if (check_control_security(o) != 0) return -1;
    // A trainer on the control channel may send NCCL weight updates, received into a second copy of the weights.
    o->engine.reserve_weight_copy = o->control != NULL;
    return 0;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    Options o;
    if (parse_options(argc, argv, &o) < 0) return 2;

    char err[1024];
    err[0] = 0;
    // Before any thread exists: from here on SIGTERM / SIGINT are acted on wherever they land.
    if (stop_request_init(err, sizeof err) != 0) {
        serve_log("%s", err);
        return 1;
    }
    signal(SIGPIPE, SIG_IGN); // a client closing its socket mid-write must not end the process

    // Keys are read before the model loads, so a wrong path fails in a moment rather than after minutes.
    static ZmqControlKeys control_keys;
    int secure = o.control_key_file != NULL;
    if (secure && load_control_keys(&o, &control_keys) != 0) return 1;

    char kv[32], list[ENGINE_GROUP_MAX * 12], devs[sizeof list + 32];
    human_bytes(o.engine.kv_cache_bytes, kv, sizeof kv);
    list[0] = 0;
    for (int i = 0, at = 0; i < o.n_devices && at < (int)sizeof list - 16; i++) {
        char name[32];
        engine_device_name(&o.devices[i], name, sizeof name);
        at += snprintf(list + at, sizeof list - at, "%s%s", i ? ", " : "", name);
    }
    if (o.n_devices == 1) // the single-engine wording, as before --devices
        snprintf(devs, sizeof devs, "device %s:%d", o.engine.backend == OPS_BACKEND_CUDA ? "cuda" : "cpu",
                 o.engine.device);
    else
        snprintf(devs, sizeof devs, "%d engines on %s", o.n_devices, list);
    if (o.engine.tensor_parallel_size > 1) {
        const size_t at = strlen(devs);
        snprintf(devs + at, sizeof devs - at, ", tensor parallel %d (%s)", o.engine.tensor_parallel_size,
                 o.engine.backend == OPS_BACKEND_CUDA ? "each engine on its device and the next ones" : "CPU shards");
    }
    serve_log("starting: model %s, %s, kv cache %s bytes, block size %d, max seqs %d, max batched tokens "
              "%d, max queued requests %d, prefix caching %s",
              o.engine.model_dir, devs, kv, o.engine.block_size, o.engine.max_num_seqs,
              o.engine.max_num_batched_tokens, o.engine.max_queued_requests,
              o.engine.enable_prefix_caching ? "on" : "off");
    double t0 = now_s();
    EngineGroup *engines = NULL;
    if (engine_group_create(&engines, &o.engine, o.devices, o.n_devices, err, sizeof err) != 0) {
        serve_log("cannot start the %s: %s", o.n_devices > 1 ? "engines" : "engine", err[0] ? err : "unknown error");
        return 1;
    }
    const Model *m = engine_group_model(engines);
    serve_log("%s ready in %.2f s: %s, %d layers, vocab %d, context %d tokens, policy version %" PRId64,
              o.n_devices > 1 ? "engines" : "engine", now_s() - t0, m->cfg.arch_name, m->cfg.num_layers,
              m->cfg.vocab_size, m->cfg.max_seq_len, engine_group_policy_version(engines));

    if (!engine_group_tokenizer(engines))
        serve_log("no tokenizer: %s has no tokenizer.json, so text is off: /v1/completions and /generate/ take "
                  "prompts as token ids only and answer with empty text (ask for return_token_ids); text prompts, "
                  "/v1/chat/completions, /tokenize, /detokenize and stop strings answer 400. Put the model's "
                  "tokenizer.json in the folder to serve text",
                  o.engine.model_dir);
    const char *served = o.http.served_model_name ? o.http.served_model_name : engine_group_model_id(engines);
    for (int k = 1; k <= o.engine.n_loras; k++) {
        if (strcmp(o.lora_names[k - 1], served) == 0) {
            serve_log("--lora %s: the adapter's name is the served model's: give it another NAME, or set "
                      "--served-model-name", o.lora_names[k - 1]);
            engine_group_destroy(engines, 0);
            return 1;
        }
        serve_log("LoRA adapter '%s' from %s: requests with \"model\": \"%s\" run through it", o.lora_names[k - 1],
                  o.lora_dirs[k - 1], o.lora_names[k - 1]);
    }
    HttpServer *http = NULL;
    if (http_server_start(&http, engines, &o.http, err, sizeof err) != 0) {
        serve_log("cannot start the HTTP server: %s", err);
        engine_group_destroy(engines, 0);
        return 1;
    }
    ZmqControl *zmq = NULL;
    if (o.control) {
        if (zmq_control_start(&zmq, engines, o.control, secure ? &control_keys : NULL,
                              (int)(o.weight_sync_timeout_s * 1000), o.weight_update_mode, err, sizeof err) != 0) {
            serve_log("cannot start the ZeroMQ control channel on %s: %s", o.control, err);
            http_server_stop(http);
            engine_group_destroy(engines, 0);
            return 1;
        }
        zmq_control_on_shutdown(zmq, stop_request_shutdown, NULL);
        if (secure)
            serve_log("ZeroMQ control channel on %s, CURVE: server public key %s, %d client key(s) admitted from %s",
                      o.control, control_keys.server.public_key, control_keys.n_authorized,
                      o.control_authorized_keys);
        else
            serve_log("ZeroMQ control channel on %s, no keys: %s", o.control,
                      zmq_control_endpoint_is_local(o.control)
                          ? "only this machine can reach it"
                          : "--control-insecure, anyone who reaches it can control this server");
    }
    stop_request_serving(); // before the line that tells supervisors the server is up
    serve_log("listening on http://%s%s%s:%d (model id '%s'%s)", strchr(o.http.host, ':') ? "[" : "", o.http.host,
              strchr(o.http.host, ':') ? "]" : "", http_server_port(http),
              o.http.served_model_name ? o.http.served_model_name : engine_group_model_id(engines),
              o.http.api_key ? ", API key required" : "");

    int sig = stop_request_wait();
    const char *why = sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "a ZeroMQ shutdown request";
    int drain_ms = (int)(o.drain_timeout_s * 1000);
    double deadline = now_s() + o.drain_timeout_s;
    // Stop accepting before saying so: whoever reads the log line may rely on it.
    http_server_stop_accepting(http);
    char drain[32];
    human_seconds(o.drain_timeout_s, drain, sizeof drain);
    serve_log("received %s: no longer accepting requests; draining for up to %s s", why, drain);
    int left = http_server_drain(http, drain_ms);
    // Requests submitted over ZeroMQ get the rest of the drain time too.
    EngineStats st;
    for (;;) {
        engine_group_stats(engines, &st, NULL);
        if (st.requests_running + st.requests_waiting == 0 || now_s() >= deadline) break;
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (left > 0 || st.requests_running + st.requests_waiting > 0) {
        serve_log("drain timeout: aborting %d HTTP request(s) and %" PRId64 " engine request(s) still in flight", left,
                  st.requests_running + st.requests_waiting);
        // Their completions end with FINISH_ABORT: OpenAI answers and streams go out with what was generated and
        // finish_reason "abort" (as /pause?mode=abort ends them), given a moment to be written.
        engine_group_abort_requests(engines);
        left = http_server_drain(http, ABORT_ANSWER_GRACE_MS);
        if (left > 0) serve_log("%d HTTP request(s) still open after the abort: their connections are closed", left);
    } else {
        serve_log("drained: no request in flight");
    }
    zmq_control_stop(zmq);
    http_server_stop(http);
    double rest = deadline - now_s();
    engine_group_destroy(engines, rest > 0 ? (int)(rest * 1000) : 0);
    serve_log("stopped");
    return 0;
}

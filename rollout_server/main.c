// rollout_server/main.c — tandem-serve: loads a model into the engine (one engine per device with --devices),
// serves HTTP (and the trainer's ZeroMQ control channel with --control), and on SIGTERM / SIGINT (or a ZeroMQ
// `shutdown`) stops accepting, lets the work in flight finish within --drain-timeout, and exits 0. A signal that
// comes during start-up ends the process at once with status 128 + signal (rollout_server/stop_request.h).
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
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
#include "shared/version.h"

// Defaults of the options that are not engine or HTTP settings.
#define DEFAULT_DRAIN_TIMEOUT_S 30.0
#define DEFAULT_WEIGHT_SYNC_TIMEOUT_S 600.0

typedef struct {
    EngineConfig engine;
    HttpConfig http;
    const char *control;
    const char *control_key_file;          // --control-key-file, else TANDEM_CONTROL_KEY_FILE
    const char *control_authorized_keys;   // --control-authorized-keys, else TANDEM_CONTROL_AUTHORIZED_KEYS
    int control_insecure;
    double drain_timeout_s;
    double weight_sync_timeout_s;
    int device_given;
    const char *devices_arg;        // --devices as given, NULL when absent
    EngineDevice devices[ENGINE_GROUP_MAX];
    int n_devices;
} Options;

enum {
    OPT_MODEL = 256, OPT_HOST, OPT_PORT, OPT_CONTROL, OPT_DEVICE, OPT_KV, OPT_BLOCK, OPT_SEQS, OPT_BATCHED,
    OPT_QUEUED, OPT_BODY, OPT_KEY, OPT_DRAIN, OPT_PREFIX, OPT_NO_PREFIX, OPT_SEED, OPT_NAME, OPT_TEMPLATE, OPT_HELP,
    OPT_SYNC_TIMEOUT, OPT_GPU_UTIL, OPT_DEVICES,
    OPT_MAX_CONNECTIONS, OPT_MAX_CONNECTIONS_PER_CLIENT, OPT_REQUEST_READ_TIMEOUT,
    OPT_ENFORCE_EAGER, OPT_GRAPH_MAX_BATCH, OPT_VERSION, OPT_CONTROL_KEY, OPT_CONTROL_AUTHORIZED,
    OPT_CONTROL_INSECURE,
};

static const struct option kLongOpts[] = {
    {"model", required_argument, 0, OPT_MODEL},
    {"host", required_argument, 0, OPT_HOST},
    {"port", required_argument, 0, OPT_PORT},
    {"control", required_argument, 0, OPT_CONTROL},
    {"control-key-file", required_argument, 0, OPT_CONTROL_KEY},
    {"control-authorized-keys", required_argument, 0, OPT_CONTROL_AUTHORIZED},
    {"control-insecure", no_argument, 0, OPT_CONTROL_INSECURE},
    {"device", required_argument, 0, OPT_DEVICE},
    {"devices", required_argument, 0, OPT_DEVICES},
    {"kv-cache-memory", required_argument, 0, OPT_KV},
    {"gpu-memory-utilization", required_argument, 0, OPT_GPU_UTIL},
    {"block-size", required_argument, 0, OPT_BLOCK},
    {"max-num-seqs", required_argument, 0, OPT_SEQS},
    {"max-num-batched-tokens", required_argument, 0, OPT_BATCHED},
    {"max-queued-requests", required_argument, 0, OPT_QUEUED},
    {"max-body-bytes", required_argument, 0, OPT_BODY},
    {"max-connections", required_argument, 0, OPT_MAX_CONNECTIONS},
    {"max-connections-per-client", required_argument, 0, OPT_MAX_CONNECTIONS_PER_CLIENT},
    {"request-read-timeout", required_argument, 0, OPT_REQUEST_READ_TIMEOUT},
    {"api-key", required_argument, 0, OPT_KEY},
    {"drain-timeout", required_argument, 0, OPT_DRAIN},
    {"weight-sync-timeout", required_argument, 0, OPT_SYNC_TIMEOUT},
    {"enable-prefix-caching", no_argument, 0, OPT_PREFIX},
    {"no-prefix-caching", no_argument, 0, OPT_NO_PREFIX},
    {"seed", required_argument, 0, OPT_SEED},
    {"served-model-name", required_argument, 0, OPT_NAME},
    {"chat-template", required_argument, 0, OPT_TEMPLATE},
    {"enforce-eager", no_argument, 0, OPT_ENFORCE_EAGER},
    {"cuda-graph-max-batch", required_argument, 0, OPT_GRAPH_MAX_BATCH},
    {"help", no_argument, 0, OPT_HELP},
    {"version", no_argument, 0, OPT_VERSION},
    {0, 0, 0, 0},
};

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

static void usage(FILE *f) {
    EngineConfig ec;
    engine_config_default(&ec);
    HttpConfig hc;
    http_config_default(&hc);
    char kv[32], body[32], drain[32], sync[32], read_timeout[32];
    human_bytes(ec.kv_cache_bytes, kv, sizeof kv);
    human_bytes(hc.max_body_bytes, body, sizeof body);
    human_seconds(DEFAULT_DRAIN_TIMEOUT_S, drain, sizeof drain);
    human_seconds(hc.request_read_timeout_s, read_timeout, sizeof read_timeout);
    human_seconds(DEFAULT_WEIGHT_SYNC_TIMEOUT_S, sync, sizeof sync);
    fprintf(f,
            "usage: tandem-serve --model DIR [options]\n"
            "\n"
            "Serves a Hugging Face model folder over HTTP (OpenAI-compatible and TRL vllm-serve routes, see\n"
            "docs/http-api.md) and, with --control, over the trainer's ZeroMQ channel (docs/protocol-zmq.md).\n"
            "\n"
            "  --model DIR                   model folder: config.json, *.safetensors, tokenizer.json (required)\n"
            "  --host ADDR                   address to listen on (default 127.0.0.1)\n"
            "  --port N                      HTTP port; 0 picks a free one and logs it (default 8000)\n"
            "  --control ENDPOINT            ZeroMQ ROUTER endpoint, e.g. tcp://127.0.0.1:5555; one that other\n"
            "                                machines can reach (tcp://0.0.0.0:5555) needs keys (default: none)\n"
            "  --control-key-file PATH       this server's CURVE key pair (tandem-train keygen writes one): the\n"
            "                                control channel then admits only the clients listed in\n"
            "                                --control-authorized-keys; env TANDEM_CONTROL_KEY_FILE (default: none)\n"
            "  --control-authorized-keys PATH  client public keys allowed on the control channel, one a line; env\n"
            "                                TANDEM_CONTROL_AUTHORIZED_KEYS (default: none)\n"
            "  --control-insecure            allow --control on an address other machines can reach without keys\n"
            "                                (anyone reaching it can pause, replace the weights, shut down); without\n"
            "                                it such a --control needs the two options above (default: off)\n"
            "  --device cpu|cuda[:N]         compute backend and device index (default cpu)\n"
            "  --devices LIST                one engine per listed device, each with its own copy of the model\n"
            "                                and KV pool (data parallel); requests go to the least loaded engine,\n"
            "                                weight updates to all: cuda:0,cuda:1 or 0,1 (CUDA devices), cpu,cpu;\n"
            "                                not with --device (default: none, one engine on --device)\n"
            "  --kv-cache-memory BYTES       KV cache pool size; suffixes K, M, G, T (x1024) (default %s)\n"
            "  --gpu-memory-utilization F    cuda: size the KV pool so that this server's GPU (each engine's, with\n"
            "                                --devices) stays within fraction F of its memory, counting the weights,\n"
            "                                the step workspace, memory other processes hold and (with --control)\n"
            "                                the copy NCCL weight updates land in; replaces --kv-cache-memory\n"
            "                                (default: off)\n"
            "  --block-size N                tokens per KV cache block (default %d)\n"
            "  --max-num-seqs N              sequences decoded together per step (default %d)\n"
            "  --max-num-batched-tokens N    tokens per engine step, decodes plus prefill chunks (default %d)\n"
            "  --cuda-graph-max-batch N      cuda: decode-only steps (one new token per sequence) of up to N\n"
            "                                sequences are padded to a ladder of batch sizes (1, 2, 4, 8, 16, 24,\n"
            "                                32, 48, 64, 96, ..., N) and replayed as CUDA graphs, all recorded at\n"
            "                                start-up; larger steps and steps with prompt tokens run op by op;\n"
            "                                0 = never pad (default %d)\n"
            "  --enforce-eager               cuda: run decode-only steps op by op instead of replaying CUDA graphs,\n"
            "                                still padded: the same kernels and shapes as the graphs (default: off)\n"
            "  --max-queued-requests N       queued requests beyond which new ones get 429 (default %d)\n"
            "  --max-body-bytes BYTES        largest HTTP request body; larger gets 413 (default %s)\n"
            "  --max-connections N           concurrent HTTP connections, one thread each; more are accepted\n"
            "                                and closed at once (default %d)\n"
            "  --max-connections-per-client N  concurrent connections from one client address; more are\n"
            "                                closed at once. A trainer needs its peak concurrent requests plus\n"
            "                                its idle kept-alive connections; 0 = as --max-connections\n"
            "                                (default: as --max-connections)\n"
            "  --request-read-timeout SECONDS  a request's headers and body must arrive within this time of\n"
            "                                the connect (or of its request line, on a kept-alive connection),\n"
            "                                however steadily bytes trickle in: a slower request gets 408 or\n"
            "                                its connection closed; 0 = no limit (default %s)\n"
            "  --api-key KEY                 require 'Authorization: Bearer KEY' on every route but /health and\n"
            "                                /health/; the environment variable TANDEM_API_KEY also sets it\n"
            "                                (default: none, no auth)\n"
            "  --drain-timeout SECONDS       on SIGTERM/SIGINT, time given to requests in flight (default %s)\n"
            "  --weight-sync-timeout SECONDS a weight update over NCCL (joining the trainer's communicator, each\n"
            "                                receive) that stalls this long fails; the server keeps its weights\n"
            "                                (default %s)\n"
            "  --enable-prefix-caching       reuse KV blocks of identical prompt prefixes across requests\n"
            "  --no-prefix-caching           do not (default: %s)\n"
            "  --seed N                      seed for requests that carry none (default %" PRIu64 ")\n"
            "  --served-model-name NAME      model id in /v1/models and answers (default: the folder's name)\n"
            "  --chat-template NAME          force a chat template family: chatml, qwen3, llama3, llama3.1, llama2,\n"
            "                                mistral, mistral-v1, zephyr (default: recognised from the model)\n"
            "  -h, --help                    this text\n"
            "  --version                     the version and how this binary was built\n"
            "\n"
            "Exit status: 0 after a drain (SIGTERM, SIGINT or a ZeroMQ shutdown once listening); 1 when start-up\n"
            "fails; 2 on a usage error; 128 + N (143 for SIGTERM, 130 for SIGINT) when signal N arrives before the\n"
            "server listens: start-up stops at once, nothing was served.\n",
            kv, ec.block_size, ec.max_num_seqs, ec.max_num_batched_tokens, ec.cuda_graph_max_batch,
            ec.max_queued_requests, body, hc.max_connections, read_timeout, drain, sync,
            ec.enable_prefix_caching ? "enabled" : "disabled", ec.seed);
}

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
    const char *env_key = getenv("TANDEM_API_KEY");
    if (env_key && env_key[0]) o->http.api_key = env_key;
    const char *env_ckey = getenv("TANDEM_CONTROL_KEY_FILE"), *env_cauth = getenv("TANDEM_CONTROL_AUTHORIZED_KEYS");
    if (env_ckey && env_ckey[0]) o->control_key_file = env_ckey;
    if (env_cauth && env_cauth[0]) o->control_authorized_keys = env_cauth;
    const char *env_tune = getenv("TANDEM_GEMM_AUTOTUNE");   // kernels/cuda/README.md
    if (env_tune && env_tune[0] && ops_gemm_autotune_parse(env_tune, &o->engine.ops.gemm_autotune) != 0) {
        fprintf(stderr, "tandem-serve: TANDEM_GEMM_AUTOTUNE=%s: expected 0 (off), 1 (on) or 2 (on, logged)\n",
                env_tune);
        return -1;
    }
    long long v;
    int c;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "h", kLongOpts, NULL)) != -1) {
        switch (c) {
        case OPT_MODEL: o->engine.model_dir = optarg; break;
        case OPT_HOST: o->http.host = optarg; break;
        case OPT_PORT:
            if (parse_long("port", optarg, 0, 65535, &v)) return -1;
            o->http.port = (int)v;
            break;
        case OPT_CONTROL: o->control = optarg; break;
        case OPT_CONTROL_KEY: o->control_key_file = optarg; break;
        case OPT_CONTROL_AUTHORIZED: o->control_authorized_keys = optarg; break;
        case OPT_CONTROL_INSECURE: o->control_insecure = 1; break;
        case OPT_DEVICE:
            if (strcmp(optarg, "cpu") == 0) {
                o->engine.backend = OPS_BACKEND_CPU, o->engine.device = 0;
            } else if (strncmp(optarg, "cuda", 4) == 0 && (optarg[4] == 0 || optarg[4] == ':')) {
                o->engine.backend = OPS_BACKEND_CUDA, o->engine.device = 0;
                if (optarg[4] == ':' && parse_long("device", optarg + 5, 0, 1023, &v)) return -1;
                if (optarg[4] == ':') o->engine.device = (int)v;
            } else {
                return bad("device", optarg, "expected cpu, cuda or cuda:N");
            }
            o->device_given = 1;
            break;
        case OPT_DEVICES: {
            char why[256];
            o->n_devices = engine_devices_parse(optarg, o->devices, ENGINE_GROUP_MAX, why, sizeof why);
            if (o->n_devices < 0) return bad("devices", optarg, why);
            o->devices_arg = optarg;
            break;
        }
        case OPT_GPU_UTIL: {
            char *end;
            double d = strtod(optarg, &end);
            if (end == optarg || *end || !(d > 0) || d > 1)
                return bad("gpu-memory-utilization", optarg, "expected a fraction in (0, 1], e.g. 0.9");
            o->engine.gpu_memory_utilization = d;
            break;
        }
        case OPT_KV:
            if (parse_bytes("kv-cache-memory", optarg, &o->engine.kv_cache_bytes)) return -1;
            if (o->engine.kv_cache_bytes == 0) return bad("kv-cache-memory", optarg, "must be > 0");
            break;
        case OPT_BLOCK:
            if (parse_long("block-size", optarg, 1, 4096, &v)) return -1;
            o->engine.block_size = (int)v;
            break;
        case OPT_SEQS:
            if (parse_long("max-num-seqs", optarg, 1, 1 << 20, &v)) return -1;
            o->engine.max_num_seqs = (int)v;
            break;
        case OPT_BATCHED:
            if (parse_long("max-num-batched-tokens", optarg, 1, 1 << 24, &v)) return -1;
            o->engine.max_num_batched_tokens = (int)v;
            break;
        case OPT_QUEUED:
            if (parse_long("max-queued-requests", optarg, 1, 1 << 24, &v)) return -1;
            o->engine.max_queued_requests = (int)v;
            break;
        case OPT_BODY:
            if (parse_bytes("max-body-bytes", optarg, &o->http.max_body_bytes)) return -1;
            if (o->http.max_body_bytes == 0) return bad("max-body-bytes", optarg, "must be > 0");
            break;
        case OPT_MAX_CONNECTIONS:
            if (parse_long("max-connections", optarg, 1, 1 << 16, &v)) return -1;
            o->http.max_connections = (int)v;
            break;
        case OPT_MAX_CONNECTIONS_PER_CLIENT:
            if (parse_long("max-connections-per-client", optarg, 0, 1 << 16, &v)) return -1;
            o->http.max_connections_per_client = (int)v;
            break;
        case OPT_REQUEST_READ_TIMEOUT: {
            char *end;
            double d = strtod(optarg, &end);
            if (end == optarg || *end || !(d >= 0) || d > 86400)
                return bad("request-read-timeout", optarg, "expected 0..86400 seconds (0 = no limit)");
            o->http.request_read_timeout_s = d;
            break;
        }
        case OPT_KEY: o->http.api_key = optarg; break;
        case OPT_DRAIN: {
            char *end;
            double d = strtod(optarg, &end);
            if (end == optarg || *end || !(d >= 0) || d > 86400)
                return bad("drain-timeout", optarg, "expected 0..86400 seconds");
            o->drain_timeout_s = d;
            break;
        }
        case OPT_SYNC_TIMEOUT: {
            char *end;
            double d = strtod(optarg, &end);
            if (end == optarg || *end || !(d >= 1) || d > 86400)
                return bad("weight-sync-timeout", optarg, "expected 1..86400 seconds");
            o->weight_sync_timeout_s = d;
            break;
        }
        case OPT_PREFIX: o->engine.enable_prefix_caching = 1; break;
        case OPT_NO_PREFIX: o->engine.enable_prefix_caching = 0; break;
        case OPT_SEED: {
            char *end;
            errno = 0;
            unsigned long long s = strtoull(optarg, &end, 10);
            if (errno || end == optarg || *end || optarg[0] == '-')
                return bad("seed", optarg, "expected an unsigned integer");
            o->engine.seed = (uint64_t)s;
            break;
        }
        case OPT_NAME:
            if (!optarg[0]) return bad("served-model-name", "\"\"", "must not be empty");
            o->http.served_model_name = optarg;
            break;
        case OPT_TEMPLATE: o->http.chat_template = optarg; break;
        case OPT_ENFORCE_EAGER: o->engine.enforce_eager = 1; break;
        case OPT_GRAPH_MAX_BATCH:
            if (parse_long("cuda-graph-max-batch", optarg, 0, 1 << 20, &v)) return -1;
            o->engine.cuda_graph_max_batch = (int)v;
            break;
        case 'h':
        case OPT_HELP: usage(stdout); exit(0);
        case OPT_VERSION: tandem_print_version(stdout, "tandem-serve"); exit(0);
        default:
            fprintf(stderr, "tandem-serve: unknown option or missing value: %s (see --help)\n", argv[optind - 1]);
            return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "tandem-serve: unexpected argument '%s' (see --help)\n", argv[optind]);
        return -1;
    }
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
    HttpServer *http = NULL;
    if (http_server_start(&http, engines, &o.http, err, sizeof err) != 0) {
        serve_log("cannot start the HTTP server: %s", err);
        engine_group_destroy(engines, 0);
        return 1;
    }
    ZmqControl *zmq = NULL;
    if (o.control) {
        if (zmq_control_start(&zmq, engines, o.control, secure ? &control_keys : NULL,
                              (int)(o.weight_sync_timeout_s * 1000), err, sizeof err) != 0) {
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
    if (left > 0 || st.requests_running + st.requests_waiting > 0)
        serve_log("drain timeout: aborting %d HTTP request(s) and %" PRId64 " engine request(s) still in flight", left,
                  st.requests_running + st.requests_waiting);
    else
        serve_log("drained: no request in flight");
    zmq_control_stop(zmq);
    http_server_stop(http);
    double rest = deadline - now_s();
    engine_group_destroy(engines, rest > 0 ? (int)(rest * 1000) : 0);
    serve_log("stopped");
    return 0;
}

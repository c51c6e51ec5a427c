// test_trainer_zero3_cuda.c — ZeRO on 2 GPUs (NCCL backend) computes what 1 GPU computes (bf16).
//
// The harness of tests/unit/zero3_testlib.h with the CUDA ops and NCCL, on a Qwen2-style model large enough
// that units are split over several NCCL chunks (hidden 256, 4 layers, vocab 4096, tied embeddings, bias) and
// sequences of 100-230 tokens. For every stage, 2 ranks (one per GPU) against 1 rank.
// Tolerances (stated): losses within 5e-3 relative, gradient norms within 2e-2 relative (they catch a gradient
// scaled wrongly, which Adam's update would hide), weights within 2e-2 of the largest weight. The runs differ in
// the order of fp32 gradient reductions and in the GEMM shapes (each rank holds half the batch), and bf16
// parameters turn a rounding difference of a master weight into a 1-ulp bf16 step (2^-8 relative), which the next
// steps carry.
// Also checks the memory claim of docs/architecture.md ("Trainer: ZeRO-3"): model state per rank (bf16 slice +
// fp32 master, Adam m and v, gradient slice) <= 18 bytes x params / N (plus alignment padding), plus the
// gathered units.
// Skips (77) without 2 GPUs. The parent never touches CUDA (a CUDA context does not survive fork()): it counts
// GPUs with nvidia-smi.
#include "check_macros.h"
#include "zero3_testlib.h"

static const Z3Case CASE = {
    .config = "{\"architectures\": [\"Qwen2ForCausalLM\"], \"vocab_size\": 4096, \"hidden_size\": 256, "
              "\"intermediate_size\": 704, \"num_hidden_layers\": 4, \"num_attention_heads\": 4, "
              "\"num_key_value_heads\": 2, \"max_position_embeddings\": 512, \"tie_word_embeddings\": true, "
              "\"hidden_act\": \"silu\", \"rope_theta\": 10000.0}",
    .vocab = 4096, .n_seq = 8, .base_len = 100, .len_spread = 131,
    .ops = OPS_BACKEND_CUDA, .comm = COMM_BACKEND_NCCL,
    .init_std = 0.02f,
    .hp = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f, .max_grad_norm = 1.0f},
};

static int gpu_count(void) {
    FILE *p = popen("nvidia-smi -L 2>/dev/null", "r");
    if (!p) return 0;
    char line[512];
    int n = 0;
    while (fgets(line, sizeof line, p))
        if (!strncmp(line, "GPU ", 4)) n++;
    pclose(p);
    return n;
}

// comm_backend_available may create a CUDA context: ask in a child so that the parent stays clean for fork().
static int nccl_available(void) {
    pid_t pid = fork();
    if (pid == 0) _exit(comm_backend_available(COMM_BACKEND_NCCL) ? 0 : 1);
    int st;
    return pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

int main(void) {
    int gpus = gpu_count();
    if (gpus < 2 || !nccl_available()) {
        printf("SKIP: needs 2 GPUs and an NCCL build (%d GPU(s) visible)\n", gpus);
        return 77;
    }
    for (int stage = 1; stage <= 3; stage++) {
        Z3Result one = {0}, two = {0};
        const int ran = z3_run_world(&CASE, 1, stage, &one) == 0 &&
                        z3_run_world(&CASE, 2, stage, &two) == 0 && one.n == two.n;
        CHECK(ran, "stage %d: a run failed", stage);
        if (!ran) continue;
        double worst_loss = z3_worst_in(&one, &two, Z3_HEAD, Z3_NORMS, 0);
        double worst_norm = z3_worst_in(&one, &two, Z3_NORMS, Z3_PARAMS, 0);
        double worst = z3_worst_in(&one, &two, Z3_PARAMS, one.n, 1);
        double params = two.v[3], state = two.v[0], gathered = two.v[1], grad_work = two.v[2];
        printf("stage %d, 2 GPUs vs 1: losses %.5f -> %.5f (max rel diff %.2e), gradient norms max rel diff %.2e, "
               "weights max diff %.2e of the largest; "
               "per rank: model state %.2f bytes/param/N (limit 18), gathered units %.1f MB, gradient work %.1f MB\n",
               stage, two.v[Z3_HEAD], two.v[Z3_HEAD + Z3_STEPS - 1], worst_loss, worst_norm, worst, state / (params / 2),
               gathered / 1e6, grad_work / 1e6);
        CHECK(two.v[Z3_HEAD + Z3_STEPS - 1] < two.v[Z3_HEAD], "stage %d: loss did not go down", stage);
        CHECK(worst_loss <= 5e-3 && worst_norm <= 2e-2 && worst <= 2e-2, "stage %d: over the tolerances", stage);
        // 18 bytes/param/N plus the alignment padding of each unit's slices (LAYOUT_ALIGN elements per rank).
        CHECK(stage < 2 || state / (params / 2) <= 18.05, "stage %d: model state %.2f bytes/param/N > 18", stage,
              state / (params / 2));
        free(one.v);
        free(two.v);
    }
    return check_exit_code("test_trainer_zero3_cuda");
}

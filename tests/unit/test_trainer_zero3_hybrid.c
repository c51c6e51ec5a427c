// test_trainer_zero3_hybrid.c — node-aware ZeRO computes what flat ZeRO computes (host backend, CPU, fp32):
// HSDP (zero3_create_sharded: state partitioned within a node, replicated across nodes) keeps half the state per
// rank and sends across nodes only the once-per-step all-reduce of the gradient slices; hpZ (zero3_create_hpz:
// parameters partitioned within the node, the rest over all ranks) sends across nodes only the gradient
// reduce-scatters of node-local slices and the once-per-step refresh of the parameters.
//
// 4 rank processes on 127.0.0.1 stand for 2 nodes x 2 ranks (LOCAL_WORLD_SIZE 2; tests/unit/zero3_testlib.h). For
// every stage, flat ZeRO over the 4 ranks and HSDP (sharded over each node's 2, replicated over the 2 nodes) train
// the same tiny random model for 5 AdamW steps with clipping.
// Checks: losses, gradient norms and final weights agree within 1e-5 relative (only summation orders differ); the
// sharded model state per rank is twice the flat one (1/2 of the model instead of 1/4; stage 1's full gradients
// excepted); HSDP's bytes sent across nodes are
// exactly its gradient all-reduces (2 x ceil(slice / 2) fp32 per unit and step: about 2 bytes x parameters per
// step), so no all-gather or reduce-scatter of forward and backward left the node, and they are fewer than flat
// ZeRO's on the same layout.
#include "check_macros.h"
#include "testlib.h"
#include "zero3_testlib.h"

static const Z3Case FLAT = {
    .config = "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 61, \"hidden_size\": 32, "
              "\"intermediate_size\": 40, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
              "\"num_key_value_heads\": 2, \"head_dim\": 8, \"max_position_embeddings\": 64, "
              "\"tie_word_embeddings\": true, \"attention_bias\": true, \"hidden_act\": \"silu\"}",
    .vocab = 61, .n_seq = 8, .base_len = 3, .len_spread = 7,
    .ops = OPS_BACKEND_CPU, .comm = COMM_BACKEND_HOST,
    .init_std = 0.2f,
    .hp = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f, .max_grad_norm = 0.5f},
    .nodes = 2,
};

int main(void) {
    Z3Case hybrid = FLAT;
    hybrid.hybrid = 1;
    for (int stage = 1; stage <= 3; stage++) {
        Z3Result flat = {0}, hsdp = {0};
        int ran = z3_run_world(&FLAT, 4, stage, &flat) == 0 && z3_run_world(&hybrid, 4, stage, &hsdp) == 0 &&
                  flat.n == hsdp.n;
        CHECK(ran, "stage %d: a run failed (values: flat %zu, HSDP %zu)", stage, flat.n, hsdp.n);
        if (!ran) {
            free(flat.v), free(hsdp.v);
            continue;
        }
        double worst = z3_worst(&flat, &hsdp), params = flat.v[3];
        double state_ratio = hsdp.v[0] / flat.v[0];
        double inter_flat = flat.v[5], inter_hsdp = hsdp.v[5], intra_hsdp = hsdp.v[4];
        // Per step, one all-reduce of every unit's gradient across the 2 replicas: 2 x ceil(n / 2) x 4 bytes to the
        // one peer, n = the slice (padded numel / 2), or the whole padded unit in stage 1 (full gradients): about 2
        // (stage 1: 4) bytes x parameters; the padding (each unit to a multiple of 2 x an alignment) adds a little.
        double want = Z3_STEPS * (stage == 1 ? 4.0 : 2.0) * params;
        printf("stage %d: HSDP 2x2 vs flat 4: max relative difference %.3g; state per rank %.2fx flat; bytes across "
               "nodes %.0f (gradient all-reduces alone: %.0f; flat ZeRO %.0f), inside %.0f\n", stage, worst,
               state_ratio, inter_hsdp, want, inter_flat, intra_hsdp);
        CHECK(worst <= 1e-5, "stage %d: %.3g over 1e-5", stage, worst);
        // Stage 1 keeps full gradients on every rank: only its master and Adam state halve.
        if (stage > 1)
            CHECK(state_ratio > 1.9 && state_ratio < 2.1, "stage %d: HSDP state %.0f bytes vs flat %.0f", stage,
                  hsdp.v[0], flat.v[0]);
        else
            CHECK(state_ratio > 1.2 && state_ratio < 1.5, "stage 1: HSDP state %.0f bytes vs flat %.0f", hsdp.v[0],
                  flat.v[0]);
        CHECK(inter_hsdp >= want && inter_hsdp <= 1.05 * want, "stage %d: HSDP sent %.0f bytes across nodes, the "
              "gradient all-reduces are %.0f", stage, inter_hsdp, want);
        CHECK(intra_hsdp > 0 && inter_hsdp < inter_flat, "stage %d: across nodes HSDP %.0f, flat %.0f", stage,
              inter_hsdp, inter_flat);
        free(flat.v), free(hsdp.v);
    }
    // hpZ, stage 3: the master, Adam and gradient slices over all 4 ranks, the parameters over each node's 2.
    Z3Case hpz = FLAT;
    hpz.hpz = 1;
    Z3Result flat = {0}, h = {0};
    int ran = z3_run_world(&FLAT, 4, 3, &flat) == 0 && z3_run_world(&hpz, 4, 3, &h) == 0 && flat.n == h.n;
    CHECK(ran, "hpZ: a run failed (values: flat %zu, hpZ %zu)", flat.n, h.n);
    if (ran) {
        double worst = z3_worst(&flat, &h), params = flat.v[3];
        // fp32 on the CPU: flat keeps (4 + 16) bytes x P / 4 per rank, hpZ 4 x P / 2 + 16 x P / 4: 1.2x.
        double state_ratio = h.v[0] / flat.v[0];
        // Per step and rank across nodes: the reduce-scatter of the node-local gradient slice (fp32, P / 4 to the
        // one peer) and the refresh's all-gather (P / 4 fp32): 2 bytes x P, none of the parameter all-gathers; the
        // padding (each unit to a multiple of 4 x an alignment) and the norm's one-float all-reduce add up to 10 %.
        double want = Z3_STEPS * 2.0 * params;
        printf("stage 3: hpZ 2x2 vs flat 4: max relative difference %.3g; state per rank %.2fx flat; bytes across "
               "nodes %.0f (gradient reduce-scatters and refreshes alone: %.0f; flat ZeRO %.0f), inside %.0f\n", worst,
               state_ratio, h.v[5], want, flat.v[5], h.v[4]);
        CHECK(worst <= 1e-5, "hpZ: %.3g over 1e-5", worst);
        CHECK(state_ratio > 1.15 && state_ratio < 1.25, "hpZ state %.0f bytes vs flat %.0f", h.v[0], flat.v[0]);
        CHECK(h.v[5] >= want && h.v[5] <= 1.1 * want, "hpZ sent %.0f bytes across nodes, want %.0f", h.v[5], want);
        CHECK(h.v[5] < flat.v[5]);
    }
    free(flat.v), free(h.v);
    return check_exit_code("test_trainer_zero3_hybrid");
}

"""tandem's GRPO math (trainer/grpo_*.c through tests/reference/tools/trainer_grpo_tool.c) against TRL 1.16 itself.

TRL's own code is called, not a re-implementation of it:
  * GRPOTrainer._generate_and_score_completions (rewards -> advantages, mask_truncated_completions,
    num_items_in_batch, the vLLM importance-sampling ratio and every metric it logs) on a stand-in `self` whose
    `_generate`, `_calculate_rewards` and `_get_per_token_logps_and_entropies` return the case's completions,
    rewards and logprobs (the parts that would need a model or a vLLM server);
  * GRPOTrainer._compute_loss on that output, with the policy's per-token logprobs and entropies returned as leaf
    tensors that require grad, so autograd gives TRL's dL/dlogprob and dL/dentropy.
The stand-in's accelerator is one process (gather / reduce are the identity); num_processes = 2 is emulated where
it enters the math (the dapo/cispo/vespo normaliser, with a global num_items_in_batch twice the local count).

Every loss_type x importance_sampling_level x beta {0, 0.04} x epsilon_high {unset, 0.28} x delta {unset, 1.25} x
scale_rewards x rollout-correction mode {no sampling logprobs, sampling logprobs uncorrected, the four
vllm_importance_sampling_mode values} is run (vespo with a sequence-level correction is left out: TRL refuses it;
test_invalid_options checks that tandem refuses it too). The other options are drawn per case from a seeded
generator: mask_truncated_completions, top_entropy_quantile, off_policy_mask_threshold, use_bias_correction_kl,
multi_objective_aggregation, clip_min/clip_max, train/eval, gradient accumulation and steps_per_generation
(on-policy or with old logprobs), sapo temperatures, vespo parameters, the (adaptive) entropy bonus, and a batch
whose completions are all one token long. Each case has 3 groups of 4 ragged completions (1..7 tokens, some
truncated), None rewards, a row that every reward function scored None and a group whose rewards are all equal.

Tolerance (fp32): TRL computes in fp32, tandem accumulates in double. Advantages and the loss agree within
1e-5 * max(1, |value|); gradients within 1e-5 * max|TRL gradient| (+1e-9); IS ratios and metrics within 1e-5
relative (+1e-6 absolute); masks, counts and flags exactly. Rewards are multiples of 0.25 so that an all-equal
group has exactly zero std in fp32 too (otherwise TRL's fp32 mean can leave a ~1e-8 std that flips
frac_reward_zero_std's isclose test).
"""
import itertools
import json
import math
import subprocess
import types
from collections import defaultdict

import numpy as np
import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer

from conftest import tool

EOS, PAD = 2, 0
NUM_GENERATIONS, GROUPS, MAX_LEN = 4, 3, 7
B = NUM_GENERATIONS * GROUPS
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
ROLLOUT_MODES = ["none", "uncorrected", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
REL = 1e-5


class _Accelerator:
    """One process: every collective is the identity."""

    device = torch.device("cpu")
    process_index = 0
    is_main_process = True
    sync_gradients = True

    def __init__(self, num_processes):
        self.num_processes = num_processes

    def gather(self, t):
        return t

    def reduce(self, t, reduction="sum"):
        return t

    def gather_for_metrics(self, t):
        return t

    def pad_across_processes(self, t, dim=0, pad_index=0):
        return t


class _TrainerStandIn:
    """The stand-in `self`: TRL's methods under test, bound to plain attributes set per case."""

    _generate_and_score_completions = GRPOTrainer._generate_and_score_completions
    _compute_loss = GRPOTrainer._compute_loss
    get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask
    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)
    get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)


def f32(x):
    return float(np.float32(x))


def make_case(rng, one_token):
    """Completions, rewards and logprobs of one generation batch (B completions, groups of NUM_GENERATIONS)."""
    lengths = np.ones(B, dtype=int) if one_token else rng.integers(1, MAX_LEN + 1, B)
    if not one_token:
        lengths[0], lengths[5] = 1, MAX_LEN  # a single-token completion and a full-length one
    truncated = rng.random(B) < 0.3
    truncated[1] = True
    completion_ids = []
    for b in range(B):
        ids = [int(x) for x in rng.integers(3, 50, lengths[b])]
        if not truncated[b]:
            ids[-1] = EOS
        completion_ids.append(ids)
    T = int(lengths.max())
    # Rewards: multiples of 0.25 (exact in fp32); None (NaN) here and there; row 3 unscorable; group 2 all equal.
    rewards = rng.choice([0.0, 0.25, 0.5, 1.0, 1.5, 2.0], size=(B, 2)).astype(np.float32)
    rewards[rng.random((B, 2)) < 0.15] = np.nan
    rewards[3, :] = np.nan
    rewards[8:12, 0], rewards[8:12, 1] = 0.5, np.nan
    rewards[9, 1] = 1.0
    rewards[10:12, 1] = 1.0
    rewards[8, 1] = 1.0
    weights = [f32(w) for w in rng.choice([0.5, 1.0, 2.0], size=2)]

    def arr(x):
        return torch.tensor(np.asarray(x, dtype=np.float32))

    logps = -rng.exponential(1.0, (B, T))
    old = logps + rng.normal(0.0, 0.25, (B, T))
    ref = logps + rng.normal(0.0, 0.3, (B, T))
    sampling = old + rng.normal(0.0, 0.2, (B, T))
    entropies = rng.uniform(0.05, 3.0, (B, T))
    sampling_lists = []
    for b in range(B):
        row = [f32(v) for v in sampling[b, : lengths[b]]]
        for t in range(len(row)):
            if rng.random() < 0.05:
                row[t] = None  # a token the server could not score
        sampling_lists.append(row)
    return dict(lengths=lengths, completion_ids=completion_ids, T=T, rewards=rewards, weights=weights,
                logps=arr(logps), old=arr(old), ref=arr(ref), sampling_lists=sampling_lists, entropies=arr(entropies))


def draw_options(rng, loss_type, level, beta, eps_high, delta, scale, rollout):
    o = dict(num_generations=NUM_GENERATIONS, max_completion_length=8, loss_type=loss_type,
             importance_sampling_level=level, beta=beta, epsilon=0.2, epsilon_high=eps_high, delta=delta,
             scale_rewards=scale)
    o["mask_truncated_completions"] = bool(rng.random() < 0.5)
    o["top_entropy_quantile"] = 1.0 if rng.random() < 0.6 else float(rng.choice([0.0, 0.2, 0.5]))
    o["off_policy_mask_threshold"] = None if rng.random() < 0.6 else float(rng.choice([0.0, 0.05, 0.5]))
    o["use_bias_correction_kl"] = bool(rng.random() < 0.75)
    o["multi_objective_aggregation"] = "normalize_then_sum" if rng.random() < 0.25 else "sum_then_normalize"
    o["sapo_temperature_pos"] = float(rng.choice([0.5, 1.0, 2.0]))
    o["sapo_temperature_neg"] = float(rng.choice([0.5, 1.05, 2.0]))
    o["vespo_k_pos"], o["vespo_lambda_pos"] = float(rng.choice([1.0, 2.0])), float(rng.choice([1.0, 3.0]))
    o["vespo_k_neg"], o["vespo_lambda_neg"] = float(rng.choice([2.0, 3.0])), float(rng.choice([0.0, 0.5, 2.0]))
    o["vllm_importance_sampling_correction"] = rollout not in ("none", "uncorrected")
    o["vllm_importance_sampling_mode"] = rollout if o["vllm_importance_sampling_correction"] else "sequence_mask"
    clip_min = None if rng.random() < 0.7 else 0.5
    clip_max = float(rng.choice([3.0, 1.5]))
    if clip_min is not None and rollout.endswith("_mask") and rng.random() < 0.5:
        clip_max = None  # mask only below clip_min
    o["vllm_importance_sampling_clip_min"], o["vllm_importance_sampling_clip_max"] = clip_min, clip_max
    o["entropy_coef"], o["use_adaptive_entropy"] = 0.0, False
    if rng.random() < 0.3:
        o["entropy_coef"] = 0.01
        o["use_adaptive_entropy"] = bool(rng.random() < 0.5)
        o["entropy_target"] = float(rng.choice([0.2, 2.0]))
    return o


def run_trl(case, o, rollout, batch, entropy_state):
    """TRL's own stages on the stand-in; returns its outputs, TRL's loss, its gradients and its metrics."""
    s = _TrainerStandIn()
    training = batch["training"]
    use_vllm = rollout != "none"
    s.accelerator = _Accelerator(batch["num_processes"])
    s.model = types.SimpleNamespace(training=training, is_gradient_checkpointing=False)
    s.ref_model = object()
    s.args = types.SimpleNamespace(
        gradient_accumulation_steps=batch["gradient_accumulation_steps"],
        steps_per_generation=batch["steps_per_generation"], per_device_train_batch_size=B,
        per_device_eval_batch_size=B, gradient_checkpointing_kwargs=None,
        use_bias_correction_kl=o["use_bias_correction_kl"], delta=o["delta"],
        sapo_temperature_pos=o["sapo_temperature_pos"], sapo_temperature_neg=o["sapo_temperature_neg"],
        vespo_k_pos=o["vespo_k_pos"], vespo_lambda_pos=o["vespo_lambda_pos"], vespo_k_neg=o["vespo_k_neg"],
        vespo_lambda_neg=o["vespo_lambda_neg"], entropy_target=o.get("entropy_target", 0.2),
        entropy_coef_delta=0.005, entropy_coef_min=0.0, entropy_coef_max=1.0)
    s.environment_factories, s.tools, s.environments = None, None, None
    s.num_iterations = 1
    s.use_vllm = use_vllm
    s.vllm_importance_sampling_correction = o["vllm_importance_sampling_correction"] if use_vllm else True
    s.vllm_importance_sampling_mode = o["vllm_importance_sampling_mode"]
    s.vllm_importance_sampling_clip_min = o["vllm_importance_sampling_clip_min"]
    s.vllm_importance_sampling_clip_max = o["vllm_importance_sampling_clip_max"]
    s.beta = o["beta"]
    s.mask_truncated_completions = o["mask_truncated_completions"]
    s.eos_token_ids = [EOS]
    s._tokenizer = types.SimpleNamespace(pad_token_id=PAD)
    s.pad_to_multiple_of = None
    s._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    s._logs = {"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
               "extra": defaultdict(list), "images": []}
    s._pending_extra_logs, s._pending_metrics = defaultdict(list), defaultdict(list)
    s.reward_func_names = ["func0", "func1"]
    s.reward_funcs = [None, None]  # only counted (len) by the code under test
    s.reward_weights = torch.tensor(case["weights"], dtype=torch.float32)
    s.num_generations = s.num_generations_eval = NUM_GENERATIONS
    s.multi_objective_aggregation = o["multi_objective_aggregation"]
    s.scale_rewards = o["scale_rewards"]
    s.log_multimodal, s._is_vlm = False, False
    s.loss_type = o["loss_type"]
    s.importance_sampling_level = o["importance_sampling_level"]
    s.epsilon_low = o["epsilon"]
    s.epsilon_high = o["epsilon_high"] if o["epsilon_high"] is not None else o["epsilon"]
    s.top_entropy_quantile = o["top_entropy_quantile"]
    s.off_policy_mask_threshold = o["off_policy_mask_threshold"]
    s.max_completion_length = o["max_completion_length"]
    s.current_gradient_accumulation_steps = batch["gradient_accumulation_steps"]
    s.aux_loss_enabled = False
    s.entropy_coef = entropy_state["coef"]
    s.use_adaptive_entropy = o["use_adaptive_entropy"]
    s._entropy_bonus_enabled = o["entropy_coef"] != 0.0 or o["use_adaptive_entropy"]
    s._last_world_entropy = entropy_state["last_world_entropy"]
    s._entropy_window_stats = None

    sampling = case["sampling_lists"] if use_vllm else None
    s._generate = lambda prompts: ([[1, 1]] * B, case["completion_ids"], None, ["c"] * B, sampling, {}, None, None)

    def no_grad_logps(model, *args, **kwargs):  # stage 1: the old and the reference logprobs
        return (case["ref"] if model is s.ref_model else case["old"]).clone(), None, None

    s._get_per_token_logps_and_entropies = no_grad_logps
    s._calculate_rewards = lambda *args: torch.from_numpy(case["rewards"].copy())
    out = s._generate_and_score_completions([{"prompt": "p"}] * B)
    if batch["num_processes"] > 1:  # the all-gathered count of two ranks holding the same number of tokens
        out["num_items_in_batch"] = out["num_items_in_batch"] * batch["num_processes"]

    logps = case["logps"].clone().requires_grad_(True)
    entropies = case["entropies"].clone().requires_grad_(True)
    s._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, entropies, None)
    loss = s._compute_loss(None, out)
    loss.backward()
    mode = "train" if training else "eval"
    metrics = {k: v[-1] for k, v in s._metrics[mode].items()}
    return dict(out=out, loss=loss.item(), grad_logps=logps.grad, grad_entropies=entropies.grad,
                metrics=metrics, entropy_coef=s.entropy_coef, last_world_entropy=s._last_world_entropy)


def tool_case(case, o, rollout, trl_out, batch, entropy_state):
    """The same case as the C tool's JSON: the pre-truncation mask and TRL's own logprob tensors."""
    T = case["T"]
    mask = [[1 if t < case["lengths"][b] else 0 for t in range(T)] for b in range(B)]

    def rows(t):
        return None if t is None else [[None if math.isnan(v) else v for v in r] for r in t.tolist()]

    options = {k: v for k, v in o.items()}
    return {
        "options": options,
        "rewards_per_func": rows(torch.from_numpy(case["rewards"])),
        "reward_weights": case["weights"],
        # The loss takes TRL's advantages: where a group's advantages are 0 in exact arithmetic, TRL's fp32 leaves
        # +-1e-8 noise whose sign flips sign-dependent choices (clip metrics, sapo temperature, off-policy mask).
        # The computed advantages are compared on their own.
        "loss_advantages": [float(a) for a in trl_out["advantages"].tolist()],
        "mask": mask,
        "completion_ids": case["completion_ids"],
        "eos_token_ids": [EOS],
        "pad_token_id": PAD,
        "logps": rows(case["logps"]),
        "old_logps": rows(trl_out.get("old_per_token_logps")),
        "ref_logps": rows(trl_out.get("ref_per_token_logps")),
        "sampling_logps": rows(trl_out.get("sampling_per_token_logps")),
        "entropies": rows(case["entropies"]),
        "batch": dict(batch, num_items_in_batch=float(trl_out["num_items_in_batch"])),
        "entropy_control": {"coef": entropy_state["coef"],
                            "last_world_entropy": None if math.isinf(entropy_state["last_world_entropy"])
                            else entropy_state["last_world_entropy"]},
    }


def close(ours, ref, rel=REL, abs_=1e-6):
    if ours is None or ref is None or (isinstance(ref, float) and math.isnan(ref)):
        return (ours is None or math.isnan(ours)) and (ref is None or math.isnan(ref))
    return abs(ours - ref) <= rel * abs(ref) + abs_


def nan_array(x):
    return np.array([[np.nan if v is None else v for v in r] for r in x], dtype=np.float64)


def compare(name, ours, trl):
    where = f"[{name}]"
    out = trl["out"]
    # Advantages, the truncation-masked completion mask, the token count.
    adv = np.array(ours["advantages"], dtype=np.float64)
    ref_adv = out["advantages"].double().numpy()
    assert np.all(np.abs(adv - ref_adv) <= REL * np.maximum(1.0, np.abs(ref_adv))), f"{where} advantages {adv} vs {ref_adv}"
    assert np.array_equal(np.array(ours["mask"]), out["completion_mask"].numpy()), f"{where} mask"
    assert ours["num_items_in_batch"] == float(out["num_items_in_batch"]), f"{where} num_items_in_batch"
    if "importance_sampling_ratio" in out:
        r = np.array(ours["importance_sampling_ratio"], dtype=np.float64)
        ref_r = out["importance_sampling_ratio"].double().flatten().numpy()
        assert r.shape == ref_r.shape and np.allclose(r, ref_r, rtol=REL, atol=1e-7), f"{where} IS ratio"
    else:
        assert "importance_sampling_ratio" not in ours, f"{where} IS ratio computed without the correction"
    # Loss and its gradients.
    assert abs(ours["loss"] - trl["loss"]) <= REL * max(1.0, abs(trl["loss"])), f"{where} loss {ours['loss']} vs {trl['loss']}"
    for key in ("grad_logps", "grad_entropies"):
        g = nan_array(ours[key])
        ref_g = trl[key].double().numpy() if trl[key] is not None else np.zeros_like(g)
        err = np.abs(g - ref_g).max()
        assert err <= REL * np.abs(ref_g).max() + 1e-9, f"{where} {key}: max error {err:.3g}, max |TRL| {np.abs(ref_g).max():.3g}"
    # Metrics: the same names as TRL logs, the same values.
    assert set(ours["metrics"]) == set(trl["metrics"]), f"{where} metric names {sorted(ours['metrics'])} vs {sorted(trl['metrics'])}"
    for k, v in trl["metrics"].items():
        assert close(ours["metrics"][k], float(v)), f"{where} metric {k}: {ours['metrics'][k]} vs {v}"
    assert close(ours["entropy_control"]["coef"], trl["entropy_coef"]), f"{where} entropy_coef"
    lw = ours["entropy_control"]["last_world_entropy"]
    assert close(math.inf if lw is None else lw, trl["last_world_entropy"], abs_=1e-6) or (
        lw is None and math.isinf(trl["last_world_entropy"])), f"{where} last_world_entropy"


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_matches_trl(loss_type):
    exe = tool("trainer_grpo_tool")
    rng = np.random.default_rng(LOSS_TYPES.index(loss_type) + 1)
    combos = itertools.product(["token", "sequence"], [0.0, 0.04], [None, 0.28], [None, 1.25],
                               ["group", "batch", "none"], ROLLOUT_MODES)
    names, cases, refs = [], [], []
    for level, beta, eps_high, delta, scale, rollout in combos:
        if loss_type == "vespo" and rollout.startswith("sequence"):
            continue  # TRL refuses this combination (see test_invalid_options)
        case = make_case(rng, one_token=rng.random() < 0.08)
        o = draw_options(rng, loss_type, level, beta, eps_high, delta, scale, rollout)
        if rollout in ("none", "uncorrected") and rng.random() < 0.5:
            ga, spg = 2, 2  # generation aligned with the optimizer step: on-policy, no old logprobs
        else:
            ga, spg = int(rng.choice([1, 2, 4])), 4  # old logprobs (always computed with sampling logprobs)
        batch = dict(num_processes=int(rng.choice([1, 1, 2])), gradient_accumulation_steps=ga,
                     steps_per_generation=spg, training=bool(rng.random() < 0.85), sync_gradients=True)
        entropy_state = {"coef": o["entropy_coef"],
                         "last_world_entropy": float(rng.choice([math.inf, 0.1, 5.0]))
                         if o["use_adaptive_entropy"] else math.inf}
        trl = run_trl(case, o, rollout, batch, entropy_state)
        names.append(f"{loss_type} level={level} beta={beta} eps_high={eps_high} delta={delta} scale={scale} "
                     f"rollout={rollout} options={o} batch={batch}")
        cases.append(tool_case(case, o, rollout, trl["out"], batch, entropy_state))
        refs.append(trl)
    proc = subprocess.run([exe], input=json.dumps(cases), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    answers = json.loads(proc.stdout)
    assert len(answers) == len(cases)
    for name, ours, trl in zip(names, answers, refs):
        assert "error" not in ours, f"[{name}] refused: {ours.get('error')}"
        compare(name, ours, trl)


def test_clipping_and_masks_are_exercised():
    """The random cases must reach the branches the comparison is meant to prove (guards the generator)."""
    exe = tool("trainer_grpo_tool")
    rng = np.random.default_rng(99)
    seen = defaultdict(int)
    cases, refs = [], []
    for rollout in ["token_mask", "sequence_mask", "token_truncate"]:
        for _ in range(6):
            case = make_case(rng, one_token=False)
            o = draw_options(rng, "dapo", "token", 0.0, None, None, "group", rollout)
            batch = dict(num_processes=1, gradient_accumulation_steps=1, steps_per_generation=4, training=True)
            trl = run_trl(case, o, rollout, batch, {"coef": 0.0, "last_world_entropy": math.inf})
            cases.append(tool_case(case, o, rollout, trl["out"], batch, {"coef": 0.0, "last_world_entropy": math.inf}))
            refs.append(trl)
            m = trl["metrics"]
            seen["low"] += m["clip_ratio/low_mean"] > 0
            seen["high"] += m["clip_ratio/high_mean"] > 0
            ratio = trl["out"]["importance_sampling_ratio"]
            seen["is_masked"] += bool((ratio == 0).any())
            seen["zero_std"] += m["frac_reward_zero_std"] > 0
    assert all(seen[k] > 0 for k in ("low", "high", "is_masked", "zero_std")), dict(seen)
    answers = json.loads(subprocess.run([exe], input=json.dumps(cases), capture_output=True, text=True,
                                        timeout=60).stdout)
    for i, (ours, trl) in enumerate(zip(answers, refs)):
        assert "error" not in ours, ours
        compare(f"exercised case {i}", ours, trl)


def _refusal(exe, options):
    case = {"options": options, "mask": [[1]], "logps": [[-1.0]], "advantages": [0.0]}
    proc = subprocess.run([exe], input=json.dumps(case), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, f"{options} was accepted"
    return json.loads(proc.stdout)["error"]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # GRPOConfig's own deprecation notices
def test_invalid_options():
    """tandem refuses what GRPOConfig itself refuses, and the values the math cannot take, naming the option."""
    from trl import GRPOConfig

    exe = tool("trainer_grpo_tool")
    refused_by_trl = [
        ({"num_generations": 1}, "num_generations"),
        ({"vllm_importance_sampling_clip_min": 3.0}, "vllm_importance_sampling_clip_min"),
        ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None},
         "vllm_importance_sampling_clip_max"),
    ]
    for options, name in refused_by_trl:
        with pytest.raises(ValueError):
            GRPOConfig(output_dir="/tmp/tandem-grpo-config", per_device_train_batch_size=8, report_to=[],
                       use_cpu=True, bf16=False, **options)
        assert name in _refusal(exe, {"num_generations": 2, **options} if name != "num_generations" else options)
    # TRL's trainer refuses these when it builds or runs the loss; tandem refuses them up front.
    ours_only = [
        ({"loss_type": "ppo"}, "loss_type"),
        ({"loss_type": "vespo", "vllm_importance_sampling_mode": "sequence_mask"}, "vllm_importance_sampling_mode"),
        ({"scale_rewards": "median"}, "scale_rewards"),
        ({"importance_sampling_level": "batch"}, "importance_sampling_level"),
        ({"vllm_importance_sampling_mode": "token_clip"}, "vllm_importance_sampling_mode"),
        ({"multi_objective_aggregation": "max"}, "multi_objective_aggregation"),
        ({"epsilon": -0.1}, "epsilon"),
        ({"epsilon_high": -1.0}, "epsilon_high"),
        ({"delta": 0.0}, "delta"),
        ({"beta": -0.01}, "beta"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile"),
        ({"sapo_temperature_pos": 0.0}, "sapo_temperature_pos"),
        ({"off_policy_mask_threshold": -1.0}, "off_policy_mask_threshold"),
        ({"max_completion_length": 0}, "max_completion_length"),
        ({"entropy_coef_min": 2.0}, "entropy_coef_min"),
        ({"epsilon": "0.2"}, "epsilon"),
        ({"num_generations": 2.5}, "num_generations"),
        ({"no_such_option": 1}, "no_such_option"),
    ]
    for options, name in ours_only:
        assert name in _refusal(exe, {"num_generations": 2, **options}), options


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_deprecated_cap_and_bool_scale_rewards():
    """GRPOConfig's conversions: vllm_importance_sampling_cap overrides clip_max; scale_rewards True/False."""
    from trl import GRPOConfig

    exe = tool("trainer_grpo_tool")
    cfg = GRPOConfig(output_dir="/tmp/tandem-grpo-config", per_device_train_batch_size=8, report_to=[], use_cpu=True,
                     bf16=False, vllm_importance_sampling_cap=1.1, vllm_importance_sampling_clip_max=4.0,
                     vllm_importance_sampling_mode="token_truncate", scale_rewards=False)
    assert cfg.vllm_importance_sampling_clip_max == 1.1 and cfg.scale_rewards == "none"
    # Old/sampling log-difference of 0.5 on every active token: exp(0.5) = 1.65 is capped to 1.1 (4.0 is ignored);
    # the padded position has a zero difference, ratio 1.
    case = {"options": {"num_generations": 2, "vllm_importance_sampling_cap": 1.1,
                        "vllm_importance_sampling_clip_max": 4.0, "vllm_importance_sampling_mode": "token_truncate",
                        "scale_rewards": False},
            "rewards_per_func": [[1.0], [3.0]], "mask": [[1, 1], [1, 0]], "logps": [[-1.0, -1.0], [-1.0, -1.0]],
            "old_logps": [[-1.0, -1.0], [-1.0, -1.0]], "sampling_logps": [[-1.5, -1.5], [-1.5, -1.5]]}
    ours = json.loads(subprocess.run([exe], input=json.dumps(case), capture_output=True, text=True,
                                     timeout=30).stdout)
    assert np.allclose(ours["importance_sampling_ratio"], [1.1, 1.1, 1.1, 1.0])
    assert ours["advantages"] == [-1.0, 1.0]  # scale_rewards none: r - mean, not divided by the std


def test_entropy_threshold_is_torch_quantile():
    """top_entropy_quantile's threshold is bit-identical to torch.quantile (what TRL's get_high_entropy_mask calls):
    a threshold one ulp off moves a token across '>= threshold' (seen in the random cases before the fix)."""
    exe = tool("trainer_grpo_tool")
    g = torch.Generator().manual_seed(3)
    cases, refs = [], []
    for trial in range(3000):
        n = int(torch.randint(1, 80, (1,), generator=g))
        values = torch.rand(n, generator=g) * 3
        if trial % 5 == 0:
            values[: n // 2] = values[0]  # ties
        top = [0.0, 0.2, 0.5, 0.3, 0.05, 0.8, 0.999][trial % 7]
        refs.append(torch.quantile(values, 1 - top).item())
        cases.append({"quantile_values": values.tolist(), "top_entropy_quantile": top})
    answers = json.loads(subprocess.run([exe], input=json.dumps(cases), capture_output=True, text=True,
                                        timeout=60).stdout)
    mismatches = [(c["top_entropy_quantile"], a["threshold"], r) for c, a, r in zip(cases, answers, refs)
                  if a["threshold"] != r]
    assert not mismatches, f"{len(mismatches)} thresholds differ from torch.quantile, e.g. {mismatches[:3]}"

"""tandem-train's options against TRL's GRPOConfig and SFTConfig: every option that is not tandem's own is a field
of theirs (so a TRL config's keys mean the same thing here), and its default equals TRL's. Every other field of
TRL's dataclasses has a fate in tandem's TRL key table (trainer/train_config_trl.c), so a TRL upgrade that adds a
field fails here, naming it. A TRL-style config file is accepted as it is, and the derived batch sizes equal
GRPOConfig.__post_init__'s. Driven through tests/reference/tools/trainer_config_tool.c.
"""
import dataclasses
import json
import subprocess

import pytest
from trl import GRPOConfig, ModelConfig, SFTConfig

from conftest import tool

REQUIRED = ["--model", "/m", "--train-file", "/d.jsonl", "--rollout-servers", "tcp://h:1", "--rewards",
            "think_format"]

# tandem's own options (no GRPOConfig field of that name). overwrite_output_dir is transformers 4's
# TrainingArguments name; transformers 5 dropped the field.
TANDEM_ONLY = {"model", "train_file", "mode", "overwrite_output_dir", "chat_template", "max_prompt_length",
               "overlong_prompts", "rewards",
               "answer_column", "format_regex", "format_regex_mode", "soft_punish_cache", "length_penalty_coef",
               "length_penalty_target", "reward_url", "reward_timeout", "reward_connect_timeout", "reward_retries",
               "reward_backoff", "reward_max_response_mb", "resume", "zero_stage", "device", "init_timeout", "comm_timeout",
               "rollout_servers", "rollout_timeout", "weight_sync_steps", "weight_sync_transport", "warmup_ratio",
               "keep_logits", "control_server_key", "control_client_key",
               "max_staleness",   # TRL's AsyncGRPOConfig has it, GRPOConfig does not
               "sharding_strategy", "zero_hpz_partition_size",   # FSDP's and DeepSpeed ZeRO++'s names
               "overlap_comm",   # DeepSpeed's zero_optimization key
               "lora_init",   # PEFT's init_lora_weights, which TRL's ModelConfig does not expose
               "lora_save_merged", "lora_sync",
               # TRL takes tools and environments as GRPOTrainer arguments
               "tools", "tool_lookup_file", "tool_call_format", "env_url", "env_timeout", "env_connect_timeout",
               "env_retries", "env_backoff"}
# LoRA options: TRL's ModelConfig fields (trl sft/grpo scripts take them beside the trainer config), its defaults
# but for this spelling: the modules PEFT picks for tandem's architectures when target_modules is None.
MODEL_CONFIG = {"use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "use_rslora"}
MODEL_CONFIG_SPELLING = {"lora_target_modules": (None, "q_proj,v_proj")}
# SFTConfig's names (no GRPOConfig field), compared with SFTConfig's defaults.
SFT_KEYS = {"max_length", "truncation_mode", "completion_only_loss", "dataset_text_field"}
# Same meaning, different spelling of "unset" or a value that only names TRL's implementation.
DEFAULT_SPELLING = {
    "min_p": (None, 0.0),             # off
    "data_seed": (None, -1),          # use seed
    "save_total_limit": (None, 0),    # keep all
    "steps_per_generation": (1, 0),   # TRL resolves it in __post_init__; tandem in train_config_finalize
    "generation_batch_size": (8, 0),  # idem
    "optim": ("adamw_torch_fused", "adamw_torch"),  # both AdamW
    "output_dir": (None, "output"),   # TRL requires it; tandem defaults it
    "max_tool_calling_iterations": (None, -1),   # no limit
}


def run_config_tool(*args, world=1):
    proc = subprocess.run([tool("trainer_config_tool"), "--world-size", str(world), *REQUIRED, *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def tandem_config(*args, world=1):
    return run_config_tool(*args, world=world)["config"]


def trl_config(tmp_path, **kw):
    return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **kw)


def plain(v):
    return getattr(v, "value", v)  # enums (lr_scheduler_type) to their string


def test_keys_are_trl_names_with_trl_defaults(tmp_path):
    ours = tandem_config()
    trl = trl_config(tmp_path)
    sft = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    model_cfg = ModelConfig()
    for key in SFT_KEYS:
        assert key not in fields and key in {f.name for f in dataclasses.fields(SFTConfig)}, key
        want = plain(getattr(sft, key))
        assert ours[key] == want, f"default of {key}: tandem {ours[key]!r}, SFTConfig {want!r}"
    for key, value in ours.items():
        if key in MODEL_CONFIG:
            want = getattr(model_cfg, key)
            assert (want, value) == MODEL_CONFIG_SPELLING.get(key, (want, want)), key
            continue
        if key in SFT_KEYS:
            continue
        if key in TANDEM_ONLY:
            assert key not in fields, f"{key} is a GRPOConfig field: drop it from TANDEM_ONLY"
            continue
        assert key in fields, f"option {key} is not a GRPOConfig field"
        want = plain(getattr(trl, key))
        if key in DEFAULT_SPELLING:
            if key == "output_dir":
                continue
            assert (want, value) == DEFAULT_SPELLING[key], key
            continue
        if key == "reward_weights":
            assert want is None and value is None
            continue
        assert value == want, f"default of {key}: tandem {value!r}, TRL {want!r}"


def test_trl_config_file_is_accepted(tmp_path):
    cfg = {"learning_rate": 5e-7, "num_generations": 4, "per_device_train_batch_size": 4,
           "gradient_accumulation_steps": 2, "max_completion_length": 128, "beta": 0.04, "epsilon_high": 0.28,
           "loss_type": "grpo", "scale_rewards": False, "importance_sampling_level": "sequence",
           "lr_scheduler_type": "cosine", "warmup_steps": 0.1, "max_steps": 20, "seed": 3, "logging_steps": 1,
           "save_steps": 10, "use_vllm": True, "vllm_mode": "server", "report_to": "none", "bf16": False,
           "mask_truncated_completions": True, "vllm_importance_sampling_mode": "token_truncate"}
    path = tmp_path / "grpo.json"
    path.write_text(json.dumps(cfg))
    ours = tandem_config("--config", str(path), world=2)
    trl = trl_config(tmp_path, **{k: v for k, v in cfg.items() if k not in ("report_to", "bf16")})
    for key in cfg:
        if key in ("use_vllm", "vllm_mode", "report_to", "bf16"):
            continue  # accepted and ignored by tandem
        assert ours[key] == plain(getattr(trl, key)), key


@pytest.mark.parametrize("pdtbs,gas,spg,gbs", [(8, 1, None, None), (4, 3, None, None), (4, 1, 4, None),
                                               (2, 1, None, 16), (6, 2, None, None)])
def test_derived_batches_match_grpo_config(tmp_path, pdtbs, gas, spg, gbs):
    # One process: GRPOConfig resolves with world size 1, the same as the tool is told.
    trl = trl_config(tmp_path, per_device_train_batch_size=pdtbs, gradient_accumulation_steps=gas,
                     steps_per_generation=spg, generation_batch_size=gbs, num_generations=2)
    args = ["--per-device-train-batch-size", str(pdtbs), "--gradient-accumulation-steps", str(gas),
            "--num-generations", "2"]
    if spg:
        args += ["--steps-per-generation", str(spg)]
    if gbs:
        args += ["--generation-batch-size", str(gbs)]
    got = run_config_tool(*args)["resolved"]
    assert (got["steps_per_generation"], got["generation_batch_size"]) == (trl.steps_per_generation,
                                                                          trl.generation_batch_size)


def test_ignored_trl_keys_are_reported(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"use_vllm": True, "report_to": "none", "sync_ref_model": False}))
    assert sorted(run_config_tool("--config", str(path))["ignored"]) == ["report_to", "sync_ref_model", "use_vllm"]


def trl_table():
    proc = subprocess.run([tool("trainer_config_tool"), "--keys"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("cls", [GRPOConfig, SFTConfig], ids=lambda c: c.__name__)
def test_every_trl_field_has_a_fate(tmp_path, cls):
    """Each field of TRL's dataclass is a tandem option or has a row in the TRL key table; each "only values" row
    accepts TRL's own default, as the installed TRL writes it."""
    table = trl_table()
    options, trl = set(table["options"]), table["trl"]
    assert not options & set(trl), f"keys both options and TRL table rows: {sorted(options & set(trl))}"
    written = json.loads(cls(output_dir=str(tmp_path), use_cpu=True, bf16=False).to_json_string())
    for field in dataclasses.fields(cls):
        name = field.name
        assert name in options or name in trl, (
            f"TRL {cls.__name__}.{name} (written as {written.get(name)!r}) has no "
            f"fate in tandem: add a row to trainer/train_config_trl.c (no effect: any value; or only the values "
            f"tandem implements, with why / what to do) or implement it as an option in train_config_table.c")
        row = trl.get(name)
        if row and row["fate"] == "only values" and name in written:
            assert any(v == written[name] for v in row["values"]), (
                f"{cls.__name__}.{name}: TRL's default {written[name]!r} is not among the values tandem accepts "
                f"{row['values']!r}")
        assert row is None or row["why"], name


def test_no_stale_trl_rows():
    """Every row of tandem's TRL key table is a field of GRPOConfig or SFTConfig (a key TRL dropped goes too)."""
    fields = {f.name for cls in (GRPOConfig, SFTConfig) for f in dataclasses.fields(cls)}
    stale = sorted(set(trl_table()["trl"]) - fields)
    assert not stale, f"rows of trainer/train_config_trl.c that no TRL config has: {stale}"

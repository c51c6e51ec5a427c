"""TRL config dumps, as the installed TRL writes them (`GRPOConfig(...).to_json_string()`, `SFTConfig(...)`), given
to `tandem-train --config` whole:

- SFTConfig at its defaults and with non-default SFT settings (max_length, truncation_mode, completion_only_loss,
  dataset_text_field) trains for real on a tiny model (one CPU process, seconds), and the accepted TRL keys are
  listed once, in one start-up line;
- GRPOConfig at its defaults and with non-default settings gets through every configuration check: the run stops
  at its earliest later failure point (the model folder, given as one that does not exist), not at a key;
- a dump with several unsupported settings is refused in one run that names every one of them, with what to do;
- the values reach the configuration TRL's way (trainer_config_tool prints what tandem read).
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import build_tiny_model  # noqa: E402
from test_train_grpo import BUILD, train_binary  # noqa: E402
from test_train_sft_resume import write_sft  # noqa: E402

trl = pytest.importorskip("trl")
from trl import GRPOConfig, SFTConfig  # noqa: E402

CONTRACT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# A CPU machine: TRL's own default bf16=True refuses to build a config without a GPU.
CPU = dict(use_cpu=True, bf16=False)


def dump(path, config):
    path.write_text(config.to_json_string())
    return path


def run(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    p = subprocess.run([train_binary(), *args], capture_output=True, text=True, timeout=timeout, env=env)
    return p.returncode, p.stderr


def accepted_line(log):
    lines = [x for x in log.splitlines() if "TRL key(s) accepted with no effect" in x]
    assert len(lines) == 1, log
    return lines[0].split(": ", 3)[-1].split(", ")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("trlcfg")
    build_tiny_model(d / "model")
    write_sft(d / "train.jsonl")
    with open(d / "lm.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"body": f"text number {i} of the corpus"}) + "\n")
    return d


def test_sft_dumps_train(setup):
    d = setup
    default = dump(d / "sft_default.json", SFTConfig(output_dir=str(d / "sft-out"), **CPU))
    custom = dump(d / "sft_custom.json", SFTConfig(
        output_dir=str(d / "sft-out2"), max_length=12, truncation_mode="keep_end", completion_only_loss=False,
        dataset_text_field="body", learning_rate=1e-3, per_device_train_batch_size=2, max_steps=2, logging_steps=1,
        save_strategy="steps", save_steps=2, seed=3, data_seed=4, save_total_limit=1, report_to="none", **CPU))
    for cfg, data in ((default, d / "train.jsonl"), (custom, d / "lm.jsonl")):
        code, log = run("--config", str(cfg), "--mode", "sft", "--model", str(d / "model"), "--train-file", str(data),
                        "--max-steps", "2", "--device", "cpu")
        assert code == 0, log
        keys = accepted_line(log)
        # Keys TRL writes at values tandem implements or that drive only TRL's machinery, listed once.
        assert {"report_to", "packing", "eos_token", "hub_token", "use_cpu"} <= set(keys), keys
        assert len(keys) == len(set(keys))
        out = pathlib.Path(json.loads(cfg.read_text())["output_dir"])
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert rows and rows[-1]["step"] == 2 and all(r["loss"] > 0 for r in rows)


@pytest.mark.parametrize("strategy,checkpoints", [("epoch", ["checkpoint-10", "checkpoint-8"]),
                                                  ("no", ["checkpoint-10"])])
def test_save_strategy_and_logging_first_step(setup, tmp_path, strategy, checkpoints):
    """16 rows, 2 a step: an epoch is 8 steps. save_strategy epoch saves at its end (and the final step), no saves
    only the final step; logging_first_step adds step 1 to every logging_steps'."""
    d = setup
    out = tmp_path / "out"
    cfg = dump(tmp_path / "sft.json", SFTConfig(
        output_dir=str(out), save_strategy=strategy, logging_steps=5, logging_first_step=True, max_steps=10,
        per_device_train_batch_size=2, learning_rate=1e-3, dataset_text_field="body", report_to="none", **CPU))
    code, log = run("--config", str(cfg), "--mode", "sft", "--model", str(d / "model"), "--train-file",
                    str(d / "lm.jsonl"), "--device", "cpu")
    assert code == 0, log
    assert sorted(p.name for p in out.glob("checkpoint-*")) == checkpoints
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 5, 10]
    assert [r["epoch"] for r in rows] == [1 / 8, 5 / 8, 10 / 8]


def test_grpo_dumps_pass_every_check(setup, tmp_path):
    d = setup
    configs = [
        GRPOConfig(output_dir=str(tmp_path / "g0"), **CPU),
        GRPOConfig(output_dir=str(tmp_path / "g1"), learning_rate=5e-7, num_generations=4,
                   per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=2,
                   max_completion_length=64, beta=0.04, epsilon_high=0.28, loss_type="grpo", scale_rewards="batch",
                   importance_sampling_level="sequence", lr_scheduler_type="cosine", warmup_steps=0.1, max_steps=20,
                   min_p=0.05, data_seed=7, save_total_limit=2, report_to="none", use_vllm=True, vllm_mode="server",
                   model_init_kwargs={"torch_dtype": "bfloat16"}, mask_truncated_completions=True, **CPU),
    ]
    for i, config in enumerate(configs):
        cfg = dump(tmp_path / f"grpo{i}.json", config)
        missing = tmp_path / "no-such-model"
        code, log = run("--config", str(cfg), "--model", str(missing), "--train-file", str(d / "train.jsonl"),
                        "--rollout-servers", "tcp://127.0.0.1:9", "--rewards", "think_format", "--device", "cpu")
        assert code == 1, log  # a run that started and failed, not a refused configuration (2)
        assert str(missing) in log.splitlines()[-1], log
        keys = accepted_line(log)
        assert {"use_vllm", "vllm_mode", "report_to", "hub_token", "accelerator_config"} <= set(keys), keys


def test_unsupported_settings_are_refused_in_one_run(setup, tmp_path):
    d = setup
    config = json.loads(GRPOConfig(output_dir=str(tmp_path / "g"), report_to=["wandb"], logging_strategy="epoch",
                                   learning_rate=-1.0, **CPU).to_json_string())
    config["num_generation"] = 4    # a typo
    config["save_strategy"] = "best"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    code, log = run("--config", str(path), "--model", str(d / "model"), "--train-file", str(d / "train.jsonl"),
                    "--rollout-servers", "tcp://127.0.0.1:9", "--rewards", "think_format", timeout=30)
    assert code == 2, log
    for needle in ('save_strategy: "best" keeps the checkpoint with the best evaluation metric',
                   'report_to: ["wandb"] is not supported by tandem', "metrics.jsonl",
                   'logging_strategy: "epoch" is not supported', "unknown key 'num_generation' (did you mean "
                   "'num_generations'?)", "learning_rate: must be >= 0"):
        assert needle in log, (needle, log)


def test_values_read_as_trl_means_them(tmp_path):
    tool = BUILD / "tests" / "trainer_config_tool"
    if not tool.exists():
        pytest.skip(f"{tool} is not built")
    config = GRPOConfig(output_dir=str(tmp_path / "g"), per_device_train_batch_size=4, steps_per_generation=4,
                        num_generations=4, min_p=None, data_seed=None, save_total_limit=None, **CPU)
    path = dump(tmp_path / "g.json", config)
    base = [str(tool), "--model", "/m", "--train-file", "/d", "--rollout-servers", "tcp://h:1", "--rewards",
            "think_format", "--config", str(path)]
    p = subprocess.run([base[0], "--world-size", "1", *base[1:]], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    # The pair GRPOConfig derived (generation_batch_size 16 = 4 x 1 process x 4) agrees for one rank.
    assert (got["resolved"]["generation_batch_size"], got["resolved"]["steps_per_generation"]) == \
        (config.generation_batch_size, config.steps_per_generation) == (16, 4)
    assert got["config"]["min_p"] == 0 and got["config"]["data_seed"] == -1 and got["config"]["save_total_limit"] == 0
    # Over two ranks the same pair disagrees: refused, saying for how many ranks TRL derived it.
    p = subprocess.run([base[0], "--world-size", "2", *base[1:]], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "derived for 1 rank(s)" in p.stderr and "give only one of them" in p.stderr

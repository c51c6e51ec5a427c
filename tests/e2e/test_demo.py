"""`tandem-train demo` end to end.

- The full default run (CPU, 2 threads; 2-digit a + b, every number least significant digit first): held-out accuracy before GRPO below 50 %, after above 90 %, GRPO stopped by
  its validation rule (validation accuracy at least 95 % at two evaluations in a row), not by the step cap; the
  summary, metrics.jsonl and the SVG plot (both series, one reward point per GRPO step, one accuracy point per
  evaluation) are written. It takes about 5-10 minutes on 2 cores (bench/notes/demo.md, "The demo's spread").
- The stopping rule: a target of 0 stops GRPO at the first evaluation.
- A small configuration that runs every phase in seconds (the plumbing, without the accuracy target), twice in the
  same folder (the second run replaces the first one's files).
- The model folder the demo makes loads in Hugging Face tokenizers and transformers.
- --help lists every option with its default; an unknown option is refused.
"""
import json
import subprocess
import time
import xml.etree.ElementTree as ET

import pytest

import server_fixtures

SVG = "{http://www.w3.org/2000/svg}"
SMALL = ["--train-size", 500, "--heldout-size", 20, "--validation-size", 20, "--sft-size", 500, "--sft-min-steps", 10,
         "--sft-check-every", 10, "--sft-max-steps", 20, "--prompts-per-step", 8, "--eval-every", 2]


def demo_binary():
    path = server_fixtures.BUILD / "bin" / "tandem-train"
    if not path.exists() or not (server_fixtures.BUILD / "bin" / "tandem-serve").exists():
        pytest.skip(f"{path} or tandem-serve is not built (run scripts/test.sh, or set TANDEM_BUILD_DIR)")
    return str(path)


def run_demo(out, *extra, timeout=900):
    args = [demo_binary(), "demo", "--output-dir", str(out), "--device", "cpu", "--threads", "2", *map(str, extra)]
    t0 = time.time()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc, time.time() - t0


def check_outputs(out, summary):
    """metrics.jsonl has every GRPO step; the SVG parses and holds both series with the right point counts."""
    steps = summary["grpo"]["steps"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(0.0 <= r["reward"] <= 1.0 for r in rows)
    assert len(summary["reward_per_step"]) == steps
    root = ET.parse(out / "demo.svg").getroot()
    assert root.tag == SVG + "svg"
    lines = {p.get("id"): p.get("points").split() for p in root.iter(SVG + "polyline")}
    assert len(lines["reward"]) == steps, lines.keys()
    assert len(lines["accuracy"]) == len(summary["evaluations"])
    for pts in lines.values():
        for p in pts:
            x, y = map(float, p.split(","))
            assert 0 <= x <= float(root.get("width")) and 0 <= y <= float(root.get("height"))
    markers = [c for c in root.iter(SVG + "circle") if c.find(SVG + "title") is not None]
    assert len(markers) == len(summary["evaluations"])
    text = " ".join(t.text or "" for t in root.iter(SVG + "text"))
    for label in ("GRPO step", "mean reward", "held-out accuracy"):
        assert label in text, text


def test_full_demo_reaches_the_accuracy_target(tmp_path):
    out = tmp_path / "demo"
    proc, wall = run_demo(out, timeout=2700)  # up to 600 GRPO steps: the cap, far past the measured 100-200
    summary = json.loads((out / "demo_summary.json").read_text())
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    print(f"demo: held-out accuracy {before:.3f} -> {after:.3f} in {wall:.0f} s")
    assert before < 0.5, summary["evaluations"]
    assert after > 0.9, summary["evaluations"]
    assert summary["well_formed_before"] > 0.95  # the warm-up taught the answer format (the sum's exact width)
    # answer_match compares numbers; the figure is the exact-string one: recount the last held-out evaluation.
    answers = [json.loads(line)["answer"] for line in (out / "data" / "heldout.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (out / "eval" / f"step-{summary['grpo']['steps']:04d}.jsonl").read_text().splitlines()]
    exact = sum(r["completions"][0] == answers[r["row"] - 1] for r in rows) / len(answers)
    assert exact == pytest.approx(after), (exact, after)
    assert summary["evaluations"][0]["step"] == 0 and summary["evaluations"][-1]["step"] == summary["grpo"]["steps"]
    # The margin comes from the rule, not from luck: GRPO ran until validation accuracy held the target twice.
    assert summary["grpo"]["stopped_by"] == "validation target reached", summary["evaluations"]
    assert all(e["validation_accuracy"] >= 0.95 for e in summary["evaluations"][-2:]), summary["evaluations"]
    assert summary["sft"]["checks"][-1]["validation_accuracy"] >= summary["sft"]["target_validation_accuracy"]
    check_outputs(out, summary)
    # The last line is the one-line summary.
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("held-out accuracy ") and "(cpu, 2 threads)" in last, last
    # The GRPO checkpoint is a model folder tandem-serve loads: config, weights, tokenizer.
    ckpt = out / f"checkpoint-{summary['grpo']['steps']}"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (ckpt / name).exists(), name


def test_small_configuration_runs_every_phase(tmp_path):
    out = tmp_path / "demo"
    proc, _ = run_demo(out, *SMALL, "--grpo-steps", 4, timeout=300)
    summary = json.loads((out / "demo_summary.json").read_text())
    assert [e["step"] for e in summary["evaluations"]] == [0, 2, 4]
    assert summary["sft"]["steps"] in (10, 20)
    check_outputs(out, summary)
    data = {name: [json.loads(line) for line in (out / "data" / name).read_text().splitlines()]
            for name in ("train.jsonl", "validation.jsonl", "heldout.jsonl", "sft.jsonl")}
    assert [len(data[n]) for n in ("train.jsonl", "validation.jsonl", "heldout.jsonl")] == [500, 20, 20]
    prompts = [set(r["prompt"] for r in data[n]) for n in ("train.jsonl", "validation.jsonl", "heldout.jsonl")]
    assert not (prompts[0] & prompts[1]) and not (prompts[0] & prompts[2]) and not (prompts[1] & prompts[2])
    # Every number least significant digit first, zero-padded: "21+43=" is 12 + 34, its answer "460" is 064.
    def lsd_first(text):
        return int(text[::-1])

    for r in data["heldout.jsonl"] + data["validation.jsonl"] + data["train.jsonl"]:
        a, b = map(lsd_first, r["prompt"].rstrip("=").split("+"))
        assert len(r["prompt"]) == 6 and 10 <= a <= 99 and 10 <= b <= 99, r
        assert isinstance(r["answer"], str) and len(r["answer"]) == 3 and lsd_first(r["answer"]) == a + b, r
    for r in data["sft.jsonl"]:
        a, b = map(lsd_first, r["prompt"].rstrip("=").split("+"))
        assert lsd_first(r["completion"]) == a + b and len(r["completion"]) == 3, r
    assert "held-out accuracy" in proc.stdout
    # A second run in the same folder replaces the first one's files (metrics.jsonl is not appended to).
    run_demo(out, *SMALL, "--grpo-steps", 2, timeout=300)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_the_validation_rule_stops_grpo(tmp_path):
    """A target every evaluation meets stops GRPO at the first evaluation after step 0; above 1, never."""
    out = tmp_path / "demo"
    run_demo(out, *SMALL, "--grpo-steps", 6, "--stop-accuracy", 0, "--stop-patience", 1, timeout=300)
    summary = json.loads((out / "demo_summary.json").read_text())
    assert [e["step"] for e in summary["evaluations"]] == [0, 2]
    assert summary["grpo"]["steps"] == 2 and summary["grpo"]["max_steps"] == 6
    assert summary["grpo"]["stopped_by"] == "validation target reached"
    assert all(0 <= e["validation_accuracy"] <= 1 for e in summary["evaluations"])
    check_outputs(out, summary)
    run_demo(out, *SMALL, "--grpo-steps", 4, "--stop-accuracy", 1.5, timeout=300)
    summary = json.loads((out / "demo_summary.json").read_text())
    assert [e["step"] for e in summary["evaluations"]] == [0, 2, 4]
    assert summary["grpo"]["stopped_by"] == "step cap (--grpo-steps)"


def test_a_foreign_folder_is_refused(tmp_path):
    (tmp_path / "precious.txt").write_text("not a demo")
    proc = subprocess.run([demo_binary(), "demo", "--output-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "holds no earlier demo" in proc.stderr
    assert (tmp_path / "precious.txt").read_text() == "not a demo"


def test_the_model_folder_loads_in_hf_tokenizers_and_transformers(tmp_path):
    """The tokenizer and model the demo makes are ordinary Hugging Face files."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "demo"
    run_demo(out, *SMALL, "--grpo-steps", 1, "--eval-every", 1, timeout=300)
    tok = tokenizers.Tokenizer.from_file(str(out / "model" / "tokenizer.json"))
    enc = tok.encode("347+885=1232<eos>")
    assert enc.tokens == list("347+885=1232") + ["<eos>"]
    assert tok.decode(enc.ids) == "347+885=1232"
    hf = transformers.AutoTokenizer.from_pretrained(str(out / "model"))
    assert hf.eos_token == "<eos>" and hf("12+3=").input_ids == tok.encode("12+3=").ids
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out / "model"))
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == tok.get_vocab_size()


def test_help_lists_every_option_with_its_default():
    proc = subprocess.run([demo_binary(), "demo", "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    # One entry per option: its line and the continuation lines (a long help wraps, indented past the flags).
    entries = []
    for line in proc.stdout.splitlines():
        if line.startswith("  --"):
            entries.append(line)
        elif entries and line.startswith(" " * 31) and line.strip():
            entries[-1] += " " + line.strip()
    options = [e.split()[0] for e in entries]
    for flag in ("--output-dir", "--device", "--seed", "--grpo-steps", "--sft-target"):
        assert flag in options
    for entry in entries:
        if not entry.startswith(("  --help", "  --version")):
            assert "(default " in entry, entry
    bad = subprocess.run([demo_binary(), "demo", "--grpo-stepz", "3"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown option --grpo-stepz" in bad.stderr
    short = subprocess.run([demo_binary(), "demo", "-h"], capture_output=True, text=True, timeout=30)
    assert short.returncode == 0 and short.stdout == proc.stdout
    version = subprocess.run([demo_binary(), "demo", "--version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and version.stdout.startswith("tandem-train demo 0.")

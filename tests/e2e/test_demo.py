"""`tandem-train demo` end to end on a small configuration: every phase runs (model and tokenizer made by tandem,
SFT warm-up, held-out accuracy over HTTP, GRPO against a rollout server with weight pushes, evaluations along the
way), and it writes what it promises — metrics.jsonl, demo_summary.json, demo.svg with both series. The accuracy
target of the full default run (< 50 % -> > 90 % in 5 minutes on 2 cores) is a benchmark, measured in
bench/NOTES.md, not asserted here: a full run takes minutes."""
import json
import subprocess
import xml.etree.ElementTree as ET

import server_fixtures


def test_demo_small_configuration_runs_every_phase(tmp_path):
    out = tmp_path / "demo"
    args = [str(server_fixtures.BUILD / "bin" / "tandem-train"), "demo", "--output-dir", str(out), "--device", "cpu",
            "--threads", "2", "--train-size", "500", "--heldout-size", "20", "--validation-size", "20",
            "--sft-size", "500", "--sft-min-steps", "10", "--sft-check-every", "10", "--sft-max-steps", "20",
            "--grpo-steps", "4", "--prompts-per-step", "8", "--eval-every", "2"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "demo_summary.json").read_text())
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert [e["step"] for e in summary["evaluations"]] == [0, 2, 4]
    assert len(summary["reward_per_step"]) == 4
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r][-4:] == [1, 2, 3, 4]
    svg = ET.parse(out / "demo.svg").getroot()
    text = " ".join(t.text or "" for t in svg.iter() if t.tag.endswith("text"))
    assert "reward" in text.lower() and "accuracy" in text.lower(), text
    assert "held-out accuracy" in (proc.stdout + proc.stderr)


def test_demo_help_lists_every_option_with_its_default():
    proc = subprocess.run([str(server_fixtures.BUILD / "bin" / "tandem-train"), "demo", "--help"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0
    text = proc.stdout + proc.stderr
    for flag in ("--output-dir", "--device", "--seed", "--grpo-steps", "--sft-target"):
        assert flag in text
    assert text.count("(default") >= 20

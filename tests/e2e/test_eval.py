"""`tandem-train eval` against a real tandem-serve: the figures equal what the test computes itself from the same
greedy completions (fetched with the same requests), pass@k follows the unbiased estimator, and chat-message rows
go through /v1/chat/completions; --api-key (or OPENAI_API_KEY) reaches a server that requires one."""
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import BUILD, TandemServer, http_json, tiny_model_dir  # noqa: E402,F401


def run_eval(args, env_extra=None):
    exe = (BUILD / "bin" / "tandem-train").resolve()
    if not exe.exists():
        pytest.skip(f"{exe} is not built")
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}  # the key's fallback; tests set it
    env.update(env_extra or {})
    p = subprocess.run([str(exe), "eval", *args], capture_output=True, text=True, timeout=300, env=env)
    return p.returncode, p.stdout, p.stderr


def test_eval_matches_direct_scoring(tiny_model_dir, tmp_path):
    rows = [{"prompt": f"numbers plus {i} equals", "answer": str(i)} for i in range(6)]
    rows += [{"prompt": [{"role": "user", "content": "seven wizards"}], "answer": "7"}]
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with TandemServer(tiny_model_dir) as srv:
        code, out, err = run_eval(["--url", srv.url, "--data", str(data), "--rewards", "regex_format,answer_match",
                                   "--format-regex", "[0-9]", "--format-regex-mode", "search", "--max-tokens", "12",
                                   "--output", str(tmp_path / "res.jsonl")])
        assert code == 0, out + err
        summary = json.loads(out.strip().splitlines()[-1])
        # The same greedy requests, scored here.
        regex_hits = []
        for r in rows:
            if isinstance(r["prompt"], str):
                st, ans, _ = http_json("POST", srv.url + "/v1/completions",
                                       {"prompt": r["prompt"], "max_tokens": 12, "temperature": 0})
                text = ans["choices"][0]["text"]
            else:
                st, ans, _ = http_json("POST", srv.url + "/v1/chat/completions",
                                       {"messages": r["prompt"], "max_tokens": 12, "temperature": 0})
                text = ans["choices"][0]["message"]["content"]
            assert st == 200, ans
            regex_hits.append(1.0 if re.search("[0-9]", text) else 0.0)
    assert summary["rows"] == 7 and summary["failed_rows"] == 0
    assert summary["rewards/regex_format/mean"] == pytest.approx(sum(regex_hits) / 7)
    assert summary["pass@1"] == pytest.approx(sum(regex_hits) / 7)  # pass@1 of the first reward, n = 1
    assert 0.0 <= summary["rewards/answer_match/mean"] <= 1.0
    res = [json.loads(x) for x in (tmp_path / "res.jsonl").read_text().splitlines()]
    assert len(res) == 7 and all(len(r["completions"]) == 1 for r in res)


def test_pass_at_k_estimator(tiny_model_dir, tmp_path):
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"think step {i}"}) + "\n" for i in range(4)))
    with TandemServer(tiny_model_dir) as srv:
        code, out, err = run_eval(["--url", srv.url, "--data", str(data), "--rewards", "regex_format",
                                   "--format-regex", "[0-9]", "--format-regex-mode", "search", "--n", "5", "--k", "2",
                                   "--temperature", "1.0", "--max-tokens", "8", "--output", str(tmp_path / "r.jsonl")])
    assert code == 0, out + err
    summary = json.loads(out.strip().splitlines()[-1])
    want = 0.0
    for r in map(json.loads, (tmp_path / "r.jsonl").read_text().splitlines()):
        c = sum(s["regex_format"] >= 1 for s in r["scores"])
        want += 1.0 if 5 - c < 2 else 1.0 - math.comb(5 - c, 2) / math.comb(5, 2)
    assert summary["pass@2"] == pytest.approx(want / 4)


def test_eval_bad_input(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "no prompt here"}\n')
    code, out, err = run_eval(["--url", "http://127.0.0.1:9", "--data", str(data)])
    assert code == 1 and "bad.jsonl:1" in err
    code, out, err = run_eval(["--url", "http://127.0.0.1:9", "--data", str(data), "--n", "2", "--k", "3"])
    assert code == 2 and "k <= n" in err
    # Every valid JSON number is read: a column beyond int64 is no error (the row reaches the missing server).
    big = tmp_path / "big.jsonl"
    big.write_text('{"prompt": "p", "id": 100000000000000000000, "w": 1e400}\n')
    code, out, err = run_eval(["--url", "http://127.0.0.1:9", "--data", str(big)])
    assert code == 1 and "cannot connect" in err and "big.jsonl:1" not in err, err


def test_eval_api_key(tiny_model_dir, tmp_path):
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"numbers plus {i}", "answer": str(i)}) + "\n" for i in range(3)))
    base = ["--data", str(data), "--max-tokens", "4"]
    with TandemServer(tiny_model_dir, "--api-key", "sekret-42") as srv:
        code, out, err = run_eval(["--url", srv.url, *base])
        assert code == 1 and "answered 401" in err and "3 of 3 rows failed" in err, out + err
        code, out, err = run_eval(["--url", srv.url, *base, "--api-key", "wrong"])
        assert code == 1 and "answered 401" in err, out + err
        code, out, err = run_eval(["--url", srv.url, *base, "--api-key", "sekret-42"])
        assert code == 0, out + err
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["rows"] == 3 and summary["failed_rows"] == 0
        code, out, err = run_eval(["--url", srv.url, *base], {"OPENAI_API_KEY": "sekret-42"})
        assert code == 0, out + err
        # The flag wins over the environment.
        code, out, err = run_eval(["--url", srv.url, *base, "--api-key", "wrong"], {"OPENAI_API_KEY": "sekret-42"})
        assert code == 1 and "answered 401" in err, out + err
    code, out, err = run_eval(["--url", "http://127.0.0.1:9", *base, "--api-key", "two\r\nX-Injected: 1"])
    assert code == 2 and "control character" in err


def test_eval_seed_makes_sampling_reproducible(tiny_model_dir, tmp_path):
    """--seed reaches the server's sampling: at temperature 1 the same seed gives the same completions (whatever
    the concurrency), another seed other ones. Row r asks for seed + r * n, so rows with the same prompt differ."""
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"prompt": "the quick brown fox"}) + "\n" for _ in range(4)))

    def completions(srv, seed, concurrency):
        out = tmp_path / f"seed{seed}-c{concurrency}.jsonl"
        code, stdout, err = run_eval(["--url", srv.url, "--data", str(data), "--rewards", "think_format", "--n", "2",
                                      "--temperature", "1.0", "--max-tokens", "8", "--seed", str(seed),
                                      "--concurrency", str(concurrency), "--output", str(out)])
        assert code == 0, stdout + err
        return [r["completions"] for r in sorted(map(json.loads, out.read_text().splitlines()), key=lambda r: r["row"])]

    with TandemServer(tiny_model_dir) as srv:
        a = completions(srv, 5, 4)
        b = completions(srv, 5, 1)
        c = completions(srv, 6, 4)
    assert a == b
    assert a != c
    flat = [t for row in a for t in row]
    assert len(set(flat)) > 1, flat  # one prompt four times: the rows' seeds differ
    code, out, err = run_eval(["--url", "http://127.0.0.1:9", "--data", str(data), "--seed", "-1"])
    assert code == 2 and "--seed -1 is out of range" in err


def test_eval_reports_each_error_once_and_writes_no_empty_output(tmp_path):
    """A server that is not there fails every row with the same message: it is printed once with the number of
    rows, and --output is not written (an empty file would look like a result)."""
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q {i}", "answer": "1"}) + "\n" for i in range(40)))
    out = tmp_path / "res.jsonl"
    code, stdout, err = run_eval(["--url", "http://127.0.0.1:9", "--data", str(data), "--output", str(out)])
    assert code == 1
    refused = [line for line in err.splitlines() if "cannot connect" in line]
    assert len(refused) == 1, err
    assert refused[0].startswith("tandem-train eval: 40 rows failed (rows 1, 2, 3, 4, 5, ...): "), err
    assert "40 of 40 rows failed" in err and "nothing was scored" in err
    assert not out.exists() and f"--output {out} was not written" in err
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["failed_rows"] == 40 and summary["pass@1"] is None


def test_eval_output_holds_the_rows_scored(tiny_model_dir, tmp_path):
    """Rows the server refuses (a prompt longer than the model's context) are reported and left out; the other rows
    are scored and written."""
    rows = [{"prompt": f"numbers plus {i} equals", "answer": str(i)} for i in range(5)]
    rows[2] = {"prompt": "seven wizards " * 3000, "answer": "7"}
    rows[4] = {"prompt": "lazy dog " * 3000, "answer": "7"}
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "res.jsonl"
    with TandemServer(tiny_model_dir) as srv:
        code, stdout, err = run_eval(["--url", srv.url, "--data", str(data), "--max-tokens", "4", "--output", str(out)])
    assert code == 1, stdout + err
    assert "2 of 5 rows failed" in err and "the figures cover the 3 rows scored" in err, err
    assert "answered 400" in err, err
    assert [r["row"] for r in map(json.loads, out.read_text().splitlines())] == [1, 2, 4]

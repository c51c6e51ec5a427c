"""Streaming groups (issue 24) end to end on the CPU: a round's groups are decoded and scored as they come back from
the rollout server, built-ins and the reward service (--reward-url) alike, while the server still generates the
round's other groups. The toy task of test_train_grpo.py, with a reward service beside the built-in regex_format.

* The reward service is slow per call and the server decodes one group at a time (--max-num-seqs = G), long
  completions: the first group of every round is scored by a call made while the others are still generating (a
  call of fewer completions than the round, reward_overlap_time about one call's delay), and the step's *_time
  fields still add up.
* With four micro-batches of one group each per round, the first micro-batch's old and reference logprobs and its
  micro-step run while the server still generates the round's later groups.
* The only rollout server is killed while the first round comes back (from the reward service's first call, so
  some groups are in) and started again on its endpoint: the trainer keeps the groups it has, sends the others
  again, and the run is the uninterrupted run, bit for bit.
* The scores are per completion, the old / reference logprobs of a micro-batch do not depend on when they are
  computed, and a micro-step run early sees the numbers it would see later (only where the options make that so),
  so the run is the same run as the build before streaming (TANDEM_BASELINE_BUILD_DIR: one service call per round
  there, everything after the whole round), two ranks, four micro-batches a round, for several option sets: every
  metric the baseline logs and every checkpoint, bit for bit.
"""
import contextlib
import json
import os
import pathlib
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import TandemServer, build_tiny_model, free_port  # noqa: E402
from test_train_grpo import _differing_keys, assert_same_run_as_baseline, _metric_rows, grpo_args, launch, write_dataset  # noqa: E402
from test_train_grpo_async import PHASES  # noqa: E402

G = 8


class RewardService:
    """An HTTP reward service that takes `delay` seconds per call: 1.0 for a completion with a digit, else 0.5 when it
    has a space, else 0. Records each call's (start, end, number of completions)."""

    def __init__(self, delay, on_first_call=None):
        self.delay, self.calls, self.lock, self.on_first_call = delay, [], threading.Lock(), on_first_call
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                start = time.time()
                batch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service.lock:
                    first, service.on_first_call = service.on_first_call, None
                if first:
                    first()
                time.sleep(service.delay)
                scores = [1.0 if re.search("[0-9]", s["completion"]) else 0.5 if " " in s["completion"] else 0.0
                          for s in batch]
                body = json.dumps({"scores": scores}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                with service.lock:
                    service.calls.append((start, time.time(), len(batch)))

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo_stream")
    model_dir = d / "model"
    build_tiny_model(model_dir)
    data = d / "train.jsonl"
    write_dataset(data)
    return d, model_dir, data


def run(setup, tag, steps, world, extra, server_args=(), delay=0.0, binary=None):
    d, model_dir, data = setup
    out_dir = d / tag
    control = f"tcp://127.0.0.1:{free_port()}"
    with contextlib.ExitStack() as stack:
        stack.enter_context(TandemServer(model_dir, "--control", control, *server_args))
        service = stack.enter_context(RewardService(delay))
        args = grpo_args(model_dir, data, out_dir, control, steps=steps, extra=[*extra, "--reward-url", service.url])
        procs = launch(args, world, free_port(), d, binary=binary)
        codes = [p.wait(timeout=600) for p, _ in procs]
        for _, log in procs:
            log.close()
    logs = "".join((d / f"rank{r}.log").read_text()[-3000:] for r in range(world))
    assert codes == [0] * world, logs
    return out_dir, _metric_rows(out_dir), sorted(service.calls)


def test_groups_are_scored_while_the_round_still_generates(setup):
    # 4 prompts a round; the server decodes one group of 8 at a time, completions of up to 400 tokens (tens of ms a
    # group even for the tiny model), and the service takes 0.4 s a call.
    delay, steps, prompts = 0.4, 3, 4
    out, rows, calls = run(setup, "overlap", steps, 1, ["--per-device-train-batch-size", str(prompts * G),
                                                        "--max-completion-length", "400"],
                           server_args=("--max-num-seqs", str(G)), delay=delay)
    assert sorted(rows) == list(range(1, steps + 1))
    # Every completion scored once, in calls of whole groups; a round's first call is a part of the round.
    assert sum(n for _, _, n in calls) == steps * prompts * G, calls
    assert all(n % G == 0 for _, _, n in calls), calls
    assert len(calls) > steps and min(n for _, _, n in calls) < prompts * G, calls
    for step, row in rows.items():
        # At least one call ran while groups of the round were still generating (the first group's).
        assert row["reward_overlap_time"] >= 0.8 * delay, (step, row["reward_overlap_time"])
        assert row["reward_time"] >= row["reward_overlap_time"], row
        assert row["rewards_phase_time"] >= row["reward_overlap_time"], row
        assert abs(sum(row[k] for k in PHASES) - row["step_wall_time"]) < 1e-6, row
        assert "rewards/reward_service/mean" in row and "rewards/regex_format/mean" in row


def test_micro_batches_start_while_the_round_still_generates(setup):
    # 4 micro-batches of one group each per round, the server decoding one group at a time, completions of up to 400
    # tokens: once the first group is in, its old and reference logprobs and its micro-step run while the others
    # generate.
    steps = 3
    out, rows, _ = run(setup, "early-micro-steps", steps, 1,
                       ["--per-device-train-batch-size", str(G), "--gradient-accumulation-steps", "4", "--beta", "0.04",
                        "--max-completion-length", "400"], server_args=("--max-num-seqs", str(G)))
    assert sorted(rows) == list(range(1, steps + 1))
    # Whether a given step overlaps depends on the scheduler (on a loaded machine the server can finish every group
    # before the trainer first looks); a build that does not stream never overlaps, in any step.
    overlapped = [s for s, row in rows.items() if row["logps_overlap_time"] > 0 and row["train_overlap_time"] > 0]
    assert overlapped, rows
    for step, row in rows.items():
        assert row["old_logps_time"] + row["ref_logps_time"] >= row["logps_overlap_time"], row
        assert row["forward_backward_time"] >= row["train_overlap_time"], row
        assert abs(sum(row[k] for k in PHASES) - row["step_wall_time"]) < 1e-6, row


# Options beside 4 micro-batches of one group each per round (one optimizer step), and whether micro-steps may start
# before the round is in: the grpo loss with a reference model; bnpo with two iterations over the round and the
# entropy quantile (a collective inside each micro-step); dapo (num_items_in_batch: the whole round) with
# scale_rewards batch, which only stream rewards and logprobs; asynchronous rounds (one sent ahead, the servers'
# weights held still so that both builds sample the same completions).
VARIANTS = {
    "grpo-beta": (["--beta", "0.04"], True),
    "grpo-ahead": (["--max-staleness", "1", "--weight-sync-steps", "100"], True),
    "bnpo-iterations-entropy": (["--loss-type", "bnpo", "--num-iterations", "2", "--top-entropy-quantile", "0.5"],
                                True),
    "dapo-batch": (["--loss-type", "dapo", "--scale-rewards", "batch", "--beta", "0.04"], False),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_streaming_is_the_baseline_build(setup, variant):
    """The old and reference logprobs of a micro-batch are computed once both ranks hold its group, and (where the
    options allow) its micro-step runs, while later groups generate: the run is still the baseline's."""
    base = os.environ.get("TANDEM_BASELINE_BUILD_DIR")
    if not base:
        pytest.skip("set TANDEM_BASELINE_BUILD_DIR to a build of the commit before streaming groups")
    options, early_micro_steps = VARIANTS[variant]
    extra = ["--save-steps", "2", "--per-device-train-batch-size", str(G), "--gradient-accumulation-steps", "4",
             "--max-completion-length", "200", *options]
    binary = str(pathlib.Path(base) / "bin" / "tandem-train")
    server = ("--max-num-seqs", str(G))
    out_b, rows_b, calls_b = run(setup, f"baseline-{variant}", 4, 2, extra, server_args=server, binary=binary)
    out_s, rows_s, calls_s = run(setup, f"streaming-{variant}", 4, 2, extra, server_args=server)
    # The baseline scores a round in one call per rank; streaming in calls of the groups that came back together.
    assert calls_b and all(n == 4 * G for _, _, n in calls_b), calls_b
    assert len(calls_s) > len(calls_b), calls_s
    assert sorted(rows_b) == sorted(rows_s) == [1, 2, 3, 4]
    # How much overlaps depends on timing (test_micro_batches_start_while_the_round_still_generates shows it); which
    # options let micro-steps start early does not.
    if not early_micro_steps:
        assert all(rows_s[s]["train_overlap_time"] == 0 for s in rows_s), rows_s
    assert_same_run_as_baseline(out_b, rows_b, out_s, rows_s, ("checkpoint-2", "checkpoint-4"),
                                micro_steps_per_step=4)


def test_a_server_lost_mid_round_keeps_the_groups_in(setup):
    d, model_dir, data = setup
    extra = ["--per-device-train-batch-size", str(G), "--gradient-accumulation-steps", "4",
             "--max-completion-length", "200", "--save-steps", "3"]
    server = ("--max-num-seqs", str(G))
    out_u, rows_u, _ = run(setup, "uninterrupted", 3, 1, extra, server_args=server)
    out_dir = d / "interrupted"
    control = f"tcp://127.0.0.1:{free_port()}"
    servers = [TandemServer(model_dir, "--control", control, *server)]

    def restart():   # the round's first group is in: the server dies with the others, and comes back
        servers[0].kill()
        servers.append(TandemServer(model_dir, "--control", control, *server))

    try:
        with RewardService(0.0, on_first_call=restart) as service:
            args = grpo_args(model_dir, data, out_dir, control, steps=3, extra=[*extra, "--reward-url", service.url])
            procs = launch(args, 1, free_port(), d)
            codes = [p.wait(timeout=600) for p, _ in procs]
            for _, log in procs:
                log.close()
        calls = sorted(service.calls)
    finally:
        for srv in servers:
            srv.stop()
    log = (d / "rank0.log").read_text()
    assert codes == [0], log[-3000:]
    assert len(servers) == 2 and "lost mid-round" in log, log[-3000:]
    # Every group scored once: the groups in before the loss were not generated again.
    assert sum(n for _, _, n in calls) == 3 * 4 * G, calls
    rows_i = _metric_rows(out_dir)
    assert sorted(rows_i) == sorted(rows_u) == [1, 2, 3]
    for step in rows_u:
        differing = _differing_keys(rows_u[step], rows_i[step])
        assert not differing, (step, {k: (rows_u[step].get(k), rows_i[step].get(k)) for k in differing})
    assert (out_u / "checkpoint-3" / "model.safetensors").read_bytes() == \
        (out_dir / "checkpoint-3" / "model.safetensors").read_bytes()

"""tandem-serve with several engines in one process (`--devices`), end to end on real server processes.

CPU (`--devices cpu,cpu`): concurrent requests from the official `openai` client give exactly the greedy outputs
of a single-engine server, and both engines served some (per-engine counters in /metrics, engines in /health);
the prompts of one request spread over the engines while its n completions stay on one; ZeroMQ generates spread
too; a zmq weight push reaches both engines (the greedy output of a prompt routed to engine 0 and of the same
prompt routed to engine 1 both become the new weights' output, with the new policy version on each engine);
streams closed by the client are aborted on the engine that ran them; --device together with --devices is
refused with a clear message; --help lists --devices.

GPU (`--devices 0,1`, skipped unless two CUDA devices are visible): the same greedy equality against a
single-engine server on cuda:0, both engines used, and a zmq push reaching both. Without pytest (the GPU machine
has none), `python3 tests/e2e/test_serve_devices.py --gpu` runs that check (`scripts/gpu-check.sh B devices`);
its last line says whether it passed or was skipped.
"""
import concurrent.futures
import json
import random
import subprocess
import sys
import time

from server_fixtures import BUILD, TandemServer, build_tiny_model, free_port, http_json, metric, metrics, serve_binary

try:
    import pytest
except ImportError:   # the GPU machine: run as a script (see the end)
    pytest = None

if pytest is not None and __name__ != "__main__":   # as a script (the GPU check) only the GPU part runs
    from server_fixtures import tiny_model_dir  # noqa: F401 (pytest fixture)
    from test_zmq_control import Client, hf_greedy, models, pack_units, send_update  # noqa: F401

PROMPTS = [[1, 17, 250, 3, 99, 42, 7], [1, 5], [1, 200, 201, 202, 203, 204, 205, 206], [4, 4, 4, 4],
           [1, 90, 91, 92], [7, 8, 9, 10, 11, 12, 13, 14, 15], [33], [1, 2, 3, 5, 8, 13, 21]]


def engine_series(url, name):
    """{engine index: value} of a per-engine metric."""
    out = {}
    for (n, labels), v in metrics(url).items():
        if n == name:
            out[int(dict(labels)["engine"])] = v
    return out


def completions(url, body, timeout=120):
    status, out, _ = http_json("POST", url + "/v1/completions", body, timeout=timeout)
    assert status == 200, out
    return out


def greedy_ids(url, prompts, max_tokens=12, n=1):
    """Token ids of each choice of one request with a list of token-id prompts (greedy, eos ignored)."""
    out = completions(url, {"prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "n": n,
                            "ignore_eos": True, "return_token_ids": True})
    return [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]


def wait_idle(url, timeout=10):
    """Waits until no engine has a request running or waiting and no completion is outstanding."""
    deadline = time.time() + timeout
    while True:
        m = metrics(url)
        busy = (metric(m, "tandem_requests_running") + metric(m, "tandem_requests_waiting") +
                metric(m, "tandem_engine_outstanding_sequences"))
        if busy == 0:
            return m
        assert time.time() < deadline, f"engines still busy after {timeout} s: {busy}"
        time.sleep(0.05)


# ---- CPU ------------------------------------------------------------------------------------------------

if pytest is not None and __name__ != "__main__":
    openai = pytest.importorskip("openai")

    @pytest.fixture(scope="module")
    def servers(tiny_model_dir):
        """A single-engine server and a two-engine one on the same folder."""
        with TandemServer(tiny_model_dir, "--served-model-name", "tiny") as one, \
                TandemServer(tiny_model_dir, "--served-model-name", "tiny", "--devices", "cpu,cpu") as two:
            yield one, two
            assert one.alive(), one.log_text()
            assert two.alive(), two.log_text()


def test_help_lists_devices():
    out = subprocess.run([serve_binary(), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    line = [ln for ln in out.stdout.splitlines() if ln.strip().startswith("--devices LIST")]
    assert line, out.stdout
    assert "(default none, one engine on --device)" in " ".join(out.stdout.split())


def test_device_and_devices_together_are_refused(tmp_path):
    out = subprocess.run([serve_binary(), "--model", str(tmp_path), "--device", "cpu", "--devices", "cpu,cpu"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out
    assert "--device and --devices cpu,cpu cannot be used together" in out.stderr, out.stderr
    out = subprocess.run([serve_binary(), "--model", str(tmp_path), "--devices", "cpu,cuda:1"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "mix the CPU and CUDA devices" in out.stderr, out.stderr


def test_unavailable_device_stops_start_up_naming_it(tiny_model_dir):
    """The second engine cannot start (no such CUDA device, or no CUDA in this build): the server exits 1 and
    says which engine and device."""
    out = subprocess.run([serve_binary(), "--model", str(tiny_model_dir), "--port", "0", "--kv-cache-memory", "64M",
                          "--devices", "0,999"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out
    assert "cannot start the engines: engine" in out.stderr and "on device cuda:" in out.stderr, out.stderr


def test_concurrent_openai_requests_equal_a_single_engine(servers):
    one, two = servers
    before = engine_series(two.url, "tandem_engine_requests_routed_total")
    assert sorted(before) == [0, 1], before

    def run(url, prompt):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        return r.choices[0].text, r.choices[0].token_ids

    jobs = [p for p in PROMPTS for _ in range(3)]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda p: run(two.url, p), jobs))
    want = {tuple(p): run(one.url, p) for p in PROMPTS}
    for p, g in zip(jobs, got):
        assert g == want[tuple(p)], (p, g, want[tuple(p)])
    after = engine_series(two.url, "tandem_engine_requests_routed_total")
    served = {e: after[e] - before.get(e, 0) for e in after}
    assert served[0] > 0 and served[1] > 0, served
    assert served[0] + served[1] == len(jobs), served
    m = wait_idle(two.url)
    gen = engine_series(two.url, "tandem_engine_generation_tokens_total")
    assert gen[0] > 0 and gen[1] > 0 and gen[0] + gen[1] == metric(m, "tandem_generation_tokens_total"), gen
    status, health, _ = http_json("GET", two.url + "/health")
    assert status == 200 and health["status"] == "ok", health
    assert [(e["engine"], e["device"]) for e in health["engines"]] == [(0, "cpu"), (1, "cpu")], health
    status, health1, _ = http_json("GET", one.url + "/health")
    assert health1 == {"status": "ok"}   # one engine: the answer as before --devices
    status, models_two, _ = http_json("GET", two.url + "/v1/models")
    status, models_one, _ = http_json("GET", one.url + "/v1/models")
    for m1, m2 in zip(models_one["data"], models_two["data"]):
        assert {k: v for k, v in m1.items() if k != "created"} == {k: v for k, v in m2.items() if k != "created"}


def test_prompts_spread_and_n_stays_on_one_engine(servers):
    one, two = servers
    wait_idle(two.url)
    before = engine_series(two.url, "tandem_engine_requests_routed_total")
    # Two prompts in one request on an idle server: the first to engine 0, the second to engine 1.
    got = greedy_ids(two.url, [PROMPTS[0], PROMPTS[0]])
    assert got[0] == got[1] == greedy_ids(one.url, [PROMPTS[0]])[0]
    after = engine_series(two.url, "tandem_engine_requests_routed_total")
    assert after[0] - before[0] == 1 and after[1] - before[1] == 1, (before, after)
    # One prompt with n = 4: one engine takes all four completions (they share the prompt's blocks).
    wait_idle(two.url)
    before = after
    gen_before = engine_series(two.url, "tandem_engine_generation_tokens_total")
    got = greedy_ids(two.url, [PROMPTS[2]], max_tokens=8, n=4)
    assert len(got) == 4 and all(g == got[0] for g in got)
    wait_idle(two.url)
    after = engine_series(two.url, "tandem_engine_requests_routed_total")
    gen_after = engine_series(two.url, "tandem_engine_generation_tokens_total")
    assert after[0] - before[0] == 1 and after[1] == before[1], (before, after)
    assert gen_after[0] - gen_before[0] == 32 and gen_after[1] == gen_before[1], (gen_before, gen_after)


def test_closed_streams_are_aborted_on_their_engines(servers):
    _, two = servers
    wait_idle(two.url)
    client = openai.OpenAI(base_url=two.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    # Two long streams at once: one on each engine.
    streams = [client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=4000, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True}) for i in range(2)]
    for s in streams:
        next(iter(s))
    running = engine_series(two.url, "tandem_engine_requests_running")
    outstanding = engine_series(two.url, "tandem_engine_outstanding_sequences")
    assert outstanding == {0: 1, 1: 1}, outstanding
    assert running[0] + running[1] >= 1, running
    for s in streams:
        s.close()
    m = wait_idle(two.url, timeout=30)
    assert metric(m, "tandem_generation_tokens_total") < 2 * 4000 + 1000
    assert two.alive(), two.log_text()


def test_zmq_weight_push_reaches_both_engines(models):
    """A weights_begin / slices / weights_end push over ZeroMQ: afterwards the greedy output on either engine is
    the new model's (HTTP and ZeroMQ generates, each routed to both engines), every engine reports the version."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    srv = TandemServer(models["base"]["dir"], "--control", endpoint, "--drain-timeout", "5", "--devices", "cpu,cpu")
    c = Client(endpoint)
    try:
        hello, _ = c.ask({"type": "hello", "id": 1})
        prompt = PROMPTS[0]
        k = 12
        base_ref = hf_greedy(models["base"]["model"], prompt, k)[0]
        new_ref = hf_greedy(models["upd_a"]["model"], prompt, k)[0]
        assert base_ref != new_ref

        def check(ref, version, gid):
            wait_idle(srv.url)
            before = engine_series(srv.url, "tandem_engine_requests_routed_total")
            # HTTP: two copies of the prompt in one request, one per engine.
            assert greedy_ids(srv.url, [prompt, prompt], max_tokens=k) == [ref, ref]
            wait_idle(srv.url)
            # ZeroMQ: a generate of two copies, again one per engine.
            res = c.generate(gid, [prompt, prompt], max_tokens=k, temperature=0, ignore_eos=True)
            for i in range(2):
                h, toks, _ = res[i]
                assert toks == [ref], (i, toks, ref)
                assert h["policy_versions"] == [version] and h["policy_versions_end"] == [version], h
            after = engine_series(srv.url, "tandem_engine_requests_routed_total")
            assert after[0] - before[0] == 2 and after[1] - before[1] == 2, (before, after)
            assert engine_series(srv.url, "tandem_engine_policy_version") == {0: version, 1: version}

        check(base_ref, 0, 10)
        units = pack_units(models["upd_a"]["state"], models["base"]["cfg"])
        rep = send_update(c, units, 1, hello["layout_hash"], "f32", random.Random(3), 1000)
        assert rep["type"] == "weights_end" and rep["version"] == 1, rep
        check(new_ref, 1, 20)
        st, _ = c.ask({"type": "stats", "id": 30})
        assert st["policy_version"] == 1 and st["paused"] == 0, st
        status, health, _ = http_json("GET", srv.url + "/health")
        assert [e["policy_version"] for e in health["engines"]] == [1, 1], health
        # A layout mismatch is refused as with one engine, and changes nothing.
        other = "0123456789abcdef" if hello["layout_hash"] != "0123456789abcdef" else "fedcba9876543210"
        rep, _ = c.ask({"type": "weights_begin", "id": 40, "version": 2, "transport": "zmq", "layout_hash": other})
        assert rep["type"] == "error" and rep["code"] == "layout_mismatch" and other in rep["message"], rep
        check(new_ref, 1, 50)
        # A pause from the trainer holds across a push: still paused after weights_end, until resume.
        assert c.ask({"type": "pause", "id": 60})[0]["type"] == "pause"
        rep = send_update(c, pack_units(models["base"]["state"], models["base"]["cfg"]), 2, hello["layout_hash"],
                          "f32", random.Random(4), 2000)
        assert rep["type"] == "weights_end" and rep["version"] == 2, rep
        st, _ = c.ask({"type": "stats", "id": 61})
        assert st["paused"] == 1 and st["policy_version"] == 2, st
        assert c.ask({"type": "resume", "id": 62})[0]["type"] == "resume"
        check(base_ref, 2, 70)
    finally:
        c.close()
        assert srv.stop() == 0, srv.log_text()


# ---- GPU ------------------------------------------------------------------------------------------------

def cuda_devices():
    try:
        import torch
        return torch.cuda.device_count()
    except ImportError:
        return 0


def gpu_check(model_dir):
    """--devices 0,1 against one engine on cuda:0: equal greedy outputs (each engine at batch 1, as the single
    engine: bf16 GEMMs may round differently at other batch sizes), both engines used under concurrency, a zmq
    push reaching both (the bf16 engines compared with each other: same outputs, new version)."""

    import numpy as np
    try:
        import zmq
    except ImportError:
        zmq = None
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with TandemServer(model_dir, "--device", "cuda:0") as one, \
            TandemServer(model_dir, "--devices", "0,1", "--control", endpoint) as two:
        for p in PROMPTS:   # two copies in one request: one on each engine
            want = greedy_ids(one.url, [p], max_tokens=16)[0]
            assert greedy_ids(two.url, [p, p], max_tokens=16) == [want, want], p
        before = engine_series(two.url, "tandem_engine_requests_routed_total")
        jobs = [p for p in PROMPTS for _ in range(4)]
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            got = list(ex.map(lambda p: greedy_ids(two.url, [p], max_tokens=16)[0], jobs))
        assert all(len(g) == 16 for g in got)
        routed = engine_series(two.url, "tandem_engine_requests_routed_total")
        assert routed[0] > before[0] and routed[1] > before[1], (before, routed)
        status, health, _ = http_json("GET", two.url + "/health")
        assert [e["device"] for e in health["engines"]] == ["cuda:0", "cuda:1"], health
        if zmq is None:
            print("zmq push: skipped (no pyzmq in this Python)")
            return "without the zmq push (no pyzmq)"

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)

        def ask(header, *frames):
            sock.send_multipart([json.dumps(header).encode()] + list(frames))
            assert sock.poll(120000), "no answer from the server"
            parts = sock.recv_multipart()
            return json.loads(parts[0])

        hello = ask({"type": "hello", "id": 1})
        rng = np.random.default_rng(5)
        assert ask({"type": "weights_begin", "id": 2, "version": 1, "transport": "zmq",
                    "layout_hash": hello["layout_hash"]})["type"] == "weights_begin"
        for u, n in enumerate(hello["unit_numel"]):
            data = (rng.standard_normal(n) * 0.1).astype(np.float32)
            sock.send_multipart([json.dumps({"type": "weights_slice", "id": 3 + u, "unit": u, "offset": 0,
                                             "count": n, "dtype": "f32"}).encode(), data.tobytes()])
        rep = ask({"type": "weights_end", "id": 1000, "version": 1})
        assert rep["type"] == "weights_end" and rep["version"] == 1, rep
        before = greedy_ids(one.url, [PROMPTS[0]])[0]
        after = greedy_ids(two.url, [PROMPTS[0], PROMPTS[0]])
        assert after[0] == after[1] != before, (after, before)
        assert engine_series(two.url, "tandem_engine_policy_version") == {0: 1, 1: 1}
        sock.close(0)
    return "zmq push reached both engines"


def test_gpu_devices_0_1(tiny_model_dir):
    n = cuda_devices()
    if n < 2:
        pytest.skip(f"--devices 0,1 needs two CUDA devices; {n} visible")
    gpu_check(tiny_model_dir)


if __name__ == "__main__":
    if "--gpu" not in sys.argv:
        sys.exit("usage: python3 tests/e2e/test_serve_devices.py --gpu   (the CPU tests run under pytest)")
    if cuda_devices() < 2:
        print(f"summary: SKIPPED: --devices 0,1 needs two CUDA devices; {cuda_devices()} visible")
        sys.exit(0)
    import tempfile
    d = tempfile.mkdtemp(prefix="tandem-devices-")
    build_tiny_model(d)
    how = gpu_check(d)
    print(f"summary: PASS: --devices 0,1 greedy equal to one engine on cuda:0, both engines used, {how}")

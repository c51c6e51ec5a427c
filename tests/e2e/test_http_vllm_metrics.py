"""/metrics under vLLM's names, read with prometheus_client's own text parser (what Prometheus-side tooling and
vLLM-built autoscalers parse): the families exist with vLLM's types, labels and histogram bounds, and they move by
exactly what a load did: after N completions request_success_total grows by N (split by finished_reason as the
answers say), generation/prompt token counters by the answers' usage, the time-to-first-token and e2e histograms
by N observations, the inter-token one by (generated tokens - N), with positive sums and e2e >= TTFT; the
completions of a client that went away count as finished_reason="abort". With `--devices cpu,cpu` the two
engines' figures sum.
"""
import concurrent.futures
import json
import socket
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_fixtures import TandemServer, http_json, tiny_model_dir  # noqa: F401

# vLLM's bucket bounds (vllm/v1/metrics/loggers.py), the contract a vLLM dashboard's histogram_quantile relies on.
TTFT_BOUNDS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BOUNDS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
              80.0]
E2E_BOUNDS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
              960.0, 1920.0, 7680.0]
HISTOGRAMS = {"vllm:time_to_first_token_seconds": TTFT_BOUNDS, "vllm:inter_token_latency_seconds": ITL_BOUNDS,
              "vllm:e2e_request_latency_seconds": E2E_BOUNDS}
# Family names as prometheus_client reports them (a counter's family drops the _total of its samples).
GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
COUNTERS = ["vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions",
            "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"]
REASONS = ["stop", "length", "abort", "error"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with TandemServer(tiny_model_dir) as s:
        yield s
        assert s.alive(), s.log_text()


def scrape(url):
    status, text, _ = http_json("GET", url + "/metrics")
    assert status == 200, text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams, family, sample, **labels):
    """Sum of the samples named `sample` of `family` whose labels include `labels`."""
    return sum(s.value for s in fams[family].samples
               if s.name == sample and labels.items() <= s.labels.items())


def figures(url):
    f = scrape(url)
    out = {
        "success": value(f, "vllm:request_success", "vllm:request_success_total"),
        "gen": value(f, "vllm:generation_tokens", "vllm:generation_tokens_total"),
        "prompt": value(f, "vllm:prompt_tokens", "vllm:prompt_tokens_total"),
        "kv": value(f, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"),
    }
    for r in REASONS:
        out["success_" + r] = value(f, "vllm:request_success", "vllm:request_success_total", finished_reason=r)
    for h in HISTOGRAMS:
        out[h + "_count"] = value(f, h, h + "_count")
        out[h + "_sum"] = value(f, h, h + "_sum")
        out[h + "_inf"] = value(f, h, h + "_bucket", le="+Inf")
    return out


def run_load(url, bodies):
    """Sends the bodies to /v1/completions concurrently; returns the answers."""
    def one(body):
        status, out, _ = http_json("POST", url + "/v1/completions", body, timeout=120)
        assert status == 200, out
        return out
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


def settled(url, before, completions, timeout=20.0):
    """Figures once the engines have published the load's `completions` finishes (published at the end of the step
    that finished them, which may come after the answer)."""
    deadline = time.monotonic() + timeout
    while True:
        after = figures(url)
        if after["success"] - before["success"] >= completions or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


def check_load_moved_metrics(url, bodies):
    before = figures(url)
    answers = run_load(url, bodies)
    choices = [c for a in answers for c in a["choices"]]
    n = len(choices)
    generated = sum(a["usage"]["completion_tokens"] for a in answers)
    prompt = sum(a["usage"]["prompt_tokens"] for a in answers)
    after = settled(url, before, n)
    d = {k: after[k] - before[k] for k in after}

    assert d["success"] == n
    for r in ("stop", "length"):
        assert d["success_" + r] == sum(c["finish_reason"] == r for c in choices), r
    assert d["gen"] == generated
    assert d["prompt"] == prompt
    ttft, itl, e2e = HISTOGRAMS
    assert d[ttft + "_count"] == n and d[ttft + "_inf"] == n
    assert d[e2e + "_count"] == n and d[e2e + "_inf"] == n
    assert d[itl + "_count"] == generated - n and d[itl + "_inf"] == generated - n  # each token after a first
    for h in HISTOGRAMS:
        assert d[h + "_sum"] > 0, h
    assert d[e2e + "_sum"] >= d[ttft + "_sum"]
    assert 0.0 <= after["kv"] <= 1.0


def test_vllm_families_types_labels_and_bounds(server):
    status, _, _ = http_json("POST", server.url + "/v1/completions", {"prompt": "the quick", "max_tokens": 3})
    assert status == 200
    fams = scrape(server.url)
    for name in GAUGES:
        assert fams[name].type == "gauge", name
    for name in COUNTERS:
        assert fams[name].type == "counter", name
    for name in HISTOGRAMS:
        assert fams[name].type == "histogram", name
    for name in GAUGES + COUNTERS + list(HISTOGRAMS):
        assert fams[name].samples, name
        for s in fams[name].samples:
            assert s.labels.get("model_name"), (name, s)
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples}
    assert reasons == set(REASONS)
    for name, bounds in HISTOGRAMS.items():
        les = [s.labels["le"] for s in fams[name].samples if s.name == name + "_bucket"]
        assert [float(le) for le in les[:-1]] == bounds and les[-1] == "+Inf", name
        counts = [s.value for s in fams[name].samples if s.name == name + "_bucket"]
        assert counts == sorted(counts), f"{name}: buckets not cumulative"
    kv = value(fams, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc")
    assert 0.0 <= kv <= 1.0


def test_vllm_metrics_move_by_the_load(server):
    bodies = [{"prompt": f"the quick brown fox {i}", "max_tokens": 4 + i, "temperature": 0} for i in range(5)]
    bodies.append({"prompt": "seven wizards", "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 7})
    bodies.append({"prompt": "numbers 0 1 2", "max_tokens": 1})
    check_load_moved_metrics(server.url, bodies)


def test_kv_cache_usage_during_load_is_a_fraction(server):
    bodies = [{"prompt": f"a lazy dog {i}", "max_tokens": 48} for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        load = pool.submit(run_load, server.url, bodies)
        seen = []
        while not load.done():
            seen.append(figures(server.url)["kv"])
        load.result()
    assert seen and all(0.0 <= v <= 1.0 for v in seen), seen


def test_vllm_metrics_sum_over_devices(tiny_model_dir):
    with TandemServer(tiny_model_dir, "--devices", "cpu,cpu") as s:
        bodies = [{"prompt": f"the quick {i}", "max_tokens": 5, "temperature": 0} for i in range(6)]
        check_load_moved_metrics(s.url, bodies)
        assert s.alive(), s.log_text()


def test_completions_of_a_client_that_went_away_count_as_abort(server):
    """vLLM counts a request its client dropped under finished_reason="abort" (with its e2e latency)."""
    before = figures(server.url)
    body = json.dumps({"prompt": "the quick brown fox", "n": 4, "max_tokens": 4000, "ignore_eos": True,
                       "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert s.recv(100).startswith(b"HTTP/1.1 200")  # generating
    s.close()
    after = settled(server.url, before, 4)
    assert after["success_abort"] - before["success_abort"] == 4
    assert after["success"] - before["success"] == 4
    e2e = "vllm:e2e_request_latency_seconds"
    assert after[e2e + "_count"] - before[e2e + "_count"] == 4

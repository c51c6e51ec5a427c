"""Every HTTP error case answers with its status and an OpenAI-style error object, and the server keeps serving.

Cases: malformed JSON and non-object bodies (400), wrong types naming the field (400), out-of-range values
(400), prompts beyond the context (400), unknown routes (404), unknown model (404), wrong methods (405 with
Allow), bodies over --max-body-bytes (413, with and without Content-Length), a full queue (429), missing or
wrong API key (401), draining after SIGTERM (503 on an open connection, in-flight work finishes, exit 0),
drain timeout (work aborted, exit 0), and clients that disconnect mid-request or mid-stream (their
sequences are released: nothing keeps generating).
"""
import http.client
import json
import pathlib
import signal
import socket
import threading
import time

import pytest

from server_fixtures import TandemServer, http_json, metric, metrics, tiny_model_dir  # noqa: F401


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with TandemServer(tiny_model_dir, "--max-body-bytes", "4096") as s:
        yield s
        assert s.alive(), s.log_text()


def assert_serving(url, headers=None):
    status, out, _ = http_json("POST", url + "/v1/completions", {"prompt": "the quick", "max_tokens": 3},
                               headers=headers)
    assert status == 200 and len(out["choices"]) == 1, out


def check_error(status, body, want_status, param=None, needle=None):
    assert status == want_status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["code"] == want_status, err
    if param is not None:
        assert err["param"] == param, err
    if needle is not None:
        assert needle in err["message"], err


C = "/v1/completions"
CHAT = "/v1/chat/completions"

BAD_REQUESTS = [
    # (path, body (dict or raw bytes), status, param)
    (C, b'{"prompt": "a",', 400, None),
    (C, b'[1, 2]', 400, None),
    (C, b'', 400, None),
    (C, b'{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    (C, {"prompt": "a", "n": "2"}, 400, "n"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": ["a", 3]}, 400, "prompt"),
    (C, {"prompt": "a", "stop": 3}, 400, "stop"),
    (C, {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "a", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "a", "n": 0}, 400, "n"),
    (C, {"prompt": "a", "n": -1}, 400, "n"),
    (C, {"prompt": "a", "temperature": -0.5}, 400, "temperature"),
    (C, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "a", "top_k": -5}, 400, "top_k"),
    (C, {"prompt": "a", "min_p": 2}, 400, "min_p"),
    (C, {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"prompt": "a", "logprobs": 50}, 400, "logprobs"),
    (C, {"prompt": "a", "stop_token_ids": [300]}, 400, "stop_token_ids"),
    (C, {"prompt": [1, 2, 999]}, 400, "prompt"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": "a", "max_tokens": 100000}, 400, "max_tokens"),
    (C, {"prompt": "a", "model": "no-such-model"}, 404, "model"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "temperature": -1}, 400, "temperature"),
    ("/generate/", {"prompts": "not a list"}, 400, "prompts"),
    ("/generate/", {"prompts": ["a"], "images": [["aGk="]]}, 400, "images"),
    ("/generate/", {"prompts": ["a"], "generation_kwargs": {"presence_penalty": 1}}, 400,
     "generation_kwargs.presence_penalty"),
    ("/tokenize", {"nothing": 1}, 400, None),
    ("/detokenize", {"tokens": [999]}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{p}" for i, (p, *_rest) in enumerate(BAD_REQUESTS)])
def test_bad_request(server, path, body, status, param):
    got_status, got, _ = http_json("POST", server.url + path, body)
    check_error(got_status, got, status, param)
    assert_serving(server.url)


@pytest.mark.parametrize("method,path,status,allow", [
    ("GET", "/v2/models", 404, None),
    ("POST", "/v1/completion", 404, None),
    ("GET", "/v1/completions", 405, "POST"),
    ("POST", "/v1/models", 405, "GET, HEAD"),
    ("DELETE", "/health", 405, "GET, HEAD"),
    ("PUT", "/generate/", 405, "POST"),
])
def test_routes_and_methods(server, method, path, status, allow):
    body = b"{}" if method in ("POST", "PUT") else None
    got_status, got, headers = http_json(method, server.url + path, body)
    check_error(got_status, got, status)
    if allow:
        assert headers.get("Allow") == allow
    assert_serving(server.url)


def test_body_too_large(server):
    big = {"prompt": "x" * 5000}
    status, got, _ = http_json("POST", server.url + C, big)
    check_error(status, got, 413, needle="--max-body-bytes")
    # Without Content-Length (chunked upload) the limit holds too.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", C, body=iter([b'{"prompt": "', b"y" * 3000, b"z" * 3000, b'"}']),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    r = conn.getresponse()
    check_error(r.status, json.loads(r.read()), 413)
    conn.close()
    # A client that waits for "100 Continue" gets the 413 before sending its body.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\nExpect: 100-continue\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(4096)
            assert chunk, reply
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 413"), reply
    # Just under the limit is fine.
    status, got, _ = http_json("POST", server.url + C, {"prompt": "x" * 3000, "max_tokens": 1})
    assert status == 200, got
    assert_serving(server.url)


def _running(url):
    m = metrics(url)
    return metric(m, "tandem_requests_running") + metric(m, "tandem_requests_waiting"), \
        metric(m, "tandem_generation_tokens_total")


def _wait_for(cond, timeout=20.0, what=""):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _assert_released(url):
    """Nothing queued or running, and the generated-token counter has stopped moving."""
    _wait_for(lambda: _running(url)[0] == 0, what="the engine to drop the abandoned request")
    before = _running(url)[1]
    time.sleep(0.5)
    assert _running(url) == (0, before)


LONG = {"prompt": "the quick brown fox", "n": 16, "max_tokens": 4000, "ignore_eos": True}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_client_disconnect_releases_sequences(server, stream):
    body = json.dumps({**LONG, "stream": stream}).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    _wait_for(lambda: _running(server.url)[0] >= 1, what="the request to start")
    if stream:
        assert s.recv(100).startswith(b"HTTP/1.1 200")  # headers and the first events arrive
    time.sleep(0.3)
    s.close()
    _assert_released(server.url)
    assert_serving(server.url)
    if not stream:  # an answer nobody was there to receive is counted as 499
        _wait_for(lambda: metric(metrics(server.url), "tandem_http_requests_total", route=C, status="499") >= 1,
                  what="the 499 count")


def test_queue_full_429(tiny_model_dir):
    with TandemServer(tiny_model_dir, "--max-queued-requests", "2", "--max-num-seqs", "1") as s:
        results = []

        def one():
            results.append(http_json("POST", s.url + C, {"prompt": "the", "max_tokens": 1500, "ignore_eos": True}))

        threads = [threading.Thread(target=one) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        statuses = sorted(r[0] for r in results)
        assert len(results) == 10 and set(statuses) <= {200, 429}, statuses
        assert statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses
        for status, body, _ in results:
            if status == 429:
                check_error(status, body, 429)
                assert body["error"]["type"] == "rate_limit_error"
            else:
                assert len(body["choices"][0]["text"]) >= 0 and body["usage"]["completion_tokens"] == 1500
        assert_serving(s.url)
        m = metrics(s.url)
        assert metric(m, "tandem_http_requests_total", route=C, status="429") == statuses.count(429)
        assert s.stop() == 0


def test_api_key(tiny_model_dir):
    with TandemServer(tiny_model_dir, "--api-key", "s3cret", "--served-model-name", "tiny") as s:
        good = {"Authorization": "Bearer s3cret"}
        for path in ("/health", "/health/"):
            assert http_json("GET", s.url + path)[0] == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/get_world_size/"),
                             ("POST", C), ("POST", "/tokenize"), ("POST", "/generate/")):
            body = {"prompt": "a"} if method == "POST" else None
            for hdrs in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                         {"Authorization": "Bearer s3cret2"}):
                status, got, headers = http_json(method, s.url + path, body, headers=hdrs)
                check_error(status, got, 401)
                assert headers.get("WWW-Authenticate") == "Bearer"
        assert http_json("GET", s.url + "/v1/models", headers=good)[0] == 200
        assert_serving(s.url, headers=good)
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model="tiny", prompt="a", max_tokens=2).choices
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="tiny", prompt="a", max_tokens=2)
        assert s.stop() == 0
    # The key can come from the environment instead of the command line.
    with TandemServer(tiny_model_dir, env={"TANDEM_API_KEY": "from-env"}) as s:
        check_error(*http_json("GET", s.url + "/v1/models")[:2], 401)
        assert http_json("GET", s.url + "/v1/models", headers={"Authorization": "Bearer from-env"})[0] == 200
        assert s.stop() == 0


def test_sigterm_drains_then_exits_zero(tiny_model_dir):
    with TandemServer(tiny_model_dir, "--drain-timeout", "60") as s:
        idle = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        idle.request("GET", "/health")
        assert idle.getresponse().read() and True
        result = {}

        def long_request():
            result["r"] = http_json("POST", s.url + C, {"prompt": "the", "n": 4, "max_tokens": 1500,
                                                        "ignore_eos": True}, timeout=120)

        t = threading.Thread(target=long_request)
        t.start()
        _wait_for(lambda: _running(s.url)[0] >= 1, what="the long request to start")
        s.proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: "draining" in s.log_text(), what="the drain to begin")
        # A request on a connection that was already open is refused with 503 ...
        idle.request("POST", C, body=json.dumps({"prompt": "a"}), headers={"Content-Type": "application/json"})
        r = idle.getresponse()
        check_error(r.status, json.loads(r.read()), 503)
        # ... new connections are not accepted ...
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", s.port), timeout=5).recv(1)
        # ... and the request in flight completes.
        t.join(120)
        status, body, _ = result["r"]
        assert status == 200 and [c["finish_reason"] for c in body["choices"]] == ["length"] * 4
        assert s.stop(timeout=60) == 0
        assert "drained" in s.log_text()


def test_drain_timeout_aborts_and_exits_zero(tiny_model_dir):
    """Requests still running when --drain-timeout runs out end as vLLM ends aborted requests: a whole answer and an
    openai-client stream each carry what was generated, with finish_reason "abort"; the server exits 0."""
    openai = pytest.importorskip("openai")
    with TandemServer(tiny_model_dir, "--drain-timeout", "1") as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        result = {}

        def long_request():
            result["r"] = http_json("POST", s.url + C, LONG, timeout=120)

        def long_stream():
            chunks = list(client.completions.create(model=pathlib.Path(str(tiny_model_dir)).name,
                                                    prompt="seven wizards", max_tokens=4000, stream=True,
                                                    extra_body={"ignore_eos": True}))
            result["s"] = chunks

        threads = [threading.Thread(target=long_request), threading.Thread(target=long_stream)]
        for t in threads:
            t.start()
        _wait_for(lambda: _running(s.url)[0] >= 2, what="the long requests to start")
        t0 = time.time()
        assert s.stop(timeout=30) == 0
        assert time.time() - t0 < 15, "the drain timeout was not applied"
        for t in threads:
            t.join(30)
        status, body, _ = result["r"]
        assert status == 200, (status, body)
        assert [c["finish_reason"] for c in body["choices"]] == ["abort"] * 16
        assert all(0 < len(c["text"]) for c in body["choices"]) and body["usage"]["completion_tokens"] < 16 * 4000
        chunks = result["s"]
        assert chunks[-1].choices[0].finish_reason == "abort"
        assert sum(len(c.choices[0].text) for c in chunks) > 0
        assert "drain timeout" in s.log_text()
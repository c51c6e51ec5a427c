"""The external reward service client (trainer/reward_service.c over trainer/http_client.c) against tiny Python
HTTP servers started in the test: a good one (both response schemas, chunked and close-delimited bodies, what
the request holds), a slow one (timeouts, retried), one answering 500 then 200 (retries), and broken ones
(garbage bytes, invalid JSON, wrong lengths, 4xx not retried, a closed port). Every failure must name the URL.
Driven through tests/reference/tools/trainer_reward_service_tool.c.
"""
import json
import socket
import socketserver
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import tool

SAMPLES = [
    {"prompt": "What is 6 x 7?", "completion": "\\boxed{42}", "columns": {"answer": "42", "level": 1}},
    {"prompt": [{"role": "user", "content": "Say hi"}], "completion": "hi é 思", "columns": {"answer": None}},
    {"prompt": "p", "completion": "", "columns": {"completion": "dataset column", "prompt": "shadowed"}},
]


class Server:
    """A ThreadingHTTPServer on 127.0.0.1 whose handler calls `respond(handler, body_json, count)`."""

    def __init__(self, respond):
        self.requests = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length))
                with outer.lock:
                    outer.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                    count = len(outer.requests)
                respond(self, body, count)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def send_json(handler, obj, status=200, chunked=False, close_delimited=False):
    data = json.dumps(obj).encode() if not isinstance(obj, bytes) else obj
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    if chunked:
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        for i in range(0, len(data), 7):  # small chunks, one with an extension
            piece = data[i:i + 7]
            ext = ";x=1" if i == 7 else ""
            handler.wfile.write(f"{len(piece):x}{ext}\r\n".encode() + piece + b"\r\n")
        handler.wfile.write(b"0\r\nTrailer: y\r\n\r\n")
    elif close_delimited:
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.wfile.write(data)
        handler.close_connection = True
    else:
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)


def call(url, samples=SAMPLES, timeout=5.0, connect_timeout=2.0, retries=0, backoff=0.05, repeat=1):
    args = [tool("trainer_reward_service_tool"), url, str(timeout), str(connect_timeout), str(retries), str(backoff),
            str(repeat)]
    proc = subprocess.run(args, input=json.dumps(samples), capture_output=True, text=True, timeout=60)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode, lines, proc.stderr


@pytest.fixture
def server():
    servers = []

    def make(respond):
        s = Server(respond)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def test_good_single_schema_and_request_shape(server):
    srv = server(lambda h, body, n: send_json(h, {"scores": [float(len(x["completion"])) for x in body]}))
    rc, lines, err = call(srv.url)
    assert rc == 0, err
    assert lines == [{"names": ["reward_service"], "scores": [[10.0], [6.0], [0.0]]}]
    req = srv.requests[0]
    assert req["path"] == "/score"
    assert req["headers"]["Content-Type"] == "application/json"
    body = req["body"]
    assert body[0] == {"prompt": "What is 6 x 7?", "completion": "\\boxed{42}", "answer": "42", "level": 1}
    assert body[1] == {"prompt": [{"role": "user", "content": "Say hi"}], "completion": "hi é 思", "answer": None}
    # A dataset column named prompt/completion does not replace tandem's two keys.
    assert body[2] == {"prompt": "p", "completion": ""}


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
def test_good_named_schema_with_nulls(server, framing):
    def respond(h, body, n):
        out = {"rewards": {"correct": [1.0, None, 0.0], "style": [0.5, -2, 1e-3]}}
        send_json(h, out, chunked=framing == "chunked", close_delimited=framing == "close")

    srv = server(respond)
    rc, lines, err = call(srv.url)
    assert rc == 0, err
    assert lines == [{"names": ["correct", "style"], "scores": [[1.0, 0.5], [None, -2.0], [0.0, 0.001]]}]


def test_names_fixed_by_first_answer(server):
    def respond(h, body, n):
        if n == 1:
            send_json(h, {"rewards": {"a": [1, 2, 3], "b": [4, 5, 6]}})
        elif n == 2:
            send_json(h, {"rewards": {"b": [40, 50, 60], "a": [10, 20, 30]}})  # other order: reordered
        else:
            send_json(h, {"rewards": {"a": [1, 2, 3]}})

    srv = server(respond)
    rc, lines, err = call(srv.url, repeat=3)
    assert rc == 1
    assert lines[0]["scores"] == [[1, 4], [2, 5], [3, 6]]
    assert lines[1]["names"] == ["a", "b"] and lines[1]["scores"] == [[10, 40], [20, 50], [30, 60]]
    assert "returned 1 reward functions, earlier 2" in err and srv.url in err


def test_slow_server_times_out_and_is_retried(server):
    def respond(h, body, n):
        time.sleep(1.5)
        send_json(h, {"scores": [0, 0, 0]})

    srv = server(respond)
    t0 = time.monotonic()
    rc, lines, err = call(srv.url, timeout=0.3, retries=1, backoff=0.05)
    elapsed = time.monotonic() - t0
    assert rc == 1 and lines == []
    assert "no complete response within 300 ms" in err and srv.url in err and "after 2 attempt(s)" in err
    assert elapsed < 1.5  # gave up on each attempt at the timeout, not when the server answered
    deadline = time.monotonic() + 2
    while len(srv.requests) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(srv.requests) == 2


def test_500_then_200_is_retried(server):
    def respond(h, body, n):
        if n == 1:
            send_json(h, b"overloaded", status=500)
        else:
            send_json(h, {"scores": [1, 1, 1]})

    srv = server(respond)
    rc, lines, err = call(srv.url, retries=2, backoff=0.05)
    assert rc == 0, err
    assert lines[0]["scores"] == [[1], [1], [1]] and len(srv.requests) == 2


def test_500_without_retries_names_url_and_status(server):
    srv = server(lambda h, body, n: send_json(h, b"overloaded", status=503))
    rc, lines, err = call(srv.url, retries=0)
    assert rc == 1 and srv.url in err and "HTTP status 503" in err and "overloaded" in err


def test_4xx_is_not_retried(server):
    srv = server(lambda h, body, n: send_json(h, {"error": "bad batch"}, status=400))
    rc, lines, err = call(srv.url, retries=3, backoff=0.05)
    assert rc == 1 and "HTTP status 400" in err and "bad batch" in err
    assert len(srv.requests) == 1


@pytest.mark.parametrize("reply,needle", [
    (b"not json at all", "the body is not valid JSON"),
    ({"score": [1, 2, 3]}, "expected {\"scores\": [...]} or {\"rewards\""),
    ({"scores": [1, 2]}, "\"scores\" has 2 scores for 3 completions"),
    ({"scores": [1, "2", 3]}, "\"scores\"[1] is not a number or null"),
    ({"rewards": {}}, "\"rewards\" must be a non-empty object"),
    ({"rewards": {"a": [1, 2, 3, 4]}}, "\"a\" has 4 scores for 3 completions"),
    ({"scores": [1, 2, 3], "rewards": {"a": [1, 2, 3]}}, "expected {\"scores\""),
    ([1, 2, 3], "expected {\"scores\""),
])
def test_bad_bodies(server, reply, needle):
    srv = server(lambda h, body, n: send_json(h, reply))
    rc, lines, err = call(srv.url, retries=2)
    assert rc == 1 and needle in err and srv.url in err and "status 200" in err
    assert len(srv.requests) == 1  # a malformed answer would fail the same way again


class GarbageHandler(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.recv(65536)
        self.request.sendall(b"hello there, I am not an HTTP server\r\n\r\n")


def test_garbage_bytes(server):
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), GarbageHandler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/"
    try:
        rc, lines, err = call(url, retries=0)
        assert rc == 1 and url in err and "not HTTP" in err
    finally:
        srv.shutdown()
        srv.server_close()


def test_connection_refused_names_url():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    url = f"http://127.0.0.1:{port}/score"
    rc, lines, err = call(url, retries=1, backoff=0.01)
    assert rc == 1 and url in err and "cannot connect" in err and "after 2 attempt(s)" in err


@pytest.mark.parametrize("url,needle", [
    ("https://example.com/x", "https:// is not supported"),
    ("ftp://h/x", "must start with http://"),
    ("http://h:99999/x", "bad port"),
    ("http:///x", "missing or too long host"),
])
def test_bad_urls(url, needle):
    rc, lines, err = call(url)
    assert rc == 1 and needle in err and "reward_url" in err

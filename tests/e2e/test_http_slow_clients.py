"""Slow clients cannot lock others out (issue 22): --request-read-timeout, --max-connections and
--max-connections-per-client.

The slow clients are raw sockets that trickle a byte every 0.2 s, so libmicrohttpd's inactivity timeout
never fires; only the read deadline closes them. They connect from other loopback addresses (127.0.0.2, ...)
than the normal client (127.0.0.1), which is what makes the per-client limit apply to them alone. The server
runs with a 2 s deadline, a cap of 24 connections and 8 per client address, so each case takes a few seconds.
"""
import http.client
import json
import socket
import subprocess
import threading
import time

import pytest

from server_fixtures import TandemServer, http_json, serve_binary, tiny_model_dir  # noqa: F401

READ_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 24
PER_CLIENT = 8
# The sweep closes a connection 1.5 s past its deadline (time for a late request to get its 408) and runs
# every 0.25 s; the rest is room for two busy cores.
SWEEP_GRACE_S = 1.5
CUT_BY_S = READ_TIMEOUT_S + SWEEP_GRACE_S + 0.25 + 1.5
# When a late request sends its last bytes: past the deadline even if the server accepted the connection up to
# 0.5 s after the client connected, and well before the sweep.
LATE_S = READ_TIMEOUT_S + 0.5


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with TandemServer(tiny_model_dir, "--request-read-timeout", READ_TIMEOUT_S, "--max-connections",
                      MAX_CONNECTIONS, "--max-connections-per-client", PER_CLIENT) as s:
        yield s
        assert s.alive(), s.log_text()


def connect_from(source_ip, port):
    s = socket.socket()
    s.bind((source_ip, 0))
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


def closed_by_peer(sock):
    """True when the server closed the socket (EOF or reset); False while it is still open."""
    sock.setblocking(False)
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True
    finally:
        sock.setblocking(True)


class Tricklers:
    """Sockets that send a request line, then one header byte every 0.2 s, never finishing their headers.

    `closed_at[i]` is the time after connecting at which the server closed socket i (None while open)."""

    def __init__(self, port, source_ips, per_ip):
        self.socks, self.opened = [], []
        for ip in source_ips:
            for _ in range(per_ip):
                s = connect_from(ip, port)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: slow\r\nX-Slow: ")
                self.socks.append(s)
                self.opened.append(time.monotonic())
        self.closed_at = [None] * len(self.socks)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        self._thread.start()

    def _trickle(self):
        while not self._stop.wait(0.2):
            for i, s in enumerate(self.socks):
                if self.closed_at[i] is not None:
                    continue
                gone = closed_by_peer(s)
                if not gone:
                    try:
                        s.send(b"a")
                    except OSError:
                        gone = True
                if gone:
                    self.closed_at[i] = time.monotonic() - self.opened[i]

    def wait_all_closed(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and None in self.closed_at:
            time.sleep(0.05)
        return list(self.closed_at)

    def close(self):
        self._stop.set()
        self._thread.join()
        for s in self.socks:
            s.close()


def timed_health(url, timeout=20):
    t0 = time.monotonic()
    status, _, _ = http_json("GET", url + "/health", timeout=timeout)
    return status, time.monotonic() - t0


def test_health_answers_at_once_while_one_client_holds_its_share_and_the_share_is_closed_by_the_deadline(server):
    slow = Tricklers(server.port, ["127.0.0.2"], PER_CLIENT)
    try:
        time.sleep(0.3)  # every slow connection accepted and trickling
        extra = connect_from("127.0.0.2", server.port)  # over the per-client limit: accepted and closed at once
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: slow\r\n")
        t0 = time.monotonic()
        while not closed_by_peer(extra) and time.monotonic() - t0 < 2:
            time.sleep(0.05)
        assert closed_by_peer(extra), "a connection over --max-connections-per-client was not refused"
        extra.close()

        status, took = timed_health(server.url)
        assert status == 200 and took < 1.0, (status, took)
        assert None in slow.closed_at, "slow connections were closed before their deadline"

        closed = slow.wait_all_closed(CUT_BY_S + 1)
        assert all(c is not None and READ_TIMEOUT_S - 0.1 <= c <= CUT_BY_S for c in closed), closed
    finally:
        slow.close()
    assert "whose request had not arrived in full" in server.log_text()
    assert "Server reached connection limit" in server.log_text()  # the refused extra, with what to raise


def test_slow_clients_filling_the_cap_lock_new_clients_out_only_until_their_deadline(server):
    per_ip = MAX_CONNECTIONS // 3
    slow = Tricklers(server.port, ["127.0.0.3", "127.0.0.4", "127.0.0.5"], per_ip)
    try:
        time.sleep(0.3)
        assert all(c is None for c in slow.closed_at), slow.closed_at
        # At the cap libmicrohttpd accepts a new connection and closes it at once.
        with pytest.raises(OSError):
            http_json("GET", server.url + "/health", timeout=5)
        answered_at = None
        while answered_at is None and time.monotonic() - slow.opened[-1] < CUT_BY_S + 1:
            try:
                status, took = timed_health(server.url, timeout=5)
                answered_at = time.monotonic() - slow.opened[-1]
            except OSError:
                time.sleep(0.1)
        assert answered_at is not None and status == 200 and answered_at <= CUT_BY_S + 0.5, answered_at
        closed = slow.wait_all_closed(CUT_BY_S + 1)
        assert all(c is not None and c <= CUT_BY_S for c in closed), closed
    finally:
        slow.close()
    status, took = timed_health(server.url)
    assert status == 200 and took < 1.0, (status, took)


def post_head(length):
    return (b"POST /v1/completions HTTP/1.1\r\nHost: slow\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % length)


def test_body_trickled_past_the_deadline_is_cut(server):
    body = b'{"prompt": "the quick", "max_tokens": 1}'.ljust(400)
    s = connect_from("127.0.0.1", server.port)
    t0 = time.monotonic()
    s.sendall(post_head(len(body)))
    answer, closed_after = b"", None
    try:
        for i in range(0, len(body), 4):  # 20 bytes a second: 20 s for the whole body
            s.setblocking(False)
            try:
                chunk = s.recv(4096)
                answer += chunk
                if not chunk:
                    closed_after = time.monotonic() - t0
                    break
            except BlockingIOError:
                pass
            except ConnectionResetError:
                closed_after = time.monotonic() - t0
                break
            s.setblocking(True)
            try:
                s.send(body[i:i + 4])
            except OSError:
                closed_after = time.monotonic() - t0
                break
            time.sleep(0.2)
    finally:
        s.close()
    assert closed_after is not None and READ_TIMEOUT_S - 0.1 <= closed_after <= CUT_BY_S, closed_after
    assert answer == b"", answer  # libmicrohttpd cannot answer while a body is arriving: the socket just closes
    log = server.log_text()
    assert "POST /v1/completions 408" in log and "(not in full within --request-read-timeout: closed)" in log, log


@pytest.mark.parametrize("what", ["headers", "body"])
def test_request_completed_just_past_the_deadline_gets_408(server, what):
    body = b'{"prompt": "the quick", "max_tokens": 1}'
    s = connect_from("127.0.0.1", server.port)
    t0 = time.monotonic()
    if what == "headers":
        head = post_head(len(body))
        s.sendall(head[:-2])
        time.sleep(max(0.0, LATE_S - (time.monotonic() - t0)))
        s.sendall(head[-2:] + body)
    else:
        s.sendall(post_head(len(body)) + body[:10])
        time.sleep(max(0.0, LATE_S - (time.monotonic() - t0)))
        s.sendall(body[10:])
    answer = b""
    try:
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
    except ConnectionResetError:
        pass
    s.close()
    head, _, text = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert b"connection: close" in head.lower(), answer
    error = json.loads(text)["error"]
    assert error["type"] == "request_timeout_error" and error["code"] == 408, error
    assert "--request-read-timeout" in error["message"], error


def test_idle_kept_alive_connections_outlive_the_read_deadline(server):
    import openai
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read() is not None
        first = conn.sock.getsockname()
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt="the quick", max_tokens=2).choices
        # Longer than the read deadline plus the sweep's grace: an idle connection is not reading a request.
        time.sleep(READ_TIMEOUT_S + SWEEP_GRACE_S + 0.5)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() is not None
        assert conn.sock.getsockname() == first, "the kept-alive connection was closed"
        assert client.completions.create(model=model, prompt="the quick", max_tokens=2).choices
    finally:
        conn.close()
        client.close()


def test_options_are_checked():
    for args, needle in ((["--request-read-timeout", "-1"], "--request-read-timeout -1"),
                         (["--max-connections", "0"], "--max-connections 0"),
                         (["--max-connections-per-client", "x"], "--max-connections-per-client 'x'")):
        r = subprocess.run([serve_binary(), "--model", "unused", *args], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and needle in r.stderr and "see --help" in r.stderr, (args, r.stderr)
    text = subprocess.run([serve_binary(), "--help"], capture_output=True, text=True, timeout=30).stdout
    for option in ("--request-read-timeout SECONDS", "--max-connections N", "--max-connections-per-client N"):
        assert option in text, option

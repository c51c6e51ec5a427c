"""The HTTP environment client (trainer/env_service.c) and the built-in tools (trainer/environment.c), driven through
tests/reference/tools/trainer_env_tool.c: against the runnable example environment of docs/environments.md
(examples/environments/arithmetic_env.py, started as its own process), and against tiny servers that are slow,
failing or lying. Every failure must come back within seconds, as an error naming the URL and what is wrong."""
import json
import pathlib
import re
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import ROOT, tool

EXAMPLE = ROOT / "examples" / "environments" / "arithmetic_env.py"


class EnvTool:
    def __init__(self, target, timeout_s=5, connect_timeout_s=2, retries=0, backoff_s=0.05):
        self.proc = subprocess.Popen([tool("trainer_env_tool"), target, str(timeout_s), str(connect_timeout_s),
                                      str(retries), str(backoff_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, encoding="utf-8")

    def ask(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        return json.loads(line)

    def reset(self, episodes):
        return self.ask(op="reset", episodes=episodes)

    def step(self, steps, fmt="hermes"):
        return self.ask(op="step", format=fmt, steps=steps)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def call(name, **args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


@pytest.fixture
def example_env():
    proc = subprocess.Popen(["python3", str(EXAMPLE), "--port", "0"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    url = re.search(r"http://\S+", line).group(0)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_example_environment_episode(example_env):
    env = EnvTool(example_env)
    rows = [{"episode_id": f"e{i}", "seed": i, "row": {"prompt": "What is 123456789 * 987654321?",
                                                         "answer": str(123456789 * 987654321)}} for i in range(3)]
    assert env.reset(rows) == {"episodes": [{"observation": None}] * 3}
    got = env.step([
        {"episode_id": "e0", "turn": 1,
         "message": "Let me compute. " + call("calculator", expression="123456789 * 987654321")},
        {"episode_id": "e1", "turn": 1, "message": call("calculator", expression="2**") + call("search", q="x")},
        {"episode_id": "e2", "turn": 1, "message": '<tool_call>{"name": "calculator", "arguments": {1}}</tool_call>'},
    ])["steps"]
    assert got[0]["observations"] == [{"name": "calculator", "content": "121932631112635269"}]
    assert not got[0]["done"] and got[0]["reward"] is None
    assert [o["name"] for o in got[1]["observations"]] == ["calculator", "search"]
    assert all("error" in json.loads(o["content"]) for o in got[1]["observations"])
    assert got[2]["observations"] == [] and got[2]["parse_error"].startswith("tool call 1 is not valid JSON")
    got = env.step([
        {"episode_id": "e0", "turn": 2, "message": "The answer is 121932631112635269."},
        {"episode_id": "e1", "turn": 2, "message": "The answer is 5."},
    ])["steps"]
    assert got[0]["done"] and got[0]["reward"] == 1.0
    assert got[1]["done"] and got[1]["reward"] == 0.0
    # A retried turn gets the same answer.
    again = env.step([{"episode_id": "e0", "turn": 2, "message": "The answer is 121932631112635269."}])["steps"]
    assert again[0]["reward"] == 1.0
    env.close()


def test_builtin_tools():
    env = EnvTool("builtin")
    assert env.reset([{"episode_id": "x", "seed": 1, "row": {}}]) == {"episodes": [{"observation": None}]}
    got = env.step([{"episode_id": "x", "turn": 1, "message": call("calculator", expression="(2 + 3) * 4.5 - 10 // 3")
                     + call("lookup", key="capital of France") + call("lookup", key="answer")
                     + call("calculator", expression="1/0") + call("nope")}])["steps"][0]
    assert [o["content"] for o in got["observations"][:3]] == ["19.5", "Paris", "42"]
    assert json.loads(got["observations"][3]["content"]) == {"error": "calculator: division by zero"}
    assert "Tool nope not found" in json.loads(got["observations"][4]["content"])["error"]
    assert got["tool_failures"] == 2 and not got["done"]
    final = env.step([{"episode_id": "x", "turn": 2, "message": "It is 19.5."}])["steps"][0]
    assert not final["done"] and final["observations"] == []   # the answer itself ends the episode
    env.close()


class Server:
    """A ThreadingHTTPServer whose handler calls respond(handler, path, body, count)."""

    def __init__(self, respond):
        self.count = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                with outer.lock:
                    outer.count += 1
                    n = outer.count
                respond(self, self.path, body, n)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/env"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def send(handler, obj, status=200):
    data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


STEPS = [{"episode_id": "a", "turn": 1, "message": call("calculator", expression="1+1")},
         {"episode_id": "b", "turn": 1, "message": "done"}]


def good_step(body):
    return {"steps": [{"episode_id": s["episode_id"], "observations": [{"name": "calculator", "content": "2"}]
                       if s["tool_calls"] else [], "done": not s["tool_calls"], "reward": None}
                      for s in body["steps"]]}


def test_slow_service_times_out_quickly():
    server = Server(lambda h, path, body, n: (time.sleep(5), send(h, good_step(body))))
    env = EnvTool(server.url, timeout_s=0.5, retries=1, backoff_s=0.1)
    t0 = time.monotonic()
    got = env.step(STEPS)
    took = time.monotonic() - t0
    assert "error" in got and server.url + "/step" in got["error"] and "2 attempt" in got["error"], got
    assert "no complete response within 500 ms" in got["error"], got
    assert took < 3.0, took
    env.close()
    server.close()


def test_failing_service_is_retried_then_reported():
    flaky = Server(lambda h, path, body, n: send(h, {"oops": 1}, 503) if n == 1 else send(h, good_step(body)))
    env = EnvTool(flaky.url, retries=2)
    got = env.step(STEPS)
    assert got["steps"][0]["observations"][0]["content"] == "2" and got["steps"][1]["done"]
    env.close()
    flaky.close()

    down = Server(lambda h, path, body, n: send(h, b"internal trouble", 500))
    env = EnvTool(down.url, retries=2)
    got = env.step(STEPS)
    assert "failed after 3 attempt(s)" in got["error"] and "HTTP status 500: internal trouble" in got["error"], got
    assert down.count == 3
    env.close()
    down.close()

    refused = Server(lambda h, path, body, n: send(h, {"error": "bad"}, 400))
    env = EnvTool(refused.url, retries=3)
    got = env.step(STEPS)
    assert "failed after 1 attempt(s)" in got["error"] and "400" in got["error"] and refused.count == 1
    env.close()
    refused.close()


def test_closed_port_is_an_error():
    server = Server(lambda h, path, body, n: None)
    url = server.url
    server.close()
    env = EnvTool(url, retries=1)
    t0 = time.monotonic()
    got = env.reset([{"episode_id": "a", "seed": 0, "row": {}}])
    assert "error" in got and url + "/reset" in got["error"] and time.monotonic() - t0 < 3.0
    env.close()


def lie(mutate):
    def respond(h, path, body, n):
        answer = good_step(body)
        mutate(answer)
        send(h, answer)
    return respond


LIES = [
    (lambda a: a["steps"].pop(), "has 1 entries for 2 episodes"),
    (lambda a: a["steps"].reverse(), "episode_id must be \"a\""),
    (lambda a: a["steps"][0].update(done="no"), "\"steps\"[0].done must be true or false"),
    (lambda a: a["steps"][0].update(reward="high"), "\"steps\"[0].reward must be a number or null"),
    (lambda a: a["steps"][0].update(observations=[{"content": 2}]), "observations[0] must be"),
    (lambda a: a["steps"][0].update(observations=[]), "has tool calls but no observations"),
    (lambda a: a.pop("steps"), "must be an object with a list \"steps\""),
]


@pytest.mark.parametrize("mutate,message", LIES, ids=[m for _, m in LIES])
def test_lying_service_is_refused(mutate, message):
    server = Server(lie(mutate))
    env = EnvTool(server.url, retries=2)
    got = env.step(STEPS)
    assert "error" in got and message in got["error"] and server.url + "/step" in got["error"], got
    assert server.count == 1   # a wrong answer would be wrong again: not retried
    env.close()
    server.close()


def test_invalid_json_answer():
    server = Server(lambda h, path, body, n: send(h, b"{not json"))
    env = EnvTool(server.url)
    got = env.reset([{"episode_id": "a", "seed": 0, "row": {}}])
    assert "not valid JSON" in got["error"] and "body starts: {not json" in got["error"], got
    env.close()
    server.close()

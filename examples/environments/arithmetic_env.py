#!/usr/bin/env python3
"""An example environment service for tandem-train (protocol: docs/environments.md). Python standard library only.

Task: the prompt asks for an arithmetic result (dataset column "answer" holds it). The policy may call the tool
`calculator` ({"expression": "..."}) as often as it likes; its final message (one without tool calls) earns
reward 1.0 when the last number in it equals the answer, else 0.0, and ends the episode.

    python3 examples/environments/arithmetic_env.py --port 8300
    tandem-train ... --env-url http://127.0.0.1:8300

Episodes are independent and many are in flight at once; answers are kept per (episode_id, turn), so a request the
trainer retries after a timeout gets the same answer again.
"""
import argparse
import ast
import json
import operator
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
             ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression):
    """Arithmetic on numbers only: parsed, never eval'd."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            if isinstance(node.op, ast.Pow) and abs(value(node.right)) > 1000:
                raise ValueError("exponent too large")
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")
    return value(ast.parse(expression.replace("^", "**"), mode="eval").body)


class Episodes:
    def __init__(self):
        self.lock = threading.Lock()
        self.answer = {}    # episode_id -> expected answer (text)
        self.replies = {}   # (episode_id, turn) -> the step answer given

    def reset(self, episode):
        with self.lock:
            self.answer[episode["episode_id"]] = str(episode["row"].get("answer", ""))
            self.replies = {k: v for k, v in self.replies.items() if k[0] != episode["episode_id"]}
        return {"episode_id": episode["episode_id"], "observation": None}

    def step(self, step):
        key = (step["episode_id"], step["turn"])
        with self.lock:
            if key in self.replies:
                return self.replies[key]
            if step["episode_id"] not in self.answer:
                raise KeyError(f"unknown episode {step['episode_id']}: reset it first")
            answer = self.answer[step["episode_id"]]
        observations = []
        for call in step["tool_calls"]:
            try:
                if call["name"] != "calculator":
                    raise ValueError(f"Tool {call['name']} not found: the only tool is calculator")
                content = str(calculate(str(call["arguments"]["expression"])))
            except Exception as e:  # the policy reads the error as the tool's answer
                content = json.dumps({"error": str(e) or type(e).__name__})
            observations.append({"name": call["name"], "content": content})
        reply = {"episode_id": step["episode_id"], "observations": observations, "done": False, "reward": None}
        if not step["tool_calls"] and not step["tool_call_error"]:
            numbers = re.findall(r"-?\d+(?:\.\d+)?", step["message"])
            reply["done"] = True
            reply["reward"] = 1.0 if numbers and numbers[-1] == answer else 0.0
        with self.lock:
            self.replies[key] = reply
        return reply


def make_server(port, host="127.0.0.1"):
    episodes = Episodes()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def answer(self, status, obj):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                if self.path.endswith("/reset"):
                    self.answer(200, {"episodes": [episodes.reset(e) for e in body["episodes"]]})
                elif self.path.endswith("/step"):
                    self.answer(200, {"steps": [episodes.step(s) for s in body["steps"]]})
                else:
                    self.answer(404, {"error": f"no such call {self.path}: use /reset or /step"})
            except (KeyError, ValueError, TypeError) as e:
                self.answer(400, {"error": f"bad request: {e}"})

    return ThreadingHTTPServer((host, port), Handler)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8300, help="port (default 8300; 0 picks a free one)")
    args = parser.parse_args()
    server = make_server(args.port, args.host)
    print(f"arithmetic environment on http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

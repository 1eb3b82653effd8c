#!/usr/bin/env python3
"""Load benchmark of smolchat through its real HTTP + SSE path (issue 3).

Starts `smolchat serve` (release build) on a free port with a temporary database, then measures:
  * for 1, 4, 8 and 16 concurrent conversations: aggregate and per-stream generated tokens/s and
    time to first token (up to 128 new tokens each, greedy; `ignore_eos` is for admins only, so
    a reply may end sooner: the figures count the tokens generated);
  * second-turn time to first token at ~1,000 tokens of history, with a warm KV cache and with a
    cold one (same history, after a server restart).
Prints one JSON object. Standard library only.

usage: scripts/http_bench.py [--binary target/release/smolchat] [--threads 2] [--clients 1,4,8,16]
                             [--model M.gguf] [--device cuda] [--env KEY=VALUE ...]
                             [--no-second-turn]
On a GPU (gpu-check's bench phase): --model the synthetic 3B file --device cuda
--clients 1,8,32,64 --no-second-turn.
"""
import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

PROMPTS = [
    "Write a long story about a lighthouse keeper.",
    "Explain how a compiler works, step by step.",
    "Describe the water cycle in detail.",
    "List the planets and describe each one.",
    "Tell me about the history of the bicycle.",
    "How do bees make honey?",
    "Explain photosynthesis to a child.",
    "What makes a good cup of coffee?",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    # Set by main from the command line: extra `serve` arguments and environment.
    extra_args = []
    extra_env = {}
    max_running = 16

    def __init__(self, binary, threads, db, env=None):
        self.port = free_port()
        e = {k: v for k, v in os.environ.items() if not k.startswith("SMOLCHAT_")}
        e.update({"SMOLCHAT_SCHEDULER__MAX_RUNNING": str(self.max_running),
                  "SMOLCHAT_SCHEDULER__QUEUE_SIZE": str(max(64, 4 * self.max_running)),
                  "SMOLCHAT_SERVER__COOKIE_SECRET": "b" * 64, "SMOLCHAT_LOG": "warn",
                  # One guest drives every conversation: the per-owner limits would throttle
                  # the load this measures.
                  "SMOLCHAT_LIMITS__CONVERSATIONS_PER_MINUTE": "0",
                  "SMOLCHAT_LIMITS__TOKENS_PER_MINUTE_PER_USER": "0",
                  "SMOLCHAT_LIMITS__TOKENS_PER_MINUTE_PER_GUEST_ADDRESS": "0",
                  "SMOLCHAT_SCHEDULER__MAX_QUEUED_PER_USER": "0",
                  "SMOLCHAT_SCHEDULER__MAX_RUNNING_PER_USER": "0",
                  "SMOLCHAT_LIMITS__MAX_STREAMS_PER_USER": "1000",
                  "SMOLCHAT_LIMITS__MAX_STREAMS_PER_ADDRESS": "1000"})
        e.update(self.extra_env)
        e.update(env or {})
        self.proc = subprocess.Popen(
            [binary, "--threads", str(threads), "serve", "--bind", f"127.0.0.1:{self.port}",
             "--database-url", f"sqlite://{db}", *self.extra_args], env=e, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if self.request("GET", "/readyz")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server did not become ready")

    def request(self, method, path, body=None, cookie="smolchat_owner=bench"):  # noqa: ARG002
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        headers = {"Content-Type": "application/json"}
        if self.cookie:
            headers["Cookie"] = self.cookie
        c.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        r = c.getresponse()
        data = r.read()
        set_cookie = r.getheader("Set-Cookie")
        if set_cookie and not self.cookie:
            self.cookie = set_cookie.split(";")[0]
        c.close()
        return r.status, (json.loads(data) if data else None)

    cookie = None

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def turn(server, conv, text):
    """Sends one message and follows the SSE stream; returns (ttft_s, total_s, summary). Only
    events after this turn's `started` count (the stream may replay the previous reply's end).
    `server` needs `port`, `cookie` (the Cookie header) and `request(method, path, body)`."""
    timeout = getattr(server, "http_timeout_s", 600)
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    c.request("GET", f"/api/conversations/{conv}/events", headers={"Cookie": server.cookie or ""})
    stream = c.getresponse()
    if stream.status != 200:
        raise RuntimeError(f"events: {stream.status}")
    t0 = time.perf_counter()
    status, body = server.request("POST", f"/api/conversations/{conv}/messages", {"content": text})
    if status != 202:
        raise RuntimeError(f"send failed: {status} {body}")
    ttft = None
    event = None
    started = False
    while True:
        line = stream.fp.readline()
        if not line:
            raise RuntimeError("stream ended early")
        line = line.decode().rstrip("\n")
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:") and event:
            if event == "started":
                started = True
            elif event in ("answer", "reasoning") and ttft is None and started:
                ttft = time.perf_counter() - t0
            elif event == "done" and started:
                total = time.perf_counter() - t0
                data = json.loads(line[5:])
                c.close()
                # A reply with no token at all: its end is the first thing seen.
                return (ttft if ttft is not None else total), total, data.get("summary", data)
            elif event == "error":
                raise RuntimeError(line)
            event = None


STEP_HISTOGRAMS = ("step", "step_engine", "step_host", "step_gap")


def step_seconds(server):
    """{name: (sum, count)} of the model worker's step histograms from /metrics: the whole step,
    its forward pass, the worker's host work, and the hop from a report to the next plan."""
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    out = {name: [0.0, 0.0] for name in STEP_HISTOGRAMS}
    for line in text.splitlines():
        for name in STEP_HISTOGRAMS:
            if line.startswith(f"smolchat_{name}_seconds_sum"):
                out[name][0] = float(line.rsplit(" ", 1)[1])
            elif line.startswith(f"smolchat_{name}_seconds_count"):
                out[name][1] = float(line.rsplit(" ", 1)[1])
    return out


def mean_ms(before, after, name):
    count = after[name][1] - before[name][1]
    return round((after[name][0] - before[name][0]) * 1e3 / count, 3) if count else None


def concurrency(server, n, new_tokens):
    convs = []
    for i in range(n):
        _, conv = server.request("POST", "/api/conversations",
                                 {"temperature": 0, "max_tokens": new_tokens, "thinking": False})
        if "id" not in (conv or {}):
            raise RuntimeError(f"creating conversation {i + 1} of {n} failed: {conv}")
        convs.append(conv["id"])
    results = [None] * n

    def run(i):
        results[i] = turn(server, convs[i], PROMPTS[i % len(PROMPTS)] + f" ({i})")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    steps_before = step_seconds(server)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    steps_after = step_seconds(server)
    steps = steps_after["step"][1] - steps_before["step"][1]
    tokens = sum(r[2]["completion_tokens"] for r in results)
    ttfts = sorted(r[0] for r in results)
    return {
        "clients": n,
        "tokens": tokens,
        "tokens_per_reply_min": min(r[2]["completion_tokens"] for r in results),
        "wall_s": round(wall, 3),
        "aggregate_tokens_per_s": round(tokens / wall, 1),
        "per_stream_tokens_per_s": round(
            sum(r[2]["completion_tokens"] / (r[2]["generation_ms"] / 1e3) for r in results) / n, 1),
        "ttft_ms_median": round(ttfts[n // 2] * 1e3, 1),
        "ttft_ms_max": round(ttfts[-1] * 1e3, 1),
        # The model worker's own step time (`smolchat_step_seconds`), to tell the engine's
        # share of a token's time from the serving path's.
        "engine_steps": steps,
        "engine_step_ms_mean": mean_ms(steps_before, steps_after, "step"),
        # Of it, the forward pass and the worker's host work; and the hop from a step's
        # report through the scheduler to the next plan, between steps.
        "forward_ms_mean": mean_ms(steps_before, steps_after, "step_engine"),
        "worker_host_ms_mean": mean_ms(steps_before, steps_after, "step_host"),
        "hop_ms_mean": mean_ms(steps_before, steps_after, "step_gap"),
    }


def long_history_text(words=700):
    base = ("The museum's collection spans ancient pottery, medieval manuscripts, early clocks, "
            "navigation instruments, and modern paintings from many countries. ")
    out = []
    while len(" ".join(out).split()) < words:
        out.append(base)
    return " ".join(out)


def second_turn(binary, threads, tmp):
    db = os.path.join(tmp, "turns.db")
    server = Server(binary, threads, db)
    history = long_history_text() + " Summarise this in one sentence."
    convs = []
    for _ in range(2):
        _, conv = server.request("POST", "/api/conversations",
                                 {"temperature": 0, "max_tokens": 16, "thinking": False})
        if "id" not in (conv or {}):
            raise RuntimeError(f"creating conversation {i + 1} of {n} failed: {conv}")
        convs.append(conv["id"])
        turn(server, conv["id"], history)
    warm_ttft, _, warm = turn(server, convs[0], "Now name one object from the collection.")
    cookie = server.cookie
    server.stop()
    # Restart: every cache is gone, the second conversation's history is re-prefilled.
    server = Server(binary, threads, db)
    server.cookie = cookie
    cold_ttft, _, cold = turn(server, convs[1], "Now name one object from the collection.")
    server.stop()
    return {
        "history_tokens": warm["prompt_tokens"],
        "warm": {"ttft_ms": round(warm_ttft * 1e3, 1), "cached_tokens": warm["cached_tokens"]},
        "cold": {"ttft_ms": round(cold_ttft * 1e3, 1), "cached_tokens": cold["cached_tokens"]},
        "cold_over_warm": round(cold_ttft / warm_ttft, 1),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--binary", default="target/release/smolchat")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clients", default="1,4,8,16")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--model", default=None, help="GGUF to serve (default: the embedded model)")
    p.add_argument("--device", default=None, help="serve --device (cpu, cuda, cuda:N)")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server")
    p.add_argument("--no-second-turn", action="store_true")
    a = p.parse_args()
    Server.extra_args = (["--model", a.model] if a.model else []) + (["--device", a.device] if a.device else [])
    Server.extra_env = dict(kv.split("=", 1) for kv in a.env)
    Server.max_running = max([16] + [int(n) for n in a.clients.split(",")])
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(a.binary, a.threads, os.path.join(tmp, "load.db"))
        try:
            rows = [concurrency(server, int(n), a.new_tokens) for n in a.clients.split(",")]
        finally:
            server.stop()
        turns = None if a.no_second_turn else second_turn(a.binary, a.threads, tmp)
    print(json.dumps({"threads": a.threads, "concurrency": rows, "second_turn": turns}, indent=2))


if __name__ == "__main__":
    sys.exit(main())

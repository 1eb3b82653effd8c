#!/usr/bin/env python3
"""Load benchmark of smolchat through its real HTTP + SSE path (issue 3).

Starts `smolchat serve` (release build) on a free port with a temporary database, then measures:
  * for 1, 4, 8 and 16 concurrent conversations: aggregate and per-stream generated tokens/s and
    time to first token (128 new tokens each, greedy, end-of-generation ignored);
  * second-turn time to first token at ~1,000 tokens of history, with a warm KV cache and with a
    cold one (same history, after a server restart).
Prints one JSON object. Standard library only.

usage: scripts/http_bench.py [--binary target/release/smolchat] [--threads 2] [--clients 1,4,8,16]
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
    def __init__(self, binary, threads, db, env=None):
        self.port = free_port()
        e = {k: v for k, v in os.environ.items() if not k.startswith("SMOLCHAT_")}
        e.update({"SMOLCHAT_SCHEDULER__MAX_RUNNING": "16", "SMOLCHAT_SCHEDULER__QUEUE_SIZE": "64",
                  "SMOLCHAT_SERVER__COOKIE_SECRET": "b" * 64, "SMOLCHAT_LOG": "warn"})
        e.update(env or {})
        self.proc = subprocess.Popen(
            [binary, "--threads", str(threads), "serve", "--bind", f"127.0.0.1:{self.port}",
             "--database-url", f"sqlite://{db}"], env=e, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if self.request("GET", "/readyz")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server did not become ready")

    def request(self, method, path, body=None, cookie="smolchat_owner=bench"):
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
    """Sends one message and follows the SSE stream; returns (ttft_s, total_s, summary)."""
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    c.request("GET", f"/api/conversations/{conv}/events", headers={"Cookie": server.cookie})
    stream = c.getresponse()
    t0 = time.perf_counter()
    status, _ = server.request("POST", f"/api/conversations/{conv}/messages", {"content": text})
    if status != 202:
        raise RuntimeError(f"send failed: {status}")
    ttft = None
    event = None
    while True:
        line = stream.fp.readline()
        if not line:
            raise RuntimeError("stream ended early")
        line = line.decode().rstrip("\n")
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:") and event:
            if event in ("answer", "reasoning") and ttft is None:
                ttft = time.perf_counter() - t0
            if event == "done":
                data = json.loads(line[5:])
                c.close()
                return ttft or 0.0, time.perf_counter() - t0, data["summary"]
            if event == "error":
                raise RuntimeError(line)


def concurrency(server, n, new_tokens):
    convs = []
    for i in range(n):
        _, conv = server.request("POST", "/api/conversations",
                                 {"temperature": 0, "max_tokens": new_tokens, "ignore_eos": True,
                                  "thinking": False})
        convs.append(conv["id"])
    results = [None] * n

    def run(i):
        results[i] = turn(server, convs[i], PROMPTS[i % len(PROMPTS)] + f" ({i})")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r[2]["completion_tokens"] for r in results)
    ttfts = sorted(r[0] for r in results)
    return {
        "clients": n,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "aggregate_tokens_per_s": round(tokens / wall, 1),
        "per_stream_tokens_per_s": round(
            sum(r[2]["completion_tokens"] / (r[2]["generation_ms"] / 1e3) for r in results) / n, 1),
        "ttft_ms_median": round(ttfts[n // 2] * 1e3, 1),
        "ttft_ms_max": round(ttfts[-1] * 1e3, 1),
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
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(a.binary, a.threads, os.path.join(tmp, "load.db"))
        try:
            rows = [concurrency(server, int(n), a.new_tokens) for n in a.clients.split(",")]
        finally:
            server.stop()
        turns = second_turn(a.binary, a.threads, tmp)
    print(json.dumps({"threads": a.threads, "concurrency": rows, "second_turn": turns}, indent=2))


if __name__ == "__main__":
    sys.exit(main())

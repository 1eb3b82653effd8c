#!/usr/bin/env python3
"""What grammar constraints cost (issue 25): the per-token mask time, and whether a constrained
sequence slows the unconstrained ones that share its batch.

Starts `smolchat serve` (release build) and, alternating for --rounds rounds, runs 8 concurrent
`/v1/chat/completions` requests of --tokens greedy tokens each (`ignore_eos`, so lengths match):
all 8 unconstrained, then 7 unconstrained beside 1 under a JSON Schema (an array of 60 integers,
so it stays constrained for its whole length). Reports the 7 unconstrained streams' aggregate
tokens/s in both cases, the constrained stream's own speed, and the mean mask time per token
(`smolchat_grammar_mask_seconds`). Standard library only; prints one JSON object.

usage: scripts/constraint_bench.py [--binary target/release/smolchat] [--threads 2] [--rounds 3]
"""
import argparse
import http.client
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from http_bench import Server  # noqa: E402

KEY = "sk-bench-admin-0123456789"
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 60, "maxItems": 60}


def complete(server, body, out, i):
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body=json.dumps(body),
              headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = json.loads(c.getresponse().read())
    c.close()
    if "usage" not in r:
        raise RuntimeError(r)
    out[i] = (r["usage"]["completion_tokens"], time.perf_counter() - t0)


def metric(server, name):
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    values = {}
    for line in text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(name + suffix):
                values[suffix] = float(line.rsplit(" ", 1)[1])
    return values.get("_sum", 0.0), values.get("_count", 0.0)


def batch(server, tokens, constrained):
    bodies = []
    for i in range(8):
        body = {"messages": [{"role": "user", "content": f"Tell me about the number {i}."}],
                "temperature": 0, "max_tokens": tokens, "ignore_eos": True}
        if constrained and i == 7:
            body = {"messages": [{"role": "user", "content": "Sixty numbers as a JSON array."}],
                    "temperature": 0, "max_tokens": 400,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}}
        bodies.append(body)
    out = [None] * 8
    threads = [threading.Thread(target=complete, args=(server, b, out, i)) for i, b in enumerate(bodies)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    plain = out[:7]
    return {
        "unconstrained_aggregate_tokens_per_s": round(sum(n for n, _ in plain) / max(s for _, s in plain), 1),
        "constrained_tokens_per_s": round(out[7][0] / out[7][1], 1) if constrained else None,
        "wall_s": round(wall, 3),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--binary", default="target/release/smolchat")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    a = p.parse_args()
    Server.extra_env = {"SMOLCHAT_SERVER__API_KEY": KEY}
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(a.binary, a.threads, os.path.join(tmp, "bench.db"))
        try:
            batch(server, 8, False)  # warm-up
            rounds = []
            for _ in range(a.rounds):
                before = metric(server, "smolchat_grammar_mask_seconds")
                free = batch(server, a.tokens, False)
                mixed = batch(server, a.tokens, True)
                after = metric(server, "smolchat_grammar_mask_seconds")
                masks = after[1] - before[1]
                rounds.append({
                    "all_unconstrained": free,
                    "one_constrained": mixed,
                    "mask_ms_per_token": round((after[0] - before[0]) * 1e3 / masks, 3) if masks else None,
                })
        finally:
            server.stop()
    print(json.dumps({"threads": a.threads, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Speculative decoding, end to end through the server: decode speed with
`scheduler.speculative` off and on, on three workloads, at 1 and 8 concurrent conversations.

  rewrite   rewrite a given code file with one small change (the reply copies the file)
  document  answer about a quoted document by quoting it
  chat      free chat (little to copy)

Each workload runs greedily (temperature 0) on a fresh server per setting, so the replies of
both settings must be identical; the script checks that and reports completion tokens per
second (all conversations together, wall time from the first request to the last reply) and
the server's draft counters. Usage:

  scripts/spec_bench.py --binary target/release/smolchat --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
      [--threads 2] [--clients 1,8] [--max-tokens 160] [--out bench.json]
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

# The workloads, in one place for every speculative-decoding benchmark.
WORKLOADS = {
    w["name"]: w["prompt"]
    for w in json.load(
        open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benches", "speculative_workloads.json"))
    )["workloads"]
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(binary, model, threads, speculative, workdir, extra_env=()):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMOLCHAT_")}
    env.update(
        {
            "SMOLCHAT_SCHEDULER__SPECULATIVE": "true" if speculative else "false",
            "SMOLCHAT_MODEL__THREADS": str(threads),
            "SMOLCHAT_LIMITS__TOKENS_PER_MINUTE_PER_USER": "0",
            "SMOLCHAT_SCHEDULER__MAX_QUEUED_PER_USER": "0",
            "SMOLCHAT_SCHEDULER__MAX_RUNNING_PER_USER": "0",
            "SMOLCHAT_LOG": "warn",
        }
    )
    for pair in extra_env:
        key, _, value = pair.partition("=")
        env[key] = value
    db = os.path.join(workdir, f"db-{port}.sqlite")
    log = open(os.path.join(workdir, f"server-{port}.log"), "w")
    proc = subprocess.Popen(
        [binary, "serve", "--bind", f"127.0.0.1:{port}", "--database-url", f"sqlite://{db}", "--model", model],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(base + "/readyz", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except Exception:
            time.sleep(0.2)
    proc.kill()
    sys.exit(f"the server did not start; see {log.name}")


def ask(base, prompt, max_tokens, user):
    """One streamed greedy reply: (text, completion tokens, seconds from the first token to the
    last, seconds to the first token)."""
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "user": user,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    req = urllib.request.Request(
        base + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    start = time.time()
    first = None
    text = []
    tokens = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    if first is None:
                        first = time.time()
                    text.append(piece)
    end = time.time()
    first = first or end
    return "".join(text), tokens, end - first, first - start


def metric(base, name):
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.split()[-1])
    return 0.0


def run(base, prompt, clients, max_tokens):
    results = [None] * clients

    def one(i):
        # A different first line per conversation, so none is served from another's cache.
        results[i] = ask(base, f"(conversation {i})\n" + prompt, max_tokens, f"bench-{i}")

    start = time.time()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - start
    tokens = sum(r[1] for r in results)
    # Decode speed per conversation: tokens after the first over the time after it.
    decode = [(r[1] - 1) / r[2] for r in results if r[2] > 0 and r[1] > 1]
    return {
        "wall_s": round(wall, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "decode_tokens_per_s": round(sum(decode) / len(decode), 1) if decode else 0.0,
        "ttft_s": round(sum(r[3] for r in results) / clients, 3),
    }, [r[0] for r in results]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server (repeatable)")
    ap.add_argument("--out")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    report = {"threads": args.threads, "max_tokens": args.max_tokens, "rows": []}
    with tempfile.TemporaryDirectory() as work:
        texts = {}
        runs = {}
        # Off and on alternate, `--repeat` times each, and each row keeps its median: a shared
        # machine's speed drifts by several percent between minutes.
        for rep in range(args.repeat):
            for speculative in ((False, True) if rep % 2 == 0 else (True, False)):
                proc, base = start(args.binary, args.model, args.threads, speculative, work, args.env)
                try:
                    ask(base, "Hi", 4, "warm-up")
                    for name, prompt in WORKLOADS.items():
                        for n in clients:
                            before = (
                                metric(base, "smolchat_spec_drafted_tokens_total"),
                                metric(base, "smolchat_spec_accepted_tokens_total"),
                            )
                            row, replies = run(base, prompt, n, args.max_tokens)
                            after = (
                                metric(base, "smolchat_spec_drafted_tokens_total"),
                                metric(base, "smolchat_spec_accepted_tokens_total"),
                            )
                            row.update(
                                {
                                    "drafted": int(after[0] - before[0]),
                                    "accepted": int(after[1] - before[1]),
                                }
                            )
                            key = (name, n)
                            texts.setdefault((key, speculative), replies)
                            row["same_replies"] = texts[(key, speculative)] == replies and texts.get((key, not speculative), replies) == replies
                            runs.setdefault((name, n, speculative), []).append(row)
                            print(json.dumps({"workload": name, "clients": n, "speculative": speculative, **row}), flush=True)
                finally:
                    proc.terminate()
                    proc.wait(timeout=30)
        for (name, n, speculative), rows in runs.items():
            median = lambda k: sorted(r[k] for r in rows)[len(rows) // 2]
            report["rows"].append(
                {
                    "workload": name,
                    "clients": n,
                    "speculative": speculative,
                    "runs": len(rows),
                    "tokens_per_s": median("tokens_per_s"),
                    "decode_tokens_per_s": median("decode_tokens_per_s"),
                    "ttft_s": median("ttft_s"),
                    "drafted": rows[0]["drafted"],
                    "accepted": rows[0]["accepted"],
                    "same_replies": all(r["same_replies"] for r in rows),
                }
            )
    # Side by side.
    for name in WORKLOADS:
        for n in clients:
            off = next(r for r in report["rows"] if r["workload"] == name and r["clients"] == n and not r["speculative"])
            on = next(r for r in report["rows"] if r["workload"] == name and r["clients"] == n and r["speculative"])
            ratio = on["tokens_per_s"] / off["tokens_per_s"] if off["tokens_per_s"] else 0
            dratio = on["decode_tokens_per_s"] / off["decode_tokens_per_s"] if off["decode_tokens_per_s"] else 0
            print(f"{name:9} {n:2} conv: end to end off {off['tokens_per_s']:7.1f} on {on['tokens_per_s']:7.1f} tok/s "
                  f"x{ratio:.2f}; decode per conversation off {off['decode_tokens_per_s']:7.1f} on "
                  f"{on['decode_tokens_per_s']:7.1f} tok/s x{dratio:.2f}; accepted {on['accepted']}/{on['drafted']}, "
                  f"same replies: {on.get('same_replies')}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Warm before send, measured through the real HTTP path (issue 50 §3). Standard library only.

Starts `smolchat serve` on a free port with a temporary database and measures, side by side:

  A. Time to first token of a ~400-token message sent after it was "typed" (its settled part
     posted to /api/conversations/{id}/draft every --draft-interval-ms, as the chat page does,
     a few words at a time), against the same message sent with no drafts, and against a
     ~20-token message; each in its own conversation with the same short history.
  B. Another user's reply (a long greedy one) in tokens/s while a typist posts drafts every
     400 ms in a conversation with a long history, against the same reply with nobody typing,
     alternated A B A B (--pairs), with the ratio pair by pair.

usage: scripts/warm_bench.py [--binary target/release/smolchat] [--threads 2] [--model M.gguf]
                             [--reps 3] [--pairs 3] [--env KEY=VALUE ...] [--out FILE]
Prints one JSON object (and writes it to --out).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from http_bench import Server, turn  # noqa: E402

SENTENCES = [
    "The harbour was quiet before dawn, and the fishing boats rocked against their ropes.",
    "A keeper climbed the spiral stairs of the lighthouse to trim the wick one last time.",
    "Gulls circled the breakwater, waiting for the first catch to come in from the grey sea.",
    "In the village, the baker lit his ovens and the smell of bread drifted down the lanes.",
    "Children would soon run to the school on the hill, their boots loud on the cobbles.",
    "Old sailors sat on the bench by the chandlery and argued about the coming weather.",
]


def long_message(sentences=18):
    text = " ".join(SENTENCES[i % len(SENTENCES)] for i in range(sentences))
    return text + " Please summarise this scene in one sentence."


SHORT = "Name three colours that you can see in a sunset over the sea."
HISTORY = "Hello! I would like to talk about a small fishing village."
COUNT = "Write a long story about a lighthouse keeper and the ships he saw."


def cpu_name():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    get = lambda k: fields.get(k, "").strip()  # noqa: E731
    return f"{get('Model name')} (family {get('CPU family')}, model {get('Model')}), {os.cpu_count()} CPUs"


def conversation(server, max_tokens):
    status, conv = server.request("POST", "/api/conversations",
                                  {"temperature": 0, "max_tokens": max_tokens, "thinking": False})
    if status != 201:
        raise RuntimeError(f"creating a conversation failed: {status} {conv}")
    return conv["id"]


def type_drafts(server, conv, text, interval_s, words_per_draft=6):
    """Posts the settled part of `text` (whole words) growing a few words at a time, as the
    page does while it is typed; returns the drafts' outcomes."""
    words = text.split(" ")
    outcomes = []
    for n in range(words_per_draft, len(words) + 1, words_per_draft):
        settled = " ".join(words[:n]) + " "
        status, out = server.request("POST", f"/api/conversations/{conv}/draft", {"content": settled})
        if status != 202:
            raise RuntimeError(f"draft refused: {status} {out}")
        outcomes.append(out)
        time.sleep(interval_s)
    return outcomes


def part_a(server, reps, interval_s):
    rows = []
    for rep in range(reps):
        row = {}
        for case in ("short", "long_no_draft", "long_typed"):
            conv = conversation(server, 8)
            turn(server, conv, HISTORY)
            if case == "long_typed":
                outs = type_drafts(server, conv, long_message(), interval_s)
                row["drafts_offered"] = sum(1 for o in outs if o.get("outcome") == "offered")
                # The page's last draft goes one interval after the typing stops.
                time.sleep(interval_s)
            text = SHORT if case == "short" else long_message()
            ttft, _, summary = turn(server, conv, text)
            row[case] = {"ttft_ms": round(ttft * 1e3, 1), "prompt_tokens": summary["prompt_tokens"],
                         "cached_tokens": summary["cached_tokens"],
                         "warmed_tokens": summary.get("warmed_tokens", 0)}
        row["typed_over_short"] = round(row["long_typed"]["ttft_ms"] / row["short"]["ttft_ms"], 3)
        row["untyped_over_short"] = round(row["long_no_draft"]["ttft_ms"] / row["short"]["ttft_ms"], 3)
        print(f"A rep {rep + 1}: {json.dumps(row)}", file=sys.stderr)
        rows.append(row)
    return rows


def rate(summary):
    gen_s = summary["generation_ms"] / 1e3
    return (summary["completion_tokens"] - 1) / gen_s if gen_s > 0 else 0.0


def part_b(server, pairs):
    typist = conversation(server, 8)
    # A long history makes each draft's prompt building realistic.
    turn(server, typist, long_message(30))
    text = long_message(12)
    out = []
    for pair in range(pairs):
        row = {}
        for case in ("alone", "typist"):
            conv = conversation(server, 300)
            stop = threading.Event()
            drafts = [0]

            def typing():
                words = text.split(" ")
                n = 3
                while not stop.is_set():
                    server.request("POST", f"/api/conversations/{typist}/draft",
                                   {"content": " ".join(words[:n]) + " "})
                    drafts[0] += 1
                    n = n % len(words) + 3
                    stop.wait(0.4)

            t = threading.Thread(target=typing) if case == "typist" else None
            if t:
                t.start()
            _, _, summary = turn(server, conv, COUNT)
            stop.set()
            if t:
                t.join()
            row[case] = {"tokens_per_s": round(rate(summary), 2),
                         "completion_tokens": summary["completion_tokens"]}
            if t:
                row[case]["drafts_posted"] = drafts[0]
        row["typist_over_alone"] = round(row["typist"]["tokens_per_s"] / row["alone"]["tokens_per_s"], 4)
        print(f"B pair {pair + 1}: {json.dumps(row)}", file=sys.stderr)
        out.append(row)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--binary", default="target/release/smolchat")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--draft-interval-ms", type=int, default=400)
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    Server.extra_args = ["--model", a.model] if a.model else []
    Server.extra_env = dict(kv.split("=", 1) for kv in a.env)
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(a.binary, a.threads, os.path.join(tmp, "warm.db"))
        try:
            rows_a = part_a(server, a.reps, a.draft_interval_ms / 1e3)
            rows_b = part_b(server, a.pairs)
        finally:
            server.stop()
    result = {
        "cpu": cpu_name(),
        "binary": a.binary,
        "model": a.model or "embedded SmolLM2-135M-Instruct Q4_1",
        "threads": a.threads,
        "ttft": rows_a,
        "ttft_median": {
            case: statistics.median(r[case]["ttft_ms"] for r in rows_a)
            for case in ("short", "long_no_draft", "long_typed")
        },
        "typed_over_short_median": statistics.median(r["typed_over_short"] for r in rows_a),
        "other_reply": rows_b,
        "typist_over_alone_median": statistics.median(r["typist_over_alone"] for r in rows_b),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())

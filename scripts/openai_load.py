#!/usr/bin/env python3
"""Concurrent streaming load on any OpenAI-compatible server (smolchat's /v1 or llama-server), so
both can be measured with the same client. Standard library only.

usage: scripts/openai_load.py URL [--clients 1,4,8,16] [--new-tokens 128]
Each client streams one chat completion (greedy, end-of-generation ignored) and the script prints
aggregate generated tokens/s (all tokens / wall time), mean per-stream tokens/s and TTFT as JSON.
"""
import argparse
import http.client
import json
import threading
import time
import urllib.parse

PROMPTS = ["Write a long story about a lighthouse keeper.", "Explain how a compiler works.",
           "Describe the water cycle in detail.", "List the planets and describe each one.",
           "Tell me about the history of the bicycle.", "How do bees make honey?",
           "Explain photosynthesis to a child.", "What makes a good cup of coffee?"]


def stream(url, prompt, new_tokens):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    first = None
    pieces = 0
    usage = None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for ch in chunk.get("choices", []):
            if ch.get("delta", {}).get("content") or ch.get("delta", {}).get("reasoning_content"):
                pieces += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else pieces
    return {"ttft": (first or end) - t0, "total": end - t0, "tokens": tokens,
            "decode_tps": (tokens - 1) / max(end - (first or end), 1e-9)}


def run(url, n, new_tokens):
    results = [None] * n
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, stream(url, PROMPTS[i % len(PROMPTS)] + f" ({i})", new_tokens))) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    return {"clients": n, "tokens": tokens, "wall_s": round(wall, 2),
            "aggregate_tokens_per_s": round(tokens / wall, 1),
            "per_stream_tokens_per_s": round(sum(r["decode_tps"] for r in results) / n, 1),
            "ttft_ms_median": round(sorted(r["ttft"] for r in results)[n // 2] * 1e3, 1)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--clients", default="1,4,8,16")
    p.add_argument("--new-tokens", type=int, default=128)
    a = p.parse_args()
    run(a.url, 1, 8)  # warm-up
    print(json.dumps([run(a.url, int(n), a.new_tokens) for n in a.clients.split(",")], indent=1))


if __name__ == "__main__":
    main()

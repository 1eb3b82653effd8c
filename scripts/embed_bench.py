#!/usr/bin/env python3
"""Embeddings throughput, smolchat against llama.cpp's `llama-embedding`, side by side.

    python3 scripts/embed_bench.py --server http://127.0.0.1:8080 \
        --llama-embedding /path/to/llama.cpp/build/bin/llama-embedding \
        --model models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 2

Embeds the same 64 texts (about 60 tokens each) with both, mean pooling, L2-normalized:
smolchat through `POST /v1/embeddings` (one request of 64 inputs, best of 3, after a warm-up),
llama.cpp in one `llama-embedding` call (wall time after its first batch starts: load
excluded; best of 3). Prints
tokens per second for each and their ratio, and the lowest cosine between the two engines'
vectors. The smolchat server must run with the same thread count (`--threads`).
"""

import argparse
import json
import math
import re
import subprocess
import time
import urllib.request

WORDS = ("river mountain quiet engine market garden lantern winter signal paper orbit harbor "
         "violin copper meadow circuit thunder pocket ladder canvas").split()


def texts(n=64, words=48):
    out = []
    for i in range(n):
        ws = [WORDS[(i * 7 + j * 3 + j * j) % len(WORDS)] for j in range(words)]
        out.append(f"Note {i}: " + " ".join(ws) + ".")
    return out


def ours(server, inputs):
    body = json.dumps({"input": inputs, "encoding_format": "float"}).encode()
    req = urllib.request.Request(f"{server}/v1/embeddings", data=body,
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        answer = json.load(r)
    return time.perf_counter() - t, answer


def llama(binary, model, threads, inputs):
    t = time.perf_counter()
    out = subprocess.run(
        [binary, "-m", model, "-t", str(threads), "--pooling", "mean", "--embd-normalize", "2",
         "--embd-output-format", "json", "--embd-separator", "<#>", "-p", "<#>".join(inputs)],
        capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t
    # Its log stamps lines `M.SS.mmm.uuu` from the start: the model is loaded by the first
    # `batch_decode`, so the embedding time is the wall time after it.
    batches = re.findall(r"(\d+)\.(\d+)\.(\d+)\.(\d+) I batch_decode: n_tokens = (\d+)", out.stderr)
    if not batches:
        raise SystemExit("no batch_decode in llama-embedding's log:\n" + out.stderr[-2000:])
    m, s, ms, us, _ = (int(x) for x in batches[0])
    loaded = m * 60 + s + ms / 1e3 + us / 1e6
    tokens = sum(int(b[4]) for b in batches)
    vectors = [d["embedding"] for d in json.loads(out.stdout)["data"]]
    return wall - loaded, tokens, vectors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--llama-embedding", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    inputs = texts()
    ours(a.server, inputs[:4])
    runs = [ours(a.server, inputs) for _ in range(3)]
    best, answer = min(runs, key=lambda r: r[0])
    tokens = answer["usage"]["prompt_tokens"]
    l_s, l_tokens, l_vectors = min((llama(a.llama_embedding, a.model, a.threads, inputs)
                                    for _ in range(3)), key=lambda r: r[0])
    mine = [d["embedding"] for d in answer["data"]]
    cos = min(sum(x * y for x, y in zip(u, v)) for u, v in zip(mine, l_vectors))
    print(json.dumps({
        "texts": len(inputs), "smolchat_tokens": tokens, "llama_tokens": l_tokens,
        "smolchat_tok_s": round(tokens / best, 1), "llama_tok_s": round(l_tokens / l_s, 1),
        "ratio": round((tokens / best) / (l_tokens / l_s), 2), "min_cosine": round(cos, 5),
    }, indent=1))


if __name__ == "__main__":
    main()

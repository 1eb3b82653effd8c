#!/usr/bin/env python3
"""Knowledge against inlining (issue 53): time to first token for a question answered from a
100-page collection, against the same question with a file that fits the window pasted in.

Starts `smolchat serve` (release build), makes a collection through `/ops/knowledge` (the admin
token) from `--pages` pages of 3,000 characters of this project's own documents (README and
docs/*.md, in order), waits for its indexing (pages a minute), then asks `--questions`
questions through `/v1/chat/completions`, streamed, each twice with its own `cache_salt` (so no
cache is shared): once with `"knowledge": [collection]` (the query's embedding, the search and
the prefill of the passages given), once with `--inline-chars` characters of the documents
around the answer pasted before the question. Time to first token is to the first content
delta. Prints one JSON object. Standard library only.

usage: scripts/knowledge_bench.py [--binary target/release/smolchat] [--threads 2]
                                  [--pages 100] [--inline-chars 24000] [--questions 5]
"""
import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import tempfile
import time
import uuid

KEY = "sk-knowledge-bench-key-0123456789"
ADMIN = "knowledge-bench-admin-token-0123456789"
PAGE = 3000

# Questions whose answers are in README.md / docs (the text holding the answer, for inlining).
QUESTIONS = [
    ("How is a consistent copy of the live SQLite database made for a backup?", "VACUUM INTO"),
    ("Which tokenizer does the conversation search index use?", "trigram"),
    ("What does tools.max_rounds limit?", "max_rounds"),
    ("How do personal API keys start?", "sk-smol-"),
    ("Why does the store close a connection whose transaction did not commit?", "WriteTx"),
    ("Which kernel took 18% of a decode step on the H200?", "rms_norm"),
    ("Where does the cookie secret come from when none is configured?", "cookie_secret"),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(port, method, path, body=None, token=KEY, raw=None, ctype="application/json", timeout=600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": ctype, "Authorization": f"Bearer {token}"}
    data = raw if raw is not None else (json.dumps(body) if body is not None else None)
    c.request(method, path, body=data, headers=headers)
    r = c.getresponse()
    out = r.read()
    c.close()
    return r.status, (json.loads(out) if out else None)


def first_token(port, body):
    """Seconds to the first content delta of a streamed chat completion, and the usage."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/chat/completions", body=json.dumps(body),
              headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    t0 = time.perf_counter()
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{r.status} {r.read()[:300]}")
    ttft, usage = None, None
    while True:
        line = r.readline()
        if not line:
            break
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for ch in chunk.get("choices", []):
            if ttft is None and ch.get("delta", {}).get("content"):
                ttft = time.perf_counter() - t0
        if chunk.get("usage"):
            usage = chunk["usage"]
    c.close()
    return ttft, usage


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--binary", default="target/release/smolchat")
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pages", type=int, default=100)
    p.add_argument("--inline-chars", type=int, default=24000)
    p.add_argument("--questions", type=int, default=5)
    a = p.parse_args()

    docs = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir("docs") if f.endswith(".md"))
    corpus = "\n\n".join(open(d, encoding="utf-8").read() for d in docs)
    text = corpus[: a.pages * PAGE]
    if len(text) < a.pages * PAGE:
        raise SystemExit(f"the documents hold only {len(text) // PAGE} pages")
    tmp = tempfile.mkdtemp(prefix="knowledge-bench-")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMOLCHAT_")}
    env.update({
        "SMOLCHAT_SERVER__API_KEY": KEY,
        "SMOLCHAT_SERVER__ADMIN_TOKEN": ADMIN,
        "SMOLCHAT_SERVER__COOKIE_SECRET": "k" * 64,
        "SMOLCHAT_LOG": "warn",
        "SMOLCHAT_LIMITS__TOKENS_PER_MINUTE_PER_USER": "0",
        "SMOLCHAT_SCHEDULER__SPECULATIVE": "false",
        "SMOLCHAT_SCHEDULER__WARM_DRAFTS": "false",
    })
    proc = subprocess.Popen(
        [a.binary, "--threads", str(a.threads), "serve", "--model", a.model, "--bind",
         f"127.0.0.1:{port}", "--database-url", f"sqlite://{tmp}/db.sqlite"],
        env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                if call(port, "GET", "/readyz")[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError("the server did not become ready")
            time.sleep(0.1)
        _, c = call(port, "POST", "/ops/knowledge", {"name": "docs"}, token=ADMIN)
        cid = c["id"]
        t0 = time.perf_counter()
        # Ten documents of a tenth each, as a collection of files would be.
        step = len(text) // 10
        for i in range(10):
            part = text[i * step:(i + 1) * step] if i < 9 else text[9 * step:]
            status, doc = call(port, "POST", f"/ops/knowledge/{cid}/documents?name=part-{i}.md",
                               raw=part.encode(), ctype="application/octet-stream", token=ADMIN)
            if status != 201:
                raise RuntimeError(f"add: {status} {doc}")
        while True:
            _, got = call(port, "GET", f"/ops/knowledge/{cid}", token=ADMIN)
            docs_state = got["documents"]
            if all(d["status"] in ("ready", "failed") for d in docs_state):
                break
            time.sleep(0.5)
        index_s = time.perf_counter() - t0
        passages = sum(d["chunks"] for d in docs_state)
        failed = [d["error"] for d in docs_state if d["status"] == "failed"]

        rows = []
        for q, needle in QUESTIONS[: a.questions]:
            at = text.find(needle)
            if at < 0:
                raise SystemExit(f"{needle!r} is not in the first {a.pages} pages")
            start = max(0, at - a.inline_chars // 2)
            inline = text[start:start + a.inline_chars]
            base = {"temperature": 0, "max_tokens": 8, "stream": True,
                    "stream_options": {"include_usage": True}}
            k_ttft, k_usage = first_token(port, dict(base, cache_salt=str(uuid.uuid4()),
                                                     knowledge=[cid],
                                                     messages=[{"role": "user", "content": q}]))
            i_ttft, i_usage = first_token(port, dict(base, cache_salt=str(uuid.uuid4()), messages=[
                {"role": "user", "content": f"{inline}\n\n{q}"}]))
            rows.append({"question": q, "knowledge_ttft_ms": k_ttft * 1e3 if k_ttft else None,
                         "knowledge_prompt_tokens": k_usage and k_usage["prompt_tokens"],
                         "inline_ttft_ms": i_ttft * 1e3 if i_ttft else None,
                         "inline_prompt_tokens": i_usage and i_usage["prompt_tokens"]})
        k = [r["knowledge_ttft_ms"] for r in rows if r["knowledge_ttft_ms"]]
        i = [r["inline_ttft_ms"] for r in rows if r["inline_ttft_ms"]]
        print(json.dumps({
            "pages": a.pages, "documents": 10, "passages": passages, "failed": failed,
            "index_s": index_s, "pages_per_minute": a.pages / index_s * 60,
            "knowledge_ttft_ms_median": statistics.median(k) if k else None,
            "inline_ttft_ms_median": statistics.median(i) if i else None,
            "inline_chars": a.inline_chars, "threads": a.threads, "rows": rows,
        }, indent=1))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()

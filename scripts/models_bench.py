#!/usr/bin/env python3
"""Two models served at once against each alone, on the same cores (issue 51).

Starts `smolchat serve` (release build) with the main model and a second one (`[[models.entries]]`,
by default a copy of the main file under another name: the same work, two model threads), then:
  * load on demand: the first request for the second model loads it (`load_s` as the server
    measured it, and that request's whole time);
  * alone: 2 x `--streams` concurrent greedy requests of `--tokens` tokens each (`ignore_eos`,
    so every reply has that length) on one model, then on the other: aggregate tokens/s;
  * together: `--streams` on each model at once (the same concurrency): aggregate tokens/s.
The ratio together / alone says what splitting the same load over two models costs on the cores
they share (1.0: nothing; below: the price of two model threads and two smaller batches). Prints one JSON object. Standard library only.

usage: scripts/models_bench.py [--binary target/release/smolchat] [--threads 2]
                               [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--second PATH]
                               [--streams 4] [--tokens 64] [--rounds 3]
"""
import argparse
import http.client
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time

KEY = "sk-models-bench-key-0123456789"
ADMIN = "models-bench-admin-token-0123456789"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(port, method, path, body=None, token=KEY, timeout=600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    c.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, (json.loads(data) if data else None)


def ask(port, model, tokens, prompt):
    status, body = call(port, "POST", "/v1/chat/completions", {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": tokens,
        "ignore_eos": True,
    })
    if status != 200:
        raise RuntimeError(f"{model}: {status} {body}")
    return body["usage"]["completion_tokens"]


def burst(port, jobs):
    """Runs (model, tokens, prompt) jobs at once; returns (generated tokens, seconds)."""
    out = [0] * len(jobs)

    def run(i, job):
        out[i] = ask(port, *job)

    threads = [threading.Thread(target=run, args=(i, j)) for i, j in enumerate(jobs)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(out), time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--binary", default="target/release/smolchat")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--second", help="the second model's file (default: a copy of --model)")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="models-bench-")
    second = a.second
    if not second:
        second = os.path.join(tmp, "second.gguf")
        shutil.copyfile(a.model, second)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMOLCHAT_")}
    env.update({
        "SMOLCHAT_SERVER__API_KEY": KEY,
        "SMOLCHAT_SERVER__ADMIN_TOKEN": ADMIN,
        "SMOLCHAT_SERVER__COOKIE_SECRET": "b" * 64,
        "SMOLCHAT_LOG": "warn",
        "SMOLCHAT_LIMITS__TOKENS_PER_MINUTE_PER_USER": "0",
        "SMOLCHAT_SCHEDULER__MAX_QUEUED_PER_USER": "0",
        "SMOLCHAT_SCHEDULER__MAX_RUNNING_PER_USER": "0",
        "SMOLCHAT_SCHEDULER__SPECULATIVE": "false",
        "SMOLCHAT_MODELS__ENTRIES": f'[{{id = "second", path = {json.dumps(second)}}}]',
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
        status, listed = call(port, "GET", "/ops/models", token=ADMIN)
        main_id = listed["models"][0]["id"]
        # Load on demand: the first request for the second model.
        t0 = time.perf_counter()
        ask(port, "second", 1, "Hello.")
        first_request_s = time.perf_counter() - t0
        _, listed = call(port, "GET", "/ops/models", token=ADMIN)
        load_s = next(m["load_s"] for m in listed["models"] if m["id"] == "second")
        ask(port, main_id, 1, "Hello.")  # warm-up
        prompts = ["Write a long story about a lighthouse keeper.",
                   "Explain how a compiler works, step by step."]
        job = lambda m, i: (m, a.tokens, prompts[i % len(prompts)])  # noqa: E731
        rounds = []
        for _ in range(a.rounds):
            # Alone with as many streams as both models get together: the same concurrency on
            # the same cores, so the ratio is what splitting it over two models costs.
            alone_main = burst(port, [job(main_id, i) for i in range(2 * a.streams)])
            alone_second = burst(port, [job("second", i) for i in range(2 * a.streams)])
            both = burst(port, [job(m, i) for m in (main_id, "second") for i in range(a.streams)])
            rate = lambda r: r[0] / r[1]  # noqa: E731
            alone = (rate(alone_main) + rate(alone_second)) / 2
            rounds.append({
                "alone_main_tok_s": round(rate(alone_main), 1),
                "alone_second_tok_s": round(rate(alone_second), 1),
                "together_tok_s": round(rate(both), 1),
                "together_over_alone": round(rate(both) / alone, 3),
            })
        ratios = sorted(r["together_over_alone"] for r in rounds)
        print(json.dumps({
            "cpu": cpu_name(),
            "threads": a.threads,
            "model": os.path.basename(a.model),
            "second": os.path.basename(second),
            "streams_per_model_together": a.streams,
            "streams_alone": 2 * a.streams,
            "tokens_per_stream": a.tokens,
            "load_on_demand_s": round(load_s, 3),
            "first_request_with_load_s": round(first_request_s, 3),
            "rounds": rounds,
            "together_over_alone_median": ratios[len(ratios) // 2],
        }, indent=2))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def cpu_name():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        fields = dict(l.split(":", 1) for l in out.splitlines() if ":" in l)
        return " ".join(fields.get(k, "").strip() for k in ("Model name", "CPU family", "Model"))
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The HTTP flows of `make gpu-check` (standard library only: the GPU machine has no network):
starts `smolchat serve` on a free port with the given model and device, then checks, as a client
would, that the server answers:

- /healthz and /readyz (ready, this model);
- a conversation: create, send a message, its reply streamed over SSE to `done`, stored complete;
- /v1/chat/completions, whole and streamed (a `finish_reason`, no error chunk);
- seeded and greedy /v1 replies repeat (tokens drawn on the device);
- n=2 choices, and /v1/embeddings (normalized, a batch equal to alone);
- /metrics: `smolchat_engine_info` names the device and tier, and whether the tier fell back;
  on a GPU, `smolchat_gpu_memory_bytes` and (fast tier) replayed decode graphs.

    scripts/gpu_http_check.py --bin ./smolchat --model M.gguf [--device cuda] [--expect-tier fast]

Prints one JSON object (what was checked, the tier, timings) and exits 0 when every check held.
`tests/gpu_check.rs` runs it against a CPU server in `make test`, so the checker itself is tested
where there is no GPU.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def call(base, method, path, body=None, headers=None, timeout=120):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("content-type", "application/json")
    req.add_header("origin", base)
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


def sse_events(base, path, cookie, until, timeout=300):
    """Reads an SSE stream until an event of type `until` (or an error) arrives."""
    req = urllib.request.Request(base + path)
    req.add_header("accept", "text/event-stream")
    req.add_header("cookie", cookie)
    events = []
    deadline = time.time() + timeout
    with urllib.request.urlopen(req, timeout=timeout) as r:
        kind = None
        for raw in r:
            line = raw.decode().rstrip("\n")
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                events.append((kind, line[5:].strip()))
                if kind in (until, "error"):
                    return events
            if time.time() > deadline:
                break
    return events


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--expect-tier", default=None)
    args = ap.parse_args()
    checks, report = [], {"device": args.device, "model": args.model}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    data = tempfile.mkdtemp(prefix="smolchat-gpu-http-")
    log = open(os.path.join(data, "server.log"), "w")
    env = dict(os.environ, SMOLCHAT_LOG="warn,smolchat=info")
    server = subprocess.Popen(
        [args.bin, "serve", "--bind", f"127.0.0.1:{port}", "--model", args.model,
         "--device", args.device, "--database-url", f"sqlite://{data}/smolchat.db"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )

    def check(name, ok, detail=""):
        checks.append({"check": name, "ok": bool(ok), "detail": str(detail)[:400]})
        return ok

    try:
        started = time.time()
        ready = False
        while time.time() - started < 300 and server.poll() is None:
            try:
                status, body, _ = call(base, "GET", "/readyz", timeout=5)
                if status == 200:
                    ready = True
                    break
            except OSError:
                pass
            time.sleep(0.5)
        report["start_s"] = round(time.time() - started, 2)
        if not check("server ready", ready, open(os.path.join(data, "server.log")).read()[-2000:]):
            return finish(report, checks)
        status, body, _ = call(base, "GET", "/healthz")
        check("healthz", status == 200, body)

        # A conversation through the JSON API and its event stream.
        status, body, headers = call(base, "POST", "/api/conversations", {})
        cookie = headers.get("set-cookie", headers.get("Set-Cookie", "")).split(";")[0]
        check("create conversation", status == 201, body)
        cid = json.loads(body)["id"] if status == 201 else ""
        t0 = time.time()
        status, body, _ = call(base, "POST", f"/api/conversations/{cid}/messages",
                               {"content": "Say hello in three words."}, {"cookie": cookie})
        check("send message", status == 202, body)
        events = sse_events(base, f"/api/conversations/{cid}/events", cookie, "done")
        kinds = [k for k, _ in events]
        check("reply streamed to done", "done" in kinds and "error" not in kinds, kinds[-5:])
        report["reply_s"] = round(time.time() - t0, 2)
        status, body, _ = call(base, "GET", f"/api/conversations/{cid}", headers={"cookie": cookie})
        stored = json.loads(body).get("messages", []) if status == 200 else []
        check("reply stored complete", any(m.get("role") == "assistant" and m.get("status") == "complete" for m in stored),
              [m.get("status") for m in stored])

        # The OpenAI-compatible API, whole and streamed.
        status, body, _ = call(base, "GET", "/v1/models")
        models = json.loads(body).get("data", []) if status == 200 else []
        check("/v1/models", bool(models), body[:300])
        model_id = models[0]["id"] if models else ""
        req = {"model": model_id, "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 24}
        status, body, _ = call(base, "POST", "/v1/chat/completions", req)
        ok = status == 200 and json.loads(body)["choices"][0]["finish_reason"] in ("stop", "length")
        check("/v1 chat completion", ok, body[:300])
        status, body, _ = call(base, "POST", "/v1/chat/completions", dict(req, stream=True))
        chunks = [json.loads(l[5:]) for l in body.splitlines() if l.startswith("data:") and l[5:].strip() != "[DONE]"]
        finished = any(c.get("choices") and c["choices"][0].get("finish_reason") for c in chunks)
        check("/v1 streamed", status == 200 and finished and not any("error" in c for c in chunks), body[-300:])

        # Tokens drawn on the device: a seeded reply is the same twice, another seed may differ,
        # and greedy replies repeat.
        def content(extra):
            st, b, _ = call(base, "POST", "/v1/chat/completions", dict(req, max_tokens=32, **extra))
            return json.loads(b)["choices"][0]["message"]["content"] if st == 200 else f"HTTP {st}: {b[:200]}"
        seeded = [content({"temperature": 1.0, "seed": 11}) for _ in range(2)]
        check("seeded replies repeat", seeded[0] == seeded[1] and not seeded[0].startswith("HTTP"), seeded)
        greedy = [content({"temperature": 0}) for _ in range(2)]
        check("greedy replies repeat", greedy[0] == greedy[1] and not greedy[0].startswith("HTTP"), greedy)

        # n choices share the prompt's KV cache on the device; each choice is a whole reply.
        st, b, _ = call(base, "POST", "/v1/chat/completions", dict(req, max_tokens=16, n=2, temperature=1.0, seed=5))
        choices = json.loads(b).get("choices", []) if st == 200 else []
        check("/v1 n=2 choices", len(choices) == 2 and all(c.get("finish_reason") in ("stop", "length") for c in choices),
              b[:300])

        # Embeddings: hidden states read back from the device, pooled and normalized; a batch
        # gives each input the vector it gets alone.
        def embed(inputs):
            st, b, _ = call(base, "POST", "/v1/embeddings", {"model": model_id, "input": inputs})
            return [d["embedding"] for d in json.loads(b)["data"]] if st == 200 else f"HTTP {st}: {b[:200]}"
        alone = embed(["The cat sat on the mat."])
        both = embed(["A different sentence, longer than the first one.", "The cat sat on the mat."])
        ok = not isinstance(alone, str) and not isinstance(both, str)
        if ok:
            norm = sum(x * x for x in alone[0]) ** 0.5
            diff = max(abs(a - b) for a, b in zip(alone[0], both[1]))
            report["embedding"] = {"dims": len(alone[0]), "norm": round(norm, 5), "batch_vs_alone_max_diff": diff}
            ok = abs(norm - 1.0) < 1e-3 and diff < 2e-2 and alone[0] != both[0]
        check("/v1/embeddings", ok, report.get("embedding", (alone, both)))

        status, body, _ = call(base, "GET", "/metrics")
        report["gpu_metrics"] = [l for l in body.splitlines()
                                 if l.startswith(("smolchat_gpu_memory_bytes", "smolchat_cuda_graph_events"))]
        if args.device.startswith("cuda"):
            def metric(prefix):
                vals = [float(l.rsplit(" ", 1)[1]) for l in body.splitlines() if l.startswith(prefix)]
                return vals[0] if vals else 0.0
            check("metrics report GPU memory", metric('smolchat_gpu_memory_bytes{part="total"}') > 0
                  and metric('smolchat_gpu_memory_bytes{part="weights"}') > 0, report["gpu_metrics"])
            if args.expect_tier == "fast":
                check("decode graphs replayed", metric('smolchat_cuda_graph_events{event="replay"}') > 0,
                      report["gpu_metrics"])
        info = [l for l in body.splitlines() if l.startswith("smolchat_engine_info")]
        report["engine_info"] = info
        tier = None
        if info:
            tier = info[0].split('tier="')[1].split('"')[0] if 'tier="' in info[0] else None
        report["tier"] = tier
        device = "cuda:0" if args.device == "cuda" else args.device
        check("metrics name the device", bool(info) and f'device="{device}"' in info[0], info)
        if args.expect_tier:
            check(f"tier is {args.expect_tier}", tier == args.expect_tier, info)
        fallback = [l for l in body.splitlines() if l.startswith("smolchat_engine_tier_fallback")]
        report["tier_fallback"] = fallback
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
    return finish(report, checks)


def finish(report, checks):
    report["checks"] = checks
    report["ok"] = all(c["ok"] for c in checks) and bool(checks)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

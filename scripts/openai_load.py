#!/usr/bin/env python3
"""The same load on any OpenAI-compatible server: ours (`smolchat serve`'s /v1) and llama-server
side by side, through one client, so their figures compare (issue 48, "a fair yardstick").

For each concurrency level N (default 1,8,32,64), N streamed `/v1/chat/completions` requests
start together, greedy, each asking for up to --new-tokens tokens; measured: time to first token
(first content chunk) per request, and tokens generated (the usage chunk's `completion_tokens`
when the server sends one, else the content chunks counted) over the wall time of the level.

Either points at a running server (URL, or --base URL), or starts one and stops it afterwards:
  --smolchat BIN --model FILE [--device D] [--env KEY=VALUE ...]   smolchat serve on a free port
  --llama-server BIN --model FILE [--ngl 99] [--parallel 64] [--ctx-size N]   llama-server likewise
A warm-up request (one client, 8 tokens) goes first. Prints one JSON object. Standard library only.
"""
import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

# The prompts of the conversation-API load (scripts/http_bench.py, beside this file), so both
# loads ask the same questions.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from http_bench import PROMPTS  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port, path, proc, seconds=300):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", path)
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"no 200 from {path} within {seconds} s")


def start_smolchat(args, tmp):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMOLCHAT_")}
    env.update({
        "SMOLCHAT_SERVER__COOKIE_SECRET": "b" * 64, "SMOLCHAT_LOG": "warn",
        # One anonymous client drives every stream: the per-client limits would throttle the
        # load this measures.
        "SMOLCHAT_LIMITS__TOKENS_PER_MINUTE_PER_USER": "0",
        "SMOLCHAT_LIMITS__TOKENS_PER_MINUTE_PER_GUEST_ADDRESS": "0",
        "SMOLCHAT_SCHEDULER__MAX_QUEUED_PER_USER": "0",
        "SMOLCHAT_SCHEDULER__MAX_RUNNING_PER_USER": "0",
        "SMOLCHAT_LIMITS__MAX_STREAMS_PER_USER": "1000",
        "SMOLCHAT_LIMITS__MAX_STREAMS_PER_ADDRESS": "1000",
        "SMOLCHAT_SCHEDULER__MAX_RUNNING": str(max(int(c) for c in args.clients.split(","))),
    })
    for kv in args.env:
        k, _, v = kv.partition("=")
        env[k] = v
    cmd = [args.smolchat, "serve", "--bind", f"127.0.0.1:{port}", "--model", args.model,
           "--database-url", f"sqlite://{tmp}/load.sqlite"]
    if args.device:
        cmd += ["--device", args.device]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    wait_ready(port, "/readyz", proc)
    return port, proc


def start_llama_server(args):
    port = free_port()
    parallel = args.parallel or max(int(c) for c in args.clients.split(","))
    cmd = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
           "-ngl", str(args.ngl), "-np", str(parallel),
           "-c", str(args.ctx_size or parallel * 512), "--temp", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    wait_ready(port, "/health", proc)
    return port, proc


def one_stream(port, model, prompt, new_tokens, key, ignore_eos=False):
    """One streamed chat completion: (seconds to the first content, tokens, error or None)."""
    request = {
        "model": model, "stream": True, "temperature": 0, "max_tokens": new_tokens,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": prompt}],
    }
    if ignore_eos:
        request["ignore_eos"] = True
    body = json.dumps(request)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    start = time.time()
    first = None
    chunks = 0
    usage = None
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        c.request("POST", "/v1/chat/completions", body, headers)
        r = c.getresponse()
        if r.status != 200:
            return None, 0, f"HTTP {r.status}: {r.read()[:300]!r}"
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content"):
                    chunks += 1
                    if first is None:
                        first = time.time() - start
    except (OSError, ValueError) as e:
        return None, 0, str(e)
    tokens = (usage or {}).get("completion_tokens") or chunks
    return first, tokens, None


def level(port, model, n, new_tokens, key, ignore_eos=False):
    results = [None] * n

    def run(i):
        prompt = PROMPTS[i % len(PROMPTS)] + f" ({i})"
        results[i] = one_stream(port, model, prompt, new_tokens, key, ignore_eos)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - start
    errors = [r[2] for r in results if r[2]]
    ttfts = [r[0] * 1000 for r in results if r[0] is not None]
    tokens = sum(r[1] for r in results)
    return {
        "clients": n,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "aggregate_tokens_per_s": round(tokens / wall, 1) if wall > 0 else 0.0,
        "per_stream_tokens_per_s": round(tokens / wall / n, 1) if wall > 0 else 0.0,
        "ttft_ms_median": round(statistics.median(ttfts), 1) if ttfts else None,
        "errors": errors[:3],
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("url", nargs="?", help="a running server: http://127.0.0.1:PORT (as --base, "
                   "with ignore_eos on unless --respect-eos)")
    p.add_argument("--base", help="a running server: http://127.0.0.1:PORT")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask for ignore_eos (smolchat takes it from admins only)")
    p.add_argument("--respect-eos", action="store_true")
    p.add_argument("--smolchat", help="start `BIN serve` on a free port")
    p.add_argument("--llama-server", help="start llama-server on a free port")
    p.add_argument("--model", help="GGUF file the started server loads (and the request's model)")
    p.add_argument("--device", default=None)
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for smolchat serve")
    p.add_argument("--ngl", type=int, default=99)
    p.add_argument("--parallel", type=int, default=0, help="llama-server -np (default: most clients)")
    p.add_argument("--ctx-size", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", default=None,
                   help="concurrency levels (default 1,8,32,64; with a positional URL 1,4,8,16)")
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args()
    if args.url:
        args.base = args.base or args.url
        args.ignore_eos = not args.respect_eos
    args.clients = args.clients or ("1,4,8,16" if args.url else "1,8,32,64")
    chosen = [x for x in (args.base, args.smolchat, args.llama_server) if x]
    if len(chosen) != 1 or (args.url and args.base != args.url):
        p.error("give exactly one of --base, --smolchat, --llama-server")
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if args.base:
                port = int(args.base.rsplit(":", 1)[1].strip("/"))
                server = args.base
            elif args.smolchat:
                port, proc = start_smolchat(args, tmp)
                server = "smolchat"
            else:
                port, proc = start_llama_server(args)
                server = "llama-server"
            model = os.path.basename(args.model or "") or "default"
            level(port, model, 1, 8, args.api_key, args.ignore_eos)  # warm-up
            levels = [level(port, model, int(n), args.new_tokens, args.api_key, args.ignore_eos)
                      for n in args.clients.split(",")]
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    out = {"server": server, "new_tokens": args.new_tokens, "concurrency": levels}
    print(json.dumps(out))
    if any(lv["errors"] for lv in levels):
        sys.exit(1)


if __name__ == "__main__":
    main()

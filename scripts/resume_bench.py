#!/usr/bin/env python3
"""Time to first token when a user comes back to a conversation (issue 50), through the real
HTTP + SSE path.

For each size N (prompt tokens of history: 500, 2000, 4000 by default) it builds conversations of
about N tokens (one long, varied, unique first message; a reply of a few tokens) and measures the
next turn's time to first token in five situations, side by side in one run:

  warm       the conversation's KV cache is still on the device (the next turn right away);
  evicted    after an admin eviction (`POST /admin/c/{id}/evict`): the KV spill tier writes the
             cache to `<spill dir>/<id>.kv` and reads it back when the conversation returns;
  opened     the same, but the conversation is opened (`GET /api/conversations/{id}`, as its page
             does) a second before the turn: the server reads the file ahead, off the model
             thread, so the turn finds the cache in memory;
  restart    after the server is stopped (SIGTERM: it writes its idle caches to the spill
             directory) and started again on the same database;
  prefilled  with the spill tier off (`SMOLCHAT_SCHEDULER__KV_SPILL_MIB=0`), after an eviction:
             the whole prompt is computed again.

Each situation has a conversation of its own (built the same way), so every measured turn is the
second turn of a conversation of about N tokens. For each it reports ttft_ms and the reply's
prompt_tokens and cached_tokens, the ratios restored/warm and prefill/restored, and the spill
files' bytes on disk per 1,000 cached tokens (each file's JSON header gives raw_bytes, the f16
K/V blocks, and data_bytes, the same zstd-compressed). The files are read back from the OS page
cache (they were just written): the figures are the tier's own cost, not a cold disk's.

The server runs with `kv_spill_idle_s` at a day (overridable with --env) so that no idle write
competes with a measurement; the eviction and the stop write what is measured.

Prints progress to stderr and one JSON object to stdout (and to --out). Standard library only.

usage: scripts/resume_bench.py [--binary /tmp/resume-bench/smolchat] [--model M.gguf]
                               [--threads 2] [--sizes 500,2000,4000] [--repeat 1]
                               [--env KEY=VALUE ...] [--out FILE] [--note TEXT]
"""
import argparse
import glob
import http.client
import json
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from http_bench import turn  # noqa: E402

ADMIN_TOKEN = "resume-bench-admin-token-0123456789"
HTTP_TIMEOUT_S = 3600
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`smolchat serve` on a free port; `db` a SQLite file (its spill directory beside it)."""
    binary = None
    threads = 2
    extra_args = []
    extra_env = {}
    log_dir = None

    def __init__(self, db, env=None, label="server", cookies=None):
        self.port = free_port()
        # The guest's owner cookie (and the admin session's), kept across a restart.
        self.cookies = dict(cookies or {})
        self.csrf = None
        self.db = db
        self.label = label
        e = {k: v for k, v in os.environ.items() if not k.startswith("SMOLCHAT_")}
        e.update({"SMOLCHAT_SERVER__COOKIE_SECRET": "b" * 64,
                  "SMOLCHAT_SERVER__ADMIN_TOKEN": ADMIN_TOKEN,
                  "SMOLCHAT_LOG": "info",
                  # One guest drives every conversation: the per-owner limits would get in the way.
                  "SMOLCHAT_LIMITS__CONVERSATIONS_PER_MINUTE": "0",
                  "SMOLCHAT_LIMITS__TOKENS_PER_MINUTE_PER_USER": "0",
                  "SMOLCHAT_LIMITS__TOKENS_PER_MINUTE_PER_GUEST_ADDRESS": "0",
                  "SMOLCHAT_LIMITS__MAX_MESSAGE_CHARS": "200000",
                  "SMOLCHAT_SCHEDULER__MAX_QUEUED_PER_USER": "0",
                  "SMOLCHAT_SCHEDULER__MAX_RUNNING_PER_USER": "0",
                  "SMOLCHAT_SCHEDULER__REQUEST_TIMEOUT_S": "0",
                  # No idle writes during the measurements (the stop writes every cache anyway).
                  "SMOLCHAT_SCHEDULER__KV_SPILL_IDLE_S": "86400"})
        e.update(self.extra_env)
        e.update(env or {})
        self.env = {k: v for k, v in e.items() if k.startswith("SMOLCHAT_")}
        self.log_path = os.path.join(self.log_dir, f"{label}-{self.port}.log")
        self.log_file = open(self.log_path, "wb")
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            [self.binary, "--threads", str(self.threads), "serve", "--bind",
             f"127.0.0.1:{self.port}", "--database-url", f"sqlite://{db}", *self.extra_args],
            env=e, stdout=self.log_file, stderr=subprocess.STDOUT)
        deadline = time.time() + 900
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{label} exited ({self.proc.returncode}); see {self.log_path}")
            try:
                if self.request("GET", "/readyz")[0] == 200:
                    self.start_s = time.perf_counter() - started
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{label} did not become ready; see {self.log_path}")

    def cookie_header(self):
        return "; ".join(f"{k}={v}" for k, v in self.cookies.items())

    http_timeout_s = HTTP_TIMEOUT_S

    @property
    def cookie(self):
        """The Cookie header (what `http_bench.turn` sends)."""
        return self.cookie_header()

    def request(self, method, path, body=None, form=None, headers=None, timeout=HTTP_TIMEOUT_S):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        h = {"Cookie": self.cookie_header()} if self.cookies else {}
        if form is not None:
            h["Content-Type"] = "application/x-www-form-urlencoded"
            payload = urllib.parse.urlencode(form)
        elif body is not None:
            h["Content-Type"] = "application/json"
            payload = json.dumps(body)
        else:
            payload = None
        h.update(headers or {})
        c.request(method, path, body=payload, headers=h)
        r = c.getresponse()
        data = r.read()
        for k, v in r.getheaders():
            if k.lower() == "set-cookie":
                name, _, value = v.split(";")[0].partition("=")
                if value:
                    self.cookies[name.strip()] = value.strip()
        c.close()
        try:
            parsed = json.loads(data) if data else None
        except ValueError:
            parsed = data.decode(errors="replace")
        return r.status, parsed

    def admin_login(self):
        """The admin page's CSRF token (per owner) and an admin-token session cookie."""
        status, page = self.request("GET", "/admin")
        m = re.search(r'data-csrf="([^"]+)"', page if isinstance(page, str) else "")
        if not m:
            raise RuntimeError(f"no CSRF token on /admin ({status})")
        self.csrf = m.group(1)
        status, body = self.request("POST", "/admin/login", form={"token": ADMIN_TOKEN},
                                    headers={"X-CSRF-Token": self.csrf})
        if status not in (200, 204) or "smolchat_admin" not in self.cookies:
            raise RuntimeError(f"admin login failed: {status} {body}")

    def evict(self, conv):
        status, body = self.request("POST", f"/admin/c/{conv}/evict",
                                    headers={"X-CSRF-Token": self.csrf})
        if status != 204:
            raise RuntimeError(f"evict failed: {status} {body}")

    def metrics(self):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
        c.close()
        out = {}
        for line in text.splitlines():
            if line.startswith("smolchat_kv_spill") and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                if "_bucket" not in name:
                    try:
                        out[name] = float(value)
                    except ValueError:
                        pass
        return out

    def stop(self):
        """SIGTERM and wait (the stop writes every idle cache to the spill tier); seconds."""
        t = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(900)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"{self.label} did not stop within 900 s; see {self.log_path}")
        self.log_file.close()
        return time.perf_counter() - t


SUBJECTS = ["The old harbour", "A quiet librarian", "The northern railway", "Our science club",
            "The village baker", "A curious fox", "The city council", "An orchestra violinist",
            "The mountain observatory", "A retired sailor", "The school garden", "A young architect",
            "The river ferry", "The weather station", "A travelling painter", "The museum guard"]
VERBS = ["carefully repaired", "described in detail", "photographed at dawn", "argued about",
         "measured twice", "painted in bright colours", "wrote a letter about", "quietly studied",
         "sold at the market", "forgot about", "rebuilt after the storm", "counted every morning"]
OBJECTS = ["seventeen wooden boats", "a map of the coastline", "the broken clock tower",
           "three baskets of apples", "an unusual green stone", "the recipe for barley bread",
           "a collection of brass keys", "the timetable for winter", "a box of faded postcards",
           "the bridge over the canal", "a pair of leather boots", "the lighthouse lamp"]
TAILS = ["before the festival began", "while the rain kept falling", "during the long winter",
         "as the tide came in", "after the last train left", "on a Tuesday in April",
         "without telling anyone", "with the help of two neighbours", "for the third time",
         "near the edge of the forest", "just before sunset", "in front of the whole town"]


def history_text(chars, seed):
    """About `chars` characters of varied sentences, unique to `seed` from the first token."""
    rng = random.Random(seed)
    out = [f"Notebook {seed:08x}, entry {rng.randrange(10**6)}."]
    n = len(out[0])
    while n < chars:
        s = (f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
             f"{rng.choice(TAILS)}, number {rng.randrange(1000)}.")
        out.append(s)
        n += len(s) + 1
    return " ".join(out)


FIRST_ASK = " Reply with one word: did you read the notes?"
NEXT_TURN = "Name one object from the notes, in one word."


class Builder:
    """Conversations of about N prompt tokens: the characters per token are learnt from the
    replies' prompt_tokens as it goes."""

    def __init__(self, new_tokens):
        self.chars_per_token = 4.2
        self.overhead_tokens = 40
        self.new_tokens = new_tokens
        self.seed = random.Random(os.getpid() ^ int(time.time())).randrange(1 << 31)

    def build(self, server, n):
        _, conv = server.request("POST", "/api/conversations",
                                 {"temperature": 0, "max_tokens": self.new_tokens,
                                  "thinking": False})
        if "id" not in (conv or {}):
            raise RuntimeError(f"creating a conversation failed: {conv}")
        self.seed += 1
        chars = int(max(n - self.overhead_tokens, 20) * self.chars_per_token)
        text = history_text(chars, self.seed) + FIRST_ASK
        ttft, total, s = turn(server, conv["id"], text)
        prompt = s["prompt_tokens"]
        # Learn the ratio from what the text cost (the overhead is the template and the ask).
        if prompt > self.overhead_tokens + 50:
            self.chars_per_token = len(text) / max(prompt - self.overhead_tokens, 1)
        return conv["id"], {"prompt_tokens": prompt, "cached_tokens": s.get("cached_tokens"),
                            "completion_tokens": s.get("completion_tokens"),
                            "ttft_ms": round(ttft * 1e3, 1), "total_ms": round(total * 1e3, 1)}


def spill_dir(db):
    return os.path.join(os.path.dirname(db), "kv-spill", "local")


def spill_file_info(path):
    """A spill file's size and header (see crates/serving/src/spill.rs: b"SMOLKV1\\n", a u32 LE
    header length, the JSON header, then the tokens and the compressed blocks)."""
    with open(path, "rb") as f:
        head = f.read(12)
        if head[:8] != b"SMOLKV1\n":
            raise RuntimeError(f"{path}: not a spill file")
        n = int.from_bytes(head[8:12], "little")
        header = json.loads(f.read(n))
    return {"file_bytes": os.path.getsize(path), "tokens": header["tokens"],
            "raw_bytes": header["raw_bytes"], "data_bytes": header["data_bytes"],
            "format": header.get("format")}


def find_spill_file(db, conv):
    p = os.path.join(spill_dir(db), f"{conv}.kv")
    if os.path.exists(p):
        return p
    found = glob.glob(os.path.join(os.path.dirname(db), "**", f"{conv}.kv"), recursive=True)
    return found[0] if found else None


def evict_to_disk(server, db, conv, timeout=900):
    """Evicts `conv` and waits until its spill file is whole on disk (re-sending the eviction
    while no write has begun: a reply still finishing is not evicted)."""
    t0 = time.perf_counter()
    last_send = -10.0
    while time.perf_counter() - t0 < timeout:
        path = find_spill_file(db, conv)
        if path:
            time.sleep(0.5)  # the writer's report, so the next turn reads the file
            return path, time.perf_counter() - t0
        tmp = glob.glob(os.path.join(os.path.dirname(db), "**", f"{conv}.kv.tmp"), recursive=True)
        if not tmp and time.perf_counter() - last_send > 5:
            server.evict(conv)
            last_send = time.perf_counter()
        time.sleep(0.05)
    raise RuntimeError(f"no spill file for {conv} after {timeout} s of evictions")


def summary_row(ttft, s):
    return {"ttft_ms": round(ttft * 1e3, 1), "prompt_tokens": s["prompt_tokens"],
            "cached_tokens": s.get("cached_tokens"), "completion_tokens": s.get("completion_tokens")}


def per_1k(info, cached):
    if not info or not cached:
        return None
    return {"file_bytes": info["file_bytes"], "raw_bytes": info["raw_bytes"],
            "data_bytes": info["data_bytes"], "header_tokens": info["tokens"],
            "cached_tokens": cached, "format": info["format"],
            "file_bytes_per_1k_tokens": round(info["file_bytes"] * 1000 / cached),
            "raw_bytes_per_1k_tokens": round(info["raw_bytes"] * 1000 / cached),
            "data_bytes_per_1k_tokens": round(info["data_bytes"] * 1000 / cached),
            "compressed_over_raw": round(info["data_bytes"] / info["raw_bytes"], 4)}


# How long after opening an evicted conversation its next message is sent ("opened").
OPENED_DELAY_S = 1.0


def one_round(sizes, tmp, builder, r):
    """One measurement of every situation at every size; {size: {situation: row}}."""
    out = {n: {} for n in sizes}
    timings = {}
    db = os.path.join(tmp, f"round{r}", "spill-on.db")
    os.makedirs(os.path.dirname(db))
    log(f"round {r + 1}: starting the server (spill tier on)")
    server = Server(db, label=f"r{r}-on")
    timings["start_s"] = round(server.start_s, 2)
    server.admin_login()
    # Warm-up (and the first estimate of characters per token): not measured.
    builder.build(server, 150)
    restart_convs = {}
    for n in sizes:
        log(f"round {r + 1}, N={n}: warm (building)")
        conv, b = builder.build(server, n)
        ttft, _, s = turn(server, conv, NEXT_TURN)
        out[n]["warm"] = summary_row(ttft, s) | {"build": b}
        log(f"  warm ttft {ttft * 1e3:.1f} ms, prompt {s['prompt_tokens']}, cached {s.get('cached_tokens')}")

        log(f"round {r + 1}, N={n}: evicted (building)")
        conv, b = builder.build(server, n)
        before = server.metrics()
        path, waited = evict_to_disk(server, db, conv)
        info = spill_file_info(path)
        ttft, _, s = turn(server, conv, NEXT_TURN)
        after = server.metrics()
        row = summary_row(ttft, s) | {"build": b, "evict_to_file_s": round(waited, 2),
                                      "spill_file": per_1k(info, s.get("cached_tokens"))}
        count = after.get("smolchat_kv_spill_restore_seconds_count", 0) - before.get(
            "smolchat_kv_spill_restore_seconds_count", 0)
        if count:
            row["server_restore_ms"] = round((after["smolchat_kv_spill_restore_seconds_sum"] - before.get(
                "smolchat_kv_spill_restore_seconds_sum", 0)) * 1e3 / count, 1)
        row["file_left_after_turn"] = os.path.exists(path)
        out[n]["evicted"] = row
        log(f"  evicted ttft {ttft * 1e3:.1f} ms, prompt {s['prompt_tokens']}, cached {s.get('cached_tokens')}, "
            f"file {info['file_bytes']} B for {info['tokens']} tokens")

        log(f"round {r + 1}, N={n}: opened (building)")
        conv, b = builder.build(server, n)
        path, waited = evict_to_disk(server, db, conv)
        # The user opens the conversation (its page, or the API's GET), which reads the spilled
        # cache ahead, and sends a moment later.
        server.request("GET", f"/api/conversations/{conv}")
        time.sleep(OPENED_DELAY_S)
        ttft, _, s = turn(server, conv, NEXT_TURN)
        out[n]["opened"] = summary_row(ttft, s) | {"build": b, "evict_to_file_s": round(waited, 2)}
        log(f"  opened ttft {ttft * 1e3:.1f} ms, prompt {s['prompt_tokens']}, cached {s.get('cached_tokens')}")

        log(f"round {r + 1}, N={n}: restart (building)")
        conv, b = builder.build(server, n)
        restart_convs[n] = (conv, b)
    log(f"round {r + 1}: stopping the server (SIGTERM)")
    timings["stop_s"] = round(server.stop(), 2)
    files = {n: find_spill_file(db, c) for n, (c, _) in restart_convs.items()}
    infos = {n: spill_file_info(p) if p else None for n, p in files.items()}
    log(f"round {r + 1}: stopped in {timings['stop_s']} s; starting it again on the same database")
    server = Server(db, label=f"r{r}-restart", cookies=server.cookies)
    timings["restart_start_s"] = round(server.start_s, 2)
    for n in sizes:
        conv, b = restart_convs[n]
        before = server.metrics()
        ttft, _, s = turn(server, conv, NEXT_TURN)
        after = server.metrics()
        row = summary_row(ttft, s) | {"build": b, "spill_file": per_1k(infos[n], s.get("cached_tokens"))}
        count = after.get("smolchat_kv_spill_restore_seconds_count", 0) - before.get(
            "smolchat_kv_spill_restore_seconds_count", 0)
        if count:
            row["server_restore_ms"] = round((after["smolchat_kv_spill_restore_seconds_sum"] - before.get(
                "smolchat_kv_spill_restore_seconds_sum", 0)) * 1e3 / count, 1)
        if files[n] is None:
            row["note"] = "no spill file after the stop"
        out[n]["restart"] = row
        log(f"round {r + 1}, N={n}: restart ttft {ttft * 1e3:.1f} ms, prompt {s['prompt_tokens']}, "
            f"cached {s.get('cached_tokens')}")
    server.stop()

    db_off = os.path.join(tmp, f"round{r}", "off", "spill-off.db")
    os.makedirs(os.path.dirname(db_off))
    log(f"round {r + 1}: starting the server with the spill tier off")
    server = Server(db_off, env={"SMOLCHAT_SCHEDULER__KV_SPILL_MIB": "0"}, label=f"r{r}-off")
    server.admin_login()
    builder.build(server, 150)
    for n in sizes:
        log(f"round {r + 1}, N={n}: prefilled (building)")
        conv, b = builder.build(server, n)
        server.evict(conv)
        time.sleep(0.5)
        ttft, _, s = turn(server, conv, NEXT_TURN)
        out[n]["prefilled"] = summary_row(ttft, s) | {"build": b}
        log(f"  prefilled ttft {ttft * 1e3:.1f} ms, prompt {s['prompt_tokens']}, cached {s.get('cached_tokens')}")
    server.stop()
    leftovers = glob.glob(os.path.join(os.path.dirname(db_off), "**", "*.kv"), recursive=True)
    timings["spill_off_files_left"] = len(leftovers)
    return out, timings


def cpu_info():
    info = {"cores": os.cpu_count(), "machine": platform.machine()}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in text.splitlines():
            k, _, v = line.partition(":")
            k = k.strip()
            if k in ("Model name", "CPU family", "Model", "Vendor ID", "Hypervisor vendor"):
                info[k.lower().replace(" ", "_")] = v.strip()
        flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                      if line.startswith("Flags")), [])
        info["avx512"] = "avx512f" in flags
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def median_row(rows):
    out = {}
    for key in ("ttft_ms", "prompt_tokens", "cached_tokens", "completion_tokens"):
        vals = [x[key] for x in rows if x.get(key) is not None]
        out[key] = round(statistics.median(vals), 1) if vals else None
    if len(rows) > 1:
        out["ttft_ms_all"] = [x["ttft_ms"] for x in rows]
    files = [x["spill_file"] for x in rows if x.get("spill_file")]
    if files:
        out["spill_file"] = files[0] if len(files) == 1 else {
            k: statistics.median([f[k] for f in files]) for k in files[0] if k != "format"}
    restores = [x["server_restore_ms"] for x in rows if x.get("server_restore_ms") is not None]
    if restores:
        out["server_restore_ms"] = round(statistics.median(restores), 1)
    return out


def ratio(a, b):
    return round(a / b, 2) if a and b else None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_binary = ("/tmp/resume-bench/smolchat" if os.path.exists("/tmp/resume-bench/smolchat")
                      else "target/release/smolchat")
    p.add_argument("--binary", default=default_binary)
    p.add_argument("--model", default=None, help="GGUF to serve (default: the server's default)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sizes", default="500,2000,4000")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server")
    p.add_argument("--repeat", type=int, default=1, help="rounds; the figures are their median")
    p.add_argument("--new-tokens", type=int, default=4, help="max_tokens of every reply")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--note", default=None, help="a remark kept in the JSON")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, files)")
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    Server.binary = a.binary
    Server.threads = a.threads
    Server.extra_args = ["--model", a.model] if a.model else []
    Server.extra_env = dict(kv.split("=", 1) for kv in a.env)
    tmp = tempfile.mkdtemp(prefix="resume-bench-")
    Server.log_dir = tmp
    log(f"binary {a.binary}, model {a.model or '(default)'}, sizes {sizes}, temp {tmp}")
    builder = Builder(a.new_tokens)
    load_before = os.getloadavg()
    started = time.time()
    rounds, timings = [], []
    try:
        for r in range(a.repeat):
            rows, t = one_round(sizes, tmp, builder, r)
            rounds.append(rows)
            timings.append(t)
    finally:
        if not a.keep:
            subprocess.run(["rm", "-rf", tmp], check=False)
    results = []
    for n in sizes:
        row = {"size": n}
        for sit in ("warm", "evicted", "opened", "restart", "prefilled"):
            row[sit] = median_row([rd[n][sit] for rd in rounds])
        w, e, rs, pf = (row[s]["ttft_ms"] for s in ("warm", "evicted", "restart", "prefilled"))
        row["ratios"] = {"evicted_over_warm": ratio(e, w), "restart_over_warm": ratio(rs, w),
                         "opened_over_warm": ratio(row["opened"]["ttft_ms"], w),
                         "prefill_over_evicted": ratio(pf, e), "prefill_over_restart": ratio(pf, rs),
                         "prefill_over_warm": ratio(pf, w)}
        f = row["evicted"].get("spill_file") or row["restart"].get("spill_file")
        row["bytes_on_disk_per_1k_tokens"] = f and f["file_bytes_per_1k_tokens"]
        results.append(row)
    model = a.model
    out = {
        "benchmark": "resume_bench (issue 50): time to first token on coming back to a conversation",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu_info(),
        "threads": a.threads,
        "binary": a.binary,
        "model": model or "(server default)",
        "model_bytes": os.path.getsize(model) if model and os.path.exists(model) else None,
        "env": Server.extra_env,
        "new_tokens": a.new_tokens,
        "repeat": a.repeat,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.time() - started, 1),
        "note": a.note,
        "results": results,
        "server_timings": timings,
        "rounds": [{str(n): rd[n] for n in sizes} for rd in rounds],
    }
    text = json.dumps(out, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    log(f"done in {out['wall_s']} s")


if __name__ == "__main__":
    sys.exit(main())

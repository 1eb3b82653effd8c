#!/usr/bin/env python3
"""The Python half of scripts/gpu-check.sh (standard library only): phase records, the reason a
phase failed in one line, the env phase, the comparison with llama.cpp's figures
(docs/bench-data/gpu-anchors.json), Nsight Compute's per-kernel table, the phase-by-phase
report, and the lease's report (gpu-lease.json, gpu-lease.md) and raw archive, rewritten after
every phase.

    gpu_check.py record OUT_JSON PHASE STATUS SECONDS LOG [RESULT_JSON]
    gpu_check.py env --out DIR --bundle DIR --device D [--smi nvidia-smi]
    gpu_check.py ncu-summary CSV_LOG [WORKLOAD]
    gpu_check.py report OUT
    gpu_check.py lease-init STATE --budget S --device D --out DIR --bundle DIR --records DIR
                            [--card NAME] [--anchors FILE] PHASE=ESTIMATE...
    gpu_check.py lease-gate STATE PHASE LEFT      prints why PHASE is skipped, or nothing
    gpu_check.py lease-skip STATE PHASE REASON
    gpu_check.py lease-start STATE PHASE LIMIT
    gpu_check.py lease-done STATE PHASE RC SECONDS
    gpu_check.py lease-finish STATE               prints the Markdown report; exit 1 on failure
"""
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

# Phases that need a GPU (and the bundle's gpu-tests); the rest dry-run with --device cpu.
GPU_ONLY = {"kernels", "tiers", "profile", "sanitizer", "llama"}
# The prompt each sequence of `smolchat bench`'s batched measurement starts from (bench.rs,
# batched_decode), and the untimed decode steps before each timed run.
BATCHED_PROMPT = 16
WARMUP_STEPS = 2
# What one file of the raw archive keeps (its head and tail), and what the archive may weigh.
ARCHIVE_FILE_HEAD = 16 * 1024
ARCHIVE_FILE_TAIL = 112 * 1024
ARCHIVE_MAX = 512 * 1024


def load(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def dump(obj, path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def read_tail(path, n):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


# --- why a phase failed, in one line ------------------------------------------------------------

DRIVER = re.compile(r"CUDA_ERROR\w*|DriverError|cudaError\w*|no kernel image|unsupported PTX|"
                    r"PTX JIT|libcuda\.so[.\d]* *(=> not found|: cannot open)|UNSUPPORTED_PTX", re.I)


def reason_from_log(text):
    """The line of a phase's log that says why it failed: a timeout, a CUDA driver error, the
    failed tests and the first panic message, an error line; else the last line."""
    lines = [l.rstrip() for l in text.splitlines()]
    for l in lines:
        if l.startswith("gpu-check: timed out"):
            return l[len("gpu-check: "):]
    first = None
    for l in lines:
        if DRIVER.search(l):
            first = l.strip()
            break
    if first is None:
        for i, l in enumerate(lines):
            if "panicked at" in l:
                msg = l.split("panicked at", 1)[1].strip()
                # Since Rust 1.73 the message is on the next line.
                if msg.endswith(":") and i + 1 < len(lines):
                    msg = lines[i + 1].strip()
                first = msg
                break
    if first is None:
        # A Python traceback's last line; else the first line that says error.
        exc = [l.strip() for l in lines if re.match(r"[A-Za-z_.]*(Error|Exception)\b:", l.strip())]
        errors = [l.strip() for l in lines
                  if re.match(r"==ERROR==|(error|Error|ERROR)\b", l.strip()) or
                  (l.startswith("gpu-check: ") and len(l.strip()) > len("gpu-check: "))]
        first = exc[-1] if exc else (errors[0] if errors else None)
    failed = []
    if "test result: FAILED" in text:
        section = text.rsplit("\nfailures:\n", 1)
        if len(section) == 2:
            for l in section[1].splitlines():
                s = l.strip()
                if not s or s.startswith("test result"):
                    break
                failed.append(s)
    if first is None:
        rest = [l.strip() for l in lines if l.strip()]
        first = rest[-1] if rest else "no output"
    if first.startswith("gpu-check: "):
        first = first[len("gpu-check: "):]
    if failed:
        first = f"{len(failed)} test(s) failed ({', '.join(failed[:4])}{', …' if len(failed) > 4 else ''}): {first}"
    return first[:400]


# --- phase records ------------------------------------------------------------------------------

def record(path, name, status, seconds, log, result=None, reason=None):
    tail = read_tail(log, 6000)
    rec = {"phase": name, "status": status, "seconds": float(seconds), "detail": tail}
    if status == "failed":
        # The HTTP phase's failed checks, else the log's line.
        bad = [c for c in (result or {}).get("checks", []) if isinstance(c, dict) and not c.get("ok")] \
            if isinstance(result, dict) else []
        if not reason and bad:
            reason = f"{len(bad)} check(s) failed: " + "; ".join(
                f"{c.get('check')}: {str(c.get('detail', ''))[:160]}" for c in bad[:3])
        rec["reason"] = reason or reason_from_log(read_tail(log, 200000))
    elif status == "skipped":
        rec["reason"] = reason or (tail.strip().splitlines() or [""])[-1]
    if result is not None:
        rec["result"] = result
    dump(rec, path)
    line = f"gpu-check {name}: {status} ({float(seconds):.0f} s)"
    if rec.get("reason"):
        line += f": {rec['reason']}"
    print(line)
    return rec


def cmd_record(args):
    path, name, status, seconds, log = args[:5]
    result = None
    if len(args) > 5 and args[5] not in ("", "null"):
        try:
            result = json.loads(args[5])
        except ValueError:
            result = None
    record(path, name, status, seconds, log, result)
    return 1 if status == "failed" else 0


# --- env ----------------------------------------------------------------------------------------

def run(cmd, timeout=30, env=None):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        return p.returncode, p.stdout, p.stderr
    except FileNotFoundError:
        return None, "", f"{cmd[0]}: not found"
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, "", str(e)


def cmd_env(argv):
    opts = dict(zip(argv[::2], argv[1::2]))
    out, bundle, device = opts["--out"], opts["--bundle"], opts["--device"]
    smi = opts.get("--smi") or "nvidia-smi"
    log_path = os.path.join(out, "env.log")
    problems, info, log = [], {"device": device}, []

    # The GPU.
    if shutil.which(smi) is None:
        problems.append(f"no GPU: {smi} is not installed")
        info["gpu"] = False
    else:
        rc, so, se = run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
        log += [f"$ {smi} --query-gpu=name,driver_version,memory.total --format=csv,noheader", so + se]
        rows = [r for r in so.splitlines() if r.strip()]
        if rc != 0:
            first = (se.strip() or so.strip() or f"exit status {rc}").splitlines()[0]
            problems.append(f"no GPU: {smi} failed: {first}")
            info["gpu"] = False
        elif not rows:
            problems.append(f"no GPU: {smi} lists no device")
            info["gpu"] = False
        else:
            name, driver, memory = ([c.strip() for c in rows[0].split(",")] + ["", "", ""])[:3]
            info.update(gpu=True, card=name, driver=driver, memory=memory, gpus=len(rows))
        rc, so, se = run([smi], timeout=30)
        log += [f"$ {smi}", so + se]

    # The bundle.
    bin_ = os.path.join(bundle, "smolchat")
    tests = os.path.join(bundle, "gpu-tests")
    if not os.access(bin_, os.X_OK):
        xz = [f for f in os.listdir(bundle) if f.endswith(".xz")] if os.path.isdir(bundle) else []
        problems.append(f"no bundle: {bundle}/*.xz missing (`make gpu-bundle` builds "
                        f"target/gpu-bundle; carry it)" if not xz else
                        f"no bundle: {bundle}/smolchat did not unpack from {', '.join(xz)}")
        info["bundle"] = False
    else:
        info["bundle"] = True
        rc, so, se = run([bin_, "--version"])
        info["version"] = (so.strip() or se.strip() or "unknown").splitlines()[0]
        try:
            info["commit"] = open(os.path.join(bundle, "commit")).read().strip() or "unknown"
        except OSError:
            info["commit"] = "unknown"
            log.append(f"gpu-check: {bundle}/commit is missing (make gpu-bundle writes it): commit unknown")
        for b in (bin_, tests):
            if not os.path.exists(b):
                continue
            rc, so, se = run(["ldd", b])
            log += [f"$ ldd {b}", so + se]
            missing = sorted({l.split("=>")[0].strip() for l in so.splitlines() if "not found" in l})
            if missing:
                problems.append(f"libraries not found for {os.path.basename(b)}: {', '.join(missing)} "
                                "(the CUDA 13 libraries: set LD_LIBRARY_PATH)")
        if device.startswith("cuda") and not os.access(tests, os.X_OK):
            problems.append(f"bundle incomplete: {tests} missing (make gpu-bundle)")
    info["problems"] = problems
    with open(log_path, "w") as f:
        f.write("\n".join(log) + "\n" + "\n".join(f"gpu-check: {p}" for p in problems) + "\n")
    status = "failed" if problems else "passed"
    record(os.path.join(out, "env.json"), "env", status, 0, log_path, info,
           reason="; ".join(problems) if problems else None)
    return 1 if problems else 0


# --- Nsight Compute -----------------------------------------------------------------------------

UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
         "second": 1e6, "s": 1e6}


def short_kernel(name):
    name = re.sub(r"\(.*$", "", name.strip())
    return name if len(name) <= 90 else name[:87] + "..."


def ncu_summary(path, top=25, tail=None):
    """Per-kernel table from `ncu --csv --page raw --metrics gpu__time_duration.sum`'s output
    (mixed with the program's own): launches, total and mean microseconds, share; of the last
    `tail` launches only when given (one decode token of a longer run)."""
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return {"launches": 0, "error": f"{path}: missing"}
    rows = list(csv.reader(io.StringIO("\n".join(l for l in text.splitlines() if l.startswith('"')))))
    header = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if header is None:
        err = [l for l in text.splitlines() if l.startswith("==ERROR==") or "ERR_" in l]
        return {"launches": 0, "error": (err[0] if err else "no kernel rows in ncu's output")[:300]}
    cols = rows[header]
    k = cols.index("Kernel Name")
    t = next((i for i, c in enumerate(cols) if c.startswith("gpu__time_duration")), None)
    if t is None:
        return {"launches": 0, "error": "ncu's output has no gpu__time_duration column"}
    scale = 1e-3  # ncu's base unit for durations: nanoseconds
    timed = []
    for r in rows[header + 1:]:
        if len(r) <= max(k, t):
            continue
        if not r[0].strip():  # the units row
            scale = UNITS.get(r[t].strip(), scale)
            continue
        try:
            timed.append((short_kernel(r[k]), float(r[t].replace(",", "")) * scale))
        except ValueError:
            continue
    if tail:
        timed = timed[-tail:]
    kernels, launches = {}, len(timed)
    for name, us in timed:
        e = kernels.setdefault(name, [0, 0.0])
        e[0] += 1
        e[1] += us
    total = sum(v[1] for v in kernels.values())
    table = [{"kernel": n, "launches": c, "total_us": round(s, 1), "mean_us": round(s / c, 2),
              "share": round(s / total, 4) if total else 0.0}
             for n, (c, s) in sorted(kernels.items(), key=lambda kv: -kv[1][1])]
    return {"launches": launches, "kernels": len(table), "total_us": round(total, 1), "top": table[:top]}


def cmd_ncu_summary(argv):
    tail = None
    if "--tail" in argv:
        i = argv.index("--tail")
        tail = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    s = ncu_summary(argv[0], tail=tail)
    if len(argv) > 1:
        s["workload"] = argv[1]
    print(json.dumps(s))
    return 0 if s.get("launches") else 1


# --- llama.cpp's figures: the anchors and a fresh run -------------------------------------------

def dig(obj, *keys):
    for key in keys:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def find_anchor(anchors, card):
    if not card:
        return None
    for c in (anchors or {}).get("cards", []):
        if c.get("name") == card:
            return c
    for c in (anchors or {}).get("cards", []):
        if c.get("match") and c["match"].lower() in card.lower():
            return c
    return None


def fresh_llama(bench):
    """llama.cpp's figures measured in this run (the bench phase, when llama.cpp was built)."""
    got = {}
    for row in bench.get("llama_bench") or []:
        if not isinstance(row, dict):
            continue
        if row.get("n_prompt") == 512 and not row.get("n_gen"):
            got["prefill_512"] = {"mean": row.get("avg_ts"), "sd": row.get("stddev_ts")}
        if row.get("n_gen") and not row.get("n_prompt"):
            got["decode_1"] = {"mean": row.get("avg_ts"), "sd": row.get("stddev_ts")}
    for line in (bench.get("llama_batched_text") or "").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[2] == "64":
            try:
                got["decode_64"] = {"s_tg": float(cells[7])}
            except ValueError:
                pass
    return got


def figure_value(fig):
    if isinstance(fig, dict):
        return fig.get("mean", fig.get("s_tg"))
    return fig


def compare(bench, env, anchors, card_override=None):
    """Our bench figures over llama.cpp's for this card. Returns (rows, problems): a figure
    missing on either side is a problem, which fails the bench phase."""
    problems = []
    card = card_override or env.get("card")
    s1, s64 = bench.get("smolchat_1") or {}, bench.get("smolchat_64") or {}
    p = dig(s1, "prefill", "prompt_tokens")
    g = dig(s1, "decode", "tokens")
    g64 = dig(s64, "batched_decode", "tokens_each")
    n64 = dig(s64, "batched_decode", "sequences")
    pb = dig(s64, "batched_decode", "prompt_tokens") or BATCHED_PROMPT
    runs = dig(s1, "repeat")
    warm = f", median of {runs} warm runs" if runs else ""
    ours = {
        "prefill_512": (dig(s1, "prefill", "tokens_per_s"), "smolchat_1.prefill.tokens_per_s",
                        (f"0 → {p}" if p else "?") + warm),
        # llama-bench's tg decodes from an empty context: ours from the same depth.
        "decode_1": (dig(s1, "decode_depth0", "tokens_per_s"),
                     "smolchat_1.decode_depth0.tokens_per_s",
                     (f"0 → {WARMUP_STEPS + 1 + g}" if g else "?") + warm),
        "decode_64": (dig(s64, "batched_decode", "aggregate_tokens_per_s"),
                      "smolchat_64.batched_decode.aggregate_tokens_per_s",
                      f"{pb + WARMUP_STEPS} → {pb + WARMUP_STEPS + g64} each, "
                      f"{n64} sequences" if g64 and n64 else "?"),
    }
    anchor = find_anchor(anchors, card)
    fresh = fresh_llama(bench)
    if anchor is None and not fresh:
        problems.append((f"no llama.cpp anchor for the card {card!r} in docs/bench-data/gpu-anchors.json"
                         if card else "no llama.cpp anchor: no card was found (--card NAME picks one)")
                        + ", and llama.cpp was not measured here (--with-llama)")
    figures = (anchors or {}).get("figures", {})
    rows = []
    for key, (value, field, depth) in ours.items():
        row = {"figure": key, "what": dig(figures, key, "what") or key, "smolchat": value,
               "smolchat_context": depth, "llama_cpp_context": dig(figures, key, "context"),
               "card": card, "driver": env.get("driver"), "commit": env.get("commit"),
               "version": env.get("version")}
        if value is None:
            problems.append(f"bench field absent: {field}")
        if anchor is not None:
            a = dig(anchor, "anchor", key)
            sessions = anchor.get("sessions", [])
            vals = [figure_value(s.get(key)) for s in sessions if figure_value(s.get(key)) is not None]
            row.update(anchor=a, anchor_card=anchor.get("name"),
                       anchor_dates=[s.get("date") for s in sessions],
                       anchor_range=[min(vals), max(vals)] if vals else None)
            if a is None:
                problems.append(f"anchor figure absent: {anchor.get('name')} {key}")
            elif value is not None:
                row["ratio"] = round(value / a, 3)
        f = fresh.get(key)
        if f is not None and figure_value(f) is not None:
            row["llama_cpp_here"] = figure_value(f)
            if f.get("sd") is not None:
                row["llama_cpp_here_sd"] = f["sd"]
            if value is not None and figure_value(f):
                row["ratio_here"] = round(value / figure_value(f), 3)
        elif fresh and anchor is None:
            problems.append(f"llama.cpp figure absent from this run: {key}")
        rows.append(row)
    return rows, problems


# --- the phase-by-phase report (scripts/gpu-check.sh report) ------------------------------------

PHASES = ["env", "kernels", "sanitizer", "tiers", "http", "llama", "bench", "server", "speculation", "profile"]


def fmt(v, digits=1):
    if v is None:
        return "?"
    if isinstance(v, (int, float)):
        return f"{v:,.{digits}f}"
    return str(v)


def bench_lines(bench):
    lines = []
    s1, s64 = bench.get("smolchat_1") or {}, bench.get("smolchat_64") or {}
    lines += ["", f"smolchat ({s1.get('device')}, {s1.get('tier')} tier): prefill "
              f"{fmt(dig(s1, 'prefill', 'prompt_tokens'), 0)} {fmt(dig(s1, 'prefill', 'tokens_per_s'))} tok/s, "
              f"decode {fmt(dig(s1, 'decode_depth0', 'tokens_per_s'))} tok/s from an empty context, "
              f"{fmt(dig(s1, 'decode', 'tokens_per_s'))} after the prompt, "
              f"{fmt(dig(s64, 'batched_decode', 'sequences'), 0)} sequences "
              f"{fmt(dig(s64, 'batched_decode', 'aggregate_tokens_per_s'))} tok/s in all"]
    auto = bench.get("auto_tier") or {}
    lines += [f"`auto` kept the {auto.get('tier')} tier on this file" + (f" ({auto['note']})" if auto.get("note") else "")]
    return lines


def server_lines(server):
    rows = (server or {}).get("concurrency") or []
    if not rows:
        return []
    lines = ["", "| conversations | aggregate tok/s | per stream tok/s | median TTFT ms | step ms | "
             "forward ms | worker host ms | hop ms |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.get('clients')} | {r.get('aggregate_tokens_per_s')} | {r.get('per_stream_tokens_per_s')} | "
              f"{r.get('ttft_ms_median')} | {fmt(r.get('engine_step_ms_mean'), 2)} | "
              f"{fmt(r.get('forward_ms_mean'), 2)} | {fmt(r.get('worker_host_ms_mean'), 3)} | "
              f"{fmt(r.get('hop_ms_mean'), 3)} |" for r in rows]
    sync = (dig(server, "sync_steps", "concurrency") or [None])[0]
    if sync:
        lines += ["", f"One conversation with every step waited for (scheduler.async_steps = false): "
                  f"{sync.get('aggregate_tokens_per_s')} tok/s, step {fmt(sync.get('engine_step_ms_mean'), 2)} ms, "
                  f"hop {fmt(sync.get('hop_ms_mean'), 3)} ms (the first row launches each steady step ahead)"]
    ours = {r.get("clients"): r for r in dig(server, "v1", "concurrency") or []}
    theirs = {r.get("clients"): r for r in dig(server, "llama_server", "concurrency") or []}
    if ours:
        lines += ["", "The same streams through one client (scripts/openai_load.py): smolchat /v1"
                  + (" beside llama-server -np 64" if theirs else " (llama-server not built: --with-llama)"),
                  "", "| streams | smolchat tok/s | TTFT ms | llama-server tok/s | TTFT ms | ratio |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for n, r in sorted(ours.items()):
            t = theirs.get(n) or {}
            a, b = r.get("aggregate_tokens_per_s"), t.get("aggregate_tokens_per_s")
            ratio = f"{a / b:.2f}" if a and b else "?"
            lines.append(f"| {n} | {a} | {r.get('ttft_ms_median')} | {b if b is not None else '-'} | "
                         f"{t.get('ttft_ms_median', '-')} | {ratio} |")
    return lines


def ncu_table(ncu, top):
    return ["| kernel | launches | total µs | mean µs | share |", "|---|---:|---:|---:|---:|"] + [
        f"| `{r['kernel']}` | {r['launches']} | {fmt(r['total_us'])} | {fmt(r['mean_us'], 2)} | "
        f"{100 * r['share']:.1f}% |" for r in (ncu.get("top") or [])[:top]]


def ncu_lines(profile, top=12):
    """The per-kernel tables of one decode step, ours and llama-bench's, at each depth."""
    profile = profile or {}
    if isinstance(profile.get("ncu"), str):
        return ["", f"Per-kernel profile: {profile['ncu']}"]
    lines = []
    for depth, pair in sorted((profile.get("decode") or {}).items(), key=lambda kv: int(kv[0])):
        ours, theirs = (pair or {}).get("ours") or {}, (pair or {}).get("llama") or {}
        a, b = ours.get("total_us"), theirs.get("total_us")
        ratio = f"; llama.cpp's ÷ ours: {b / a:.2f}" if a and b else ""
        lines += ["", f"One decode step at depth {depth} (Nsight Compute, kernel time only): ours "
                  f"{fmt(a, 0)} µs in {ours.get('launches')} launches, llama-bench's "
                  f"{fmt(b, 0) if b else '-'} µs in {theirs.get('launches', '-')} launches{ratio}.", "",
                  "Ours:", ""] + ncu_table(ours, top)
        if theirs:
            lines += ["", "llama.cpp's:", ""] + ncu_table(theirs, top)
    return lines


def cmd_report(argv):
    out = argv[0]
    recs = []
    for p in PHASES:
        rec = load(os.path.join(out, p + ".json"))
        recs.append(rec if rec else {"phase": p, "status": "not run", "seconds": 0})
    failed = [r for r in recs if r["status"] == "failed"]
    report = {"phases": recs, "passed": all(r["status"] in ("passed", "skipped") for r in recs),
              "failed": [r["phase"] for r in failed]}
    dump(report, os.path.join(out, "gpu-check.json"))
    if failed:
        head = (f"# gpu-check: FAILED — {failed[0]['phase']}: {failed[0].get('reason', 'see its log')}"
                + (f" ({len(failed)} phases failed: {', '.join(r['phase'] for r in failed)})" if len(failed) > 1 else ""))
    else:
        ran = [r for r in recs if r["status"] != "not run"]
        head = f"# gpu-check: no phase failed ({len(ran)} of {len(recs)} ran)"
    lines = [head, "", "| phase | status | seconds | why |", "|---|---|---:|---|"]
    lines += [f"| {r['phase']} | {r['status']} | {r['seconds']:.0f} | {r.get('reason', '')} |" for r in recs]
    by = {r["phase"]: r.get("result") for r in recs if r.get("result")}
    if by.get("bench"):
        lines += bench_lines(by["bench"])
    lines += server_lines(by.get("server"))
    spec = by.get("speculation")
    if spec:
        lines += ["", f"Speculative decoding ({spec.get('device')}, greedy, one sequence):", "",
                  "| workload | tok/s off | tok/s on | ratio | accepted / drafted | same tokens |",
                  "|---|---:|---:|---:|---:|---|"]
        lines += [f"| {r['workload']} | {r['decode_tokens_per_s_off']:.1f} | {r['decode_tokens_per_s_on']:.1f} | "
                  f"{r['ratio']:.2f} | {r['accepted']} / {r['drafted']} | {r['same_tokens']} |"
                  for r in spec.get("speculative", [])]
        series = spec.get("chat_series") or {}
        runs = series.get("runs") or []
        if runs:
            lines += ["", "Chat series: " + ", ".join(f"{r['drafts']} {r['decode_tokens_per_s']:.1f} tok/s" for r in runs)
                      + f" (same tokens: {series.get('same_tokens')})"]
    lines += ncu_lines(by.get("profile"))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "gpu-check.md"), "w") as f:
        f.write(text)
    print(text, end="")
    return 1 if failed else 0


# --- the lease ----------------------------------------------------------------------------------

def lease_paths(state):
    return (os.path.join(state["out"], "gpu-lease.json"), os.path.join(state["out"], "gpu-lease.md"),
            os.path.join(state["out"], "raw.tar.xz"))


def phase_of(state, name):
    return next(p for p in state["phases"] if p["phase"] == name)


def verdict(state):
    phases = state["phases"]
    done = [p for p in phases if p["status"] in ("passed", "failed", "skipped")]
    failed = [p for p in phases if p["status"] == "failed"]
    skipped = [p for p in phases if p["status"] == "skipped"]
    running = next((p for p in phases if p["status"] == "running"), None)
    elapsed = state.get("elapsed_s", 0)
    env = state.get("env") or {}
    where = (f"{env.get('card')}, driver {env.get('driver')}" if env.get("card") else "no GPU found")
    tally = (f"{len([p for p in phases if p['status'] == 'passed'])} passed, {len(failed)} failed, "
             f"{len(skipped)} skipped of {len(phases)} phases; {elapsed:.0f} s of a {state['budget_s']} s budget; "
             f"{where}; smolchat commit {env.get('commit') or 'unknown'}")
    if len(done) < len(phases) and not state.get("finished"):
        now = running["phase"] if running else next(p["phase"] for p in phases if p["status"] == "pending")
        first = (f"; first failure: {failed[0]['phase']}: {failed[0].get('reason')}" if failed else "")
        return (f"gpu-lease: CUT OFF during {now} (this report is what finished before it; "
                f"{len(done)} of {len(phases)} phases done){first} — {tally}")
    if failed:
        more = f" (also failed: {', '.join(p['phase'] for p in failed[1:])})" if len(failed) > 1 else ""
        return f"gpu-lease: FAILED — {failed[0]['phase']}: {failed[0].get('reason')}{more} — {tally}"
    return f"gpu-lease: PASSED — {tally}"


def comparison_lines(state):
    cmp_ = state.get("comparison")
    if not cmp_:
        return []
    rows = cmp_["rows"]
    dry = state["device"].startswith("cpu")
    lines = ["", "## Beside llama.cpp b9793" + (" (DRY RUN on the CPU with the tiny test file: "
                                                   "these ratios mean nothing)" if dry else ""), ""]
    lines += ["| figure | smolchat | llama.cpp (anchor) | ratio | llama.cpp here | ratio here | "
              "context (ours / llama.cpp) | card · driver · commit |",
              "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        anchor = (f"{fmt(r.get('anchor'))} ({r.get('anchor_card')}, {', '.join(r.get('anchor_dates') or [])}; "
                  f"sessions {fmt((r.get('anchor_range') or [None])[0])}–{fmt((r.get('anchor_range') or [None, None])[1])})"
                  if r.get("anchor") is not None else "MISSING")
        here = fmt(r.get("llama_cpp_here")) + (f" ± {fmt(r['llama_cpp_here_sd'])}" if r.get("llama_cpp_here_sd") else "") \
            if r.get("llama_cpp_here") is not None else "—"
        lines.append(f"| {r['what']} | {fmt(r.get('smolchat'))} | {anchor} | "
                     f"{fmt(r.get('ratio'), 2) if r.get('ratio') is not None else 'MISSING'} | {here} | "
                     f"{fmt(r.get('ratio_here'), 2) if r.get('ratio_here') is not None else '—'} | "
                     f"{r.get('smolchat_context')} / {r.get('llama_cpp_context')} | "
                     f"{r.get('card') or '—'} · {r.get('driver') or '—'} · {r.get('commit') or 'unknown'} |")
    for p in cmp_.get("problems", []):
        lines.append(f"\n**Missing:** {p}")
    return lines


def write_lease(state):
    json_path, md_path, archive = lease_paths(state)
    state["elapsed_s"] = round(time.time() - state["started"], 1)
    state["rewrites"] = state.get("rewrites", 0) + 1
    state["verdict"] = verdict(state)
    env = state.get("env") or {}
    lines = [state["verdict"], "", f"`scripts/gpu-check.sh lease --budget {state['budget_s']} --device {state['device']}"
             f"{' --with-llama' if state.get('with_llama') else ''}`: card {env.get('card') or 'none found'}, "
             f"driver {env.get('driver') or '—'}, binary `{env.get('version') or '—'}`, commit "
             f"{env.get('commit') or 'unknown'}; this report was written {state['rewrites']} times "
             "(at the start, before and after each phase).", "",
             "| # | phase | status | estimate s | limit s | seconds | why |", "|---:|---|---|---:|---:|---:|---|"]
    for i, p in enumerate(state["phases"], 1):
        lines.append(f"| {i} | {p['phase']} | {p['status']} | {p['estimate_s']} | {p.get('limit_s') or ''} | "
                     f"{'' if p.get('seconds') is None else round(p['seconds'])} | {p.get('reason', '')} |")
    lines += comparison_lines(state)
    res = {p["phase"]: p.get("result") for p in state["phases"] if p.get("result")}
    if res.get("bench"):
        lines += bench_lines(res["bench"])
    if res.get("server"):
        lines += ["", "Through the server (scripts/http_bench.py):"] + server_lines(res["server"])
    lines += ncu_lines(res.get("profile"))
    lines += ["", "Raw figures and logs (each clipped to its head and tail): raw.tar.xz."]
    dump(state, json_path)
    with open(md_path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(md_path + ".tmp", md_path)
    write_archive(state, archive)
    return "\n".join(lines) + "\n"


def clipped(path, head, tail):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) <= head + tail:
        return data
    cut = len(data) - head - tail
    return data[:head] + f"\n[... {cut} bytes cut ...]\n".encode() + data[len(data) - tail:]


def write_archive(state, path):
    """raw.tar.xz: every file the phases wrote (records, logs, figures), each clipped to its
    head and tail, clipped shorter if the archive would pass ARCHIVE_MAX."""
    records = state["records"]
    files = sorted(os.path.join(records, f) for f in os.listdir(records)
                   if os.path.isfile(os.path.join(records, f)))
    head, tail = ARCHIVE_FILE_HEAD, ARCHIVE_FILE_TAIL
    tmp = path + ".tmp"
    while True:
        with tarfile.open(tmp, "w:xz") as tar:
            for f in files:
                data = clipped(f, head, tail)
                info = tarfile.TarInfo("raw/" + os.path.basename(f))
                info.size, info.mtime = len(data), int(time.time())
                tar.addfile(info, io.BytesIO(data))
        if os.path.getsize(tmp) <= ARCHIVE_MAX or head + tail < 4096:
            break
        head, tail = head // 4, tail // 4
    os.replace(tmp, path)


def cmd_lease_init(argv):
    path = argv[0]
    opts, estimates, i = {}, [], 1
    while i < len(argv):
        if argv[i].startswith("--"):
            opts[argv[i]] = argv[i + 1]
            i += 2
        else:
            name, est = argv[i].split("=")
            estimates.append((name, int(est)))
            i += 1
    state = {
        "what": "scripts/gpu-check.sh lease: one call, phases in priority order, each skipped when "
                "the budget left is below its estimate, this report rewritten after every phase",
        "started": time.time(), "budget_s": int(opts["--budget"]), "device": opts["--device"],
        "out": opts["--out"], "bundle": opts["--bundle"], "records": opts["--records"],
        "card_override": opts.get("--card") or None, "anchors_file": opts.get("--anchors"),
        "with_llama": opts.get("--with-llama") == "1",
        "phases": [{"phase": n, "estimate_s": e, "status": "pending"} for n, e in estimates],
        "rewrites": 0,
    }
    write_lease(state)
    dump(state, path)
    return 0


def cmd_lease_gate(argv):
    path, name, left = argv[0], argv[1], int(argv[2])
    state = load(path)
    p = phase_of(state, name)
    env = state.get("env") or {}
    env_rec = phase_of(state, "env")
    why = None
    if name != "env" and env_rec["status"] != "pending":
        problems = env.get("problems", [])
        no_bundle = next((x for x in problems if x.startswith("no bundle")), None)
        no_gpu = next((x for x in problems if x.startswith("no GPU")), None)
        if no_bundle:
            why = "no bundle (see env)"
        elif name in GPU_ONLY and state["device"].startswith("cpu"):
            why = f"no GPU: {name} needs one (dry run, --device {state['device']})"
        elif no_gpu and (name in GPU_ONLY or not state["device"].startswith("cpu")):
            why = "no GPU (see env)"
    if why is None and left < p["estimate_s"]:
        why = f"budget: {left} s left, {name} is estimated at {p['estimate_s']} s"
    if why:
        print(why)
    return 0


def cmd_lease_skip(argv):
    path, name, reason = argv[0], argv[1], argv[2]
    state = load(path)
    p = phase_of(state, name)
    p.update(status="skipped", reason=reason, seconds=0)
    sys.stderr.write(f"gpu-lease {name}: skipped: {reason}\n")
    write_lease(state)
    dump(state, path)
    return 0


def cmd_lease_start(argv):
    path, name, limit = argv[0], argv[1], int(argv[2])
    state = load(path)
    p = phase_of(state, name)
    p.update(status="running", limit_s=limit, started_s=round(time.time() - state["started"], 1))
    sys.stderr.write(f"gpu-lease {name}: running (estimate {p['estimate_s']} s, limit {limit} s)\n")
    write_lease(state)
    dump(state, path)
    return 0


def cmd_lease_done(argv):
    path, name, rc, seconds = argv[0], argv[1], int(argv[2]), float(argv[3])
    state = load(path)
    p = phase_of(state, name)
    rec = load(os.path.join(state["records"], name + ".json"))
    p["seconds"] = seconds
    if rec is None:
        log = os.path.join(state["records"], name + ".log")
        if rc in (124, 137):
            p.update(status="failed", reason=f"timed out after {p.get('limit_s')} s (the budget left)")
        else:
            p.update(status="failed", reason=f"exit status {rc}, no record: "
                     + reason_from_log(read_tail(log, 200000)))
    else:
        p["status"] = rec["status"]
        if rec.get("reason"):
            p["reason"] = rec["reason"]
        if rec.get("result") is not None:
            p["result"] = rec["result"]
        if rc in (124, 137) and p["status"] != "failed":
            p.update(status="failed", reason=f"timed out after {p.get('limit_s')} s (the budget left)")
    if name == "env":
        state["env"] = rec.get("result", {}) if rec else {}
    if name == "bench" and p["status"] == "passed":
        anchors = load(state.get("anchors_file") or "", None)
        rows, problems = compare(p.get("result") or {}, state.get("env") or {}, anchors,
                                 state.get("card_override"))
        state["comparison"] = {"rows": rows, "problems": problems}
        if problems:
            p.update(status="failed", reason="missing figure: " + problems[0])
    sys.stderr.write(f"gpu-lease {name}: {p['status']} ({seconds:.0f} s)"
                     + (f": {p['reason']}" if p.get("reason") else "") + "; report rewritten\n")
    write_lease(state)
    dump(state, path)
    return 0


def cmd_lease_finish(argv):
    path = argv[0]
    state = load(path)
    state["finished"] = True
    text = write_lease(state)
    dump(state, path)
    print(text, end="")
    return 1 if any(p["status"] == "failed" for p in state["phases"]) else 0


COMMANDS = {
    "record": cmd_record, "env": cmd_env, "ncu-summary": cmd_ncu_summary, "report": cmd_report,
    "lease-init": cmd_lease_init, "lease-gate": cmd_lease_gate, "lease-skip": cmd_lease_skip,
    "lease-start": cmd_lease_start, "lease-done": cmd_lease_done, "lease-finish": cmd_lease_finish,
}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.stderr.write(__doc__)
        sys.exit(2)
    sys.exit(COMMANDS[sys.argv[1]](sys.argv[2:]))

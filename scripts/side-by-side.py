#!/usr/bin/env python3
"""One side-by-side sitting (docs/BENCHMARKS.md, issue 11): llama.cpp, ik_llama.cpp and smolchat
alternating inside each round, 2 threads, every run at `nice -n -5` (run as root, on a quiet
machine).

Usage: scripts/side-by-side.py ROUNDS OUTFILE SMOLCHAT_BIN [OLD_SMOLCHAT_BIN]
       scripts/side-by-side.py --summary OUTFILE... (medians, bests and ratios of recorded runs)
Environment: LLAMA_BENCH, IK_BENCH (the anchors' llama-bench binaries, built as docs/BENCHMARKS.md
says), M2 (SmolLM2 Q4_1 file), M3 (the 3B shape written by `smolchat bench --synthetic smollm3-3b
--save-gguf FILE`); ONLY3B=1 runs the 3B rows only; DECODE3B=1 runs only the 3B decode, smolchat
and ik_llama.cpp `-fa 0 -rtr 1` in turn, their order swapped every round, and prints the per-round
ratios. OLD_SMOLCHAT_BIN adds prefill thread-scaling
runs (1 and 2 threads) of an older binary beside the new one. AB=1 (with OLD_SMOLCHAT_BIN) runs
no anchors: the old and the new binary in turn, in ABBA order, on the SmolLM2 rows and the 3B
decode, on both paths (or those SMOL_ISAS names), and prints each row's median per binary at the
end (a change's before and after on a noisy machine).
Every result is appended to OUTFILE as one JSON line: round, engine, flags, row, tokens/s, load."""
import json, os, statistics, subprocess, sys, time


def summary(paths):
    """`side-by-side.py --summary OUT...`: per row, every engine's runs, median and best, and each
    smolchat path's ratio to the best anchor by best and by median (the figures
    docs/BENCHMARKS.md quotes as "best (median)")."""
    runs = {}
    for path in paths:
        for line in open(path):
            r = json.loads(line)
            if r["row"] == "error":
                continue
            flags = r["flags"].split(" t=")[0] if r["engine"].startswith("smolchat") else r["flags"]
            runs.setdefault((r["row"], f'{r["engine"]} {flags}'), []).append(r["tps"])
    for row in sorted({row for row, _ in runs}):
        print(row)
        anchors = [v for (rw, e), v in runs.items() if rw == row and not e.startswith("smolchat")]
        best = max((max(v) for v in anchors), default=0)
        median = max((statistics.median(v) for v in anchors), default=0)
        for (rw, engine), v in sorted(runs.items()):
            if rw != row:
                continue
            line = f"   {engine:50s} n={len(v)} median {statistics.median(v):9.2f} best {max(v):9.2f}"
            if engine.startswith("smolchat") and best and median:
                line += f"   ratio {max(v) / best:.2f} ({statistics.median(v) / median:.2f})"
            print(line)


if len(sys.argv) > 1 and sys.argv[1] == "--summary":
    summary(sys.argv[2:])
    sys.exit(0)

ROUNDS = int(sys.argv[1])
OUT = sys.argv[2]
SMOL = sys.argv[3]
OLD = sys.argv[4] if len(sys.argv) > 4 else None
M2 = os.environ.get("M2", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
M3 = os.environ.get("M3", "../anchors/smollm3-3b-synth.gguf")
LLAMA = os.environ.get("LLAMA_BENCH", "../anchors/llama.cpp/build/bin/llama-bench")
IK = os.environ.get("IK_BENCH", "../anchors/ik_llama.cpp/build/bin/llama-bench")


def load():
    return open("/proc/loadavg").read().split()[0]


def emit(rnd, engine, flags, row, value):
    rec = dict(round=rnd, engine=engine, flags=flags, row=row, tps=round(value, 2), load=load(),
               t=time.strftime("%H:%M:%S"))
    print(json.dumps(rec), flush=True)
    with open(OUT, "a") as f:
        f.write(json.dumps(rec) + "\n")


def bench_ggml(rnd, name, exe, model, args, rows):
    """rows: function(record) -> row name or None."""
    cmd = ["nice", "-n", "-5", exe, "-m", model, "-t", "2", "-r", "1", "-o", "json"] + args
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
        # ik_llama.cpp prints a ggml_calloc warning into the JSON on stdout.
        out = "\n".join(l for l in out.splitlines() if not l.startswith("WARNING"))
        for r in json.loads(out):
            row = rows(r)
            if row:
                emit(rnd, name, " ".join(args), row, r["avg_ts"])
    except Exception as e:  # a failed run is recorded, not fatal
        emit(rnd, name, " ".join(args) + f" FAILED {e}", "error", 0.0)


SMOL_ISAS = os.environ.get("SMOL_ISAS", "avx2,native").split(",")


def bench_smol(rnd, name, exe, isa, model, kv, prompt, gen, rows, threads=2):
    if (isa or "native") not in SMOL_ISAS:
        return
    env = dict(os.environ)
    if isa:
        env["SMOLCHAT_ISA"] = isa
    cmd = ["nice", "-n", "-5", exe, "--threads", str(threads), "--kv-type", kv, "bench", "--model",
           model, "--prompt-tokens", str(prompt), "--gen-tokens", str(gen), "--batch", "1"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env).stdout
        d = json.loads(out)
        for row, key in rows:
            emit(rnd, name, f"isa={d.get('isa')} kv={kv} t={threads}", row, d[key]["tokens_per_s"])
    except Exception as e:
        emit(rnd, name, f"isa={isa} kv={kv} FAILED {e}", "error", 0.0)


def smollm2_rows(depth):
    def f(r):
        if r.get("n_prompt") == 512 and r.get("n_gen") == 0:
            return "smollm2 prefill 512"
        if r.get("n_prompt") == 0 and r.get("n_gen") == 64:
            d = r.get("n_depth") or 0
            return f"smollm2 decode @{d}" if d else "smollm2 decode empty"
        if r.get("n_prompt") == depth and r.get("n_gen") == 64:  # ik -gp
            return f"smollm2 decode @{depth}"
        return None
    return f


def m3_rows(r):
    if r.get("n_prompt") == 128 and r.get("n_gen") == 0:
        return "3b prefill 128"
    if r.get("n_prompt") == 0 and r.get("n_gen") == 32:
        return "3b decode 32"
    if r.get("n_prompt") == 256 and r.get("n_gen") == 0:
        return "3b prefill 256"
    return None


def smollm2_round(rnd):
    # SmolLM2: prefill 512, decode from empty context
    bench_ggml(rnd, "llama.cpp", LLAMA, M2, ["-p", "512", "-n", "64"], smollm2_rows(0))
    bench_smol(rnd, "smolchat", SMOL, "avx2", M2, "f16", 512, 64,
               [("smollm2 prefill 512", "prefill"), ("smollm2 decode @512", "decode")])
    bench_ggml(rnd, "ik_llama.cpp", IK, M2, ["-p", "512", "-n", "64"], smollm2_rows(0))
    bench_smol(rnd, "smolchat", SMOL, None, M2, "f16", 512, 64,
               [("smollm2 prefill 512", "prefill"), ("smollm2 decode @512", "decode")])
    bench_ggml(rnd, "ik_llama.cpp", IK, M2, ["-p", "512", "-n", "64", "-fa", "0", "-rtr", "1"],
               smollm2_rows(0))
    bench_smol(rnd, "smolchat", SMOL, "avx2", M2, "f16", 1, 64, [("smollm2 decode empty", "decode")])
    bench_smol(rnd, "smolchat", SMOL, None, M2, "f16", 1, 64, [("smollm2 decode empty", "decode")])
    # decode after 512
    bench_ggml(rnd, "llama.cpp", LLAMA, M2, ["-p", "0", "-n", "64", "-d", "512"], smollm2_rows(512))
    bench_ggml(rnd, "ik_llama.cpp", IK, M2, ["-p", "0", "-n", "0", "-gp", "512,64", "-fa", "0", "-rtr", "1"],
               smollm2_rows(512))
    # depth 4096, f16 and q8_0 KV
    bench_ggml(rnd, "llama.cpp", LLAMA, M2, ["-p", "0", "-n", "64", "-d", "4096"], smollm2_rows(4096))
    bench_smol(rnd, "smolchat", SMOL, "avx2", M2, "f16", 4096, 64, [("smollm2 decode @4096", "decode")])
    bench_ggml(rnd, "ik_llama.cpp", IK, M2, ["-p", "0", "-n", "0", "-gp", "4096,64", "-fa", "1", "-rtr", "1"],
               smollm2_rows(4096))
    bench_smol(rnd, "smolchat", SMOL, None, M2, "f16", 4096, 64, [("smollm2 decode @4096", "decode")])
    bench_ggml(rnd, "llama.cpp", LLAMA, M2,
               ["-p", "0", "-n", "64", "-d", "4096", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "1"],
               lambda r: "smollm2 decode @4096 q8_0" if smollm2_rows(4096)(r) else None)
    bench_smol(rnd, "smolchat", SMOL, "avx2", M2, "q8_0", 4096, 64,
               [("smollm2 decode @4096 q8_0", "decode")])
    bench_ggml(rnd, "ik_llama.cpp", IK, M2,
               ["-p", "0", "-n", "0", "-gp", "4096,64", "-fa", "1", "-rtr", "1", "-ctk", "q8_0", "-ctv", "q8_0"],
               lambda r: "smollm2 decode @4096 q8_0" if smollm2_rows(4096)(r) else None)
    bench_smol(rnd, "smolchat", SMOL, None, M2, "q8_0", 4096, 64,
               [("smollm2 decode @4096 q8_0", "decode")])


def smollm3_round(rnd):
    # 3B shape. `llama-bench -n 32` decodes from an empty context, so smolchat's decode row does
    # too (`--prompt-tokens 1`); its prefill row is a separate run.
    def smol(isa, kv):
        bench_smol(rnd, "smolchat", SMOL, isa, M3, kv, 128, 1, [("3b prefill 128", "prefill")])
        bench_smol(rnd, "smolchat", SMOL, isa, M3, kv, 1, 32, [("3b decode 32", "decode")])

    bench_ggml(rnd, "llama.cpp", LLAMA, M3, ["-p", "128", "-n", "32"], m3_rows)
    smol("avx2", "f16")
    bench_ggml(rnd, "ik_llama.cpp", IK, M3, ["-p", "128", "-n", "32", "-fa", "0", "-rtr", "1"], m3_rows)
    smol(None, "f16")
    bench_ggml(rnd, "ik_llama.cpp", IK, M3, ["-p", "128", "-n", "32", "-rtr", "1"], m3_rows)
    smol(None, "q8_0")


def scaling_round(rnd):
    for t in (1, 2):
        bench_smol(rnd, "smolchat-old", OLD, None, M3, "f16", 256, 1, [("3b prefill 256", "prefill")], t)
        bench_smol(rnd, "smolchat", SMOL, None, M3, "f16", 256, 1, [("3b prefill 256", "prefill")], t)


def ab_round(rnd):
    """Each row on both paths, the two binaries one after the other, their order swapped every
    round (ABBA), so that a drift of the machine's speed falls on both alike."""
    pair = (("smolchat-old", OLD), ("smolchat", SMOL))
    if rnd % 2 == 0:
        pair = pair[::-1]
    for isa in (None, "avx2"):
        for name, exe in pair:
            bench_smol(rnd, name, exe, isa, M2, "f16", 512, 64,
                       [("smollm2 prefill 512", "prefill"), ("smollm2 decode @512", "decode")])
        for name, exe in pair:
            bench_smol(rnd, name, exe, isa, M2, "f16", 1, 64, [("smollm2 decode empty", "decode")])
        for name, exe in pair:
            bench_smol(rnd, name, exe, isa, M3, "f16", 1, 48, [("3b decode 48", "decode")])


def decode3b_round(rnd):
    """The 3B decode alone, smolchat's default path against ik_llama.cpp `-fa 0 -rtr 1` (the best
    anchor on that row in every sitting), one after the other, their order swapped every round: a
    sitting runs each engine once a round, minutes apart, and on a VM whose speed swings within
    minutes the row at the memory wall needs the two side by side."""
    pair = [
        lambda: bench_smol(rnd, "smolchat", SMOL, None, M3, "f16", 1, 32, [("3b decode 32", "decode")]),
        lambda: bench_ggml(rnd, "ik_llama.cpp", IK, M3, ["-p", "0", "-n", "32", "-fa", "0", "-rtr", "1"],
                           m3_rows),
    ]
    for run in pair if rnd % 2 else pair[::-1]:
        run()


if os.environ.get("DECODE3B"):
    start = sum(1 for _ in open(OUT)) if os.path.exists(OUT) else 0
    for rnd in range(1, ROUNDS + 1):
        decode3b_round(rnd)
    by_round = {}
    for line in list(open(OUT))[start:]:
        r = json.loads(line)
        if r["row"] == "3b decode 32":
            by_round.setdefault(r["round"], {})[r["engine"]] = r["tps"]
    ratios = [d["smolchat"] / d["ik_llama.cpp"] for d in by_round.values() if len(d) == 2]
    if ratios:
        print(f"per round, smolchat / ik: median {statistics.median(ratios):.3f}, geometric mean "
              f"{statistics.geometric_mean(ratios):.3f}, smolchat ahead in "
              f"{sum(x > 1 for x in ratios)} of {len(ratios)} rounds")
    summary([OUT])
    sys.exit(0)

if os.environ.get("AB"):
    if not OLD:
        sys.exit("AB=1 needs OLD_SMOLCHAT_BIN (the fourth argument)")
    for rnd in range(1, ROUNDS + 1):
        ab_round(rnd)
    runs = {}
    for line in open(OUT):
        r = json.loads(line)
        runs.setdefault((r["row"], r["flags"].split()[0], r["engine"]), []).append(r["tps"])
    for key, v in sorted(runs.items()):
        print(*key, "median", statistics.median(v), sorted(v))
    sys.exit(0)

for rnd in range(1, ROUNDS + 1):
    if not os.environ.get("ONLY3B"):
        smollm2_round(rnd)
    smollm3_round(rnd)
    if OLD:
        scaling_round(rnd)

#!/usr/bin/env python3
"""The 3B-shape decode of 32 tokens, smolchat against ik_llama.cpp (`-fa 0 -rtr 1`), the two run
in turn and their order swapped every round (ABBA), so that both meet the VM's slow and fast
minutes alike. Prints each run as a JSON line (and appends it to OUT), then medians, means and the
per-round ratios.

Usage: M3=… IK_BENCH=… scripts/decode-abba.py ROUNDS OUT SMOLCHAT_BINARY
(M3: the 3B shape written by `smolchat bench --synthetic smollm3-3b --save-gguf FILE`; IK_BENCH:
ik_llama.cpp's `llama-bench`, built as docs/BENCHMARKS.md says.)
"""
import json
import os
import statistics
import subprocess
import sys
import time

ROUNDS, OUT, SMOL = int(sys.argv[1]), sys.argv[2], sys.argv[3]
M3 = os.environ.get("M3", "../anchors/smollm3-3b-synth.gguf")
IK = os.environ.get("IK_BENCH", "../anchors/ik_llama.cpp/build/bin/llama-bench")


def smolchat():
    cmd = ["nice", "-n", "-5", SMOL, "--threads", "2", "bench", "--model", M3,
           "--prompt-tokens", "1", "--gen-tokens", "32", "--batch", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out)["decode"]["tokens_per_s"]


def ik():
    cmd = ["nice", "-n", "-5", IK, "-m", M3, "-t", "2", "-r", "1", "-p", "0", "-n", "32",
           "-fa", "0", "-rtr", "1", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    # ik_llama.cpp prints a ggml_calloc warning into the JSON on stdout.
    out = "\n".join(l for l in out.splitlines() if not l.startswith("WARNING"))
    return json.loads(out)[0]["avg_ts"]


runs = {"smolchat": [], "ik": []}
for rnd in range(ROUNDS):
    order = [("smolchat", smolchat), ("ik", ik)]
    if rnd % 2:
        order.reverse()
    for name, run in order:
        tps = run()
        runs[name].append(tps)
        rec = dict(round=rnd + 1, engine=name, tps=round(tps, 2), t=time.strftime("%H:%M:%S"))
        print(json.dumps(rec), flush=True)
        with open(OUT, "a") as f:
            f.write(json.dumps(rec) + "\n")
s, k = runs["smolchat"], runs["ik"]
per_round = [a / b for a, b in zip(s, k)]
print(f"median smolchat {statistics.median(s):.2f} ik {statistics.median(k):.2f} "
      f"ratio {statistics.median(s) / statistics.median(k):.3f}")
print(f"mean smolchat {statistics.mean(s):.2f} ik {statistics.mean(k):.2f} "
      f"ratio {statistics.mean(s) / statistics.mean(k):.3f}")
print(f"per-round ratio: median {statistics.median(per_round):.3f}, geometric mean "
      f"{statistics.geometric_mean(per_round):.3f}, smolchat ahead in "
      f"{sum(r > 1 for r in per_round)} of {len(per_round)} rounds")

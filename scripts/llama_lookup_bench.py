#!/usr/bin/env python3
"""llama.cpp's own lookup decoding on spec_bench.py's three workloads, for the side-by-side in
docs/BENCHMARKS.md: `llama-lookup` with no drafts (plain greedy decoding, timed the same way)
and with up to `--draft` drafts (its prompt lookup), on the same GGUF, the prompts in SmolLM2's ChatML template, median of `--repeat` runs.
llama.cpp is built outside this repository (a `fetch`ed b9793 with GGML_NATIVE=ON):

  scripts/llama_lookup_bench.py --llama-bin /path/to/llama.cpp/build/bin \\
      --model models/SmolLM2-135M-Instruct.Q4_1.gguf [--threads 2] [--max-tokens 160] [--draft 8]
      [--ngl 99 for a CUDA build]
"""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("spec_bench", os.path.join(HERE, "spec_bench.py"))
spec_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(spec_bench)

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([0-9.]+) s(?:econds)?, speed:\s+([0-9.]+) t/s")


def chatml(user):
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n(conversation 0)\n{user}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    m = DECODED.search(text)
    if not m:
        sys.exit(f"no speed in the output of {cmd[0]}:\n{text[-2000:]}")
    accept = re.search(r"n_accept\s+=\s+(\d+)", text)
    drafted = re.search(r"n_drafted\s+=\s+(\d+)", text)
    return {
        "tokens": int(m.group(1)),
        "seconds": float(m.group(2)),
        "tokens_per_s": float(m.group(3)),
        "accepted": int(accept.group(1)) if accept else None,
        "drafted": int(drafted.group(1)) if drafted else None,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ngl", type=int, default=0, help="layers on the GPU (-ngl), 99 for all")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--draft", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for name, user in spec_bench.WORKLOADS.items():
        prompt = chatml(user)
        plain, lookup = [], []
        for _ in range(args.repeat):
            for draft, into in ((0, plain), (args.draft, lookup)):
                into.append(
                    run(
                        [
                            os.path.join(args.llama_bin, "llama-lookup"),
                            "-m", args.model, "-p", prompt, "-n", str(args.max_tokens),
                            "-t", str(args.threads), "--temp", "0",
                            "--spec-draft-n-max", str(draft), "-c", "4096",
                            "-ngl", str(args.ngl),
                        ]
                    )
                )
        median = lambda rs: sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2]
        p, l = median(plain), median(lookup)
        row = {"workload": name, "plain": p, "lookup": l, "ratio": round(l["tokens_per_s"] / p["tokens_per_s"], 2)}
        rows.append(row)
        print(
            f"{name:9} llama.cpp decode: plain {p['tokens_per_s']:7.1f} tok/s, lookup {l['tokens_per_s']:7.1f} tok/s, "
            f"x{row['ratio']:.2f}, accepted {l['accepted']}/{l['drafted']}",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

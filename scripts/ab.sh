#!/usr/bin/env bash
# A/B of smolchat builds (docs/BENCHMARKS.md, issue 28): the binaries take turns inside each
# round, 2 threads, `nice -n -5`, on the SmolLM2 rows (prefill 512 + decode after it, decode from
# an empty context on the AVX-512 and AVX2 paths) and the 3B shape's decode from an empty context.
# Usage: scripts/ab.sh ROUNDS OUTFILE BIN...   (appends "binary isa row tok/s" lines to OUTFILE)
# Environment: M2 (SmolLM2 Q4_1 file), M3 (the 3B shape from `smolchat bench --synthetic
# smollm3-3b --save-gguf FILE`). Medians per row and binary:
#   python3 -c 'import collections as c,statistics as s,sys; d=c.defaultdict(list)
#   [d[tuple(l.split()[:3])].append(float(l.split()[3])) for l in open(sys.argv[1])]
#   [print(k, s.median(v)) for k, v in sorted(d.items())]' OUTFILE
set -euo pipefail
rounds=$1 out=$2
shift 2
M2=${M2:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
M3=${M3:-../anchors/smollm3-3b-synth.gguf}
run() { # binary isa model prompt gen row-prefix keys
  SMOLCHAT_ISA=$2 nice -n -5 "$1" --threads 2 bench --model "$3" --prompt-tokens "$4" \
    --gen-tokens "$5" --batch 1 2>/dev/null |
    python3 -c "import json,sys; d=json.load(sys.stdin)
for k in '$7'.split(','): print('$(basename "$1")', '$2', '$6' + k, round(d[k]['tokens_per_s'], 2))"
}
for _ in $(seq "$rounds"); do
  for bin in "$@"; do
    run "$bin" avx512 "$M2" 512 64 smollm2- prefill,decode
    run "$bin" avx512 "$M2" 1 64 smollm2-empty- decode
    run "$bin" avx2 "$M2" 1 64 smollm2-empty- decode
    run "$bin" avx512 "$M3" 1 48 3b- decode
  done
done >>"$out"

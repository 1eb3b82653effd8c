#!/usr/bin/env python3
"""Static throughput of the quantized matmul kernels' inner loops, for CPUs we cannot run on.

    scripts/kernel-throughput.py [--cpus znver4,znver5,sapphirerapids] BINARY [SYMBOL_REGEX]

For each function of BINARY (a release build of smolchat) whose demangled name matches
SYMBOL_REGEX (default: the AVX-512 and AVX2 Q4_1/Q8_0 kernels), finds every innermost loop
that holds a dot-product instruction (`vpdpbusd`, `vpmaddubsw`) and prints llvm-mca's simulated
cycles per iteration on each CPU model, with the dot products per iteration.

For a kernel's per-block loop, cycles per iteration over the tile's tokens is the cost of one
32-value block of 16 rows (8 for one AVX2 half) for one token: the figure to compare between
kernels. It is a model (LLVM's scheduling tables, no memory system), not a measurement: use it to
see what a change does to a kernel on a CPU the machine at hand does not have, then measure on one.

Needs llvm-mca 17 or later (Zen 4 and later models): `apt-get install llvm-19` gives llvm-mca-19.
"""
import argparse
import re
import shutil
import subprocess
import sys

DOT = ("vpdpbusd", "vpmaddubsw")
ITERATIONS = 200


def functions(binary, pattern):
    nm = subprocess.run(["nm", "-C", "-S", binary], capture_output=True, text=True, check=True)
    for line in nm.stdout.splitlines():
        parts = line.split(maxsplit=3)
        if len(parts) == 4 and pattern.search(parts[3]):
            yield int(parts[0], 16), int(parts[1], 16), parts[3]


def disassemble(binary, start, size):
    out = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", f"--start-address={start}",
         f"--stop-address={start + size}", binary],
        capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        m = re.match(r"\s+([0-9a-f]+):\s+(.*)$", line)
        if m:
            yield int(m.group(1), 16), m.group(2).split("#")[0].strip()


def innermost_loops(ins):
    """(first, last) addresses of backward branches' bodies with no other such body inside."""
    loops = []
    for addr, text in ins:
        m = re.match(r"j\w+\s+([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    return [(t, a) for t, a in loops
            if not any(t <= t2 and a2 < a and (t2, a2) != (t, a) for t2, a2 in loops)]


def cycles(mca, cpu, body):
    # The loop's own branches are dropped: llvm-mca repeats the block as a loop.
    asm = "\n".join(t for t in body if not t.startswith("j")) + "\n"
    r = subprocess.run([mca, f"-mcpu={cpu}", f"-iterations={ITERATIONS}"], input=asm,
                       capture_output=True, text=True)
    m = re.search(r"Total Cycles:\s+(\d+)", r.stdout)
    if not m:
        sys.exit(f"llvm-mca failed for -mcpu={cpu}: {r.stderr.strip()[:300]}")
    return int(m.group(1)) / ITERATIONS


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary")
    ap.add_argument("symbols", nargs="?", default=r"quant::(avx512::(q4_1|q8_0)_tile|avx2::(q4_1|q8_0)$)")
    ap.add_argument("--cpus", default="znver4,znver5,sapphirerapids")
    args = ap.parse_args()
    mca = next((m for m in ("llvm-mca-19", "llvm-mca-18", "llvm-mca-17", "llvm-mca") if shutil.which(m)), None)
    if mca is None:
        sys.exit("no llvm-mca: `apt-get install llvm-19` (llvm-mca 17 or later knows Zen 4)")
    cpus = args.cpus.split(",")
    print(f"{'function':46} {'loop':>8} {'dots':>5} " + " ".join(f"{c:>15}" for c in cpus))
    for start, size, name in sorted(functions(args.binary, re.compile(args.symbols))):
        ins = list(disassemble(args.binary, start, size))
        for first, last in innermost_loops(ins):
            body = [t for a, t in ins if first <= a <= last]
            dots = sum(any(t.startswith(d) for d in DOT) for t in body)
            if dots == 0:
                continue
            short = name.replace("smolchat_engine::cpu::quant::", "")
            row = " ".join(f"{cycles(mca, c, body):15.1f}" for c in cpus)
            print(f"{short:46} {first:8x} {dots:5} {row}")


if __name__ == "__main__":
    main()

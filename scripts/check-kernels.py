#!/usr/bin/env python3
"""Static checks of the fast tier's CUDA kernels (crates/engine/src/fast/cuda/kernels.cu), run by
`make test` on machines without a GPU: they compile for sm_90 with nvcc (CUDA 13.0, the toolkit
`make cuda-toolkit` installs; `scripts/cuda-env.sh` puts it on PATH), warnings as errors, and
ptxas's resource report must show for every kernel:

- no spill stores or loads and no stack frame (registers are enough);
- registers within the launch bounds: at most 65536 / (threads x min blocks) per thread;
- static shared memory within 48 KiB;
- the tensor-core kernels (TENSOR_CORE_KERNELS) use tensor-core instructions in their SASS
  (HMMA, read with nvdisasm from the toolkit): a kernel written for tensor cores that the
  compiler turned into CUDA-core arithmetic would pass its twin's tests and still be slow;
- every kernel's PTX holds `griddepcontrol.wait` (programmatic dependent launch: the runner
  launches them all with the attribute, so a kernel without the wait could read its inputs
  before the kernel writing them has finished).

    scripts/check-kernels.py [--source FILE]

Exit status 0 when every kernel passes; 1 with one line per problem otherwise. `tests/kernels.rs`
shows it failing on a kernel that spills and on one that does not compile cleanly.
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "crates/engine/src/fast/cuda/kernels.cu"
SMEM_LIMIT = 48 * 1024
# Kernel name prefixes whose SASS must hold tensor-core MMA instructions.
TENSOR_CORE_KERNELS = ("flash_prefill_d",)
REGISTERS_PER_SM = 65536


def launch_bounds(source):
    """kernel name -> (threads, min blocks) from __launch_bounds__, macro instances included."""
    bounds = {}
    for m in re.finditer(r"__launch_bounds__\((\d+)(?:,\s*(\d+))?\)\s*(\w+)", source):
        threads, blocks, name = int(m.group(1)), int(m.group(2) or 1), m.group(3)
        # Macro instances (`attention_partial_g##G`, `matvec_##name`): the prefix.
        bounds[name.split("##")[0]] = (threads, blocks)
    return bounds


def bounds_of(bounds, name):
    """The launch bounds of kernel `name`: its own, or the longest macro prefix's."""
    if name in bounds:
        return bounds[name]
    prefixes = [p for p in bounds if p and name.startswith(p)]
    return bounds[max(prefixes, key=len)] if prefixes else (1024, 1)


def ptx_entries(ptx):
    """kernel name -> its PTX body."""
    entries = {}
    parts = re.split(r"^\.visible \.entry (\w+)\(", ptx, flags=re.M)
    for name, body in zip(parts[1::2], parts[2::2]):
        entries[name] = body
    return entries


def grid_dependency_problems(ptx):
    """One line per kernel whose PTX lacks griddepcontrol.wait."""
    if ptx is None:
        return []
    entries = ptx_entries(ptx)
    if not entries:
        return ["the PTX has no kernel entries"]
    return [
        f"{name}: no griddepcontrol.wait in its PTX (every kernel starts with GRID_DEPENDENCY())"
        for name, body in sorted(entries.items())
        if "griddepcontrol.wait" not in body
    ]


def sass_sections(cubin):
    """kernel name -> its SASS text, from nvdisasm; None when nvdisasm cannot run."""
    try:
        out = subprocess.run(["nvdisasm", str(cubin)], capture_output=True, text=True)
    except FileNotFoundError:
        return None
    if out.returncode != 0:
        return None
    sections = {}
    current = None
    for line in out.stdout.splitlines():
        m = re.match(r"\s*\.section\s+\.text\.(\w+),", line)
        if m:
            current = m.group(1)
            sections[current] = []
            continue
        if current is not None:
            sections[current].append(line)
    return {k: "\n".join(v) for k, v in sections.items()}


def tensor_core_problems(sections, names):
    """One line per tensor-core kernel without an HMMA instruction in its SASS."""
    if sections is None:
        return ["nvdisasm not found or failed: the tensor-core check needs it (`make cuda-toolkit`)"]
    problems = []
    for name in sorted(names):
        if not name.startswith(TENSOR_CORE_KERNELS):
            continue
        hmma = len(re.findall(r"\bHMMA\.", sections.get(name, "")))
        if hmma == 0:
            problems.append(f"{name}: no tensor-core (HMMA) instruction in its SASS")
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", default=SOURCE, type=Path)
    args = ap.parse_args()
    text = args.source.read_text(encoding="utf-8")
    bounds = launch_bounds(text)
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        # The front end once, to PTX (warnings are errors), then ptxas on that PTX for the
        # resource report and the cubin nvdisasm reads: one compile serves every check.
        ptx_path, cubin = Path(tmp) / "kernels.ptx", Path(tmp) / "kernels.cubin"
        cmd = [
            "nvcc", "-arch=sm_90", "--ptx", "-O3", "--Werror", "all-warnings",
            "-o", str(ptx_path), str(args.source),
        ]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode == 0:
                out = subprocess.run(
                    ["ptxas", "-arch=sm_90", "-O3", "-v", "--warning-as-error", str(ptx_path), "-o", str(cubin)],
                    capture_output=True, text=True,
                )
        except FileNotFoundError:
            print("check-kernels: nvcc or ptxas not found; run `make cuda-toolkit` and `eval \"$(scripts/cuda-env.sh)\"`")
            return 1
        sections = sass_sections(cubin) if out.returncode == 0 else {}
        ptx = ptx_path.read_text(encoding="utf-8") if out.returncode == 0 else None
    report = out.stdout + out.stderr
    if out.returncode != 0:
        errors = [l for l in report.splitlines() if "error" in l or "warning" in l]
        problems.append("nvcc failed (warnings are errors): " + " | ".join(errors[:8]))
    kernels = {}
    current = None
    for line in report.splitlines():
        m = re.search(r"Function properties for (\w+)", line)
        if m:
            current = m.group(1)
            kernels.setdefault(current, {})
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            kernels[current].update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            kernels[current]["registers"] = int(m.group(1))
            m2 = re.search(r"(\d+) bytes smem", line)
            kernels[current]["smem"] = int(m2.group(1)) if m2 else 0
    entries = {k: v for k, v in kernels.items() if "registers" in v}
    if out.returncode == 0 and not entries:
        problems.append("ptxas reported no kernels")
    for name, info in sorted(entries.items()):
        if info.get("spill_st", 0) or info.get("spill_ld", 0):
            problems.append(f"{name}: spills ({info['spill_st']} bytes stored, {info['spill_ld']} loaded)")
        if info.get("stack", 0):
            problems.append(f"{name}: a {info['stack']}-byte stack frame (local memory)")
        threads, blocks = bounds_of(bounds, name)
        limit = min(255, REGISTERS_PER_SM // (threads * blocks))
        if info["registers"] > limit:
            problems.append(
                f"{name}: {info['registers']} registers, over {limit} for {threads} threads x {blocks} blocks"
            )
        if info["smem"] > SMEM_LIMIT:
            problems.append(f"{name}: {info['smem']} bytes of shared memory, over {SMEM_LIMIT}")
    if out.returncode == 0:
        problems.extend(tensor_core_problems(sections, entries))
        problems.extend(grid_dependency_problems(ptx))
    for p in problems:
        print(p)
    if problems:
        print(f"check-kernels: {len(problems)} problem(s) in {args.source}")
        return 1
    tensor = sum(1 for n in entries if n.startswith(TENSOR_CORE_KERNELS))
    print(
        f"check-kernels: {len(entries)} kernels for sm_90, no spills, registers and shared memory "
        f"within bounds, tensor cores in the {tensor} that must use them, griddepcontrol.wait in "
        f"every kernel's PTX"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

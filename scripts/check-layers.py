#!/usr/bin/env python3
"""The layer check: which top-level modules of `src/` may name which, and no import cycle
between module files. Run by `make lint` (and so by `make test`); `tests/layers.rs` shows that
it fails when a forbidden dependency or a cycle is added.

    scripts/check-layers.py [--root DIR]     # DIR holds src/ (default: this repository)

It reads every `crate::…`, `super::…` and `self::…` path in `src/**/*.rs` (use trees expanded,
comments left out), resolves each to the module file it names, and then checks:

1. Layers. `ALLOWED` lists, for each top-level module, the others it may name. The engine names
   nothing above it, the store nothing, the web layer nothing of the command line, and so on.
   A module's own items and its ancestors' (a child naming its parent's items, as Rust modules
   do) are always allowed.
2. Cycles. Between module files, following the same references (a reference to an ancestor
   module is not an edge: a parent declares and wires its children). Any cycle is reported with
   the names that tie it.

Exit status 0 when both hold; 1 with one line per violation otherwise.
"""

import argparse
import re
import sys
from pathlib import Path

# Top-level module -> the top-level modules it may name (besides itself). The order is the
# architecture, lowest first: docs/ARCHITECTURE.md, "Layers".
ALLOWED = {
    "engine": set(),
    "store": set(),
    "secrets": set(),
    "config": {"engine"},
    "auth": {"store", "config"},
    "actors": {"engine", "store", "auth"},
    "platform": {"engine", "store", "auth", "actors", "config", "secrets"},
    "web": {"engine", "store", "auth", "actors", "config", "platform", "secrets"},
    "cli": {"engine", "store", "auth", "actors", "config", "platform", "secrets", "web"},
}

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
PATH_RE = re.compile(rf"\b(crate|super|self)((?:::{IDENT})+)")
USE_RE = re.compile(r"\buse\s+((?:crate|super|self)\b[^;]*);", re.S)


def strip_comments(text):
    """Removes // and /* */ comments and string literals' contents (roughly, enough for paths)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""')
            i = j + 1
        elif c == "'" and i + 2 < n and (text[i + 2] == "'" or text[i + 1] == "\\"):
            # A char literal such as '"' or '\n' (lifetimes have no closing quote).
            j = text.find("'", i + 2)
            i = n if j < 0 else j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def expand_use_tree(tree):
    """`super::{a, b::{c, d}}` -> ['super::a', 'super::b::c', 'super::b::d']."""
    tree = re.sub(r"\s+as\s+\w+", "", tree)
    tree = re.sub(r"\s+", "", tree)

    def expand(prefix, t):
        brace = t.find("{")
        if brace < 0:
            return [prefix + t]
        head, body = t[:brace], t[brace + 1 : t.rfind("}")]
        parts, depth, cur = [], 0, ""
        for ch in body:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += ch == "{"
            depth -= ch == "}"
            cur += ch
        parts.append(cur)
        out = []
        for p in parts:
            if p:
                out.extend(expand(prefix + head, p))
        return out

    return [p.replace("::self", "") for p in expand("", tree)]


def module_of(path, src):
    """The module path of a file: src/engine/quant/gemm.rs -> ('engine', 'quant', 'gemm')."""
    rel = path.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def resolve(module, path):
    """The absolute module path a `crate|super|self::…` path starts from, plus its segments."""
    segs = path.split("::")
    head, rest = segs[0], segs[1:]
    if head == "crate":
        base = ()
    else:
        # `self` of a file module is the module itself; `super` is its parent.
        base = module
        if head == "super":
            base = module[:-1]
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
    return base + tuple(r for r in rest if r != "self")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=Path(__file__).resolve().parent.parent, type=Path)
    args = ap.parse_args()
    src = args.root / "src"
    files = sorted(p for p in src.rglob("*.rs") if p.name != "main.rs")
    modules = {module_of(p, src): p for p in files}
    problems = []
    edges = {}  # (from module, to module) -> names
    for path in files:
        module = module_of(path, src)
        text = strip_comments(path.read_text(encoding="utf-8"))
        refs = []
        for m in USE_RE.finditer(text):
            refs.extend(expand_use_tree(m.group(1)))
        refs.extend(m.group(0) for m in PATH_RE.finditer(USE_RE.sub(";", text)))
        for ref in refs:
            target = resolve(module, ref)
            # The longest prefix that is a module file is the file the path names.
            k = len(target)
            while k > 0 and target[:k] not in modules:
                k -= 1
            named, rest = target[:k], target[k:]
            if not named:
                continue
            if module[: len(named)] == named:
                continue  # the module itself or an ancestor
            top, layer = module[0] if module else "", named[0]
            if top and top != layer and layer not in ALLOWED.get(top, set()):
                problems.append(
                    f"{path.relative_to(args.root)}: `{ref}` names the `{layer}` layer, which "
                    f"`{top}` may not use (allowed: {', '.join(sorted(ALLOWED.get(top, []))) or 'none'})"
                )
            edges.setdefault((module, named), set()).add(rest[0] if rest else named[-1])
    # Cycles between module files (Tarjan's strongly connected components).
    graph = {}
    for (a, b) in edges:
        graph.setdefault(a, set()).add(b)
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            strong(v)
    name = lambda m: "::".join(m) or "crate"
    for comp in comps:
        members = set(comp)
        ties = "; ".join(
            f"{name(a)} -> {name(b)} ({', '.join(sorted(edges[(a, b)]))})"
            for (a, b) in sorted(edges)
            if a in members and b in members
        )
        problems.append(f"import cycle between {', '.join(sorted(name(m) for m in comp))}: {ties}")
    for p in problems:
        print(p)
    if problems:
        print(f"check-layers: {len(problems)} problem(s); see scripts/check-layers.py for the rules")
        return 1
    print(f"check-layers: {len(files)} files, {len(edges)} module dependencies, layers hold, no cycles")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The layer check: the workspace's crate graph is the architecture, and no module imports
itself in a circle. Run by `make lint` (and so by `make test`); `tests/layers.rs` shows that it
fails when a forbidden dependency or a cycle is added.

    scripts/check-layers.py [--root DIR]     # DIR holds the workspace (default: this repository)

1. Crates. `cargo metadata --no-deps` lists each workspace crate's declared dependencies. Every
   `smolchat-*` dependency must be one `ALLOWED` lists for that crate (the compiler then keeps
   each crate from naming anything else), and the crates low in the stack must not depend on the
   frameworks of the layers above them (`FORBIDDEN`: the engine knows no actix, SQL, tokio or
   HTTP; the store and auth know no web framework; and so on). Dev-dependencies (tests) may name
   any workspace crate that does not itself depend on the crate under test.
2. Cycles. Within each crate, between module files, following every `crate::…`, `super::…` and
   `self::…` path (use trees expanded, comments left out; a reference to an ancestor module is not
   an edge: a parent declares and wires its children). Any cycle is reported with the names that
   tie it.

Exit status 0 when both hold; 1 with one line per violation otherwise.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

# Crate -> the workspace crates it may depend on. The order is the architecture, lowest first:
# docs/ARCHITECTURE.md, "Crates".
ALLOWED = {
    "smolchat-gguf": set(),
    "smolchat-engine": {"smolchat-gguf"},
    "smolchat-text": {"smolchat-gguf"},
    "smolchat-serving": {"smolchat-gguf", "smolchat-engine", "smolchat-text"},
    "smolchat-store": set(),
    "smolchat-auth": {"smolchat-store"},
    # The client side of MCP (an outside system, like the database): no other workspace crate.
    "smolchat-mcp": set(),
    "smolchat-service": {
        "smolchat-mcp",
        "smolchat-gguf",
        "smolchat-engine",
        "smolchat-text",
        "smolchat-serving",
        "smolchat-store",
        "smolchat-auth",
    },
    # The web layer parses, calls a service and renders: it cannot name the store, the engine or
    # the scheduler, only the services (and the plain text types requests are parsed into).
    "smolchat-web": {"smolchat-text", "smolchat-auth", "smolchat-service"},
    "smolchat": {
        "smolchat-gguf",
        "smolchat-engine",
        "smolchat-text",
        "smolchat-serving",
        "smolchat-store",
        "smolchat-auth",
        "smolchat-mcp",
        "smolchat-service",
        "smolchat-web",
    },
}

ASYNC_AND_IO = {"actix", "actix-web", "actix-web-lab", "tokio", "sqlx", "reqwest", "hyper", "http"}
WEB = {"actix-web", "actix-web-lab", "askama", "reqwest", "hyper", "http", "pulldown-cmark", "ammonia"}

# Crate -> external crates it must not depend on (normal or build dependencies).
FORBIDDEN = {
    "smolchat-gguf": ASYNC_AND_IO,
    "smolchat-engine": ASYNC_AND_IO,
    "smolchat-text": ASYNC_AND_IO,
    "smolchat-serving": WEB | {"sqlx"},
    "smolchat-store": WEB | {"actix", "candle-core"},
    "smolchat-auth": WEB | {"actix", "candle-core"},
    # An HTTP client (reqwest, for Streamable HTTP), never a server framework.
    "smolchat-mcp": {"actix", "actix-web", "actix-web-lab", "askama", "candle-core", "sqlx"},
    "smolchat-service": WEB | {"candle-core", "sqlx"},
    "smolchat-web": {"candle-core", "sqlx"},
    "smolchat": set(),
}


def check_crates(root):
    out = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps", "--offline"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        return [f"cargo metadata failed: {out.stderr.strip()}"], []
    meta = json.loads(out.stdout)
    members = {p["name"]: p for p in meta["packages"]}
    problems = []
    deps = {}
    for name, pkg in sorted(members.items()):
        if name not in ALLOWED:
            problems.append(
                f"crate `{name}` is not in scripts/check-layers.py's ALLOWED table: place it in "
                "the layers (and in docs/ARCHITECTURE.md, \"Crates\")"
            )
            continue
        normal = {d["name"] for d in pkg["dependencies"] if d.get("kind") in (None, "build")}
        dev = {d["name"] for d in pkg["dependencies"] if d.get("kind") == "dev"}
        deps[name] = normal
        for d in sorted(normal & set(members)):
            if d not in ALLOWED[name]:
                problems.append(
                    f"{pkg['manifest_path']}: `{name}` depends on `{d}`, which it may not use "
                    f"(allowed: {', '.join(sorted(ALLOWED[name])) or 'no workspace crate'})"
                )
        for d in sorted(normal & FORBIDDEN[name]):
            problems.append(
                f"{pkg['manifest_path']}: `{name}` depends on `{d}`, a framework of a layer above "
                "it (see FORBIDDEN in scripts/check-layers.py)"
            )
        deps[name + " (dev)"] = dev & set(members)
    # A dev-dependency may not close a loop through the normal graph.
    def reaches(a, b, seen=None):
        seen = seen or set()
        if a == b:
            return True
        seen.add(a)
        return any(reaches(n, b, seen) for n in deps.get(a, ()) if n not in seen)

    for name in members:
        for d in sorted(deps.get(name + " (dev)", ())):
            if d != name and reaches(d, name):
                problems.append(
                    f"`{name}`'s tests depend on `{d}`, which depends on `{name}`: a loop"
                )
    crates = [
        (name, Path(pkg["manifest_path"]).parent / "src")
        for name, pkg in members.items()
    ]
    return problems, crates


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
    """The module path of a file: src/cpu/quant/gemm.rs -> ('cpu', 'quant', 'gemm')."""
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


def module_edges(src):
    files = sorted(p for p in src.rglob("*.rs") if p.name != "main.rs")
    modules = {module_of(p, src): p for p in files}
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
            if module[: len(named)] == named:
                continue  # the module itself or an ancestor
            edges.setdefault((module, named), set()).add(rest[0] if rest else named[-1])
    return files, edges


def cycles(crate, edges):
    """Tarjan's strongly connected components over the module graph."""
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
    problems = []
    for comp in comps:
        members = set(comp)
        ties = "; ".join(
            f"{name(a)} -> {name(b)} ({', '.join(sorted(edges[(a, b)]))})"
            for (a, b) in sorted(edges)
            if a in members and b in members
        )
        problems.append(
            f"import cycle in `{crate}` between {', '.join(sorted(name(m) for m in comp))}: {ties}"
        )
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=Path(__file__).resolve().parent.parent, type=Path)
    args = ap.parse_args()
    problems, crates = check_crates(args.root)
    n_files = n_edges = 0
    for crate, src in sorted(crates):
        files, edges = module_edges(src)
        n_files += len(files)
        n_edges += len(edges)
        problems.extend(cycles(crate, edges))
    for p in problems:
        print(p)
    if problems:
        print(f"check-layers: {len(problems)} problem(s); see scripts/check-layers.py for the rules")
        return 1
    print(
        f"check-layers: {len(crates)} crates, {n_files} files, {n_edges} module dependencies; "
        "the crate graph holds, no cycles"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

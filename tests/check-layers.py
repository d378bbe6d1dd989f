#!/usr/bin/env python3
"""Checks the import structure of every crate in the repository.

For each crate (the workspace members, fuzz/ and python/), a node is a module file under
its src/; an edge A -> B is a path in A's non-test code (`crate::…`, `super::…`,
`self::…`) that resolves to an item defined in B. A path that ends at a directory module
(`crate::index::Foo`) is followed through that module's `pub use` re-exports to the file
that defines `Foo`, so a `mod.rs` that only declares and re-exports never closes a cycle.
Test code (`#[cfg(test)]` modules and files named tests.rs / testing.rs / loom_models.rs)
is left out: tests may reach anywhere.

Two rules:
- no crate has an import cycle among its module files;
- a crate whose root file (lib.rs) declares floors — doc lines `//!     floor N: a b c`,
  lowest first — has every top-level module on exactly one floor, and each module
  imports only modules of lower floors (the crate root, which re-exports, is exempt).
  The engine declares its floors in engine/src/lib.rs; that list is the one place the
  order is written.

Usage: check-layers.py [-v]          every crate
       check-layers.py SRC_DIR [-v]  one crate's src/
       check-layers.py --self-test   the negative controls: an upward import added to a
                                     copy of the engine, and a cycle added to a copy of
                                     another crate, must each be caught
"""
import os
import re
import sys

SKIP_FILES = {"tests.rs", "testing.rs", "loom_models.rs"}
SKIP_DIRS = {"loom_models"}


def module_files(src):
    """Maps module path tuples to files: ('index','table') -> src/index/table.rs."""
    mods = {}
    for root, _dirs, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs") or f in SKIP_FILES:
                continue
            rel = os.path.relpath(os.path.join(root, f), src)
            parts = rel[:-3].split(os.sep)
            if parts[0] in SKIP_DIRS:
                continue
            if parts[-1] in ("mod", "lib", "main"):
                parts = parts[:-1]
            mods[tuple(parts)] = os.path.join(root, f)
    return mods


def strip_code(text):
    """Drops comments, string literals and inline test modules."""
    # One left-to-right pass, so a quote inside a comment or a comment marker inside a
    # string is not taken for what it is not.
    token = re.compile(
        r"""//[^\n]*|/\*.*?\*/|\br(#*)".*?"\1|b?"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])'""", re.S
    )
    text = token.sub(lambda m: '""' if m.group(0)[:1] in 'rb"' else " ", text)
    out = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"\s*#\[cfg\((all\()?(test|loom)\b", line) and i + 1 < len(lines) and re.match(
            r"\s*(pub(\(crate\))? )?mod \w+\s*\{", lines[i + 1]
        ):
            # skip the braced module that follows
            depth = 0
            j = i + 1
            while j < len(lines):
                depth += lines[j].count("{") - lines[j].count("}")
                if depth <= 0 and "{" in "".join(lines[i + 1 : j + 1]):
                    break
                j += 1
            i = j + 1
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def expand_use_groups(text):
    """`use a::{b, c::{d, e}};` -> ['a::b', 'a::c::d', 'a::c::e'] (plus all plain paths)."""
    paths = []
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        paths.extend(_expand(m.group(1).replace("\n", " ").strip()))
    return paths


def _expand(s):
    s = s.strip()
    if "{" not in s:
        s = re.sub(r"\s+as\s+\w+$", "", s)
        return [s] if s else []
    head, rest = s.split("{", 1)
    inner = rest[: rest.rfind("}")]
    parts, depth, cur = [], 0, ""
    for ch in inner:
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
        p = p.strip()
        if not p:
            continue
        if p == "self":
            out.append(head.rstrip(":"))
        else:
            out.extend(head + q for q in _expand(p))
    return out


def reexports(mods, code):
    """For each module, item name -> path segments it re-exports (from `pub use`)."""
    table = {}
    for mod, _f in mods.items():
        names = {}
        for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", code[mod]):
            for p in _expand(m.group(1).replace("\n", " ")):
                alias = re.search(r"\s+as\s+(\w+)$", p)
                p = re.sub(r"\s+as\s+\w+$", "", p).strip()
                segs = p.split("::")
                names[alias.group(1) if alias else segs[-1]] = segs
        table[mod] = names
    return table


def absolutize(mod, segs):
    segs = list(segs)
    base = list(mod)
    if segs[0] == "crate":
        return segs[1:]
    if segs[0] in ("self", "super"):
        cur = base
        while segs and segs[0] in ("self", "super"):
            if segs[0] == "super":
                cur = cur[:-1]
            segs = segs[1:]
        return cur + segs
    return None  # extern crate or a local name


def resolve(mods, rex, segs, seen=None):
    """Returns the module that defines what `segs` (absolute, crate-relative) names."""
    seen = seen or set()
    key = tuple(segs)
    if key in seen:
        return None
    seen.add(key)
    # longest module prefix
    for n in range(len(segs), -1, -1):
        prefix = tuple(segs[:n])
        if prefix in mods:
            rest = segs[n:]
            if rest and rest[0] in rex.get(prefix, {}):
                target = rex[prefix][rest[0]]
                absolute = absolutize(prefix, target)
                if absolute is not None:
                    r = resolve(mods, rex, absolute + rest[1:], seen)
                    if r is not None:
                        return r
            return prefix
    return None


def crate_graph(src):
    """(modules, edges) of the crate whose module files are under `src`."""
    mods = module_files(src)
    code = {m: strip_code(open(f, encoding="utf-8").read()) for m, f in mods.items()}
    rex = reexports(mods, code)
    edges = {m: set() for m in mods}
    for mod in mods:
        text = code[mod]
        paths = expand_use_groups(text)
        paths += re.findall(r"\b((?:crate|super|self)(?:::\w+)+)", text)
        for p in paths:
            segs = [s.strip() for s in p.split("::") if s.strip()]
            if not segs or segs[-1] == "*":
                segs = segs[:-1]
            if not segs:
                continue
            absolute = absolutize(mod, segs)
            if absolute is None:
                continue
            target = resolve(mods, rex, absolute)
            if target is None or target == mod:
                continue
            # A module's own ancestors only count when the item is defined there, which
            # resolve() already decided; a child module used by its parent counts too.
            edges[mod].add(target)
    return mods, edges


def cycles(mods, edges):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
                sccs.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(mods):
        if v not in index:
            strong(v)
    return sccs


FLOOR = re.compile(r"^//!\s+floor (\d+):\s*(.*?)\s*$", re.M)


def floors(src):
    """Top-level module -> floor, from the crate root's `//! floor N: a b c` lines, or None
    when the crate declares no floors."""
    root = os.path.join(src, "lib.rs")
    if not os.path.exists(root):
        return None
    found = FLOOR.findall(open(root, encoding="utf-8").read())
    if not found:
        return None
    table = {}
    for n, names in found:
        for name in names.split():
            if name in table:
                sys.exit(f"check-layers: {root}: module {name} is on two floors")
            table[name] = int(n)
    return table


def name(m):
    return "::".join(m) or "crate"


def check_crate(src, verbose=False):
    """Problems found in one crate (a list of lines; empty when it is sound)."""
    mods, edges = crate_graph(src)
    problems = []
    if verbose:
        for m in sorted(edges):
            print(f"  {name(m)} -> {', '.join(sorted(name(t) for t in edges[m]))}")
    for comp in cycles(mods, edges):
        members = set(comp)
        problems.append("cycle among: " + ", ".join(sorted(name(m) for m in comp)))
        for m in sorted(comp):
            inside = sorted(name(t) for t in edges[m] if t in members)
            problems.append(f"  {name(m)} -> {', '.join(inside)}")
    table = floors(src)
    if table is not None:
        tops = sorted({m[0] for m in mods if m})
        for t in tops:
            if t not in table:
                problems.append(f"module {t} is on no floor (add it to lib.rs's floor list)")
        for t in sorted(set(table) - set(tops)):
            problems.append(f"floor list names {t}, which is not a module")
        for m in sorted(edges):
            if not m or m[0] not in table:
                continue
            for t in sorted(edges[m]):
                if not t or t[0] == m[0] or t[0] not in table:
                    continue
                if table[t[0]] >= table[m[0]]:
                    how = "same floor" if table[t[0]] == table[m[0]] else "upward"
                    problems.append(
                        f"{how} import: {name(m)} (floor {table[m[0]]}) -> "
                        f"{name(t)} (floor {table[t[0]]})"
                    )
    return len(mods), table is not None, problems


def crates(root):
    """Every crate's src/ directory: the workspace members and the crates it excludes
    (fuzz/, python/, the Dynamo side-by-side bench), each a workspace of its own."""
    manifest = open(os.path.join(root, "Cargo.toml"), encoding="utf-8").read()
    members = re.search(r"members\s*=\s*\[(.*?)\]", manifest, re.S).group(1)
    excluded = re.search(r"exclude\s*=\s*\[(.*?)\]", manifest, re.S).group(1)
    dirs = re.findall(r'"([^"]+)"', members) + re.findall(r'"([^"]+)"', excluded)
    out = []
    for d in dirs:
        src = os.path.join(root, d, "src")
        if os.path.isdir(src):
            out.append(src)
    return out


def caught(tmp, root, crate, file, line, expected, what):
    """One negative control: a copy of `crate`'s src/ with `line` appended to `file` must
    report a problem for which `expected` holds; prints the lines that did."""
    import shutil

    copy = os.path.join(tmp, crate.replace("/", "_"))
    shutil.copytree(os.path.join(root, crate, "src"), copy)
    with open(os.path.join(copy, file), "a", encoding="utf-8") as f:
        f.write("\n" + line + "\n")
    _, _, problems = check_crate(copy)
    hits = [p for p in problems if expected(p)]
    if not hits:
        sys.exit(f"self-test: {what} was not caught:\n" + "\n".join(problems))
    print(f"check-layers self-test: {what} was caught:")
    print("\n".join("  " + p for p in hits))


def self_test(root):
    """The negative controls: a copy of the engine with one upward import (the lowest
    floor naming the partition) and a copy of the service with one added cycle (a module
    the registry imports naming the registry) must each fail, naming what they added;
    the real tree must pass."""
    import tempfile

    for src in crates(root):
        _, _, problems = check_crate(src)
        if problems:
            sys.exit(f"self-test: {src} itself fails:\n" + "\n".join(problems))
    with tempfile.TemporaryDirectory() as tmp:
        caught(
            tmp, root, "engine", "ids.rs",
            "pub(crate) fn up(_: &crate::partition::Partition) {}",
            lambda p: p.startswith("upward import: ids") and "partition" in p,
            "an upward import",
        )
        caught(
            tmp, root, "service", "error.rs",
            "pub(crate) fn back(_: &crate::registry::Registry) {}",
            lambda p: p.startswith("cycle among") and "error" in p and "registry" in p,
            "an added cycle",
        )


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.abspath(os.path.join(here, ".."))
    verbose = "-v" in sys.argv
    if "--self-test" in sys.argv:
        return self_test(root)
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    bad = 0
    for src in args or crates(root):
        n, layered, problems = check_crate(src, verbose)
        rel = os.path.relpath(src, root)
        if problems:
            bad += 1
            print(f"check-layers: {rel}: {len(problems)} problem line(s):")
            print("\n".join("  " + p for p in problems))
        else:
            what = "no cycle, every import downward" if layered else "no cycle"
            print(f"check-layers: {rel}: {n} modules, {what}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Fails when the engine's modules import each other in a cycle (issue 13, item 1).

A node is a module file under engine/src; an edge A -> B is a path in A's non-test code
(`crate::…`, `super::…`, `self::…`) that resolves to an item defined in B. A path that
ends at a directory module (`crate::index::Foo`) is followed through that module's
`pub use` re-exports to the file that defines `Foo`, so a `mod.rs` that only declares and
re-exports never closes a cycle. Test code (`#[cfg(test)]` modules and files named
tests.rs / testing.rs / loom_models.rs) is left out: tests may reach anywhere.

Usage: check-module-cycles.py [SRC_DIR]   (default: engine/src beside this script's repo;
                                          any crate's src/, e.g. service/src, ffi/src)
       check-module-cycles.py --self-test   (the negative control: a copy of engine/src with
                                             one added back edge must be caught)
"""
import os
import re
import sys

SKIP_FILES = {"tests.rs", "testing.rs", "loom_models.rs"}


def module_files(src):
    """Maps module path tuples to files: ('index','table') -> src/index/table.rs."""
    mods = {}
    for root, _dirs, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs") or f in SKIP_FILES:
                continue
            rel = os.path.relpath(os.path.join(root, f), src)
            parts = rel[:-3].split(os.sep)
            if parts[-1] in ("mod", "lib"):
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


def self_test(src):
    """Adds a back edge (the bottom layer, ids, naming the partition) to a copy of the
    tree and checks that the cycle is found and named; the real tree must pass."""
    import shutil
    import subprocess
    import tempfile

    me = os.path.abspath(__file__)
    clean = subprocess.run([sys.executable, me, src], capture_output=True, text=True)
    if clean.returncode != 0:
        sys.exit("self-test: the tree itself has a cycle:\n" + clean.stdout)
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "src")
        shutil.copytree(src, copy)
        with open(os.path.join(copy, "ids.rs"), "a", encoding="utf-8") as f:
            f.write("\npub(crate) fn back_edge(_: &crate::partition::Partition) {}\n")
        bad = subprocess.run([sys.executable, me, copy], capture_output=True, text=True)
    if bad.returncode == 0 or "ids -> " not in bad.stdout or "partition" not in bad.stdout:
        sys.exit("self-test: a deliberately added cycle was not caught:\n" + bad.stdout)
    print("check-module-cycles self-test: the added cycle was caught:")
    print("\n".join("  " + l for l in bad.stdout.splitlines()[:4]))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default = os.path.join(here, "..", "engine", "src")
    if "--self-test" in sys.argv:
        return self_test(default)
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    src = args[0] if args else default
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

    # Tarjan's strongly connected components.
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

    name = lambda m: "::".join(m) or "crate"
    if "-v" in sys.argv or os.environ.get("KVR_CYCLES_VERBOSE"):
        for m in sorted(edges):
            print(f"{name(m)} -> {', '.join(sorted(name(t) for t in edges[m]))}")
    if sccs:
        print(f"check-module-cycles: {len(sccs)} import cycle(s) in {src}:")
        for comp in sccs:
            members = set(comp)
            print("  cycle among: " + ", ".join(sorted(name(m) for m in comp)))
            for m in sorted(comp):
                inside = sorted(name(t) for t in edges[m] if t in members)
                print(f"    {name(m)} -> {', '.join(inside)}")
        sys.exit(1)
    print(f"check-module-cycles: no import cycle among {len(mods)} modules of {src}")


if __name__ == "__main__":
    main()

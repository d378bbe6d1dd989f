#!/usr/bin/env python3
"""Checks docs/seed-000.md: every test it names (`path::name`) exists in that file.

A Rust test is `fn name(`, a C test `static void name(`, a Go test `func Name(`, a C++
test `name(` at the start of a line (after `static void ` or `void `). Exits 1 naming
the missing ones.
"""
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
doc = (root / "docs" / "seed-000.md").read_text()
refs = sorted(set(re.findall(r"`([\w./-]+\.(?:rs|c|go|cpp))::(\w+)`", doc)))
patterns = {
    ".rs": r"^\s*(?:pub\s+)?fn {}\(",
    ".c": r"^static void {}\(",
    ".go": r"^func {}\(",
    ".cpp": r"^(?:static\s+)?void {}\(",
}
missing = []
for path, name in refs:
    f = root / path
    pat = patterns[pathlib.Path(path).suffix].format(re.escape(name))
    if not f.exists() or not re.search(pat, f.read_text(), re.M):
        missing.append(f"{path}::{name}")
if not refs:
    print("check-seed-map: no tests named in docs/seed-000.md")
    sys.exit(1)
for m in missing:
    print(f"check-seed-map: not found: {m}")
print(f"check-seed-map: {len(refs) - len(missing)} of {len(refs)} named tests exist")
sys.exit(1 if missing else 0)

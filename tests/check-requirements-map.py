#!/usr/bin/env python3
"""Checks docs/requirements.md: every test it names (`path::name`) exists in that file.

A Rust test is `fn name(`, a C test `static void name(`, a Go test `func Name(`, a C++
test `void name(` at the start of a line, a Python test `def name(`. Exits 1 naming the
missing ones, or when the map names no test at all.

With KVR_SHARED_DIR set (the shared reference directory, as for the hash conformance
check), it also checks that the map quotes no outside design text: no run of ten words
of any `seeds/*.txt` there appears in it.
"""
import os
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
doc_path = root / "docs" / "requirements.md"
doc = doc_path.read_text()
refs = sorted(set(re.findall(r"`([\w./-]+\.(?:rs|c|go|cpp|py))::(\w+)`", doc)))
patterns = {
    ".rs": r"^\s*(?:pub\s+)?(?:async\s+)?fn {}\(",
    ".c": r"^static void {}\(",
    ".go": r"^func {}\(",
    ".cpp": r"^(?:static\s+)?void {}\(",
    ".py": r"^(?:async\s+)?def {}\(",
}
missing = []
for path, name in refs:
    f = root / path
    pat = patterns[pathlib.Path(path).suffix].format(re.escape(name))
    if not f.exists() or not re.search(pat, f.read_text(), re.M):
        missing.append(f"{path}::{name}")
if not refs:
    print("check-requirements-map: no tests named in docs/requirements.md")
    sys.exit(1)
for m in missing:
    print(f"check-requirements-map: not found: {m}")
print(f"check-requirements-map: {len(refs) - len(missing)} of {len(refs)} named tests exist")

copied = []
shared = os.environ.get("KVR_SHARED_DIR")
if shared:
    def words(text):
        return re.findall(r"[a-z0-9_]+", text.lower())
    ours = words(doc)
    runs = {tuple(ours[i:i + 10]) for i in range(len(ours) - 9)}
    seeds = sorted(pathlib.Path(shared).glob("seeds/*.txt"))
    for seed in seeds:
        theirs = words(seed.read_text())
        for i in range(len(theirs) - 9):
            if tuple(theirs[i:i + 10]) in runs:
                copied.append(f"{seed.name}: {' '.join(theirs[i:i + 10])}")
    for c in copied:
        print(f"check-requirements-map: ten words copied from {c}")
    print(f"check-requirements-map: no ten-word run of {len(seeds)} seed texts copied"
          if not copied else "check-requirements-map: the map quotes outside text")
sys.exit(1 if missing or copied else 0)

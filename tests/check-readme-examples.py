#!/usr/bin/env python3
"""README.md's host examples are the files CI compiles and runs.

A fenced code block right after a line `<!-- example: PATH -->` must equal the file PATH
(relative to the repository root) byte for byte, apart from a final newline. Fails when
one differs or names a missing file, or when README.md names none. Run by tests/run-all.sh.
"""
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
readme = (root / "README.md").read_text()
pattern = re.compile(r"<!-- example: (\S+) -->\n```[a-z+]*\n(.*?)```", re.S)
found = pattern.findall(readme)
if not found:
    sys.exit("README.md names no example (<!-- example: PATH --> before a code block)")
bad = 0
for path, block in found:
    f = root / path
    if not f.is_file():
        print(f"README example {path}: no such file")
        bad += 1
        continue
    if f.read_text().rstrip("\n") != block.rstrip("\n"):
        print(f"README example {path}: the code block differs from the file")
        bad += 1
    else:
        print(f"README example {path}: matches")
sys.exit(1 if bad else 0)

"""README.md's Python example (tests/python/example.py, checked equal to the README's
block by tests/check-readme-examples.py) runs and prints what its comment says."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_readme_example_runs():
    out = subprocess.run([sys.executable, os.path.join(HERE, "example.py")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "http://gpu-host:8000", "0"], out.stdout

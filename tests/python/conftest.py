"""Shared fixtures of the Python binding tests (tests/python/run.sh runs them)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
COMPAT = os.path.join(os.path.dirname(HERE), "compat")
sys.path.insert(0, COMPAT)  # harness.py (comparison rules) and the vLLM publisher

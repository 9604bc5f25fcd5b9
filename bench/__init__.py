"""Benchmarks and the fault soak of issue 7: every speed or reliability figure in the README comes
from here. Run each with `.venv/bin/python -m bench.<name>` from the repository root (bench/README.md).
"""

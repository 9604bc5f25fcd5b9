"""The command line: `run`, `demo`, `check`, `record`, `validate`.
"""

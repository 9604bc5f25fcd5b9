"""Development tools that are not part of the pod: the launcher of a real Triton for the demo, tests
and benchmarks.
"""

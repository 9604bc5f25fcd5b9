"""The KServe v2 and Triton vocabulary both sides speak: datatypes, server-sent events, Triton's
error verdicts. No I/O, no framework: every package may import it.
"""

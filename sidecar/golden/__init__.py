"""Golden requests: the file format, loading and checking of `golden_requests/<model>/*.json`, and the
comparison of an answer with a case's expected outputs. Pure: used by the health loop, the serving
core (a model whose cases expect NaN) and the command line.
"""

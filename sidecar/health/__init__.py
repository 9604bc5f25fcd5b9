"""The health control loop: the Triton client, probe rounds, the per-model loops that own model state,
the healer, discovery of models (roster), and live reload of config and golden files. It never
imports the serving core.
"""

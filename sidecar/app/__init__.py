"""The composition root: `create_app(config, ...)` wires config, health, serving and fronts into one
aiohttp application, and serves the kubelet's endpoints (/healthz, /readyz, /status, /metrics).
"""

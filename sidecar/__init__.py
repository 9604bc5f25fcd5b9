"""triton-sidecar: semantic health checks, self-healing and a guarding proxy for Triton."""

__version__ = "0.1.0"

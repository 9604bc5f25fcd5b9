"""The serving core: the one chain every proxied request runs through, whatever its wire (admission,
specs, validation, breaker, screening, passive signals, telemetry, refusals, drain). It speaks no
wire: no aiohttp, grpc or httptools here (an import-linter contract). It reads model state; it
never writes it.
"""

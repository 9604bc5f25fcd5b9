"""The inference proxy on the sidecar port (KServe v2 / Open Inference Protocol over HTTP)."""

from __future__ import annotations

from aiohttp import web


def add_proxy_routes(app: web.Application) -> None:
    """Register the proxied v2 endpoints on the sidecar's app."""
    del app

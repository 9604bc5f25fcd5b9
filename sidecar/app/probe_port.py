"""`listen.probe_port`: plaintext /healthz, /readyz and /metrics for the kubelet and Prometheus.

With TLS on `listen.port` (and above all with mutual TLS) the kubelet cannot probe it: an httpGet probe
with `scheme: HTTPS` skips verification but can present no client certificate, and a gRPC probe
speaks no TLS at all. This port answers the three read-only endpoints and nothing else, so no
inference and no model document ever travels in plaintext.
"""

from __future__ import annotations

from aiohttp import web

from sidecar.app.kubelet import healthz, metrics_endpoint, readyz

#: The only paths the probe port serves.
PROBE_PATHS = ("/healthz", "/readyz", "/metrics")


def probe_application(app: web.Application) -> web.Application:
    """A small app over the very state of `app` (after its start-up: the handlers read the same
    objects, so readiness fails here the moment a drain starts there)."""
    probe = web.Application()
    for key in app:
        probe[key] = app[key]  # type: ignore[index]
    probe.router.add_get("/healthz", healthz)
    probe.router.add_get("/readyz", readyz)
    probe.router.add_get("/metrics", metrics_endpoint)
    probe.router.add_route("*", "/{path:.*}", _not_here)
    return probe


async def _not_here(request: web.Request) -> web.Response:
    return web.json_response(
        {"error": f"the probe port serves only {', '.join(PROBE_PATHS)}; inference and every other endpoint "
                  "are on listen.port (and listen.grpc_port)", "reason": "unknown_path"}, status=404)


class ProbeListener:
    def __init__(self, app: web.Application) -> None:
        self.app = app
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> None:
        self._runner = web.AppRunner(probe_application(self.app), handle_signals=False, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, reuse_address=True).start()

    @property
    def port(self) -> int:
        assert self._runner is not None
        return int(self._runner.addresses[0][1])

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

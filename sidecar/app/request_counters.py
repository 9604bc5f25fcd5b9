"""How many live requests the data plane has served per model and version: the one seam through which
the health loop sees traffic (rounds paced by `probes.every_requests`, sidecar.health.traffic_pace).

Read from the counters /metrics exports, which the data plane keeps as atomics (sidecar._dataplane's
RequestMetrics), so the request path pays nothing for it: no lock, event or callback per request;
the supervisors read them when they look (a few times per round while traffic flows).
"""

from __future__ import annotations

from sidecar.metrics import SidecarMetrics
from sidecar.serving.routing import FALLBACK, PINNED, SPLIT
from sidecar.serving.telemetry import GRPC, HTTP

#: The answers that served a client: (protocol, code) as triton_sidecar_proxy_requests_total labels them.
SERVED = ((HTTP, "200"), (GRPC, "OK"))


#: The routed reasons that send a client's request to a version by name (shadow calls are the
#: sidecar's own copies, not live requests).
NAMED = (PINNED, SPLIT, FALLBACK)


class RequestCounters:
    def __init__(self, metrics: SidecarMetrics) -> None:
        # Read, never created: a model or code without traffic adds no series to /metrics.
        self._counts = metrics.requests

    def served(self, model: str, version: str = "") -> int:
        """Requests of `model` answered 200 / OK since start, every version (`version` ""); or the
        requests the router sent to `version` by name (pinned, split, fallback; counted when routed,
        so the few refused after routing are in too). Monotonic; only differences are meaningful."""
        if version:
            return sum(self._counts.routed_count(model, version, reason) for reason in NAMED)
        return sum(self._counts.requests(protocol, model, code) for protocol, code in SERVED)

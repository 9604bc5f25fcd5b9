"""How many live requests the data plane has served per model and version: the one seam through which
the health loop sees traffic (rounds paced by `probes.every_requests`, sidecar.health.traffic_pace).

Read from the counters /metrics exports, so the request path pays nothing for it: no lock, event or
callback per request; the supervisors read them when they look (a few times per round while traffic
flows). When the data plane's counters move into the compiled extension, only this module changes:
the supervisors get the same `served(model, version) -> int`.
"""

from __future__ import annotations

from typing import Any

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
        # The counters' children by label values, as prometheus_client keeps them: looked up, never
        # created, so a model or code without traffic adds no series to /metrics.
        self._requests: dict[tuple[str, ...], Any] = metrics.proxy_requests._metrics
        self._routed: dict[tuple[str, ...], Any] = metrics.routed._metrics

    def served(self, model: str, version: str = "") -> int:
        """Requests of `model` answered 200 / OK since start, every version (`version` ""); or the
        requests the router sent to `version` by name (pinned, split, fallback; counted when routed,
        so the few refused after routing are in too). Monotonic; only differences are meaningful."""
        if version:
            children = [self._routed.get((model, version, reason)) for reason in NAMED]
        else:
            children = [self._requests.get((protocol, model, code)) for protocol, code in SERVED]
        # _value.get() is the child's own read (what /metrics' collect does), not a lock of ours.
        return int(sum(child._value.get() for child in children if child is not None))

"""Typed keys for the state every handler reads from the aiohttp application (no globals).
"""

from __future__ import annotations

from aiohttp import web

from sidecar.config import SidecarConfig
from sidecar.fronts.upstream_pool import UpstreamPool
from sidecar.health.healer import Healer
from sidecar.health.prober import Prober
from sidecar.health.reload import LiveConfig
from sidecar.health.roster import Roster
from sidecar.health.triton_client import TritonClient
from sidecar.health.triton_watch import TritonWatch
from sidecar.metrics import SidecarMetrics
from sidecar.serving.core import ServingCore
from sidecar.serving.lifecycle import Lifecycle
from sidecar.states import ModelStates

#: The configuration the process started with: what only a restart changes (listen, triton, proxy,
#: logging, golden_dir) is read here. Settings that reload are read from LIVE.
CONFIG = web.AppKey("config", SidecarConfig)


#: The configuration and golden cases in force now, swapped whole by a reload (sidecar.reload).
LIVE = web.AppKey("live", LiveConfig)


#: The guarded models and their probe loops (sidecar.roster).
ROSTER = web.AppKey("roster", Roster)


TRITON = web.AppKey("triton", TritonClient)


METRICS = web.AppKey("metrics", SidecarMetrics)


STATES = web.AppKey("states", ModelStates)


PROBER = web.AppKey("prober", Prober)


HEALER = web.AppKey("healer", Healer)


WATCH = web.AppKey("watch", TritonWatch)


LIFECYCLE = web.AppKey("lifecycle", Lifecycle)


#: Golden cases by model name: the mapping a reload updates (LIVE.golden.cases), one tuple per model.
GOLDEN = web.AppKey("golden", dict)


#: Keep-alive connections to Triton's HTTP port for proxied inferences (the hot path, both
#: listeners), generate and generate_stream.
UPSTREAM_POOL = web.AppKey("upstream_pool", UpstreamPool)


#: The same client stack to the same port for Triton's documents (metadata, config, ready, stats):
#: a pool of its own so that a burst of spec fetches never takes the inference path's warm
#: connections, and its idle stack stays sized for inferences.
DOCUMENT_POOL = web.AppKey("document_pool", UpstreamPool)


#: The same client stack to Triton's metrics port (`triton.metrics_url`), for /metrics scrapes.
TRITON_METRICS_POOL = web.AppKey("triton_metrics_pool", UpstreamPool)


#: The serving core shared by the HTTP and gRPC fronts (admission, specs, breakers, signals, telemetry).
SERVING = web.AppKey("serving", ServingCore)


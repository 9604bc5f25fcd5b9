"""Typed keys for the state every handler reads from the aiohttp application (no globals).
"""

from __future__ import annotations

from aiohttp import web

from sidecar.config import SidecarConfig
from sidecar.fronts.tls import ServerTls
from sidecar.health.escalation import RestartEscalation
from sidecar.health.healer import Healer
from sidecar.health.heartbeats import Heartbeats
from sidecar.health.prober import Prober
from sidecar.health.reload import LiveConfig
from sidecar.health.roster import Roster
from sidecar.health.triton_client import TritonClient
from sidecar.health.triton_watch import TritonWatch
from sidecar.metrics import SidecarMetrics
from sidecar.serving.core import ServingCore
from sidecar.serving.lifecycle import Lifecycle
from sidecar.serving.readiness import Readiness
from sidecar.states import ModelStates
from sidecar.upstream import UpstreamPool

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


#: The pod's decision to restart Triton for a process-level fault (sidecar.health.escalation).
ESCALATION = web.AppKey("escalation", RestartEscalation)


WATCH = web.AppKey("watch", TritonWatch)


#: What turns outside the event loop (the Rust front's runtime), for /healthz's watchdog.
HEARTBEATS = web.AppKey("heartbeats", Heartbeats)


LIFECYCLE = web.AppKey("lifecycle", Lifecycle)


#: Keep-alive connections to Triton's HTTP port for proxied inferences (the hot path, both
#: listeners), generate and generate_stream.
UPSTREAM_POOL = web.AppKey("upstream_pool", UpstreamPool)


#: The same client stack to the same port for Triton's documents (metadata, config, ready, stats):
#: a pool of its own so that a burst of spec fetches never takes the inference path's warm
#: connections, and its idle stack stays sized for inferences.
DOCUMENT_POOL = web.AppKey("document_pool", UpstreamPool)


#: The same client stack to Triton's metrics port (`triton.metrics_url`), for /metrics scrapes.
TRITON_METRICS_POOL = web.AppKey("triton_metrics_pool", UpstreamPool)


#: The one readiness every endpoint answers with: /readyz, /v2/health/ready, /v2/models/{m}/ready,
#: gRPC ServerReady and ModelReady, grpc.health.v1.
READINESS = web.AppKey("readiness", Readiness)


#: The serving core shared by the HTTP and gRPC fronts (admission, specs, breakers, signals, telemetry).
SERVING = web.AppKey("serving", ServingCore)



#: The TLS material in force and its watch; set only when tls.cert_file and tls.key_file are.
TLS = web.AppKey("tls", ServerTls)


#: The port of the Python gRPC server when it listens on loopback behind the data plane's gRPC
#: front (listen.grpc_front: rust), set once it listens (sidecar.fronts.grpc_server.grpc_front).
GRPC_BACK_PORT = web.AppKey("grpc_back_port", int)

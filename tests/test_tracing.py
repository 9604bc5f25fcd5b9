"""Distributed tracing against real components: a real Triton exporting its own OpenTelemetry spans and
the sidecar exporting its spans, both to one OTLP/HTTP receiver that decodes what arrives with the
official definitions (opentelemetry-proto): protobuf from the sidecar's SDK, JSON from Triton 2.51."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from aiohttp import web
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from tritonclient.grpc import service_pb2 as pb

from sidecar.config import ConfigError, load_config
from sidecar.devtools.certificates import issue, make_ca
from sidecar.devtools.tritonserver import LocalTriton, free_port
from sidecar.fronts.appkeys import CONFIG
from sidecar.fronts.grpc_server import SERVICE
from sidecar.logs import configure_logging
from sidecar.states import ModelState
from tests.conftest import EXAMPLE_MODELS, _repository_copy
from tests.harness import FreshModel, stop_sidecar, wait_for
from tests.proxy_support import credit_json, features, proxy_config, served_by_front, started_and_healthy

SIDECAR_SERVICE = "triton-sidecar"

#: Spans leave the sidecar within this after they end (tracing.export_delay_s below), and Triton posts
#: each span at once (bsp_max_export_batch_size=1): what a test waits on top of the event itself.
EXPORT_DELAY_S = 0.2

#: gRPC ModelInfer's span name: the RPC's full name, as OpenTelemetry's RPC conventions say.
INFER_SPAN = f"{SERVICE}/ModelInfer"


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    attributes: dict[str, Any]
    status_code: int
    status_message: str
    events: tuple[str, ...]
    #: The resource's telemetry.sdk.language: which side's SDK exported it ("rust": the front's).
    language: str = ""

    @property
    def failed(self) -> bool:
        return self.status_code == trace_pb2.Status.STATUS_CODE_ERROR


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


#: OTLP/JSON writes trace and span ids in hex, where protobuf's JSON mapping expects base64.
_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _hex_ids_to_base64(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: (base64.b64encode(bytes.fromhex(v)).decode() if k in _ID_KEYS and v else _hex_ids_to_base64(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_hex_ids_to_base64(v) for v in node]
    return node


class OtlpReceiver:
    """An OTLP/HTTP traces receiver (POST /v1/traces) on a loopback port, in a thread of its own so that
    the Triton started before any test's event loop can post to it for the whole module."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self.port = free_port()
        #: Set: the receiver speaks https:// only (a collector behind TLS).
        self.ssl_context = ssl_context
        self.spans: list[ReceivedSpan] = []
        self.posts: dict[str, int] = {"protobuf": 0, "json": 0}
        #: Bodies that did not decode: each is a test failure (`assert not receiver.errors`).
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="otlp-receiver", daemon=True)

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}/v1/traces"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port,
                                                  ssl_context=self.ssl_context).start())
        self._started.set()
        self._loop.run_forever()

    def start(self) -> OtlpReceiver:
        self._thread.start()
        assert self._started.wait(10), "the OTLP receiver did not start"
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        export = trace_service_pb2.ExportTraceServiceRequest()
        kind = "json" if request.content_type == "application/json" else "protobuf"
        try:
            if kind == "json":
                json_format.ParseDict(_hex_ids_to_base64(json.loads(body)), export, ignore_unknown_fields=True)
            else:
                export.ParseFromString(body)
        except Exception as e:
            with self._lock:
                self.errors.append(f"{kind}: {type(e).__name__}: {e}: {body[:300]!r}")
            return web.Response(status=400, text=str(e))
        received = []
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service=str(resource.get("service.name", "")), trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(), parent_span_id=span.parent_span_id.hex(), name=span.name,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        status_code=span.status.code, status_message=span.status.message,
                        events=tuple(e.name for e in span.events),
                        language=str(resource.get("telemetry.sdk.language", ""))))
        with self._lock:
            self.posts[kind] += 1
            self.spans.extend(received)
        answer = trace_service_pb2.ExportTraceServiceResponse()
        if kind == "json":
            return web.json_response({})
        return web.Response(body=answer.SerializeToString(), content_type="application/x-protobuf")

    def find(self, **match: Any) -> list[ReceivedSpan]:
        """Spans whose fields equal `match`; `attributes` matches a subset of the span's attributes."""
        wanted_attributes = match.pop("attributes", {})
        with self._lock:
            spans = list(self.spans)
        return [s for s in spans if all(getattr(s, k) == v for k, v in match.items())
                and all(s.attributes.get(k) == v for k, v in wanted_attributes.items())]


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    server = OtlpReceiver().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def traced_triton(receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTriton]:
    """A Triton of this module's own that exports its spans into the receiver, each posted at once. It
    traces the requests that carry a traceparent (whatever the rate) and, at rate 1,000,000, almost
    none other: the golden requests the probes send every half second would otherwise keep Triton's
    exporter busy and delay the spans a test waits for by seconds."""
    root = tmp_path_factory.mktemp("traced-triton")
    trace_flags = ["mode=opentelemetry", f"opentelemetry,url=127.0.0.1:{receiver.port}/v1/traces",
                   "opentelemetry,bsp_max_export_batch_size=1", "level=TIMESTAMPS", "rate=1000000"]
    server = LocalTriton(model_repository=_repository_copy(root), models=EXAMPLE_MODELS, workdir=root / "work",
                         extra_args=[arg for flag in trace_flags for arg in ("--trace-config", flag)])
    server.start()
    yield server
    server.stop(grace_s=3)


def tracing_config(triton: LocalTriton, endpoint: str, *, models: list[str] | None = None,
                   golden_dir: Path | None = None, grpc_port: int = 0, **tracing: Any):  # type: ignore[no-untyped-def]
    """The proxy config of the tests, with a gRPC port, every request in the access log, and the tracing
    section pointed at `endpoint`."""
    sections: dict[str, Any] = {} if golden_dir is None else {"golden_dir": golden_dir}
    config = proxy_config(triton, models=models, logging={"access_log_sample_rate": 1.0}, **sections)
    base = load_config(None, environ={}).tracing
    return replace(config, listen=replace(config.listen, grpc_port=grpc_port),
                   tracing=replace(base, endpoint=endpoint, export_delay_s=EXPORT_DELAY_S, **tracing))


async def _infer(target: str, request: pb.ModelInferRequest, metadata: tuple[tuple[str, str], ...] = ()
                 ) -> tuple[grpc.StatusCode, dict[str, str], bytes]:
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(f"/{SERVICE}/ModelInfer")(request.SerializeToString(), timeout=10,
                                                               metadata=metadata)
        try:
            answer = await call
            return grpc.StatusCode.OK, dict(await call.trailing_metadata() or ()), answer
        except grpc.aio.AioRpcError as e:
            return e.code(), dict(e.trailing_metadata() or ()), b""


def _credit_request(seed: int = 0) -> pb.ModelInferRequest:
    x = features(rows=1, seed=seed)
    tensor = pb.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=list(x.shape))
    return pb.ModelInferRequest(model_name="credit_risk", inputs=[tensor], raw_input_contents=[x.tobytes()])


#: Triton 2.51 now and then exports no span at all for a traced gRPC request: sent straight to Triton (no
#: sidecar), 3 of 30 requests, each on a new channel with a sampled traceparent, had none after 4 s
#: (Triton's log says nothing). A test that needs Triton's span sends up to this many requests, each in a
#: trace of its own, and judges the first one Triton exported.
TRITON_TRIES = 5


async def _triton_joins(receiver: OtlpReceiver, send: Any) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
    """`await send(i)` sends request i (x-request-id `send`'s own) and returns that request id. Returns
    the sidecar's span of the first request Triton exported a span for, and Triton's spans under it."""
    for i in range(TRITON_TRIES):
        request_id = await send(i)
        ours = await wait_for(lambda r=request_id: receiver.find(service=SIDECAR_SERVICE,
                                                                 attributes={"sidecar.request_id": r}),
                              10, what=f"the sidecar's span of {request_id}")
        assert len(ours) == 1, ours
        try:
            theirs = await wait_for(lambda o=ours[0]: receiver.find(trace_id=o.trace_id, parent_span_id=o.span_id),
                                    5, what="Triton's span under the sidecar's")
        except AssertionError:
            continue
        assert all(s.service != SIDECAR_SERVICE for s in theirs), theirs
        return ours[0], theirs
    raise AssertionError(f"Triton exported no span under the sidecar's in {TRITON_TRIES} traces; "
                         f"undecoded posts: {receiver.errors}")


@pytest.fixture
def log_events() -> Iterator[list[dict[str, Any]]]:
    """Every log event as the sidecar writes it, its context variables (request, trace and span ids)
    merged in as in production (structlog.testing.capture_logs would leave them out)."""
    events: list[dict[str, Any]] = []

    def keep(logger: Any, method: str, event: dict[str, Any]) -> Any:
        events.append(dict(event))
        raise structlog.DropEvent

    structlog.configure(processors=[structlog.contextvars.merge_contextvars, keep])
    yield events
    configure_logging()


@pytest.mark.fault
async def test_a_real_nan_fault_is_healed_in_a_trace_of_its_own_with_its_unload_load_and_verify_steps(
        receiver, traced_triton, tmp_path, start, log_events):
    model = FreshModel.create(traced_triton, tmp_path)
    try:
        # sample_rate 0: no probe round is traced, and still every heal is.
        sidecar = await start(tracing_config(traced_triton, receiver.url, models=[model.name],
                                             golden_dir=model.golden_dir, sample_rate=0.0))
        await wait_for(lambda: sidecar.state(model.name) is ModelState.HEALTHY, 30, what="HEALTHY")
        model.inject("nan")
        await wait_for(lambda: sidecar.metric("triton_sidecar_heal_attempts_total", model=model.name,
                                              result="success"), 60, what="the heal")
        heals = await wait_for(lambda: receiver.find(name="heal", attributes={"sidecar.model": model.name}),
                               10, what="the heal's span")
    finally:
        model.remove()
    heal = heals[0]
    assert len(heals) == 1, heals
    assert heal.service == SIDECAR_SERVICE and heal.parent_span_id == "", heal
    assert heal.attributes["sidecar.heal.healed"] is True and heal.attributes["sidecar.heal.attempts"] == 1, heal
    assert heal.attributes["sidecar.heal.cause"].startswith("golden case "), heal  # the round that failed
    assert not heal.failed, heal
    steps = await wait_for(lambda: len(found := receiver.find(trace_id=heal.trace_id, parent_span_id=heal.span_id))
                           >= 3 and found, 10, what="the heal's three steps")
    assert [s.name for s in steps] == ["unload", "load", "verify"], steps
    assert all(s.attributes["sidecar.heal.attempt"] == 1 and not s.failed for s in steps), steps
    verify = steps[2]
    assert verify.attributes["sidecar.probe.ok"] is True and verify.attributes["sidecar.probe.cases"] >= 1, verify
    # No probe round was traced at sample rate 0.
    assert not receiver.find(name="probe round", attributes={"sidecar.model": model.name})
    # The heal's log events carry its trace id, and each step's events that step's span id.
    heal_logs = [e for e in log_events if e.get("model") == model.name and str(e["event"]).startswith("heal_")]
    assert heal_logs and all(e.get("trace_id") == heal.trace_id for e in heal_logs), heal_logs
    unloaded = [e for e in heal_logs if e["event"] in ("heal_unloaded", "heal_unload_not_awaited")]
    assert unloaded and unloaded[0]["span_id"] == steps[0].span_id, unloaded
    verified = [e for e in heal_logs if e["event"] == "heal_verified"]
    assert verified and verified[0]["span_id"] == verify.span_id, verified


async def test_the_golden_requests_of_a_traced_probe_round_carry_its_traceparent_and_triton_s_spans_nest_under_it(
        receiver, traced_triton, start):
    service = "probing-sidecar"  # this test's own spans, whatever the module's other sidecars export
    await start(tracing_config(traced_triton, receiver.url, models=["credit_risk"], sample_rate=1.0,
                               service_name=service))

    def nested() -> tuple[ReceivedSpan, list[ReceivedSpan]] | None:
        rounds = receiver.find(service=service, name="probe round", attributes={"sidecar.model": "credit_risk"})
        for round_span in rounds:
            theirs = receiver.find(trace_id=round_span.trace_id, parent_span_id=round_span.span_id)
            if theirs:
                return round_span, theirs
        return None

    # Rounds come every half second, each traced at rate 1.0; Triton now and then exports none for a
    # request (TRITON_TRIES says), so the first round it did export one for is judged.
    found = await wait_for(nested, 20, what="Triton's span under a probe round")
    assert found is not None
    round_span, theirs = found
    assert all(s.service != service for s in theirs), theirs
    assert round_span.parent_span_id == "", round_span  # a round is a trace of its own


async def test_a_grpc_request_continues_the_client_s_trace_and_triton_s_spans_nest_under_the_sidecar_s(
        receiver, traced_triton, start, log_events):
    port = free_port()
    # sample_rate 0 and parent-based: only the client's sampled traces are kept.
    sidecar = await started_and_healthy(start, tracing_config(traced_triton, receiver.url, grpc_port=port,
                                                              sample_rate=0.0))
    client_span = "00f067aa0ba902b7"

    def client_trace(i: int) -> str:
        return f"{i:x}bf92f3577b34da6a3ce929d0e0e4736"

    async def send(i: int) -> str:
        code, _, answer = await _infer(f"127.0.0.1:{port}", _credit_request(), metadata=(
            ("traceparent", f"00-{client_trace(i)}-{client_span}-01"), ("tracestate", "vendor=kept"),
            ("x-request-id", f"traced-{i}")))
        assert code is grpc.StatusCode.OK and pb.ModelInferResponse.FromString(answer).model_name == "credit_risk"
        return f"traced-{i}"

    span, _ = await _triton_joins(receiver, send)
    i = int(span.attributes["sidecar.request_id"].split("-")[1])
    assert (span.trace_id, span.name, span.parent_span_id) == (client_trace(i), INFER_SPAN, client_span), span
    assert span.attributes["sidecar.model"] == "credit_risk", span
    assert span.attributes["rpc.grpc.status_code"] == 0 and span.attributes["sidecar.status"] == "OK", span
    assert not span.failed, span
    # grpcio's calls too: the Rust front's tracer makes and exports every request span.
    assert span.language == "rust", span
    if sidecar.app[CONFIG].listen.grpc_front == "rust":  # the data plane's span, with its phases as events
        assert span.events == ("validation", "breaker wait", "upstream call", "screening"), span
        assert sidecar.server.grpc_served > 0, "the Rust gRPC front handed every call to grpcio"
    else:  # grpcio's call: the serving core's phases, the admission's wait first
        assert span.events == ("admission", "validation", "breaker wait", "upstream call", "screening"), span
    assert span.attributes["sidecar.routing.reason"] == "default", span
    assert receiver.posts["json"] >= 1 and receiver.posts["protobuf"] >= 1, receiver.posts
    # The access log line of the request names the trace and the sidecar's span.
    access = [e for e in log_events if e.get("event") == "proxy_request" and e.get("request_id") == f"traced-{i}"]
    assert access and (access[0]["trace_id"], access[0]["span_id"]) == (span.trace_id, span.span_id), access

    # A client trace that is not sampled stays unsampled: nothing of the sidecar's in it.
    unsampled = "5bf92f3577b34da6a3ce929d0e0e4737"
    code, _, _ = await _infer(f"127.0.0.1:{port}", _credit_request(1),
                              metadata=(("traceparent", f"00-{unsampled}-{client_span}-00"),))
    assert code is grpc.StatusCode.OK
    # Ordered after it: a sampled request's span; once it is in, the unsampled one's would be too.
    last = "6bf92f3577b34da6a3ce929d0e0e4738"
    await _infer(f"127.0.0.1:{port}", _credit_request(2), metadata=(("traceparent", f"00-{last}-{client_span}-01"),))
    await wait_for(lambda: receiver.find(trace_id=last, service=SIDECAR_SERVICE), 10, what="the last span")
    assert not receiver.find(trace_id=unsampled, service=SIDECAR_SERVICE)
    assert sidecar.metric("triton_sidecar_tracing_spans_dropped_total", reason="queue_full") == 0


async def test_a_request_without_a_traceparent_starts_a_trace_that_triton_joins(receiver, traced_triton, start):
    port = free_port()
    await started_and_healthy(start, tracing_config(traced_triton, receiver.url, grpc_port=port, sample_rate=1.0))

    async def send(i: int) -> str:
        code, _, _ = await _infer(f"127.0.0.1:{port}", _credit_request(3), metadata=(("x-request-id", f"new-{i}"),))
        assert code is grpc.StatusCode.OK
        return f"new-{i}"

    span, _ = await _triton_joins(receiver, send)
    assert span.name == INFER_SPAN and span.parent_span_id == "" and span.trace_id != "0" * 32, span
    # At sample rate 1 probe rounds are traced too, each a trace of its own with its probes as events.
    rounds = await wait_for(lambda: receiver.find(name="probe round", attributes={"sidecar.model": "credit_risk"}),
                            10, what="a probe round's span")
    passed = [r for r in rounds if r.attributes["sidecar.probe.ok"] is True and not r.failed]
    assert passed and all(r.parent_span_id == "" for r in rounds), rounds
    assert {r.language for r in rounds} == {"python"}, rounds  # the health loop's spans: the Python SDK's
    assert {"server_ready", "model_ready", "metadata", "golden"} <= set(passed[0].events), passed[0]


async def test_a_refused_grpc_request_leaves_an_error_span_with_its_reason_and_never_reaches_triton(
        receiver, traced_triton, start):
    port = free_port()
    await started_and_healthy(start, tracing_config(traced_triton, receiver.url, grpc_port=port, sample_rate=0.0))
    refused_trace, after_trace, parent = ("7bf92f3577b34da6a3ce929d0e0e4739", "8bf92f3577b34da6a3ce929d0e0e473a",
                                          "00f067aa0ba902b7")
    bad = pb.ModelInferRequest(model_name="credit_risk", inputs=[pb.ModelInferRequest.InferInputTensor(
        name="features", datatype="FP64", shape=[1, 128], contents=pb.InferTensorContents(fp64_contents=[0.5] * 128))])
    code, trailing, _ = await _infer(f"127.0.0.1:{port}", bad,
                                     metadata=(("traceparent", f"00-{refused_trace}-{parent}-01"),))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and trailing["x-sidecar-reason"] == "datatype"
    spans = await wait_for(lambda: receiver.find(trace_id=refused_trace), 10, what="the refused request's span")
    span = spans[0]
    assert span.service == SIDECAR_SERVICE and span.name == INFER_SPAN and span.parent_span_id == parent, span
    assert span.failed and span.attributes["sidecar.refusal.reason"] == "datatype", span
    assert span.status_message.startswith("[datatype] ") and "FP64" in span.status_message, span
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0], span
    # Good requests after it: once Triton's span for one is in, one for the refused request would be too.

    async def send(i: int) -> str:
        code, _, _ = await _infer(f"127.0.0.1:{port}", _credit_request(4), metadata=(
            ("traceparent", f"00-{after_trace[:-1]}{i:x}-{parent}-01"), ("x-request-id", f"after-{i}")))
        assert code is grpc.StatusCode.OK
        return f"after-{i}"

    await _triton_joins(receiver, send)
    assert [s.service for s in receiver.find(trace_id=refused_trace)] == [SIDECAR_SERVICE]


async def test_with_the_collector_down_or_hung_answers_and_latency_do_not_change_and_lost_spans_are_counted(
        triton, start, sidecars):
    """Down: nothing listens (each export fails at once). Hung: a socket that takes the connection and
    never answers, so each export waits its whole bound while spans keep coming."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    try:
        for endpoint in (f"http://127.0.0.1:{free_port()}/v1/traces",
                         f"http://127.0.0.1:{hung.getsockname()[1]}/v1/traces"):
            port = free_port()
            config = tracing_config(triton, endpoint, grpc_port=port, sample_rate=1.0, queue_size=4, batch_size=2,
                                    export_timeout_s=1.0)
            sidecar = await started_and_healthy(start, config)
            answers, slowest = set(), 0.0
            for _ in range(40):
                sent = time.monotonic()
                code, _, answer = await _infer(f"127.0.0.1:{port}", _credit_request(5))
                slowest = max(slowest, time.monotonic() - sent)
                assert code is grpc.StatusCode.OK
                answers.add(bytes(pb.ModelInferResponse.FromString(answer).raw_output_contents[0]))
            assert len(answers) == 1, "the same request got different answers"
            # A request that waited for an export would take its whole bound (1 s).
            assert slowest < 0.5, f"{endpoint}: a request took {slowest:.2f} s"

            def lost(reason: str, running=sidecar) -> float:  # type: ignore[no-untyped-def]
                return running.metric("triton_sidecar_tracing_spans_dropped_total", reason=reason) or 0

            await wait_for(lambda: lost("export_failed") >= 1, 10, what=f"{endpoint}: failed exports counted")
            assert sidecar.metric("triton_sidecar_tracing_spans_exported_total") == 0
            if endpoint.endswith(f":{hung.getsockname()[1]}/v1/traces"):
                # 40 requests and their probe rounds in 1 s of a hung export: the queue of 4 overflowed.
                assert lost("queue_full") >= 10, lost("queue_full")
            await _stops_within_the_export_bound(sidecars, sidecar)
    finally:
        hung.close()


async def _stops_within_the_export_bound(sidecars: list, sidecar: Any) -> None:
    """Stopping waits for a collector that is down or hung no longer than the export bound (1 s)."""
    sidecars.remove(sidecar)
    stopping = time.monotonic()
    await stop_sidecar(sidecar)
    assert time.monotonic() - stopping < 1.0 + 2.0, f"stopping took {time.monotonic() - stopping:.1f} s"


# -- HTTP requests served by the Rust front (listen.front: rust; dataplane/src/front/tracing.rs) ------------

#: The front's span names: the method and the route template (http.route).
HTTP_INFER_SPAN = "POST /v2/models/{model}/infer"

#: The front's span thread, which makes its spans OTLP and posts them (dataplane front/span_records.rs):
#: the front starts one only while tracing is on.
EXPORT_THREAD = "sidecar-spans"


def _rust(config: Any) -> Any:
    return replace(config, listen=replace(config.listen, front="rust"))


def _export_threads() -> int:
    return sum(1 for comm in Path("/proc/self/task").glob("*/comm") if comm.read_text().strip() == EXPORT_THREAD)


async def _lane(sidecar: Any, model: str) -> Any:
    """The front, once `model` is one of its lanes (its requests served in Rust, so traced there)."""
    front = sidecar.server
    await served_by_front(front, model, 10, settled=False)
    return front


async def _http_infer(sidecar: Any, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    async with sidecar.session.post(sidecar.url + "/v2/models/credit_risk/infer", json=body, headers=headers) as r:
        return r.status, await r.json()


async def test_an_http_request_on_the_rust_front_continues_the_client_s_trace_with_triton_s_spans_under_it(
        receiver, traced_triton, start, log_events):
    # sample_rate 0 and parent-based: only the client's sampled traces are kept.
    sidecar = await started_and_healthy(start, _rust(tracing_config(traced_triton, receiver.url, sample_rate=0.0)))
    front = await _lane(sidecar, "credit_risk")
    served_before = front.fast_requests
    client_span = "00f067aa0ba902b7"

    def client_trace(i: int) -> str:
        return f"{i:x}af92f3577b34da6a3ce929d0e0e4736"

    async def send(i: int) -> str:
        status, answer = await _http_infer(sidecar, credit_json(seed=6), {
            "traceparent": f"00-{client_trace(i)}-{client_span}-01", "tracestate": "vendor=kept",
            "x-request-id": f"http-traced-{i}"})
        assert status == 200 and answer["model_name"] == "credit_risk", answer
        return f"http-traced-{i}"

    span, theirs = await _triton_joins(receiver, send)
    i = int(span.attributes["sidecar.request_id"].rsplit("-", 1)[1])
    assert front.fast_requests > served_before, "the requests were not served by the front"
    assert (span.trace_id, span.name, span.parent_span_id) == (client_trace(i), HTTP_INFER_SPAN, client_span), span
    assert span.attributes["sidecar.model"] == "credit_risk" and span.attributes["sidecar.protocol"] == "http", span
    assert span.attributes["http.request.method"] == "POST", span
    assert span.attributes["http.route"] == "/v2/models/{model}/infer", span
    assert span.attributes["http.response.status_code"] == 200 and span.attributes["sidecar.status"] == "200", span
    assert span.attributes["http.request.body.size"] > 1000 and span.attributes["http.response.body.size"] > 0, span
    assert "sidecar.refusal.reason" not in span.attributes and not span.failed, span
    assert list(span.events) == ["validation", "breaker wait", "upstream call", "screening"], span
    assert span.attributes["sidecar.routing.reason"] == "default" and "sidecar.model.version" not in span.attributes
    assert all(s.trace_id == span.trace_id for s in theirs), theirs
    # The access log line the front sent up names the trace and the front's span.
    access = [e for e in log_events if e.get("event") == "proxy_request" and e.get("request_id") == f"http-traced-{i}"]
    assert access and (access[0]["trace_id"], access[0]["span_id"]) == (span.trace_id, span.span_id), access

    # A client trace that is not sampled stays unsampled: nothing of the sidecar's in it, and Triton gets
    # the client's own traceparent, as without tracing.
    unsampled = "5af92f3577b34da6a3ce929d0e0e4737"
    status, _ = await _http_infer(sidecar, credit_json(seed=7), {"traceparent": f"00-{unsampled}-{client_span}-00"})
    assert status == 200
    last = "6af92f3577b34da6a3ce929d0e0e4738"
    status, _ = await _http_infer(sidecar, credit_json(seed=8), {"traceparent": f"00-{last}-{client_span}-01"})
    assert status == 200
    await wait_for(lambda: receiver.find(trace_id=last, service=SIDECAR_SERVICE), 10, what="the last span")
    assert not receiver.find(trace_id=unsampled, service=SIDECAR_SERVICE)
    # A version the client pins: the span says which, and why. The first request to a version is the
    # Python chain's (it fetches that version's spec and publishes it), the next one the lane's.
    for n, pinned in enumerate(("9bf92f3577b34da6a3ce929d0e0e4701", "9bf92f3577b34da6a3ce929d0e0e4702")):
        if n:
            await wait_for(lambda: any(lane[0] == "credit_risk" and any(v[0] == "1" for v in lane[6])
                                       for lane in front.lanes()[0]), 5, what="version 1 pinnable on the front")
        fast = front.fast_requests
        traced = {"traceparent": f"00-{pinned}-{client_span}-01"}
        async with sidecar.session.post(sidecar.url + "/v2/models/credit_risk/versions/1/infer",
                                        json=credit_json(seed=9), headers=traced) as r:
            assert r.status == 200 and (await r.json())["model_version"] == "1"
        assert (front.fast_requests > fast) == bool(n), (n, fast, front.fast_requests)
        span = (await wait_for(lambda p=pinned: receiver.find(trace_id=p, service=SIDECAR_SERVICE), 10,
                               what="the pinned request's span"))[0]
        assert (span.attributes["sidecar.model.version"], span.attributes["sidecar.routing.reason"]) == (
            "1", "pinned"), span
        assert span.events[0] == ("validation" if n else "admission"), span
    assert sidecar.metric("triton_sidecar_tracing_spans_exported_total") >= 2
    assert sidecar.metric("triton_sidecar_tracing_spans_dropped_total", reason="queue_full") == 0


async def test_an_http_request_without_a_traceparent_starts_a_trace_and_a_stream_is_one_span(
        receiver, traced_triton, start):
    config = tracing_config(traced_triton, receiver.url, models=["credit_risk", "text_echo"], sample_rate=1.0)
    sidecar = await started_and_healthy(start, _rust(config))
    await _lane(sidecar, "credit_risk")

    async def send(i: int) -> str:
        status, _ = await _http_infer(sidecar, credit_json(seed=9), {"x-request-id": f"http-new-{i}"})
        assert status == 200
        return f"http-new-{i}"

    span, _ = await _triton_joins(receiver, send)
    assert span.name == HTTP_INFER_SPAN and span.parent_span_id == "" and span.trace_id != "0" * 32, span

    # A generate_stream: one span for the whole stream, a bounded number of events whatever its length.
    await _lane(sidecar, "text_echo")
    words = 40
    body = {"text_input": " ".join(f"w{i}" for i in range(words)), "max_tokens": words}
    async with sidecar.session.post(sidecar.url + "/v2/models/text_echo/generate_stream", json=body,
                                    headers={"x-request-id": "http-stream"}) as r:
        assert r.status == 200
        events = (await r.read()).count(b"\n\n")
    assert events == words
    streams = await wait_for(lambda: receiver.find(attributes={"sidecar.request_id": "http-stream"}), 10,
                             what="the stream's span")
    assert len(streams) == 1, streams
    stream = streams[0]
    assert stream.name == "POST /v2/models/{model}/generate_stream" and not stream.failed, stream
    assert stream.attributes["http.response.status_code"] == 200, stream
    assert stream.attributes["sidecar.model"] == "text_echo", stream
    assert stream.events == ("validation", "breaker wait", "upstream call", "first event sent", "stream ended"), stream


async def test_a_refused_http_request_leaves_an_error_span_with_its_reason_and_never_reaches_triton(
        receiver, traced_triton, start):
    sidecar = await started_and_healthy(start, _rust(tracing_config(traced_triton, receiver.url, sample_rate=0.0)))
    await _lane(sidecar, "credit_risk")
    refused_trace, parent = "7af92f3577b34da6a3ce929d0e0e4739", "00f067aa0ba902b7"
    bad = credit_json(seed=10)
    bad["inputs"][0]["shape"] = [2, 64]  # 128 values, but not the model's [-1, 128]
    status, answer = await _http_infer(sidecar, bad, {"traceparent": f"00-{refused_trace}-{parent}-01"})
    assert status == 400 and answer["reason"] == "shape", answer
    spans = await wait_for(lambda: receiver.find(trace_id=refused_trace), 10, what="the refused request's span")
    span = spans[0]
    assert span.service == SIDECAR_SERVICE and span.name == HTTP_INFER_SPAN and span.parent_span_id == parent, span
    assert span.failed and span.attributes["sidecar.refusal.reason"] == "shape", span
    assert span.status_message == f"[shape] {answer['error']}", span
    assert span.attributes["http.response.status_code"] == 400, span
    assert span.events == ("validation",), span  # refused before the breaker and Triton
    # Good requests after it: once Triton's span for one is in, one for the refused request would be too.

    async def send(i: int) -> str:
        status, _ = await _http_infer(sidecar, credit_json(seed=11), {
            "traceparent": f"00-{refused_trace[:-1]}{(i + 10):x}-{parent}-01", "x-request-id": f"http-after-{i}"})
        assert status == 200
        return f"http-after-{i}"

    await _triton_joins(receiver, send)
    assert [s.service for s in receiver.find(trace_id=refused_trace)] == [SIDECAR_SERVICE]

    # Refused before its body is read (declared too large): a span too, its reason and message the
    # client's, and no phase (nothing of the chain ran).
    early_trace = "7af92f3577b34da6a3ce929d0e0e4740"
    host, port = sidecar.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST /v2/models/credit_risk/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {10**12}\r\ntraceparent: 00-{early_trace}-{parent}-01\r\n\r\n".encode())
    await writer.drain()
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode()
    length = next(int(line.split(":", 1)[1]) for line in head.split("\r\n")
                  if line.lower().startswith("content-length"))
    early = json.loads(await asyncio.wait_for(reader.readexactly(length), 10))
    writer.close()
    assert head.startswith("HTTP/1.1 413") and early["reason"] == "body_too_large", (head, early)
    span = (await wait_for(lambda: receiver.find(trace_id=early_trace), 10, what="the early refusal's span"))[0]
    assert (span.name, span.parent_span_id, span.language) == (HTTP_INFER_SPAN, parent, "rust"), span
    assert span.failed and span.status_message == f"[body_too_large] {early['error']}", span
    assert span.attributes["sidecar.refusal.reason"] == "body_too_large", span
    assert span.attributes["http.response.status_code"] == 413, span
    assert span.attributes["http.route"] == "/v2/models/{model}/infer", span
    assert span.attributes["sidecar.model"] == "credit_risk" and span.events == (), span


async def test_http_requests_the_python_side_answers_have_spans_too_and_triton_s_nest_under_them(
        receiver, traced_triton, start, sidecars):
    """A model's metadata and an unknown model's refusal (answered by the Rust front itself, as the
    Python chain answered them) and every request on the Python listener (listen.front: python) get
    a span named as the front names its own: the front's tracer makes it, or the Python SDK
    without the Rust front."""
    sidecar = await started_and_healthy(start, _rust(tracing_config(traced_triton, receiver.url, sample_rate=0.0)))
    front = await _lane(sidecar, "credit_risk")
    handed_before = front.handovers
    parent = "00f067aa0ba902b7"
    metadata_trace, unknown_trace = "8af92f3577b34da6a3ce929d0e0e4731", "8af92f3577b34da6a3ce929d0e0e4732"
    async with sidecar.session.get(sidecar.url + "/v2/models/credit_risk",
                                   headers={"traceparent": f"00-{metadata_trace}-{parent}-01"}) as r:
        assert r.status == 200 and (await r.json())["name"] == "credit_risk"
    async with sidecar.session.post(sidecar.url + "/v2/models/no_such_model/infer", json=credit_json(),
                                    headers={"traceparent": f"00-{unknown_trace}-{parent}-01"}) as r:
        refused = await r.json()
        assert r.status == 404 and refused["reason"] == "unknown_model", refused
    assert front.handovers == handed_before, "the front served them itself"
    metadata = (await wait_for(lambda: receiver.find(trace_id=metadata_trace), 10, what="the metadata span"))[0]
    assert (metadata.service, metadata.name, metadata.parent_span_id) == (
        SIDECAR_SERVICE, "GET /v2/models/{model}", parent), metadata
    assert metadata.attributes["http.route"] == "/v2/models/{model}", metadata
    assert metadata.attributes["http.response.status_code"] == 200 and not metadata.failed, metadata
    assert metadata.attributes["sidecar.model"] == "credit_risk", metadata
    # Made by the front's tracer, not the Python SDK.
    assert metadata.language == "rust", metadata
    unknown = (await wait_for(lambda: receiver.find(trace_id=unknown_trace), 10, what="the refusal's span"))[0]
    assert unknown.name == HTTP_INFER_SPAN and unknown.failed, unknown
    assert unknown.attributes["sidecar.refusal.reason"] == "unknown_model", unknown
    assert unknown.attributes["http.response.status_code"] == 404, unknown
    assert unknown.status_message == f"[unknown_model] {refused['error']}", unknown
    sidecars.remove(sidecar)
    await stop_sidecar(sidecar)

    # The Python listener: an infer it forwards carries its span to Triton as the parent.
    config = tracing_config(traced_triton, receiver.url, sample_rate=0.0)
    sidecar = await started_and_healthy(start, replace(config, listen=replace(config.listen, front="python")))

    def client_trace(i: int) -> str:
        return f"{i:x}cf92f3577b34da6a3ce929d0e0e4736"

    async def send(i: int) -> str:
        status, answer = await _http_infer(sidecar, credit_json(seed=14), {
            "traceparent": f"00-{client_trace(i)}-{parent}-01", "x-request-id": f"python-traced-{i}"})
        assert status == 200 and answer["model_name"] == "credit_risk", answer
        return f"python-traced-{i}"

    span, theirs = await _triton_joins(receiver, send)
    i = int(span.attributes["sidecar.request_id"].rsplit("-", 1)[1])
    assert (span.trace_id, span.name, span.parent_span_id) == (client_trace(i), HTTP_INFER_SPAN, parent), span
    assert span.attributes["http.request.method"] == "POST" and span.attributes["sidecar.protocol"] == "http", span
    assert span.attributes["http.route"] == "/v2/models/{model}/infer", span
    assert span.attributes["http.response.status_code"] == 200 and not span.failed, span
    assert span.language == "python", span
    # The serving core's phases, named as the lane's, the admission's wait (a hold) first; the route.
    assert list(span.events) == ["admission", "validation", "breaker wait", "upstream call", "screening"], span
    assert span.attributes["sidecar.routing.reason"] == "default", span
    assert all(s.trace_id == span.trace_id for s in theirs), theirs


async def test_an_https_collector_gets_both_sides_spans_and_one_signed_by_another_ca_gets_none(
        triton, start, sidecars, tmp_path):
    """tracing.ca_file is the CA both exporters trust: the front's (rustls) and Python's (requests)."""
    ca, stranger = make_ca("collector CA"), make_ca("another CA")
    server = issue(ca, "collector", dns=("localhost",), ips=("127.0.0.1",))
    (tmp_path / "cert.pem").write_bytes(server.cert_pem)
    (tmp_path / "key.pem").write_bytes(server.key_pem)
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem)
    (tmp_path / "stranger.pem").write_bytes(stranger.cert_pem)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    collector = OtlpReceiver(ssl_context=context).start()
    try:
        for trusted in ("ca.pem", "stranger.pem"):
            config = _rust(tracing_config(triton, collector.url, sample_rate=1.0, ca_file=str(tmp_path / trusted)))
            sidecar = await started_and_healthy(start, config)
            front = await _lane(sidecar, "credit_risk")
            status, _ = await _http_infer(sidecar, credit_json(seed=15), {"x-request-id": f"tls-{trusted}"})
            assert status == 200
            # A filtered model's pinned version: its metadata is rewritten by the Python side.
            async with sidecar.session.get(sidecar.url + "/v2/models/credit_risk/versions/1",
                                           headers={"x-request-id": f"tls-meta-{trusted}"}) as r:
                assert r.status == 200
            assert front.fast_requests >= 1 and front.handovers >= 1
            if trusted == "ca.pem":
                for request_id, name in ((f"tls-{trusted}", HTTP_INFER_SPAN),
                                         (f"tls-meta-{trusted}", "GET /v2/models/{model}/versions/{version}")):
                    spans = await wait_for(lambda r=request_id: collector.find(attributes={"sidecar.request_id": r}),
                                           10, what=f"{request_id}'s span over https")
                    assert spans[0].name == name, spans
            else:
                # Refused at the handshake, each export: counted as lost, never received.
                await wait_for(lambda s=sidecar: (s.metric("triton_sidecar_tracing_spans_dropped_total",
                                                           reason="export_failed") or 0) >= 2,
                               15, what="the spans the collector's certificate kept from it counted")
                assert not collector.find(attributes={"sidecar.request_id": f"tls-{trusted}"})
            sidecars.remove(sidecar)
            await stop_sidecar(sidecar)
        assert not collector.errors, collector.errors
    finally:
        collector.stop()


async def test_a_collector_that_wants_a_client_certificate_gets_both_exporters_spans_only_when_it_is_given(
        triton, start, sidecars, tmp_path):
    """tracing.client_cert_file/client_key_file (OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE, _KEY): both
    exporters present them to a collector that requires mutual TLS: the front's rustls client (request
    spans) and Python's requests (probe rounds). Without them the handshake fails and the loss is counted."""
    ca, client_ca = make_ca("collector CA"), make_ca("exporters' CA")
    server, client = issue(ca, "collector", dns=("localhost",), ips=("127.0.0.1",)), issue(client_ca, "sidecar",
                                                                                        client=True)
    for name, data in (("cert.pem", server.cert_pem), ("key.pem", server.key_pem), ("ca.pem", ca.cert_pem),
                       ("client.pem", client.cert_pem), ("client-key.pem", client.key_pem),
                       ("client-ca.pem", client_ca.cert_pem)):
        (tmp_path / name).write_bytes(data)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(tmp_path / "client-ca.pem")
    collector = OtlpReceiver(ssl_context=context).start()
    try:
        for identity in (True, False):
            keys: dict[str, Any] = {"client_cert_file": str(tmp_path / "client.pem"),
                                    "client_key_file": str(tmp_path / "client-key.pem")} if identity else {}
            config = _rust(tracing_config(triton, collector.url, sample_rate=1.0, ca_file=str(tmp_path / "ca.pem"),
                                          **keys))
            sidecar = await started_and_healthy(start, config)
            await _lane(sidecar, "credit_risk")
            request_id = f"mtls-{identity}"
            status, _ = await _http_infer(sidecar, credit_json(seed=16), {"x-request-id": request_id})
            assert status == 200
            if identity:
                spans = await wait_for(lambda r=request_id: collector.find(attributes={"sidecar.request_id": r}),
                                       10, what="the request's span over mutual TLS")
                assert (spans[0].name, spans[0].language) == (HTTP_INFER_SPAN, "rust"), spans
                rounds = await wait_for(lambda: collector.find(name="probe round", language="python"), 10,
                                        what="a probe round exported by Python's SDK over mutual TLS")
                assert rounds[0].service == SIDECAR_SERVICE, rounds
            else:
                # The request's span and the start's probe rounds, each exporter's batch refused.
                await wait_for(lambda s=sidecar: (s.metric("triton_sidecar_tracing_spans_dropped_total",
                                                           reason="export_failed") or 0) >= 2,
                               15, what="the spans the missing client certificate kept from the collector counted")
                assert not collector.find(attributes={"sidecar.request_id": request_id})
            sidecars.remove(sidecar)
            await stop_sidecar(sidecar)
        assert not collector.errors, collector.errors
    finally:
        collector.stop()


async def test_with_the_collector_down_or_hung_the_rust_front_s_answers_do_not_change_and_lost_spans_are_counted(
        triton, start, sidecars):
    """As the gRPC test above, for HTTP requests the front serves: probes run once an hour, so nearly every
    span is the front's (Python's probe rounds add one per model at start)."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    requests = 40
    try:
        for endpoint in (f"http://127.0.0.1:{free_port()}/v1/traces",
                         f"http://127.0.0.1:{hung.getsockname()[1]}/v1/traces"):
            config = tracing_config(triton, endpoint, sample_rate=1.0, queue_size=4, batch_size=2,
                                    export_timeout_s=1.0)
            config = _rust(replace(config, probes=replace(config.probes, interval_s=3600.0, jitter=0.0)))
            sidecar = await started_and_healthy(start, config)
            front = await _lane(sidecar, "credit_risk")
            assert _export_threads() >= 1, "tracing on: the front's exporter thread is running"
            served_before = front.fast_requests
            answers, slowest = set(), 0.0
            for _ in range(requests):
                sent = time.monotonic()
                status, answer = await _http_infer(sidecar, credit_json(seed=12), {})
                slowest = max(slowest, time.monotonic() - sent)
                assert status == 200, answer
                answers.add(json.dumps(answer["outputs"], sort_keys=True))
            assert front.fast_requests - served_before == requests
            assert len(answers) == 1, "the same request got different answers"
            assert slowest < 0.5, f"{endpoint}: a request took {slowest:.2f} s"

            def lost(running=sidecar) -> float:  # type: ignore[no-untyped-def]
                return sum(running.metric("triton_sidecar_tracing_spans_dropped_total", reason=reason) or 0
                           for reason in ("queue_full", "export_failed"))

            # Every one of the front's spans is lost one way or the other, and counted.
            await wait_for(lambda: lost() >= requests, 15, what=f"{endpoint}: the front's lost spans counted")
            assert sidecar.metric("triton_sidecar_tracing_spans_exported_total") == 0
            if endpoint.endswith(f":{hung.getsockname()[1]}/v1/traces"):
                # 40 requests in far less than one hung export (1 s): the queue of 4 overflowed.
                assert sidecar.metric("triton_sidecar_tracing_spans_dropped_total", reason="queue_full") >= 10
            await _stops_within_the_export_bound(sidecars, sidecar)
    finally:
        hung.close()


async def test_with_tracing_off_the_rust_front_runs_no_exporter_and_logs_the_client_s_trace_id(
        triton, start, log_events):
    # The exporter threads of the sidecars stopped before this one are gone: shutdown stops them.
    await wait_for(lambda: _export_threads() == 0, 10, what="no exporter thread left by stopped sidecars")
    sidecar = await started_and_healthy(start, _rust(proxy_config(triton, logging={"access_log_sample_rate": 1.0})))
    assert not sidecar.app[CONFIG].tracing.enabled
    front = await _lane(sidecar, "credit_risk")
    served_before = front.fast_requests
    client_trace = "9af92f3577b34da6a3ce929d0e0e473b"
    status, _ = await _http_infer(sidecar, credit_json(seed=13), {
        "traceparent": f"00-{client_trace}-00f067aa0ba902b7-01", "x-request-id": "untraced"})
    assert status == 200 and front.fast_requests == served_before + 1
    assert _export_threads() == 0
    access = await wait_for(lambda: [e for e in log_events if e.get("event") == "proxy_request"
                                     and e.get("request_id") == "untraced"], 5, what="the access log line")
    assert access[0]["trace_id"] == client_trace and "span_id" not in access[0], access


def test_tracing_off_imports_no_opentelemetry():
    code = ("import sys\nfrom sidecar.app.factory import create_app\nfrom sidecar.config import load_config\n"
            "create_app(load_config(None, environ={}), golden={})\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# -- the configuration -----------------------------------------------------------------------------


def test_the_standard_otel_variables_fill_the_keys_the_file_leaves_unset(tmp_path):
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/", "OTEL_SERVICE_NAME": "pod-sidecar",
               "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25",
               "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=p-1,k8s.namespace.name=ns,team=ml%20ops",
               "OTEL_BSP_MAX_QUEUE_SIZE": "100", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "10",
               "OTEL_BSP_SCHEDULE_DELAY": "250", "OTEL_BSP_EXPORT_TIMEOUT": "2000"}
    tracing = load_config(None, environ=environ).tracing
    assert tracing.enabled and tracing.endpoint == "http://collector:4318/v1/traces"
    assert (tracing.service_name, tracing.sample_rate, tracing.parent_based) == ("pod-sidecar", 0.25, False)
    assert tracing.resource_attributes == {"k8s.pod.name": "p-1", "k8s.namespace.name": "ns", "team": "ml ops"}
    assert (tracing.queue_size, tracing.batch_size, tracing.export_delay_s, tracing.export_timeout_s) == (
        100, 10, 0.25, 2.0)
    # The file's keys win, as an SDK's own settings win over its environment; the traces URL is taken as is.
    path = tmp_path / "sidecar.yaml"
    path.write_text("tracing:\n  sample_rate: 0.5\n  service_name: from-file\n")
    tracing = load_config(path, environ={**environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/t"}).tracing
    assert (tracing.sample_rate, tracing.service_name, tracing.endpoint) == (0.5, "from-file", "http://c:4318/t")
    assert not load_config(None, environ={**environ, "OTEL_SDK_DISABLED": "true"}).tracing.enabled
    assert not load_config(None, environ={**environ, "OTEL_TRACES_EXPORTER": "none"}).tracing.enabled
    assert not load_config(None, environ={}).tracing.enabled
    # The collector's CA: the traces-specific variable first, as the SDKs read them.
    (tmp_path / "a.pem").write_text("pem")
    (tmp_path / "b.pem").write_text("pem")
    tracing = load_config(None, environ={**environ, "OTEL_EXPORTER_OTLP_CERTIFICATE": str(tmp_path / "a.pem"),
                                         "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(tmp_path / "b.pem")}).tracing
    assert tracing.ca_file == str(tmp_path / "b.pem")
    # The client certificate the collector may ask for, and its key: the same order.
    tracing = load_config(None, environ={**environ, "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(tmp_path / "a.pem"),
                                         "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE": str(tmp_path / "b.pem"),
                                         "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(tmp_path / "a.pem")}).tracing
    assert (tracing.client_cert_file, tracing.client_key_file) == (str(tmp_path / "b.pem"), str(tmp_path / "a.pem"))


@pytest.mark.parametrize(("environ", "expected"), [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c:4318", "OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent/ca.pem"},
     "key 'tracing.ca_file': cannot read '/nonexistent/ca.pem'"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c:4318", "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": "/etc/hostname"},
     "key 'tracing.client_cert_file' needs tracing.client_key_file too"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c:4318", "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": "/etc/hostname",
      "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": "/nonexistent/key.pem"},
     "key 'tracing.client_key_file': cannot read '/nonexistent/key.pem'"),
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "environment variable OTEL_TRACES_SAMPLER: unknown sampler 'sometimes'"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
     "environment variable OTEL_TRACES_SAMPLER_ARG: must be 0..1"),
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "many"}, "environment variable OTEL_BSP_MAX_QUEUE_SIZE: must be an integer"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "environment variable OTEL_EXPORTER_OTLP_ENDPOINT: not an"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name"}, "environment variable OTEL_RESOURCE_ATTRIBUTES: 'k8s.pod.name'"),
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "10"}, "key 'tracing.batch_size' must not exceed tracing.queue_size"),
    ({"SIDECAR_TRACING_ENDPOINT": "ftp://collector"}, "key 'tracing.endpoint'"),
])
def test_a_bad_tracing_setting_stops_the_start_with_one_line_naming_it(environ, expected):
    with pytest.raises(ConfigError) as refused:
        load_config(None, environ=environ)
    assert expected in str(refused.value) and "\n" not in str(refused.value), refused.value


async def test_documents_and_refusals_the_front_answers_have_its_spans(receiver, triton, start, log_events):
    """A model's document and the control API's refusal, answered by the front without Python, are
    traced as the Python chain traced them: the route template, the model, the refusal's reason."""
    sidecar = await started_and_healthy(start, _rust(tracing_config(triton, receiver.url, sample_rate=0.0)))
    front = await _lane(sidecar, "credit_risk")
    handed_before = front.handovers
    parent = "00f067aa0ba902b7"
    config_trace, refused_trace = "8af92f3577b34da6a3ce929d0e0e4741", "8af92f3577b34da6a3ce929d0e0e4742"
    async with sidecar.session.get(sidecar.url + "/v2/models/image_classifier/versions/1/config",
                                   headers={"traceparent": f"00-{config_trace}-{parent}-01"}) as r:
        assert r.status == 200 and (await r.json())["name"] == "image_classifier"
    async with sidecar.session.post(sidecar.url + "/v2/repository/models/credit_risk/unload", json={},
                                    headers={"traceparent": f"00-{refused_trace}-{parent}-01"}) as r:
        refused = await r.json()
        assert r.status == 403 and refused["reason"] == "forbidden_endpoint", refused
    assert front.handovers == handed_before, "the front served them itself"
    config = (await wait_for(lambda: receiver.find(trace_id=config_trace), 10, what="the config span"))[0]
    assert (config.service, config.name, config.parent_span_id, config.language) == (
        SIDECAR_SERVICE, "GET /v2/models/{model}/versions/{version}/config", parent, "rust"), config
    assert config.attributes["http.route"] == "/v2/models/{model}/versions/{version}/config", config
    assert config.attributes["http.response.status_code"] == 200 and not config.failed, config
    assert config.attributes["sidecar.model"] == "image_classifier", config
    unknown = (await wait_for(lambda: receiver.find(trace_id=refused_trace), 10, what="the refusal's span"))[0]
    assert (unknown.name, unknown.failed) == ("POST /v2/repository{tail}", True), unknown
    assert unknown.attributes["sidecar.refusal.reason"] == "forbidden_endpoint", unknown
    assert unknown.attributes["http.response.status_code"] == 403, unknown
    assert "sidecar.model" not in unknown.attributes, unknown
    assert unknown.status_message == f"[forbidden_endpoint] {refused['error']}", unknown
    # The access log names the front's spans, as the Python chain's named its own.
    logged = await wait_for(lambda: [e for e in log_events if e.get("event") == "proxy_request"
                                     and e.get("trace_id") == refused_trace], 5, what="the refusal's log line")
    assert logged[0]["span_id"] == unknown.span_id and logged[0]["status"] == 403

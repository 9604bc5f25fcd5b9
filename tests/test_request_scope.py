"""One request wrapper for every front (sidecar.serving.request): an unexpected exception anywhere in
the chain is answered 500 with the JSON body on both HTTP paths and INTERNAL over gRPC, logged with
its traceback and counted; a gone client is 499 / CANCELLED; the drain count always returns to zero.

The scope's own rules run in milliseconds without a wire; the fronts are driven against the real
shared Triton, with the fault injected in the exchange's `validate` (inside the chain, after
admission and before Triton)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from sidecar.fronts.appkeys import LIFECYCLE
from sidecar.fronts.grpc_server import GrpcInferExchange
from sidecar.fronts.http_front import HttpFront
from sidecar.fronts.http_routes import HttpInferExchange
from sidecar.metrics import SidecarMetrics
from sidecar.serving.lifecycle import Lifecycle
from sidecar.serving.refusals import Reason, Refusal
from sidecar.serving.request import RequestWrapper
from sidecar.serving.telemetry import GRPC, HTTP, RequestTelemetry
from tests.harness import wait_for
from tests.proxy_support import credit_json, features, proxy_config, served_by_front, started_and_healthy
from tests.test_grpc import GRPC_FRONT, _credit_request, _raw_call, _served_by_the_lane, grpc_config

CREDIT = "/v2/models/credit_risk/infer"


def _wrapper() -> tuple[RequestWrapper, Lifecycle, CollectorRegistry]:
    registry = CollectorRegistry()
    telemetry = RequestTelemetry(metrics=SidecarMetrics(registry), access_log_sample_rate=1.0)
    lifecycle = Lifecycle()
    return RequestWrapper(telemetry=telemetry, lifecycle=lifecycle), lifecycle, registry


def _boom(*args: object) -> None:
    raise RuntimeError("injected fault")


# -- the scope's rules, without a wire -------------------------------------------------------------------


@pytest.mark.parametrize(("protocol", "code"), [(HTTP, "500"), (GRPC, "INTERNAL")])
async def test_an_unexpected_exception_becomes_internal_error_logged_with_traceback_and_counted(protocol, code):
    wrapper, lifecycle, registry = _wrapper()
    with capture_logs() as logs:
        scope = wrapper.open(protocol, "req-1", None, method="POST", path="/x")
        async with scope:
            assert lifecycle.in_flight == 1
            _boom()
    assert scope.refusal is not None and scope.refusal.reason is Reason.INTERNAL_ERROR
    assert (scope.refusal.status, scope.refusal.reason.grpc_code) == (500, "INTERNAL")
    assert "req-1" in scope.refusal.message and "injected fault" not in scope.refusal.message
    assert lifecycle.in_flight == 0
    crash = [e for e in logs if e["event"] == "proxy_internal_error"]
    assert len(crash) == 1 and isinstance(crash[0]["exc_info"], RuntimeError)
    assert crash[0]["exc_info"].__traceback__ is not None and crash[0]["log_level"] == "error"
    access = [e for e in logs if e["event"] == "proxy_request"]
    assert access[0]["status"] in (500, "INTERNAL") and access[0]["reason"] == "internal_error"
    assert registry.get_sample_value("triton_sidecar_proxy_internal_errors_total",
                                     {"protocol": protocol, "model": "_server_"}) == 1
    assert registry.get_sample_value("triton_sidecar_proxy_requests_total",
                                     {"protocol": protocol, "model": "_server_", "code": code}) == 1
    # Not a refusal before Triton: the rejections stay the clients' own mistakes.
    assert registry.get_sample_value("triton_sidecar_proxy_rejections_total",
                                     {"protocol": protocol, "model": "_server_", "reason": "internal_error"}) is None


async def test_a_refusal_is_answered_and_counted_and_a_gone_client_is_499_and_re_raised():
    wrapper, lifecycle, registry = _wrapper()
    scope = wrapper.open(HTTP, None, None, method="POST", path="/x")
    async with scope:
        raise Refusal(Reason.SHAPE, "bad shape")
    assert scope.refusal is not None and scope.code == "400" and len(scope.request_id) == 32
    assert registry.get_sample_value("triton_sidecar_proxy_rejections_total",
                                     {"protocol": HTTP, "model": "_server_", "reason": "shape"}) == 1
    gone = wrapper.open(GRPC, None, None, method="grpc", path="/x")
    with pytest.raises(asyncio.CancelledError):
        async with gone:
            raise asyncio.CancelledError
    assert gone.code == "CANCELLED" and gone.refusal is None and lifecycle.in_flight == 0
    assert registry.get_sample_value("triton_sidecar_proxy_requests_total",
                                     {"protocol": GRPC, "model": "_server_", "code": "CANCELLED"}) == 1


async def test_an_exception_after_the_answer_began_is_logged_counted_and_cuts_the_answer():
    wrapper, lifecycle, registry = _wrapper()
    scope = wrapper.open(HTTP, None, None, method="POST", path="/stream")
    with capture_logs() as logs, pytest.raises(RuntimeError):
        async with scope:
            scope.answered(200)  # a stream sent its status
            _boom()
    assert scope.refusal is None and scope.reason == "internal_error" and lifecycle.in_flight == 0
    assert any(e["event"] == "proxy_internal_error" and e["answer_begun"] for e in logs)
    assert registry.get_sample_value("triton_sidecar_proxy_internal_errors_total",
                                     {"protocol": HTTP, "model": "_server_"}) == 1


# -- every front, against the real Triton ------------------------------------------------------------------


async def test_an_unexpected_error_is_500_json_on_both_http_paths_logged_and_counted(triton, start, monkeypatch):
    sidecar = await started_and_healthy(start, proxy_config(triton, models=["credit_risk"]))
    front = sidecar.server
    rust = isinstance(front, HttpFront)
    if rust:
        # The fast path is the Rust front's lane: a panic injected on the real request path there,
        # the Python chain's bug behind it for the request it forwards.
        await served_by_front(front, "credit_risk", 10, settled=False)
        front.panic_next("credit_risk")
    monkeypatch.setattr(HttpInferExchange, "validate", _boom)
    fast_before = front.fast_requests

    def crashes() -> list[dict]:
        return [e for e in logs if e["event"] == "proxy_internal_error"]

    # The fast path, then the aiohttp route: the Python listener leaves a query string to aiohttp;
    # the Rust front hands the Python app a pin to a version whose spec it has not been given yet.
    handed = "/v2/models/credit_risk/versions/1/infer" if rust else CREDIT + "?via=aiohttp"
    with capture_logs() as logs:
        for path, request_id in ((CREDIT, "boom"), (handed, "boomaiohttp")):
            async with sidecar.session.post(sidecar.url + path, json=credit_json(),
                                            headers={"X-Request-ID": request_id}) as r:
                body = json.loads(await r.read())
                assert r.status == 500 and r.headers["Content-Type"].startswith("application/json"), body
                assert body["reason"] == "internal_error" and body["model"] == "credit_risk"
                assert r.headers["X-Request-ID"] == request_id
        # The front's panic reaches the log through Python's loop, just after its answer.
        await wait_for(lambda: len(crashes()) == 2, 5, what="both failures logged")
    assert front.fast_requests == fast_before + 1
    assert all(e["model"] == "credit_risk" for e in crashes())
    python_crashes = [e for e in crashes() if "exc_info" in e]
    assert all(isinstance(e["exc_info"], RuntimeError) and e["exc_info"].__traceback__ is not None
               for e in python_crashes)
    if rust:  # one each: the lane's panic, logged with its message, and the Python chain's exception
        assert len(python_crashes) == 1
        assert [e["cause"] for e in crashes() if "exc_info" not in e] == [
            "fault injected by HttpFront.panic_next(\"credit_risk\")"]
    else:
        assert len(python_crashes) == 2
    assert sidecar.metric("triton_sidecar_proxy_internal_errors_total", protocol="http", model="credit_risk") == 2
    assert sidecar.metric("triton_sidecar_proxy_requests_total", protocol="http", model="credit_risk",
                          code="500") == 2
    assert sidecar.app[LIFECYCLE].in_flight == 0 and (not rust or front.in_flight == 0)
    monkeypatch.undo()
    async with sidecar.session.post(sidecar.url + CREDIT, json=credit_json()) as r:
        assert r.status == 200, "the connection and the sidecar serve on after a bug"


async def test_an_unexpected_error_is_internal_over_grpc_logged_and_counted(triton, start, monkeypatch):
    config = grpc_config(triton, models=["credit_risk"])
    sidecar = await started_and_healthy(start, config)
    target = f"127.0.0.1:{config.listen.grpc_port}"
    request = _credit_request("credit_risk", features(rows=1, seed=3)).SerializeToString()
    rust = GRPC_FRONT == "rust"
    if rust:  # the data plane's gRPC lane serves it: a panic in its task, caught per call
        await wait_for(lambda: _served_by_the_lane(sidecar, target, request), 10, what="credit_risk a lane")
        sidecar.server.panic_next("credit_risk")
    else:
        monkeypatch.setattr(GrpcInferExchange, "validate", _boom)
    ok_before = sidecar.metric("triton_sidecar_proxy_requests_total", protocol="grpc", model="credit_risk", code="OK")
    with capture_logs() as logs:
        code, details, trailing, _ = await _raw_call(target, "ModelInfer", request,
                                                     metadata=(("x-request-id", "grpc-boom"),))
        if rust:  # the panic reaches the log through Python's loop, just after its answer
            await wait_for(lambda: any(e["event"] == "proxy_internal_error" for e in logs), 5, what="the panic logged")
    assert code is grpc.StatusCode.INTERNAL, details
    assert trailing["x-sidecar-reason"] == "internal_error" and trailing["x-request-id"] == "grpc-boom"
    assert "grpc-boom" in details and "injected fault" not in details and "panic_next" not in details
    crashes = [e for e in logs if e["event"] == "proxy_internal_error"]
    assert len(crashes) == 1 and crashes[0]["protocol"] == "grpc"
    if rust:
        assert "panic_next" in crashes[0]["cause"] and crashes[0]["request_id"] == "grpc-boom"
    else:
        assert crashes[0]["exc_info"].__traceback__ is not None
    assert sidecar.metric("triton_sidecar_proxy_internal_errors_total", protocol="grpc", model="credit_risk") == 1
    # Before the wrapper, gRPC recorded this as OK.
    assert sidecar.metric("triton_sidecar_proxy_requests_total", protocol="grpc", model="credit_risk",
                          code="INTERNAL") == 1
    assert sidecar.metric("triton_sidecar_proxy_requests_total", protocol="grpc", model="credit_risk",
                          code="OK") == ok_before
    assert sidecar.app[LIFECYCLE].in_flight == 0


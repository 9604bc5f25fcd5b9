"""Real faults in a real Triton: each is detected, healed without restarting Triton, and kubelet sees
readiness drop during the heal while liveness stays up."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs
from tritonclient.grpc import InferenceServerClient as GrpcClient
from tritonclient.utils import InferenceServerException

from sidecar.devtools.tritonserver import LocalTriton
from sidecar.fronts.appkeys import STATES
from sidecar.health.triton_client import TritonClient
from sidecar.states import ModelState
from tests.conftest import EXAMPLE_MODELS, _repository_copy
from tests.harness import (
    FAST_PROBES,
    SLACK_S,
    EndpointRecorder,
    FreshModel,
    sidecar_config,
    wait_for,
)
from tests.proxy_support import credit_json

pytestmark = pytest.mark.fault

#: Detection bound from the issue: interval × failure_threshold + timeout, with jitter, plus slack.
DETECT_BOUND_S = (
    FAST_PROBES["interval_s"] * (1 + FAST_PROBES["jitter"]) * FAST_PROBES["failure_threshold"]
    + FAST_PROBES["timeout_s"] + SLACK_S
)
HEAL_BOUND_S = 30.0


def _kill_stub(model: FreshModel) -> None:
    model.kill_stub()


async def _ready(sidecar) -> bool:  # type: ignore[no-untyped-def]
    return (await sidecar.get("/readyz"))[0] == 200


FAULTS = {
    "stub_killed": _kill_stub,
    "nan_weights": lambda m: m.inject("nan"),
    "drifted_weights": lambda m: m.inject("drift"),
    "hung_execute": lambda m: m.inject("hang"),
    "unloaded_by_someone_else": lambda m: m.unload(),
}


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_real_fault_is_detected_and_healed_without_restarting_triton(fault, triton, fresh_model, start):
    sidecar = await start(sidecar_config(triton, models=[fresh_model.name, "credit_risk"],
                                         golden_dir=fresh_model.golden_dir))
    model = fresh_model.name
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what=f"{model} HEALTHY")
    await wait_for(lambda: sidecar.state("credit_risk") is ModelState.HEALTHY, 20, what="credit_risk HEALTHY")
    await wait_for(lambda: _ready(sidecar), 5, what="/readyz 200")
    triton_pid = triton.pid
    stubs_before = fresh_model.stubs()

    recorder = EndpointRecorder(sidecar).start()
    injected_at = time.monotonic()
    FAULTS[fault](fresh_model)

    detected = await wait_for(
        lambda: sidecar.first_transition_to(model, ModelState.UNHEALTHY), DETECT_BOUND_S + 5,
        what=f"{model} UNHEALTHY after {fault}")
    assert detected.at - injected_at <= DETECT_BOUND_S, (
        f"{fault} detected after {detected.at - injected_at:.2f} s, bound {DETECT_BOUND_S:.2f} s")
    assert detected.state_from in (ModelState.HEALTHY, ModelState.DEGRADED)

    healed = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.HEALTHY, after=detected.at),
                            HEAL_BOUND_S, what=f"{model} healed")
    await wait_for(lambda: recorder.readyz and recorder.readyz[-1][1] == 200, 5, what="/readyz 200 again")
    await recorder.stop()

    assert triton.pid == triton_pid and triton.is_running(), "Triton was restarted"
    assert (fresh_model.stubs() and set(fresh_model.stubs()) != set(stubs_before)) or fault == "hung_execute"
    assert [s for _, s in recorder.healthz] and all(s == 200 for _, s in recorder.healthz), (
        f"/healthz failed during a heal: {sorted({s for _, s in recorder.healthz})}")
    during = [s for t, s in recorder.readyz if detected.at <= t <= healed.at]
    assert 503 in during, "/readyz never went 503 while the model was broken"
    assert recorder.readyz[-1][1] == 200
    assert sidecar.metric("triton_sidecar_heal_attempts_total", model=model, result="success") >= 1
    assert sidecar.metric("triton_sidecar_time_to_recover_seconds_count", model=model) == 1
    # The other model kept being probed and stayed healthy: one sick model does not spread.
    assert sidecar.first_transition_to("credit_risk", ModelState.UNHEALTHY, ModelState.DEGRADED) is None


async def test_exhausted_healing_marks_the_model_failed_and_fails_liveness(own_triton, tmp_path, start):
    # A model that cannot load leaves Triton "not ready" (strict readiness): a server of its own.
    fresh_model = FreshModel.create(own_triton, tmp_path)
    sidecar = await start(sidecar_config(own_triton, models=[fresh_model.name], golden_dir=fresh_model.golden_dir,
                                         healing={"max_attempts": 2}))
    model = fresh_model.name
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what="HEALTHY")
    assert (await sidecar.get("/healthz"))[0] == 200

    fresh_model.break_files()  # every reload now fails
    fresh_model.kill_stub()

    await wait_for(lambda: sidecar.state(model) is ModelState.FAILED, 60, what="FAILED")
    status, body = await sidecar.get("/healthz")
    assert status == 503
    assert any(model in p and "healing exhausted after 2 attempts" in p for p in body["problems"]), body
    assert sidecar.metric("triton_sidecar_heal_attempts_total", model=model, result="failure") == 2
    assert sidecar.metric("triton_sidecar_escalations_total", model=model) == 1
    assert (await sidecar.get("/readyz"))[0] == 503


async def test_a_model_that_keeps_breaking_after_heals_is_escalated_not_reloaded_forever(triton, fresh_model, start):
    sidecar = await start(sidecar_config(triton, models=[fresh_model.name], golden_dir=fresh_model.golden_dir,
                                         healing={"flap_max_heals": 1, "flap_window_s": 600}))
    model = fresh_model.name
    for heal in (1, 2):
        await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 30, what=f"HEALTHY before fault {heal}")
        await wait_for(lambda: len(fresh_model.stubs()) == 1, 10, what="one stub")
        fresh_model.kill_stub()
        await wait_for(lambda h=heal: sidecar.metric("triton_sidecar_heal_attempts_total", model=model,
                                                     result="success") == h, 30, what=f"heal {heal}")
    await wait_for(lambda: sidecar.state(model) is ModelState.FAILED, 10, what="FAILED for flapping")
    assert "flapping" in sidecar.app[STATES].get(model).cause
    status, _ = await sidecar.get("/healthz")
    assert status == 503


class _LoadRaisesUnexpectedly(TritonClient):
    """The real client to the real Triton, except that its next `times` load calls raise what no
    step of a heal foresees. What is under test is the sidecar's own logic around that call."""

    def __init__(self, url: str, *, times: int) -> None:
        super().__init__(url, timeout_s=5.0)
        self.times = times

    async def load_model(self, model: str, timeout_s: float | None = None) -> None:
        if self.times:
            self.times -= 1
            raise RuntimeError("injected: the client library failed in a way nobody foresaw")
        await super().load_model(model, timeout_s)


@pytest.fixture
async def unreliable_client(triton) -> AsyncIterator[_LoadRaisesUnexpectedly]:  # type: ignore[no-untyped-def]
    # Requested before `start`, so it is closed after the sidecar that uses it has stopped.
    client = _LoadRaisesUnexpectedly(triton.url, times=0)
    yield client
    await client.close()


@pytest.mark.parametrize("raises, outcome", [(1, ModelState.HEALTHY), (2, ModelState.FAILED)])
async def test_an_unexpected_exception_inside_a_heal_is_logged_counted_and_retried_or_escalated(
        raises, outcome, triton, fresh_model, unreliable_client, start):
    sidecar = await start(sidecar_config(triton, models=[fresh_model.name], golden_dir=fresh_model.golden_dir,
                                         healing={"max_attempts": 2}), triton=unreliable_client)
    model = fresh_model.name
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what="HEALTHY")
    recorder = EndpointRecorder(sidecar).start()
    unreliable_client.times = raises
    with capture_logs() as logs:
        fresh_model.kill_stub()
        healing = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.HEALING), DETECT_BOUND_S + 5,
                                 what="HEALING")
        ended = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.HEALTHY, ModelState.FAILED,
                                                                   after=healing.at), HEAL_BOUND_S,
                               what="the heal to end (never stranded in HEALING)")
    await recorder.stop()

    assert ended.state_to is outcome, ended.cause
    errors = [e for e in logs if e["event"] == "heal_error"]
    assert len(errors) == raises and all(e["model"] == model and e["error"] == "RuntimeError" for e in errors), errors
    assert sidecar.metric("triton_sidecar_heal_errors_total", model=model) == raises
    assert sidecar.metric("triton_sidecar_heal_attempts_total", model=model, result="failure") == raises
    if outcome is ModelState.HEALTHY:
        assert sidecar.metric("triton_sidecar_heal_attempts_total", model=model, result="success") == 1
        assert all(s == 200 for _, s in recorder.healthz), "a retried heal must not fail liveness"
    else:
        assert "healing exhausted after 2 attempts" in ended.cause and "RuntimeError" in ended.cause
        assert (await sidecar.get("/healthz"))[0] == 503


#: The probe settings of issue 12: a timeout shorter than the ~1 s Triton takes to declare a stub dead.
ISSUE_12_PROBES = {"interval_s": 0.5, "failure_threshold": 2, "timeout_s": 1.0}
#: Recovery bound: interval × threshold + the model's load time + this, i.e. 3 s + the load at these
#: probe settings: the recovery target (docs/performance.md, "≤ 3 s + load"). At 1.5 s the test was
#: stricter than the target and missed it by 10 ms once on a loaded 2-core CI machine.
RECOVERY_SLACK_S = 2.0


@pytest.mark.parametrize("timeout_s", [1.0, 0.3])
@pytest.mark.parametrize("fault", ["stub_killed", "hung_execute"])
async def test_a_dead_or_hung_stub_recovers_within_the_bound_whatever_the_probe_timeout(
        fault, timeout_s, triton, fresh_model, start):
    # unload_timeout_s stays at its 10 s default: recovery must not come from waiting it out.
    sidecar = await start(sidecar_config(triton, models=[fresh_model.name], golden_dir=fresh_model.golden_dir,
                                         probes={**ISSUE_12_PROBES, "timeout_s": timeout_s},
                                         healing={"unload_timeout_s": 10.0}))
    model = fresh_model.name
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what="HEALTHY")
    with capture_logs() as logs:
        injected_at = time.monotonic()
        FAULTS[fault](fresh_model)
        healed = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.HEALTHY, after=injected_at),
                                HEAL_BOUND_S, what=f"{model} HEALTHY again after {fault}")

    load_s = next(e["duration_ms"] for e in logs if e["event"] == "heal_ready") / 1000
    bound = ISSUE_12_PROBES["interval_s"] * ISSUE_12_PROBES["failure_threshold"] + load_s + RECOVERY_SLACK_S
    recovered_s = healed.at - injected_at
    assert recovered_s <= bound, f"{fault} recovered after {recovered_s:.2f} s, bound {bound:.2f} s"
    events = [e["event"] for e in logs]
    assert "heal_unload_not_awaited" in events and "heal_unload_incomplete" not in events, events
    assert sidecar.metric("triton_sidecar_heal_attempts_total", model=model, result="success") == 1


async def test_a_stub_triton_declares_dead_skips_the_failure_threshold(triton, fresh_model, start):
    # Five failed rounds would be needed for any other fault; Triton's verdict is final at once.
    sidecar = await start(sidecar_config(triton, models=[fresh_model.name], golden_dir=fresh_model.golden_dir,
                                         probes={"interval_s": 0.5, "failure_threshold": 5, "timeout_s": 0.3}))
    model = fresh_model.name
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what="HEALTHY")
    with capture_logs() as logs:
        fresh_model.kill_stub()
        unhealthy = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.UNHEALTHY), 10,
                                   what="UNHEALTHY")
    # Triton's verdict ("Stub process ... is not healthy") decided: mostly as a late answer to a
    # probe that gave up after 0.3 s, sometimes (a slow machine, a round that began late) within it.
    late = [e for e in logs if e["event"] == "probe_late_answer" and e["model"] == model]
    final = [e for e in logs if e["event"] == "probe_failed" and e.get("final") and e["model"] == model]
    assert late or final, [e["event"] for e in logs]
    assert sidecar.app[STATES].get(model).consecutive_failures < 5
    assert "not healthy" in unhealthy.cause, unhealthy.cause


#: The slow load of the two tests below: long enough that a stall behind it is unmistakable next to
#: the probes' 1.5 s bound and the requests' latency.
SLOW_LOAD_S = 4.0
REPOSITORY_KEY = ("triton-repository-key", "s3cret-for-the-test")


@pytest.fixture
def one_http_worker_triton(tmp_path: Path) -> Iterator[LocalTriton]:
    """A Triton whose HTTP server has one worker thread, and whose repository API (HTTP and gRPC)
    demands a header, as the k8s manifests' does. Triton runs an HTTP load on the worker that
    received it and stalls every connection that worker holds until the load ends (Triton issue
    #8958): with one worker, a load over HTTP stalls all of them; with the default eight, the ones that
    happen to share its worker."""
    server = LocalTriton(model_repository=_repository_copy(tmp_path), models=EXAMPLE_MODELS,
                         workdir=tmp_path / "work", restricted_repository_header=REPOSITORY_KEY,
                         extra_args=["--http-thread-count=1"])
    server.start()
    yield server
    server.stop(grace_s=3)


async def test_a_slow_heal_stalls_no_probe_or_request_of_the_other_models(one_http_worker_triton, tmp_path, start):
    triton = one_http_worker_triton
    fresh_model = FreshModel.create(triton, tmp_path / "scratch")
    model = fresh_model.name
    header, token = REPOSITORY_KEY
    sidecar = await start(sidecar_config(triton, models=[model, "credit_risk"], golden_dir=fresh_model.golden_dir,
                                         triton={"repository_header": header, "repository_token": token}))
    for name in (model, "credit_risk"):
        await wait_for(lambda name=name: sidecar.state(name) is ModelState.HEALTHY, 20, what=f"{name} HEALTHY")
    fresh_model.load_slowly(SLOW_LOAD_S)
    fresh_model.inject("nan")
    healing = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.HEALING), DETECT_BOUND_S + 5,
                             what=f"{model} HEALING")

    # Requests to the healthy model, one after another, through the sidecar for as long as the heal lasts.
    latencies = []
    deadline = time.monotonic() + HEAL_BOUND_S
    while sidecar.first_transition_to(model, ModelState.HEALTHY, after=healing.at) is None:
        assert time.monotonic() < deadline, f"{model} not healed within {HEAL_BOUND_S} s"
        sent = time.monotonic()
        async with sidecar.session.post(f"{sidecar.url}/v2/models/credit_risk/infer", json=credit_json()) as answer:
            assert answer.status == 200, await answer.text()
            await answer.read()
        latencies.append(time.monotonic() - sent)
    healed = sidecar.first_transition_to(model, ModelState.HEALTHY, after=healing.at)

    assert healed.at - healing.at >= SLOW_LOAD_S, "the heal's load was not the slow one this test needs"
    assert len(latencies) >= 20, latencies
    # Over HTTP, the requests that arrived during the load waited for the whole of it (4 s).
    assert max(latencies) < 1.0, f"a request to credit_risk waited {max(latencies):.2f} s during the heal"
    assert sidecar.first_transition_to("credit_risk", ModelState.UNHEALTHY, ModelState.DEGRADED) is None
    assert sidecar.metric("triton_sidecar_heal_attempts_total", model=model, result="success") == 1
    # The heal was let in by the header: without it, Triton's gRPC port refuses a load.
    with pytest.raises(InferenceServerException, match="restricted"):
        GrpcClient(f"127.0.0.1:{triton.ports.grpc}").load_model(model)


async def test_heals_go_over_http_where_tritons_grpc_port_takes_no_repository_call(triton, fresh_model, start):
    with socket.socket() as closed:  # a port nobody listens on: the gRPC call is refused, nothing sent
        closed.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{closed.getsockname()[1]}"
    sidecar = await start(sidecar_config(triton, models=[fresh_model.name], golden_dir=fresh_model.golden_dir,
                                         triton={"grpc_url": nowhere}))
    model = fresh_model.name
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what=f"{model} HEALTHY")
    with capture_logs() as logs:
        fresh_model.inject("nan")
        detected = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.HEALING), DETECT_BOUND_S + 5,
                                  what=f"{model} HEALING")
        await wait_for(lambda: sidecar.first_transition_to(model, ModelState.HEALTHY, after=detected.at),
                       HEAL_BOUND_S, what=f"{model} healed over HTTP")
    told = [e for e in logs if e["event"] == "repository_calls_over_http"]
    assert len(told) == 1 and "unload" in told[0]["cause"], told  # said once, naming what did not go
    assert sidecar.metric("triton_sidecar_heal_attempts_total", model=model, result="success") == 1

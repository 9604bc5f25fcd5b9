"""Against the real Triton: a model whose supervisor crashes is restarted and probed again while the
other models are untouched; one that keeps crashing fails /healthz by name; and a failed golden
round is confirmed at once, so a drifted model is quarantined within one interval plus two rounds."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from sidecar.fronts.appkeys import PROBER, STATES
from sidecar.health.triton_client import TritonClient
from sidecar.states import ModelState
from tests.harness import GOLDEN, SLACK_S, sidecar_config, wait_for

pytestmark = pytest.mark.fault

BROKEN, OTHER = "credit_risk", "image_classifier"


class _MetadataRaises(TritonClient):
    """The real client to the real Triton, except that its next `times[model]` metadata calls for a
    model raise a KeyError, as a metadata document without an expected field once did. What is under
    test is the sidecar's own supervision of the probe loop around that call."""

    def __init__(self, url: str) -> None:
        super().__init__(url, timeout_s=5.0)
        self.times: dict[str, int] = {}

    async def model_metadata(self, model: str, timeout_s: float | None = None) -> dict[str, Any]:
        if self.times.get(model, 0) > 0:
            self.times[model] -= 1
            raise KeyError("inputs")
        return await super().model_metadata(model, timeout_s=timeout_s)


@pytest.fixture
async def metadata_raises(triton) -> AsyncIterator[_MetadataRaises]:  # type: ignore[no-untyped-def]
    # Requested before `start`, so it is closed after the sidecar that uses it has stopped.
    client = _MetadataRaises(triton.url)
    yield client
    await client.close()


def _rounds(sidecar, model: str) -> int:  # type: ignore[no-untyped-def]
    record = sidecar.app[PROBER].records.get(model)
    return record.rounds if record is not None else 0


async def test_a_crashing_probe_round_restarts_its_supervisor_and_leaves_the_other_model_alone(
        triton, metadata_raises, start):
    sidecar = await start(sidecar_config(triton, models=[BROKEN, OTHER], golden_dir=GOLDEN), triton=metadata_raises)
    for model in (BROKEN, OTHER):
        await wait_for(lambda m=model: sidecar.state(m) is ModelState.HEALTHY, 20, what=f"{model} HEALTHY")
    broken_before, other_before = _rounds(sidecar, BROKEN), _rounds(sidecar, OTHER)

    with capture_logs() as logs:
        metadata_raises.times[BROKEN] = 3
        await wait_for(lambda: sidecar.metric("triton_sidecar_task_crashes_total", task="supervisor") == 3, 20,
                       what="three crashes counted")
        # Restarted: it completes rounds again, and the model is still judged HEALTHY by them.
        await wait_for(lambda: _rounds(sidecar, BROKEN) >= broken_before + 2, 20, what=f"{BROKEN} probed again")
    assert sidecar.state(BROKEN) is ModelState.HEALTHY
    crashes = [e for e in logs if e["event"] == "task_crashed"]
    assert len(crashes) == 3 and all(e["task"] == f"supervisor:{BROKEN}" and e["error"] == "KeyError"
                                     and e["exc_info"] is not None for e in crashes), crashes
    assert [e["restart_in_s"] for e in crashes] == [0.1, 0.2, 0.4]
    # The other model's rounds kept completing all along, and it never left HEALTHY.
    assert _rounds(sidecar, OTHER) > other_before
    assert [t.state_to for t in sidecar.transitions if t.model == OTHER] == [ModelState.WARMING, ModelState.HEALTHY]
    _, body = await sidecar.get("/status")
    supervisor = body["models"][BROKEN]["supervisor"]
    assert supervisor["crashes"] == 3 and supervisor["crashes_in_a_row"] == 0 and not supervisor["stalled"]
    assert "KeyError" in supervisor["last_crash"]
    assert body["models"][OTHER]["supervisor"]["crashes"] == 0
    assert (await sidecar.get("/healthz"))[0] == 200


async def test_a_supervisor_that_keeps_crashing_fails_liveness_and_readiness_with_the_model_named(
        triton, metadata_raises, start):
    sidecar = await start(sidecar_config(triton, models=[BROKEN, OTHER], golden_dir=GOLDEN,
                                         liveness={"watchdog_stall_s": 3.0}), triton=metadata_raises)
    for model in (BROKEN, OTHER):
        await wait_for(lambda m=model: sidecar.state(m) is ModelState.HEALTHY, 20, what=f"{model} HEALTHY")
    assert (await sidecar.get("/healthz"))[0] == 200
    metadata_raises.times[BROKEN] = 10**6

    async def healthz_fails() -> Any:
        status, body = await sidecar.get("/healthz")
        return body if status == 503 else None

    body = await wait_for(healthz_fails, 3.0 + SLACK_S + 5, what="/healthz 503")
    stalled = [p for p in body["problems"] if "stalled" in p]
    assert len(stalled) == 1 and f"model {BROKEN}" in stalled[0] and "KeyError" in stalled[0], body["problems"]
    assert not any(OTHER in p for p in body["problems"]), body["problems"]
    _, status = await sidecar.get("/status")
    assert status["models"][BROKEN]["supervisor"]["stalled"] is True
    assert status["models"][OTHER]["supervisor"]["stalled"] is False
    assert sidecar.metric("triton_sidecar_task_crashes_total", task="supervisor") >= 3
    # Its last state (HEALTHY) is no longer re-checked: not ready either, and only it.
    status, ready = await sidecar.get("/readyz")
    assert status == 503, ready
    assert any(f"model {BROKEN}" in p and "no round" in p for p in ready["problems"]), ready["problems"]
    assert not any(OTHER in p for p in ready["problems"]), ready["problems"]


#: Probes of a bank's fraud model at 3 a.m.: one round a few seconds, two failed rounds to judge.
#: The interval is long against a round (~10 ms), so that the old schedule (a confirmation one
#: interval later: 2 × interval) and the new one (interval + 2 rounds) cannot be confused.
DRIFT_PROBES = {"interval_s": 3.0, "jitter": 0.05, "failure_threshold": 2, "timeout_s": 1.5}
#: Scheduling slack on a shared 2-core machine: the event loop, the stub's signal handler.
DRIFT_SLACK_S = 0.5


async def test_a_drift_fault_is_quarantined_within_an_interval_plus_two_probe_rounds(triton, fresh_model, start):
    sidecar = await start(sidecar_config(triton, models=[fresh_model.name], golden_dir=fresh_model.golden_dir,
                                         probes=DRIFT_PROBES))
    model = fresh_model.name
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what="HEALTHY")
    suspect: list[tuple[str, bool, float]] = []
    sidecar.app[STATES].add_suspect_listener(lambda m, flag: suspect.append((m, flag, time.monotonic())))

    with capture_logs() as logs:
        injected_at = time.monotonic()
        fresh_model.inject("drift")
        unhealthy = await wait_for(lambda: sidecar.first_transition_to(model, ModelState.UNHEALTHY), 20,
                                   what="UNHEALTHY")
    failed = [e for e in logs if e["event"] == "probe_failed" and e["model"] == model]
    assert len(failed) >= 2 and all(e["probe"] == "golden" for e in failed[:2]), failed
    round_s = max(e["duration_ms"] for e in failed[:2]) / 1000
    interval = DRIFT_PROBES["interval_s"] * (1 + DRIFT_PROBES["jitter"])
    bound = interval + 2 * round_s + DRIFT_SLACK_S
    took = unhealthy.at - injected_at
    assert took <= bound, f"quarantined {took:.2f} s after the drift, bound {bound:.2f} s (round {round_s:.3f} s)"
    assert took < 2 * DRIFT_PROBES["interval_s"] * (1 - DRIFT_PROBES["jitter"]), "confirmed an interval later"
    # The confirmation ran flagged SUSPECT, and the flag went down when it had decided.
    assert suspect[:2] == [(model, True, suspect[0][2]), (model, False, suspect[1][2])], suspect
    assert suspect[1][2] - suspect[0][2] <= 2 * round_s + DRIFT_SLACK_S
    confirming = [e for e in logs if e["event"] == "probe_confirming" and e["model"] == model]
    assert confirming and confirming[0]["consecutive_failures"] == 1

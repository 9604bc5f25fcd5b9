"""What an operator scrapes: /metrics parsed with prometheus-client's own parser after a real heal."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar import __version__
from sidecar.config import FilterRule
from sidecar.devtools.tritonserver import free_port
from sidecar.states import ModelState
from tests.harness import GOLDEN, sidecar_config, wait_for
from tests.proxy_support import credit_json, proxy_config


async def _scrape(sidecar) -> dict:  # type: ignore[no-untyped-def]
    async with sidecar.session.get(sidecar.url + "/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(families: dict, family: str, sample: str, **labels: str) -> float | None:
    for s in families[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


@pytest.mark.fault
async def test_metrics_tell_which_model_broke_what_the_sidecar_did_and_how_long_it_took(
        triton, fresh_model, start):
    model = fresh_model.name
    sidecar = await start(sidecar_config(triton, models=[model, "credit_risk"], golden_dir=fresh_model.golden_dir))
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what="HEALTHY")
    before = await _scrape(sidecar)
    assert _value(before, "triton_sidecar_model_state", "triton_sidecar_model_state", model=model,
                  state="HEALTHY") == 1
    assert _value(before, "triton_sidecar_heal_attempts", "triton_sidecar_heal_attempts_total", model=model,
                  result="success") == 0  # series exist at zero before the first heal

    fresh_model.inject("nan")
    await wait_for(lambda: sidecar.first_transition_to(model, ModelState.HEALING), 15, what="HEALING")
    during = await _scrape(sidecar)
    states = {s.labels["state"]: s.value for s in during["triton_sidecar_model_state"].samples
              if s.labels["model"] == model}
    assert sum(states.values()) == 1 and states["HEALING"] == 1
    assert _value(during, "triton_sidecar_probes", "triton_sidecar_probes_total", model=model, probe="golden",
                  result="failure") >= 2
    assert _value(during, "triton_sidecar_probe_consecutive_failures", "triton_sidecar_probe_consecutive_failures",
                  model=model) >= 2

    await wait_for(lambda: sidecar.metric("triton_sidecar_time_to_recover_seconds_count", model=model) == 1,
                   30, what="recovered")
    after = await _scrape(sidecar)
    assert _value(after, "triton_sidecar_model_state", "triton_sidecar_model_state", model=model,
                  state="HEALTHY") == 1
    assert _value(after, "triton_sidecar_heal_attempts", "triton_sidecar_heal_attempts_total", model=model,
                  result="success") == 1
    assert _value(after, "triton_sidecar_heal_duration_seconds", "triton_sidecar_heal_duration_seconds_count",
                  model=model) == 1
    recover_sum = _value(after, "triton_sidecar_time_to_recover_seconds", "triton_sidecar_time_to_recover_seconds_sum",
                         model=model)
    heal_sum = _value(after, "triton_sidecar_heal_duration_seconds", "triton_sidecar_heal_duration_seconds_sum",
                      model=model)
    assert recover_sum > heal_sum > 0  # recovery includes detection
    assert _value(after, "triton_sidecar_escalations", "triton_sidecar_escalations_total", model=model) == 0
    assert _value(after, "triton_sidecar_probe_duration_seconds", "triton_sidecar_probe_duration_seconds_count",
                  model=model, probe="golden") > 0
    # The other model was untouched by the heal.
    assert _value(after, "triton_sidecar_heal_attempts", "triton_sidecar_heal_attempts_total", model="credit_risk",
                  result="success") == 0
    assert _value(after, "triton_sidecar_triton_up", "triton_sidecar_triton_up") == 1
    assert _value(after, "triton_sidecar_build_info", "triton_sidecar_build_info", version=__version__) == 1
    assert "process_resident_memory_bytes" in after


async def _post(sidecar, path: str, body: bytes) -> int:  # type: ignore[no-untyped-def]
    async with sidecar.session.post(sidecar.url + path, data=body,
                                    headers={"Content-Type": "application/json"}) as response:
        await response.read()
        return response.status


@pytest.mark.fault
async def test_proxied_traffic_around_a_heal_is_counted_by_model_code_reason_and_output(triton, fresh_model, start):
    model = fresh_model.name
    config = proxy_config(triton, models=[model], golden_dir=fresh_model.golden_dir,
                          rules=(FilterRule(model=model, drop_outputs=("income_prob",)),))
    sidecar = await start(config)
    await wait_for(lambda: sidecar.state(model) is ModelState.HEALTHY, 20, what="HEALTHY")
    infer = f"/v2/models/{model}/infer"
    good = json.dumps(credit_json()).encode()
    assert [await _post(sidecar, infer, good) for _ in range(3)] == [200, 200, 200]
    assert await _post(sidecar, infer, b'{"inputs": [') == 400
    assert await _post(sidecar, infer, json.dumps(credit_json(outputs=[{"name": "income_prob"}])).encode()) == 403
    assert await _post(sidecar, "/v2/models/no_such_model/infer", good) == 404
    assert await _post(sidecar, "/v2/repository/index", b"{}") == 403

    fresh_model.kill_stub()
    await wait_for(lambda: sidecar.first_transition_to(model, ModelState.UNHEALTHY), 15, what="UNHEALTHY")
    quarantined = [await _post(sidecar, infer, good) for _ in range(2)]
    await wait_for(lambda: sidecar.metric("triton_sidecar_time_to_recover_seconds_count", model=model) == 1,
                   30, what="recovered")
    assert await _post(sidecar, infer, good) == 200

    m = await _scrape(sidecar)
    requests = "triton_sidecar_proxy_requests"
    assert _value(m, requests, f"{requests}_total", protocol="http", model=model, code="200") == 4
    assert _value(m, requests, f"{requests}_total", protocol="http", model=model, code="400") == 1
    assert _value(m, requests, f"{requests}_total", protocol="http", model=model, code="403") == 1
    assert _value(m, requests, f"{requests}_total", protocol="http", model="_unknown_", code="404") == 1
    assert quarantined == [503, 503]  # the heal takes seconds: both arrive while quarantined
    rejections = "triton_sidecar_proxy_rejections"
    assert _value(m, rejections, f"{rejections}_total", protocol="http", model=model, reason="malformed") == 1
    assert _value(m, rejections, f"{rejections}_total", protocol="http", model=model, reason="filtered_output") == 1
    assert _value(m, rejections, f"{rejections}_total", protocol="http", model="_unknown_", reason="unknown_model") == 1
    filtered = "triton_sidecar_outputs_filtered"
    assert _value(m, filtered, f"{filtered}_total", model=model, output="income_prob") == 4
    quarantine = "triton_sidecar_proxy_quarantined"
    assert _value(m, quarantine, f"{quarantine}_total", model=model, outcome="rejected") == 2
    duration = "triton_sidecar_proxy_request_duration_seconds"
    assert _value(m, duration, f"{duration}_count", protocol="http", model=model) >= 6
    assert _value(m, "triton_sidecar_proxy_in_flight", "triton_sidecar_proxy_in_flight", model=model) == 0
    labels = {s.labels.get("model") for f in m.values() for s in f.samples if f.name.startswith("triton_sidecar_")}
    assert labels <= {model, "_unknown_", "_server_", None}, labels  # no label from a raw request path


async def test_triton_metrics_come_through_the_sidecar_when_asked(triton, start):
    sidecar = await start(sidecar_config(triton, models=["credit_risk"], golden_dir=GOLDEN,
                                         metrics={"include_triton": True}))
    await wait_for(lambda: sidecar.state("credit_risk") is ModelState.HEALTHY, 20, what="HEALTHY")
    families = await _scrape(sidecar)
    assert _value(families, "nv_inference_request_success", "nv_inference_request_success_total",
                  model="credit_risk") >= 1  # the golden probes themselves
    assert "triton_sidecar_model_state" in families


async def test_without_triton_metrics_the_scrape_still_serves_the_sidecars_own(triton, start):
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    sidecar = await start(sidecar_config(triton, models=["credit_risk"], golden_dir=GOLDEN,
                                         triton={"metrics_url": dead},
                                         metrics={"include_triton": True, "triton_timeout_s": 0.5}))
    families = await _scrape(sidecar)
    assert "triton_sidecar_build_info" in families
    assert not any(name.startswith("nv_") for name in families)

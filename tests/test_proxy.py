"""The inference proxy in front of the real, shared Triton: answers pass through unchanged, filtered
outputs never leave, the control API is closed, and bad requests are refused before Triton."""

from __future__ import annotations

import asyncio
import gzip
import json
import time

import aiohttp
import numpy as np
import pytest
from structlog.testing import capture_logs

from sidecar.app.factory import create_app
from sidecar.config import ConfigError
from sidecar.fronts.appkeys import WATCH
from tests.harness import triton_post, wait_for
from tests.proxy_support import (
    binary_request,
    credit_json,
    decode_answer,
    features,
    image_json,
    json_tail,
    output_names,
    proxy_config,
    raw_http,
    started_and_healthy,
    triton_successes,
)

CREDIT = "/v2/models/credit_risk/infer"
IMAGE = "/v2/models/image_classifier/infer"


async def _post(session: aiohttp.ClientSession, url: str, body: bytes | dict, headers: dict | None = None
                ) -> tuple[int, dict, bytes]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    async with session.post(url, data=data, headers=headers or {"Content-Type": "application/json"}) as r:
        return r.status, dict(r.headers), await r.read()


async def test_answers_equal_triton_direct_apart_from_filtered_outputs(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton))
    s = sidecar.session
    # A model without rules: the proxied answer is Triton's, byte for byte.
    for body, headers in ((json.dumps(image_json(batch=2)).encode(), {"Content-Type": "application/json"}),
                          binary_request("image", np.random.default_rng(1).uniform(0, 1, (2, 3, 32, 32))
                                         .astype(np.float32), outputs=[("class_scores", True)])):
        direct = await _post(s, triton.url + IMAGE, body, headers)
        proxied = await _post(s, sidecar.url + IMAGE, body, headers)
        assert direct[0] == proxied[0] == 200
        assert proxied[2] == direct[2]
        assert proxied[1].get("Inference-Header-Content-Length") == direct[1].get("Inference-Header-Content-Length")

    # credit_risk: equal apart from income_prob, in JSON, in binary, and in mixed answers.
    x = features(rows=8, seed=3)
    cases = [
        (json.dumps(credit_json(rows=8, seed=3)).encode(), {"Content-Type": "application/json"}),
        (json.dumps(credit_json(rows=8, seed=3, parameters={"binary_data_output": True})).encode(), {}),
        binary_request("features", x),
        binary_request("features", x, outputs=[("scores", True)]),
    ]
    for body, headers in cases:
        direct = await _post(s, triton.url + CREDIT, body, headers)
        proxied = await _post(s, sidecar.url + CREDIT, body, headers)
        assert direct[0] == proxied[0] == 200, proxied[2][:300]
        want, got = decode_answer(direct[2], direct[1]), decode_answer(proxied[2], proxied[1])
        assert set(got) == set(want) - {"income_prob"}
        for name, value in got.items():
            assert np.array_equal(value, want[name]), name
        assert b"income_prob" not in proxied[2]


async def test_filtered_outputs_never_leave_the_pod(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton))
    s = sidecar.session
    answers = [
        await _post(s, sidecar.url + CREDIT, credit_json(rows=2)),
        await _post(s, sidecar.url + CREDIT, credit_json(rows=2, parameters={"binary_data_output": True})),
        await _post(s, sidecar.url + CREDIT, *binary_request("features", features(2))),
        await _post(s, sidecar.url + CREDIT, *binary_request("features", features(2),
                                                             outputs=[("scores", False)])),
        await _post(s, sidecar.url + "/v2/models/credit_risk/versions/1/infer", credit_json()),
    ]
    for status, headers, body in answers:
        assert status == 200
        assert output_names(body, headers) == ["scores"]
        assert b"income_prob" not in body
    # Binary answers were rewritten consistently: header length and body length agree with the header.
    status, headers, body = answers[1]
    assert "Inference-Header-Content-Length" in headers
    assert decode_answer(body, headers)["scores"].shape == (2, 1)
    assert int(headers["Content-Length"]) == len(body)

    # Asking for it by name is refused before Triton.
    before = triton_successes(triton, "credit_risk")
    status, _, body = await _post(s, sidecar.url + CREDIT, credit_json(outputs=[{"name": "income_prob"}]))
    assert status == 403
    assert json.loads(body)["reason"] == "filtered_output" and "income_prob" in json.loads(body)["error"]
    assert triton_successes(triton, "credit_risk") == before

    # Metadata and config answered through the proxy do not mention it either.
    for path in ("/v2/models/credit_risk", "/v2/models/credit_risk/versions/1", "/v2/models/credit_risk/config"):
        async with s.get(sidecar.url + path) as r:
            assert r.status == 200
            text = await r.text()
        assert "income_prob" not in text and "scores" in text, path
    # 4 infer answers (the one asking for scores only had nothing to drop) and 3 documents
    assert sidecar.metric("triton_sidecar_outputs_filtered_total", model="credit_risk", output="income_prob") == 7


CONTROL_ENDPOINTS = [
    ("POST", "/v2/repository/index"),
    ("POST", "/v2/repository/models/credit_risk/load"),
    ("POST", "/v2/repository/models/credit_risk/unload"),
    ("GET", "/v2/systemsharedmemory/status"),
    ("POST", "/v2/systemsharedmemory/region/r/register"),
    ("GET", "/v2/cudasharedmemory/status"),
    ("GET", "/v2/logging"),
    ("POST", "/v2/logging"),
    ("GET", "/v2/trace/setting"),
    ("GET", "/v2/models/credit_risk/trace/setting"),
    ("GET", "/v2/models/credit_risk/stats"),
    ("GET", "/v2/models/stats"),
]


async def test_control_endpoints_are_refused_through_the_proxy_but_reachable_on_loopback(triton, start):
    # Statistics are served by default; the key that denies them puts them with the control API.
    sidecar = await started_and_healthy(start, proxy_config(triton, proxy={"allow_statistics": False}))
    s = sidecar.session
    for method, path in CONTROL_ENDPOINTS:
        async with s.request(method, sidecar.url + path, json={}) as r:
            assert r.status == 403, (method, path, r.status)
            assert (await r.json())["reason"] == "forbidden_endpoint"
        async with s.request(method, triton.url + path, json={}) as r:
            assert r.status != 403 and r.status != 404, (method, path, r.status)
    # The healer's path still works: Triton's repository index answers on loopback.
    assert triton_post(triton, "/v2/repository/index")[0] == 200
    for path in ("/v1/models/credit_risk:predict", "/v2/models/credit_risk/explain", "/admin"):
        async with s.get(sidecar.url + path) as r:
            assert r.status == 404 and (await r.json())["reason"] == "unknown_path", path
    async with s.get(sidecar.url + CREDIT) as r:
        assert r.status == 405 and (await r.json())["reason"] == "method_not_allowed"
    async with s.get(sidecar.url + "/v2") as r:
        extensions = (await r.json())["extensions"]
    assert "model_repository" not in extensions and "binary_tensor_data" in extensions


async def test_statistics_are_proxied_by_default(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton, models=["credit_risk"]))
    async with sidecar.session.get(sidecar.url + "/v2/models/credit_risk/stats") as r:
        assert r.status == 200
        assert (await r.json())["model_stats"][0]["name"] == "credit_risk"
    async with sidecar.session.get(sidecar.url + "/v2") as r:
        assert "statistics" in (await r.json())["extensions"]


async def test_health_answers_come_from_the_sidecars_view(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton))
    s = sidecar.session
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/credit_risk/ready",
                 "/v2/models/image_classifier/versions/1/ready"):
        async with s.get(sidecar.url + path) as r:
            assert r.status == 200, path
    async with s.get(sidecar.url + "/v2/models/no_such_model/ready") as r:
        assert r.status == 404 and (await r.json())["reason"] == "unknown_model"
    # Triton still says ready; the sidecar stops saying so as soon as it cannot reach Triton.
    sidecar.app[WATCH].mark_unreachable("test")
    async with s.get(sidecar.url + "/v2/health/ready") as r:
        assert r.status == 503 and "Triton not ready" in (await r.json())["error"]


async def test_request_id_and_traceparent_pass_through_and_are_logged(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton, models=["credit_risk"],
                                                            logging={"access_log_sample_rate": 1.0}))
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with capture_logs() as logs:
        async with sidecar.session.post(sidecar.url + CREDIT, json=credit_json(),
                                        headers={"X-Request-ID": "req-42", "traceparent": traceparent}) as r:
            assert r.status == 200 and r.headers["X-Request-ID"] == "req-42"
        async with sidecar.session.post(sidecar.url + CREDIT, json=credit_json(),
                                        headers={"X-Request-ID": "bad id; rm -rf"}) as r:
            generated = r.headers["X-Request-ID"]
    assert len(generated) == 32 and "bad" not in generated
    access = [e for e in logs if e["event"] == "proxy_request"]
    assert [e["request_id"] for e in access] == ["req-42", generated]
    first = access[0]
    assert first["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert first["model"] == "credit_risk" and first["status"] == 200 and first["duration_ms"] > 0
    assert not any("data" in key or "body" in key for e in access for key in e)
    assert "income_prob" not in repr(logs)


async def test_access_log_is_sampled_but_errors_are_always_logged(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton, models=["credit_risk"],
                                                            logging={"access_log_sample_rate": 0.0}))
    with capture_logs() as logs:
        for _ in range(5):
            assert (await _post(sidecar.session, sidecar.url + CREDIT, credit_json()))[0] == 200
        assert (await _post(sidecar.session, sidecar.url + CREDIT, b"{not json"))[0] == 400
    access = [e for e in logs if e["event"] == "proxy_request"]
    assert [e["status"] for e in access] == [400]
    assert access[0]["reason"] == "malformed"


def _credit(**tensor) -> dict:
    base = {"name": "features", "shape": [1, 128], "datatype": "FP32", "data": [0.5] * 128}
    base.update(tensor)
    return {"inputs": [base]}


BAD_REQUESTS = [
    ("not json", b'{"inputs": [', {}, 400, "malformed"),
    ("duplicate key", b'{"inputs": [], "inputs": []}', {}, 400, "malformed"),
    ("wrong content type", json.dumps(_credit()).encode(), {"Content-Type": "text/plain"}, 415,
     "unsupported_media_type"),
    ("unknown encoding", json.dumps(_credit()).encode(), {"Content-Encoding": "x-lzw"}, 415, "unsupported_media_type"),
    ("not really gzip", json.dumps(_credit()).encode(), {"Content-Encoding": "gzip"}, 400, "malformed"),
    ("bad header length", json.dumps(_credit()).encode(), {"Inference-Header-Content-Length": "abc"}, 400,
     "malformed"),
    ("header length past the body", json.dumps(_credit()).encode(),
     {"Inference-Header-Content-Length": "999999"}, 400, "malformed"),
    ("wrong datatype", _credit(datatype="FP64"), {}, 400, "datatype"),
    ("bool in FP32 data", _credit(data=[True] * 128), {}, 400, "datatype"),
    ("string in FP32 data", _credit(data=["0.5"] * 128), {}, 400, "datatype"),
    ("short data", _credit(data=[0.5] * 100), {}, 400, "shape"),
    ("wrong rank", _credit(shape=[128], data=[0.5] * 128), {}, 400, "shape"),
    ("wrong fixed dim", _credit(shape=[2, 64], data=[0.5] * 128), {}, 400, "shape"),
    ("batch above max", _credit(shape=[65, 128], data=[0.5] * 128 * 65), {}, 400, "shape"),
    ("NaN literal", json.dumps(_credit(data=[float("nan")] * 128)).encode(), {}, 400, "non_finite"),
    ("overflows FP32", _credit(data=[1e39] * 128), {}, 400, "non_finite"),
    ("unknown input", {"inputs": [{**_credit()["inputs"][0], "name": "extra"}]}, {}, 400, "unknown_input"),
    ("no inputs", {"inputs": []}, {}, 400, "schema"),
    ("unknown output", {**_credit(), "outputs": [{"name": "nope"}]}, {}, 400, "unknown_output"),
    ("non-string id", {**_credit(), "id": 7}, {}, 400, "schema"),
    ("bad known parameter", {**_credit(), "parameters": {"binary_data_output": 1}}, {}, 400, "parameter"),
    ("object parameter", {**_credit(), "parameters": {"x": {"y": 1}}}, {}, 400, "parameter"),
    ("shared memory input", _credit(data=None, parameters={"shared_memory_region": "r"}), {}, 403,
     "shared_memory"),
    ("unknown field", {**_credit(), "inptus": []}, {}, 400, "schema"),
]


async def test_bad_requests_are_refused_before_reaching_triton(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton))
    before = triton_successes(triton, "credit_risk")
    for label, body, headers, status, reason in BAD_REQUESTS:
        if isinstance(body, dict):
            body = json.dumps({**body, "inputs": [{k: v for k, v in t.items() if v is not None}
                                                 for t in body["inputs"]]}).encode()
        got, _, answer = await _post(sidecar.session, sidecar.url + CREDIT, body,
                                     {"Content-Type": "application/json", **headers})
        doc = json.loads(answer)
        assert (got, doc["reason"]) == (status, reason), (label, doc)
        assert doc["error"] and doc["model"] == "credit_risk", label
    # Binary NaN: image_classifier would happily answer NaN scores; the sidecar refuses the input.
    image = np.random.default_rng(0).uniform(0, 1, (1, 3, 32, 32)).astype(np.float32)
    image[0, 1, 2, 3] = np.nan
    status, _, answer = await _post(sidecar.session, sidecar.url + IMAGE, *binary_request("image", image))
    assert status == 400 and json.loads(answer)["reason"] == "non_finite"
    status, _, answer = await _post(sidecar.session, sidecar.url + "/v2/models/nope/infer", _credit())
    assert status == 404 and json.loads(answer)["reason"] == "unknown_model"

    assert triton_successes(triton, "credit_risk") == before, "a refused request reached Triton"
    assert sidecar.metric("triton_sidecar_proxy_rejections_total",
                          protocol="http", model="credit_risk", reason="shape") == 4
    # Unknown model names never become metric labels.
    assert sidecar.metric("triton_sidecar_proxy_rejections_total",
                          protocol="http", model="_unknown_", reason="unknown_model") == 1
    assert sidecar.metric("triton_sidecar_proxy_requests_total",
                          protocol="http", model="nope", code="404") is None


async def test_a_huge_declared_body_is_refused_before_it_is_sent(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton, models=["credit_risk"]))
    host, port = "127.0.0.1", sidecar.server.port
    head = (f"POST {CREDIT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {1024 ** 3}\r\n\r\n").encode()
    started = time.monotonic()
    status, raw = await raw_http(host, port, head, [b'{"inputs": ['])
    assert status == 413 and json_tail(raw)["reason"] == "body_too_large"
    assert time.monotonic() - started < 5


async def test_a_chunked_body_is_counted_while_it_streams(triton, start):
    limit = 256 * 1024
    sidecar = await started_and_healthy(start, proxy_config(triton, models=["credit_risk"],
                                                            validation={"max_body_bytes": limit}))

    async def chunks():
        for _ in range(1000):  # 64 MB if it were all read
            yield b" " * 65536

    async with sidecar.session.post(sidecar.url + CREDIT, data=chunks(),
                                    headers={"Content-Type": "application/json"}) as r:
        assert r.status == 413 and (await r.json())["reason"] == "body_too_large"
    # A gzip bomb stops at the limit too: 64 MB of spaces inflate from about 64 KB.
    bomb = gzip.compress(b" " * (64 * 1024 * 1024))
    status, _, body = await _post(sidecar.session, sidecar.url + CREDIT, bomb,
                                  {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 413 and json.loads(body)["reason"] == "body_too_large"
    status, _, body = await _post(sidecar.session, sidecar.url + CREDIT, gzip.compress(
        json.dumps(credit_json()).encode()), {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 200, body
    # A chunked body under the limit is fine.
    small = json.dumps(credit_json()).encode()

    async def one():
        yield small

    async with sidecar.session.post(sidecar.url + CREDIT, data=one()) as r:
        assert r.status == 200


async def test_element_and_nesting_limits(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton, models=["credit_risk"],
                                                            validation={"max_elements": 1000}))
    status, _, body = await _post(sidecar.session, sidecar.url + CREDIT, credit_json(rows=8))
    assert status == 413 and json.loads(body)["reason"] == "too_many_elements"
    deep = b'{"inputs": [{"name": "features", "shape": [1, 128], "datatype": "FP32", "data": ' \
           + b"[" * 100_000 + b"]" * 100_000 + b"}]}"
    status, _, body = await _post(sidecar.session, sidecar.url + CREDIT, deep)
    assert status == 400 and json.loads(body)["reason"] == "malformed"
    status, _, body = await _post(sidecar.session, sidecar.url + CREDIT, credit_json(rows=1))
    assert status == 200


async def test_a_slow_client_gets_408_without_holding_up_others(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton, models=["credit_risk"],
                                                            proxy={"client_body_timeout_s": 1.0}))
    body = json.dumps(credit_json()).encode()
    head = (f"POST {CREDIT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    slow = asyncio.create_task(raw_http("127.0.0.1", sidecar.server.port, head, [body[:100]]))
    # Meanwhile other clients are served at once.
    for _ in range(3):
        started = time.monotonic()
        assert (await _post(sidecar.session, sidecar.url + CREDIT, body))[0] == 200
        assert time.monotonic() - started < 1.0
    status, raw = await slow
    assert status == 408 and json_tail(raw)["reason"] == "body_timeout"


async def test_business_rules_from_a_json_schema_file(triton, start, tmp_path):
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["id"],
        "properties": {"id": {"type": "string", "pattern": "^app-"}},
        "x-tensors": {"features": {"minimum": -10, "maximum": 10}},
    }
    path = tmp_path / "credit_risk.schema.json"
    path.write_text(json.dumps(schema))
    sidecar = await started_and_healthy(start, proxy_config(triton, models=["credit_risk"],
                                                            validation={"schemas": {"credit_risk": str(path)}}))
    s = sidecar.session
    assert (await _post(s, sidecar.url + CREDIT, credit_json(id="app-1")))[0] == 200
    status, _, body = await _post(s, sidecar.url + CREDIT, credit_json())
    assert status == 400 and json.loads(body)["reason"] == "business_rule" and "id" in json.loads(body)["error"]
    x = features(1)
    x[0, 5] = 11.0
    too_big = {"id": "app-2", "inputs": [{"name": "features", "shape": [1, 128], "datatype": "FP32",
                                          "data": x.tolist()}]}
    status, _, body = await _post(s, sidecar.url + CREDIT, too_big)
    assert status == 400 and "maximum" in json.loads(body)["error"] and json.loads(body)["input"] == "features"
    # The same rule holds for binary tensors.
    bin_body, headers = binary_request("features", x)
    header = json.loads(bin_body[: int(headers["Inference-Header-Content-Length"])])
    header["id"] = "app-3"
    new_header = json.dumps(header).encode()
    bin_body = new_header + bin_body[int(headers["Inference-Header-Content-Length"]):]
    headers["Inference-Header-Content-Length"] = str(len(new_header))
    status, _, body = await _post(s, sidecar.url + CREDIT, bin_body, headers)
    assert status == 400 and json.loads(body)["reason"] == "business_rule"


@pytest.mark.parametrize("content, complaint", [
    ("{not json", "not valid JSON"),
    ('{"type": 12}', "not a valid Draft 2020-12 schema"),
    ('{"x-tensors": {"features": {"minimum": "low"}}}', "x-tensors"),
    ('{"properties": {"inputs": {"items": {"properties": {"data": {"items": {"maximum": 1}}}}}}}', "x-tensors"),
])
async def test_a_bad_schema_file_stops_the_start_naming_the_file(triton, tmp_path, content, complaint):
    path = tmp_path / "broken.json"
    path.write_text(content)
    config = proxy_config(triton, validation={"schemas": {"credit_risk": str(path)}})
    with pytest.raises(ConfigError) as error:
        create_app(config, golden={})
    assert str(path) in str(error.value) and complaint in str(error.value)


async def test_unknown_model_names_do_not_grow_metric_labels(triton, start):
    sidecar = await started_and_healthy(start, proxy_config(triton, models=["credit_risk"]))
    for i in range(20):
        async with sidecar.session.get(f"{sidecar.url}/v2/models/random-{i}") as r:
            assert r.status == 404
    await wait_for(lambda: sidecar.metric("triton_sidecar_proxy_requests_total",
                          protocol="http", model="_unknown_", code="404")
                   == 20, 2, what="20 unknown-model 404s counted under one label")
    families = {s.labels.get("model") for m in sidecar.registry.collect() for s in m.samples}
    assert not any(str(label).startswith("random-") for label in families)


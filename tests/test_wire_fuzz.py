"""Fuzzing both wires with hypothesis, against the real sidecar and Triton: the HTTP listener gets valid
and badly framed requests (pipelined, chunked, smuggling attempts, header injection) cut into random
fragments; the gRPC front gets random and mutated protobuf bytes, unary and on a stream. Nothing
crashes or hangs, every request is answered or its connection closed, badly framed requests get the
JSON 400 nginx would give, and Triton's own success counter proves that only valid requests ran."""

from __future__ import annotations

import itertools
import json
import socket
from typing import Any

import grpc
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from sidecar.devtools.tritonserver import free_port
from sidecar.fronts.grpc_server import SERVICE
from tests.harness import wait_for
from tests.proxy_support import SidecarThread, credit_json, proxy_config, triton_successes

PATH = b"/v2/models/credit_risk/infer"
BODY = json.dumps(credit_json(seed=11)).encode()
#: Few examples, each a handful of inferences: the file runs in well under a minute.
FUZZ = settings(max_examples=80, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _head(*headers: bytes) -> bytes:
    return b"POST " + PATH + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + b"".join(headers)


def _chunked(body: bytes, cuts: list[int]) -> bytes:
    points = sorted({0, len(body), *(c % (len(body) + 1) for c in cuts)})
    chunks = [body[a:b] for a, b in itertools.pairwise(points) if b > a]
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


@st.composite
def valid_requests(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        return _head(b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY
    coding = draw(st.sampled_from([b"chunked", b"Chunked", b" chunked "]))
    cuts = draw(st.lists(st.integers(0, len(BODY)), max_size=6))
    return _head(b"Transfer-Encoding: " + coding + b"\r\n\r\n") + _chunked(BODY, cuts)


#: Requests whose framing is ambiguous or broken: each must get a 400 and end its connection, and
#: none may reach Triton. The smuggling cases are the ones nginx refuses with 400.
BADLY_FRAMED = {
    "CL and TE": _head(b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(BODY)) + _chunked(BODY, []),
    "TE and CL": _head(b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n") + _chunked(BODY, []),
    "two different CL": _head(b"Content-Length: %d\r\nContent-Length: 5\r\n\r\n" % len(BODY)) + BODY,
    "two equal CL": _head(b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n" % (len(BODY), len(BODY))) + BODY,
    "CL list": _head(b"Content-Length: %d, %d\r\n\r\n" % (len(BODY), len(BODY))) + BODY,
    "TE gzip, chunked": _head(b"Transfer-Encoding: gzip, chunked\r\n\r\n") + _chunked(BODY, []),
    "TE chunked, gzip": _head(b"Transfer-Encoding: chunked, gzip\r\n\r\n") + _chunked(BODY, []),
    "TE identity": _head(b"Transfer-Encoding: identity\r\n\r\n") + BODY,
    "TE twice": _head(b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n") + _chunked(BODY, []),
    "invalid chunk size": _head(b"Transfer-Encoding: chunked\r\n\r\n") + b"zz\r\n" + BODY + b"\r\n0\r\n\r\n",
    "chunk size overflow": _head(b"Transfer-Encoding: chunked\r\n\r\n") + b"fffffffffffffffffff\r\nab\r\n0\r\n\r\n",
    "chunk shorter than said": _head(b"Transfer-Encoding: chunked\r\n\r\n") + b"ff\r\nab\r\n0\r\n\r\n" + b"x" * 300,
    "header injected by a bare LF": _head(b"X-Note: a\nContent-Length: 0\r\nContent-Length: %d\r\n\r\n"
                                          % len(BODY)) + BODY,
    "header injected by a bare CR": _head(b"X-Note: a\rContent-Length: 0\r\n\r\n"),
    "folded header": _head(b"X-Note: a\r\n Content-Length: 0\r\nContent-Length: %d\r\n\r\n" % len(BODY)) + BODY,
    "space before the colon": _head(b"Transfer-Encoding : chunked\r\nContent-Length: %d\r\n\r\n"
                                    % len(BODY)) + BODY,
    "NUL in a header": _head(b"X-Note: a\x00b\r\nContent-Length: %d\r\n\r\n" % len(BODY)) + BODY,
    "negative CL": _head(b"Content-Length: -1\r\n\r\n"),
    "not HTTP": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\0" * 40 + b"\r\n\r\n",
}


def _answers(stream: Any, limit: int | None = None) -> tuple[list[tuple[int, dict[str, str], bytes]], bool]:
    """The answers on the connection (Content-Length framed) until it ends or `limit` came, and
    whether it ended."""
    out: list[tuple[int, dict[str, str], bytes]] = []
    try:
        while limit is None or len(out) < limit:
            status_line = stream.readline()
            if not status_line:
                return out, True
            status = int(status_line.split()[1])
            headers = {}
            while (line := stream.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            body = stream.read(int(headers.get("content-length", "0")))
            if status != 100:
                out.append((status, headers, body))
    except ConnectionResetError:
        return out, True
    return out, False


def _send(port: int, data: bytes, cuts: list[int]) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    for a, b in itertools.pairwise(points):
        sock.sendall(data[a:b])
    return sock


def _check_connection(port: int, messages: list[bytes], bad: list[bool], cuts: list[int]) -> int:
    """Send the messages pipelined and cut at `cuts`; check what came back; the number of 200s."""
    sock = _send(port, b"".join(messages), cuts)
    stream = sock.makefile("rb")
    try:
        first_bad = bad.index(True) if True in bad else None
        if first_bad is None:
            answers, ended = _answers(stream, len(messages))
            assert [a[0] for a in answers] == [200] * len(messages) and not ended, answers
            # Still in step: one more request on the same connection is answered.
            sock.sendall(_head(b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY)
            assert [a[0] for a in _answers(stream, 1)[0]] == [200]
            return len(messages) + 1
        answers, ended = _answers(stream)
    finally:
        stream.close()
        sock.close()
    # Every request before the badly framed one is answered, then the 400, then the end.
    assert [a[0] for a in answers] == [200] * first_bad + [400], answers
    assert ended, "the connection stayed open after a badly framed request"
    doc = json.loads(answers[-1][2])
    assert doc["reason"] == "malformed" and doc["error"], doc
    assert answers[-1][1].get("connection") == "close"
    return first_bad


def test_badly_framed_http_is_refused_400_at_every_fragmentation_and_never_reaches_triton(triton):
    config = proxy_config(triton, models=["credit_risk"], probes={"interval_s": 3600, "jitter": 0.0})
    valid = valid_requests()
    names = sorted(BADLY_FRAMED)
    served = 0
    with SidecarThread(config) as sidecar:
        port = sidecar.sidecar.server.port  # type: ignore[union-attr]
        before = triton_successes(triton, "credit_risk")

        # Each case after a valid request, split at every byte: the parser sees each byte alone.
        for name in names:
            messages = [_head(b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY, BADLY_FRAMED[name]]
            served += _check_connection(port, messages, [False, True], list(range(len(b"".join(messages)))))

        @FUZZ
        @given(plan=st.lists(st.one_of(valid.map(lambda m: (m, False)),
                                       st.sampled_from(names).map(lambda n: (BADLY_FRAMED[n], True))),
                             min_size=1, max_size=4),
               cuts=st.lists(st.integers(0, 10_000), max_size=12))
        def one_connection(plan: list[tuple[bytes, bool]], cuts: list[int]) -> None:
            nonlocal served
            served += _check_connection(port, [m for m, _ in plan], [b for _, b in plan], cuts)

        one_connection()
        after = triton_successes(triton, "credit_risk")
        listener = sidecar.sidecar.server  # type: ignore[union-attr]
        sidecar._run(wait_for(lambda: listener.open_connections == 0, 10, what="every fuzzed connection closed"))
    assert after - before == served, f"Triton ran {after - before} inferences, the sidecar answered {served} 200s"


def _grpc_request(seed: int) -> bytes:
    x = np.random.default_rng(seed).uniform(-1, 1, (1, 128)).astype("<f4")
    tensor = pb.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=[1, 128])
    return pb.ModelInferRequest(model_name="credit_risk", inputs=[tensor],
                                raw_input_contents=[x.tobytes()]).SerializeToString()


@st.composite
def grpc_payloads(draw: st.DrawFn) -> bytes:
    """Random bytes, or a valid request cut short, with bytes flipped or spliced in."""
    kind = draw(st.sampled_from(["random", "truncated", "flipped", "spliced"]))
    if kind == "random":
        return draw(st.binary(max_size=200))
    valid = _grpc_request(draw(st.integers(0, 3)))
    if kind == "truncated":
        return valid[: draw(st.integers(0, len(valid) - 1))]
    position = draw(st.integers(0, len(valid) - 1))
    if kind == "flipped":
        return valid[:position] + bytes([valid[position] ^ draw(st.integers(1, 255))]) + valid[position + 1:]
    return valid[:position] + draw(st.binary(min_size=1, max_size=16)) + valid[position:]


#: Codes a request the sidecar cannot use may get: never INTERNAL or UNKNOWN (a crash), never a hang.
CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED}


def test_random_protobuf_bytes_on_the_grpc_front_are_refused_and_never_reach_triton(triton):
    config = proxy_config(triton, models=["credit_risk"], probes={"interval_s": 3600, "jitter": 0.0},
                          listen={"grpc_port": free_port()})
    outcomes: list[Any] = []
    with SidecarThread(config) as sidecar, grpc.insecure_channel(f"127.0.0.1:{config.listen.grpc_port}") as channel:
        infer = channel.unary_unary(f"/{SERVICE}/ModelInfer")
        stream_infer = channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")
        before = triton_successes(triton, "credit_risk")

        @FUZZ
        @given(payload=grpc_payloads())
        def one_call(payload: bytes) -> None:
            try:
                infer(payload, timeout=10)
                outcomes.append("ok")
            except grpc.RpcError as e:
                assert e.code() in CLIENT_CODES, (e.code(), e.details(), payload[:80])
                outcomes.append(e.code())

        @FUZZ
        @given(payloads=st.lists(grpc_payloads(), min_size=1, max_size=5))
        def one_stream(payloads: list[bytes]) -> None:
            # Each request on the stream is answered (a response or an in-stream error), or the
            # stream ends with a client's code; all within the deadline.
            responses = 0
            try:
                for raw in stream_infer(iter(payloads), timeout=10):
                    response = pb.ModelStreamInferResponse.FromString(raw)
                    responses += 1
                    outcomes.append("ok" if not response.error_message else "in_stream_error")
                    assert not response.error_message or response.error_message.startswith("["), response
            except grpc.RpcError as e:
                assert e.code() in CLIENT_CODES, (e.code(), e.details())
                return
            assert responses == len(payloads)

        one_call()
        one_stream()
        after = triton_successes(triton, "credit_risk")
        assert sidecar.sidecar is not None
    answered = outcomes.count("ok")
    assert len(outcomes) - answered > 40, f"the fuzzer produced mostly valid requests ({answered} of {len(outcomes)})"
    assert after - before == answered, f"Triton ran {after - before} inferences, the sidecar passed {answered}"

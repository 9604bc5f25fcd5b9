"""The boundary to Triton's HTTP API for the health side: probes, the healer, discovery, `record`.

Everything the probes and the healer ask Triton goes through `TritonClient`; every failure comes out
as one of two exceptions: `TritonUnavailable` (no answer: refused, reset, or `TritonTimeout`) or
`TritonError` (an answer, but not a good one, with its HTTP status and Triton's message).

Two transports, one timeout model (`_call`) and one way errors arrive. What every probe round sends
(readiness, metadata, golden infer) goes over a pool of this client's own (sidecar.upstream, the
proxy's client stack: about 0.2 ms less CPU per call than aiohttp's client, measured, and a round is
six calls per model every 5 s; issue 18's idle budget). The rest (config, repository index, generate
streams) stays on one aiohttp session. Loads and unloads go to Triton's gRPC port through the data
plane's front when it runs (`send_repository_calls_through`): Triton's HTTP server runs a load on the
worker thread that received it and stalls every other connection that thread holds for the whole
load (Triton issue #8958), probes of healthy models and proxied requests among them. Without the
front (the CLI), or where the gRPC port does not serve them, they go over HTTP. The encoding and
decoding of infer bodies are tritonclient's, redone without importing its HTTP client (sidecar.health.infer_body: binary
tensors, JSON nulls read as NaN). Neither transport is shared with the proxy's traffic: a probe
must reach Triton even while the proxy's pool is saturated.

Triton's own diagnosis is a type, decided here and nowhere else: `StubUnhealthy` when Triton declares a
model instance's python-backend stub dead. Callers branch on the type, never on Triton's wording.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp
import structlog

from sidecar.golden.cases import GENERATE_STREAM, GoldenCase, ReceivedOutput
from sidecar.health.infer_body import EncodeRefused, encode_request, read_answer
from sidecar.messages import cut
from sidecar.protocol.sse import EventSplitter, text_of
from sidecar.protocol.triton_errors import (
    MAX_ERROR_CHARS,
    StubUnhealthy,
    TritonError,
    TritonTimeout,
    TritonUnavailable,
    triton_error,
)
from sidecar.upstream import UpstreamError, UpstreamPool

log = structlog.get_logger("sidecar.triton")

#: A repository call sent another way than this client's HTTP (HttpFront.repository_call): (action,
#: model, timeout_s) to (HTTP status that says the outcome, 0 without an answer; the gRPC code's name
#: or why there was no answer: timeout, unreachable, dropped; Triton's message).
RepositoryCall = Callable[[str, str, float], Awaitable[tuple[int, str, str]]]


@dataclass(frozen=True)
class InferOutcome:
    """What one inference gave: status 200 with outputs, or an error status with Triton's message."""

    status: int
    outputs: Mapping[str, ReceivedOutput] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class GenerateOutcome:
    """What one generate (or generate_stream) call gave: the text of the case's field (concatenated
    over events), Triton's error if any (an error event, or 200 with an error body), and timings."""

    status: int
    text: str = ""
    error: str = ""
    events: int = 0
    #: Seconds from sending the request to the first event (streams) and to the end of the answer.
    first_event_s: float | None = None
    total_s: float = 0.0



def _translate(e: BaseException) -> Exception:
    if isinstance(e, EncodeRefused):
        return TritonUnavailable(_cut(str(e)))
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
        return TritonTimeout("no answer within the time limit")
    return TritonUnavailable(_cut(f"{type(e).__name__}: {e}"))


_TRANSPORT_ERRORS = (aiohttp.ClientError, UpstreamError, OSError, asyncio.TimeoutError, ValueError)


class TritonClient:
    """A pool for the probes' calls and one aiohttp session for the rest, to one Triton, used by probes
    and the healer from one event loop."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 5.0,
        repository_headers: Mapping[str, str] | None = None,
        max_call_s: float = 600.0,
        trace_headers: Callable[[], tuple[tuple[str, str], ...]] = tuple,
        read_outputs: Callable[[bytes, int | None], Mapping[str, ReceivedOutput]] = read_answer,
    ) -> None:
        self.url = url.rstrip("/")
        #: The current span's traceparent (and tracestate) when tracing samples it (HealthSpans.
        #: current_trace): sent with every golden request, so Triton's spans nest under the probe
        #: round or heal step that asked. () with tracing off.
        self._trace_headers = trace_headers
        #: How a 200 answer's outputs are read: as the health loop compares them (no numpy), or as
        #: numpy arrays for the record command (infer_body.decode_answer), which writes them out.
        self._read_outputs = read_outputs
        self.timeout_s = timeout_s
        #: Every call is bounded by its own timeout (`_call`); this bounds the session itself, so
        #: that no call can outlive the longest one the settings allow (a load).
        self._max_call_s = max_call_s
        self._repository_headers = {"Content-Type": "application/json", **(repository_headers or {})}
        self._bodies: dict[tuple[str, str, str], tuple[GoldenCase, bytes, dict[str, str]]] = {}
        self._http: aiohttp.ClientSession | None = None
        #: Each call's own bound is `_call`'s timeout, whose cancellation aborts the connection; the
        #: pool's bound is only the outer one.
        self._pool = UpstreamPool(self.url, connect_timeout_s=timeout_s)
        #: Where loads and unloads go instead of this client's HTTP (Triton's gRPC port, through the
        #: data plane's front); None: over HTTP.
        self._repository_call: RepositoryCall | None = None
        self._told_over_http = False

    def send_repository_calls_through(self, call: RepositoryCall | None) -> None:
        """Send loads and unloads through `call` (None: over HTTP again)."""
        self._repository_call = call

    async def close(self) -> None:
        await self._pool.close()
        if self._http is not None:
            await self._http.close()

    async def _call(self, coro: Any, timeout_s: float | None = None) -> Any:
        try:
            async with asyncio.timeout(timeout_s or self.timeout_s):
                return await coro
        except _TRANSPORT_ERRORS as e:
            raise _translate(e) from e

    async def server_live(self, timeout_s: float | None = None) -> bool:
        return await self._call(self._answers_200("/v2/health/live"), timeout_s)

    async def server_ready(self, timeout_s: float | None = None) -> bool:
        return await self._call(self._answers_200("/v2/health/ready"), timeout_s)

    async def model_ready(self, model: str, version: str = "", timeout_s: float | None = None) -> bool:
        return await self._call(self._answers_200(_model_path(model, version) + "/ready"), timeout_s)

    async def model_metadata(self, model: str, version: str = "", timeout_s: float | None = None) -> dict[str, Any]:
        return await self._call(self._document(_model_path(model, version)), timeout_s)

    async def model_config(self, model: str, version: str = "", timeout_s: float | None = None) -> dict[str, Any]:
        """The model's config; {} where the server has none to give (404: MLServer has no config
        endpoint, and the config is an extension of the v2 protocol)."""
        return await self._call(self._document(_model_path(model, version) + "/config", missing_is_empty=True),
                                timeout_s)

    async def repository_index(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """The repository index, asked with the body `{}`: Triton takes none, but other v2 servers
        (MLServer) refuse a POST without a JSON object (422), as tritonclient sends it."""

        async def post() -> list[dict[str, Any]]:
            raw = await self._repository_post("/v2/repository/index", b"{}")
            index = json.loads(raw)
            if not isinstance(index, list):
                raise TritonError(502, _cut(f"a repository index that is not a list: {raw[:100]!r}"))
            return index

        return await self._call(post(), timeout_s)

    async def load_model(self, model: str, timeout_s: float | None = None) -> None:
        if await self._sent_elsewhere("load", model, timeout_s):
            return
        await self._call(self._repository_post(f"/v2/repository/models/{quote(model, safe='')}/load", b"{}"),
                         timeout_s)

    async def unload_model(self, model: str, timeout_s: float | None = None) -> None:
        if await self._sent_elsewhere("unload", model, timeout_s):
            return
        # As tritonclient sends it: the model's dependents (ensembles' steps) stay loaded.
        body = b'{"parameters": {"unload_dependents": false}}'
        await self._call(self._repository_post(f"/v2/repository/models/{quote(model, safe='')}/unload", body),
                         timeout_s)

    async def _sent_elsewhere(self, action: str, model: str, timeout_s: float | None) -> bool:
        """Send a load or an unload through `_repository_call`: True when it is done there (or raise
        its failure as `_call` would); False when it must go over HTTP instead: no such route, the
        gRPC port refused the connection (nothing was sent), or it does not serve repository calls
        (UNIMPLEMENTED: not Triton's, never asked again)."""
        send = self._repository_call
        if send is None:
            return False
        bound = timeout_s or self.timeout_s
        # The front's own bound ends the call first, with Triton's words; this one only guards the wait.
        status, code, message = await self._call(send(action, model, bound), bound + 1.0)
        if status == 200:
            return True
        if code == "unreachable" or code == "UNIMPLEMENTED":
            if code == "UNIMPLEMENTED":
                self._repository_call = None
            if not self._told_over_http:
                self._told_over_http = True
                log.warning("repository_calls_over_http", model=model, action=action,
                            cause=f"Triton's gRPC port did not take a {action}: {_cut(message or code)}; loads and "
                                  "unloads go over its HTTP API, where each one stalls the requests that share "
                                  "its worker thread for as long as it lasts")
            return False
        if code == "timeout":
            raise TritonTimeout(_cut(message))
        if status == 0:
            raise TritonUnavailable(_cut(message))
        raise triton_error(status, _cut(message))

    # -- the HTTP of the calls above ---------------------------------------------------------------------

    async def _answers_200(self, path: str) -> bool:
        """Readiness and liveness: 200 is yes, any other answer no (no answer raises)."""
        response = await self._pool.request("GET", path, _IDENTITY, timeout_s=self._max_call_s)
        return response.status == 200

    async def _document(self, path: str, *, missing_is_empty: bool = False) -> dict[str, Any]:
        response = await self._pool.request("GET", path, _IDENTITY, timeout_s=self._max_call_s)
        raw = response.body
        if response.status == 404 and missing_is_empty:
            return {}
        if response.status != 200:
            raise triton_error(response.status, _error_message(raw))
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise TritonError(502, _cut(f"a document that is not a JSON object: {raw[:100]!r}"))
        return doc

    async def _repository_post(self, path: str, body: bytes) -> bytes:
        """A repository call: the repository header goes with it (and only with these calls)."""
        async with self._session().post(self.url + path, data=body, headers=self._repository_headers) as response:
            raw = await response.read()
            if response.status != 200:
                raise triton_error(response.status, _error_message(raw))
            return raw

    async def infer_case(self, case: GoldenCase, timeout_s: float | None = None) -> InferOutcome:
        """Send the case's request as JSON, as a client would, and collect the answer: an error status
        is an outcome (golden error cases expect one), except Triton's verdict that the instance is
        dead, which no golden case expects: that raises StubUnhealthy."""
        body, headers = self._request_body(case)
        headers = self._traced(headers)
        path = _model_path(case.model, case.version) + "/infer"

        async def post() -> InferOutcome:
            response = await self._pool.request("POST", path, headers, body, timeout_s=self._max_call_s)
            raw = response.body
            if response.status != 200:
                error = triton_error(response.status, _error_message(raw))
                if isinstance(error, StubUnhealthy):
                    raise error
                return InferOutcome(status=response.status, error=error.message)
            length = response.headers.get("inference-header-content-length")
            try:
                outputs = self._read_outputs(raw, int(length) if length is not None else None)
            except (ValueError, KeyError, TypeError) as e:
                raise TritonError(502, _cut(f"an answer that is not v2 JSON: {e}")) from e
            return InferOutcome(status=200, outputs=outputs)

        return await self._call(post(), timeout_s)

    async def generate_case(self, case: GoldenCase, timeout_s: float | None = None) -> GenerateOutcome:
        """Send a generate case's request as a client would; read a stream event by event."""
        path = _model_path(case.model, case.version) + "/" + case.endpoint
        body = json.dumps(case.request).encode()
        headers = self._traced({"Content-Type": "application/json", "Accept-Encoding": "identity"})
        field_name = case.text.field if case.text is not None else "text_output"

        async def post() -> GenerateOutcome:
            started = loop_time()
            async with self._session().post(self.url + path, data=body, headers=headers) as response:
                if case.endpoint != GENERATE_STREAM or response.status != 200:
                    raw = await response.read()
                    if raw.startswith(b"data:"):
                        raw = raw[5:].strip()
                    try:
                        doc = json.loads(raw)
                    except ValueError as e:
                        if response.status != 200:
                            return GenerateOutcome(response.status, error=_error_message(raw))
                        raise TritonError(502, _cut(f"a generate answer that is not JSON: {e}")) from e
                    if not isinstance(doc, dict):
                        raise TritonError(502, "a generate answer that is not a JSON object")
                    error = _cut(str(doc["error"])) if "error" in doc else ""
                    return GenerateOutcome(response.status, text_of(doc, field_name), error, 1,
                                           total_s=loop_time() - started)
                splitter, pieces, events, first = EventSplitter(), [], 0, None
                async for chunk in response.content.iter_any():
                    for data in splitter.feed(chunk):
                        try:
                            doc = json.loads(data)
                        except ValueError as e:
                            raise TritonError(502, _cut(f"an event that is not JSON: {e}")) from e
                        if first is None:
                            first = loop_time() - started
                        if isinstance(doc, dict) and "error" in doc:
                            return GenerateOutcome(200, "".join(pieces), _cut(str(doc["error"])), events, first,
                                                   loop_time() - started)
                        events += 1
                        pieces.append(text_of(doc, field_name) if isinstance(doc, dict) else "")
                return GenerateOutcome(200, "".join(pieces), "", events, first, loop_time() - started)

        return await self._call(post(), timeout_s)

    def _traced(self, headers: dict[str, str]) -> dict[str, str]:
        """`headers` with the current span's traceparent added when there is one (a copy: the
        cached request's own stay as they are)."""
        trace = self._trace_headers()
        return {**headers, **dict(trace)} if trace else headers

    def _request_body(self, case: GoldenCase) -> tuple[bytes, dict[str, str]]:
        """The request encoded once (tritonclient's encoding, sidecar.health.infer_body) and kept:
        probes repeat it every few seconds, and encoding thousands of floats as JSON is most of a
        probe's CPU."""
        key = (case.model, case.name, str(case.path))
        cached = self._bodies.get(key)
        # Kept only for this very case object: a reload builds new GoldenCase objects, so a changed
        # request is encoded afresh and probed next (issue 19), an unchanged one once more.
        if cached is not None and cached[0] is case:
            return cached[1], cached[2]
        body = encode_request(case)
        # Identity: Triton would gzip the answer, and decompressing costs more than loopback bytes.
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        self._bodies[key] = (case, body, headers)
        return body, headers

    def _session(self) -> aiohttp.ClientSession:
        """The one session, made on first use (inside the event loop that uses it)."""
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._max_call_s),
                                               auto_decompress=False)
        return self._http


#: Triton would gzip its answers; decompressing costs more than loopback bytes.
_IDENTITY = {"Accept-Encoding": "identity"}


def _model_path(model: str, version: str) -> str:
    path = f"/v2/models/{quote(model, safe='')}"
    return f"{path}/versions/{quote(version, safe='')}" if version else path


def loop_time() -> float:
    return asyncio.get_running_loop().time()


def _error_message(raw: bytes) -> str:
    try:
        return _cut(str(json.loads(raw)["error"]))
    except (ValueError, KeyError, TypeError):
        return _cut(raw.decode(errors="replace")) or "(empty answer)"


def _cut(text: str) -> str:
    return cut(text, MAX_ERROR_CHARS)

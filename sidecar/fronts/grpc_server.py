"""The gRPC front: KServe v2's GRPCInferenceService (and grpc.health.v1) on `listen.grpc_port`.

Like the HTTP front it only decodes, calls the serving core and encodes. Requests and answers stay
the client's and Triton's own bytes (identity serializers): a request that passes validation is
forwarded as it came, and an answer with nothing to hide is returned as Triton sent it; messages are
parsed with tritonclient's `service_pb2` only to be checked. One long-lived channel to Triton's gRPC
port (`triton.grpc_url`, loopback inside the pod).

Refusals carry the same message and reason as over HTTP: the status code is `Reason.grpc_code`, the
reason is in the trailing metadata `x-sidecar-reason`, a quarantine adds `grpc-retry-pushback-ms`.
Every repository, shared-memory, trace and log RPC answers PERMISSION_DENIED.

With listen.grpc_front: rust the data plane's gRPC front answers the unary RPCs here besides
ModelInfer itself, by these same rules and words (dataplane/src/front/grpc/unary.rs; test_grpc
compares both fronts' answers): this server gets only what that front hands over.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
import numpy as np
import structlog
from aiohttp import web
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as pb

from sidecar._dataplane import unknown_health_service
from sidecar.config import SidecarConfig
from sidecar.fronts.appkeys import CONFIG, GRPC_BACK_PORT, READINESS, SERVING, STATES, TLS, WATCH
from sidecar.fronts.grpc_tls import GrpcCredentials, front_client_subject, grpc_client_subject, grpc_interceptors
from sidecar.fronts.http_routes import cohort_of, exposed_extensions, serving_status
from sidecar.messages import cut
from sidecar.protocol.answers import BINARY_DTYPES, AnswerTensor
from sidecar.protocol.triton_errors import StubUnhealthy, triton_error
from sidecar.serving.core import OutputPolicy, Screened, ServingCore
from sidecar.serving.filtering import hide_in_config, hide_in_metadata
from sidecar.serving.refusals import FailureKind, Reason, Refusal, UpstreamFailure
from sidecar.serving.routing import VERSION_HEADER
from sidecar.serving.streaming import EventVerdict, OpenStream
from sidecar.serving.telemetry import GRPC, RequestContext
from sidecar.serving.validation import CheckedRequest, ModelSpec, validate_decoded_request

log = structlog.get_logger("sidecar.proxy")


SERVICE = "inference.GRPCInferenceService"


#: RPCs answered here; every other RPC of the service is Triton's control API and is refused.
SERVED = frozenset({"ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig",
                    "ModelStatistics", "ModelInfer", "ModelStreamInfer"})


CONTROL = tuple(m.name for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
                if m.name not in SERVED)


#: Metadata passed on to Triton; everything else (auth, cookies) stays here.
FORWARDED_METADATA = ("traceparent", "tracestate")


REASON_KEY = "x-sidecar-reason"


#: Typed `contents` field of each datatype (FP16, BF16 can only be sent raw).
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
             "FP64": "fp64_contents"}


_FLOAT_DTYPES = {"FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}


#: Triton's own errors that are the client's to fix: passed on with Triton's code and words.
_CLIENT_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
                           grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.ALREADY_EXISTS,
                           grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED})


Handler = Callable[[bytes, grpc.aio.ServicerContext, RequestContext], Awaitable[bytes]]


def server_options(config: SidecarConfig) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments: the message limit and the HTTP/2 connection bounds
    (listen.grpc_*). gRPC core reads them once, when the server is built: a reload that changes them
    is logged as config_needs_restart (sidecar.health.reload)."""
    listen, ms = config.listen, 1000
    options = [
        ("grpc.max_receive_message_length", config.validation.max_body_bytes),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", listen.grpc_max_concurrent_streams),
        # The HTTP port's bound on client connections, counted separately for this port: past it
        # gRPC core closes a new connection at once.
        ("grpc.max_allowed_incoming_connections", listen.max_connections),
        # Keepalive enforcement: pings closer than this (with or without calls) are strikes; after
        # two, GOAWAY. A client's keepalive pings while it has no call count too (permit is off).
        ("grpc.http2.min_recv_ping_interval_without_data_ms", int(listen.grpc_min_ping_interval_s * ms)),
        ("grpc.http2.min_ping_interval_without_data_ms", int(listen.grpc_min_ping_interval_s * ms)),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.keepalive_permit_without_calls", 0),
    ]
    if listen.grpc_max_connection_idle_s:
        options.append(("grpc.max_connection_idle_ms", int(listen.grpc_max_connection_idle_s * ms)))
    if listen.grpc_max_connection_age_s:
        options.append(("grpc.max_connection_age_ms", int(listen.grpc_max_connection_age_s * ms)))
        # Calls open at GOAWAY may run as long as one proxied request may.
        options.append(("grpc.max_connection_age_grace_ms", int(config.proxy.upstream_timeout_s * ms)))
    return options


def _parameters(params: Any) -> dict[str, Any]:
    out = {}
    for key, value in params.items():
        choice = value.WhichOneof("parameter_choice")
        if choice is not None:
            out[key] = getattr(value, choice)
    return out


def decode_infer_request(request: pb.ModelInferRequest) -> tuple[dict[str, Any], bytes]:
    """The request as the core checks it: the v2 JSON shape, typed contents as `data`, raw (and
    BYTES) contents as binary chunks announced by `binary_data_size`."""
    doc: dict[str, Any] = {"inputs": []}
    if request.id:
        doc["id"] = request.id
    params = _parameters(request.parameters)
    if params:
        doc["parameters"] = params
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise Refusal(Reason.SCHEMA, f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: send "
                                     "every input's data raw, or none", model=request.model_name)
    chunks = []
    for i, tensor in enumerate(request.inputs):
        entry: dict[str, Any] = {"name": tensor.name, "shape": list(tensor.shape), "datatype": tensor.datatype}
        tensor_params = _parameters(tensor.parameters)
        if raw:
            tensor_params["binary_data_size"] = len(raw[i])
            chunks.append(raw[i])
        elif tensor.datatype == "BYTES":
            blob = b"".join(struct.pack("<I", len(b)) + b for b in tensor.contents.bytes_contents)
            tensor_params["binary_data_size"] = len(blob)
            chunks.append(blob)
        elif tensor.datatype in _CONTENTS:
            entry["data"] = list(getattr(tensor.contents, _CONTENTS[tensor.datatype]))
        else:
            raise Refusal(Reason.DATATYPE, f"input {cut(tensor.name)!r}: {cut(tensor.datatype)} tensors can only be "
                                           "sent in raw_input_contents", model=request.model_name, input=tensor.name)
        if tensor_params:
            entry["parameters"] = tensor_params
        doc["inputs"].append(entry)
    if request.outputs:
        doc["outputs"] = [{"name": o.name, **({"parameters": _parameters(o.parameters)} if o.parameters else {})}
                          for o in request.outputs]
    return doc, b"".join(chunks)


@dataclass
class GrpcAnswer:
    """Triton's serialized ModelInferResponse, or the error it answered that is the client's to fix."""

    payload: bytes = b""
    error: tuple[grpc.StatusCode, str] | None = None


def screen_infer_response(answer: GrpcAnswer, policy: OutputPolicy) -> Screened[GrpcAnswer]:
    if answer.error is not None:
        return Screened(answer, success=False)
    if policy.is_hidden is None and not policy.check_non_finite:
        return Screened(answer)
    response = pb.ModelInferResponse.FromString(answer.payload)
    raw = response.raw_output_contents
    dropped, non_finite = [], []
    for i in reversed(range(len(response.outputs))):
        output = response.outputs[i]
        if policy.is_hidden is not None and policy.is_hidden(output.name):
            dropped.append(output.name)
            del response.outputs[i]
            if i < len(raw):
                del raw[i]
        elif policy.check_non_finite and output.datatype in _FLOAT_DTYPES and not _finite(output, raw, i):
            non_finite.append(output.name)
    dropped.reverse()
    non_finite.reverse()
    payload = response.SerializeToString() if dropped else answer.payload
    return Screened(GrpcAnswer(payload), dropped=dropped, non_finite=non_finite)


def decode_infer_outputs(response: pb.ModelInferResponse) -> tuple[str, list[AnswerTensor]]:
    """(model_version, numeric outputs) of a ModelInferResponse, raw or typed contents, for measuring."""
    raw = response.raw_output_contents
    tensors: list[AnswerTensor] = []
    for i, output in enumerate(response.outputs):
        if output.datatype not in BINARY_DTYPES:
            continue
        shape = tuple(output.shape)
        if i < len(raw):
            tensors.append((output.name, output.datatype, shape, raw[i]))
        elif output.datatype in _CONTENTS:
            values = np.asarray(getattr(output.contents, _CONTENTS[output.datatype]), dtype=np.float64)
            tensors.append((output.name, output.datatype, shape, values))
    return response.model_version, tensors


def _finite(output: Any, raw: Any, index: int) -> bool:
    if index < len(raw):
        values = np.frombuffer(raw[index], dtype=_FLOAT_DTYPES[output.datatype])
    else:
        field = "fp64_contents" if output.datatype == "FP64" else "fp32_contents"
        values = np.asarray(getattr(output.contents, field), dtype=np.float64)
    return bool(np.isfinite(values).all())


def upstream_failure(e: grpc.aio.AioRpcError) -> UpstreamFailure:
    code = e.code()
    detail = cut(e.details() or code.name, 300)
    if code is grpc.StatusCode.UNAVAILABLE:
        return UpstreamFailure(FailureKind.UNREACHABLE, detail)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return UpstreamFailure(FailureKind.TIMEOUT, detail)
    if code is grpc.StatusCode.CANCELLED:
        return UpstreamFailure(FailureKind.DROPPED, detail)
    # Triton's verdict on the model's stub, typed where HTTP answers are typed (sidecar.triton).
    return UpstreamFailure(FailureKind.SERVER_ERROR, detail,
                           stub_dead=isinstance(triton_error(500, e.details() or ""), StubUnhealthy))


class GrpcInferExchange:
    """One ModelInfer: validated as decoded, forwarded as the client's bytes."""

    def __init__(self, front: GrpcFront, payload: bytes, request: pb.ModelInferRequest,
                 metadata: tuple[tuple[str, str], ...], timeout_s: float) -> None:
        self.front, self.payload, self.request = front, payload, request
        self.metadata, self.timeout_s = metadata, timeout_s

    def validate(self, spec: ModelSpec) -> CheckedRequest:
        doc, binary = decode_infer_request(self.request)
        return validate_decoded_request(spec, doc, binary)

    async def send(self, version: str) -> GrpcAnswer:
        """To the version the router chose: the client's bytes when it is the one they name, else
        the request re-serialized with that `model_version`."""
        payload = self.payload if version == self.request.model_version else self._for_version(version)
        try:
            payload = await self.front.upstream_infer(payload, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            if e.code() in _CLIENT_CODES:
                return GrpcAnswer(error=(e.code(), e.details() or ""))
            raise upstream_failure(e) from e
        return GrpcAnswer(payload)

    def _for_version(self, version: str) -> bytes:
        request = pb.ModelInferRequest()
        request.CopyFrom(self.request)
        request.model_version = version
        return request.SerializeToString()

    @staticmethod
    def screen(answer: GrpcAnswer, policy: OutputPolicy) -> Screened[GrpcAnswer]:
        """Also used alone (on the class) for the responses that arrive on a stream."""
        return screen_infer_response(answer, policy)

    @staticmethod
    def answer_tensors(answer: GrpcAnswer) -> tuple[str, list[AnswerTensor]] | None:
        if answer.error is not None:
            return None
        return decode_infer_outputs(pb.ModelInferResponse.FromString(answer.payload))

    @staticmethod
    def answer_texts(answer: GrpcAnswer) -> None:
        """Infer answers are tensors (answer_tensors)."""
        return None


class _PassedOn(Exception):
    """Triton's own error for the client, passed on with its code."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class GrpcFront:
    def __init__(self, app: web.Application, *, behind_front: bool = False) -> None:
        """`behind_front`: on loopback behind the data plane's gRPC front (listen.grpc_front: rust),
        which terminates TLS: this server listens in plaintext and takes the client certificate's
        subject from the front's header instead of its own handshake."""
        self.app = app
        self.core: ServingCore = app[SERVING]
        config = app[CONFIG]
        self.config = config
        self.channel = grpc.aio.insecure_channel(config.triton.grpc_url, options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
        self.upstream_infer = self.channel.unary_unary(f"/{SERVICE}/ModelInfer")
        self.upstream_stream = self.channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")
        self._unary = {name: self.channel.unary_unary(f"/{SERVICE}/{name}") for name in
                       ("ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig", "ModelStatistics")}
        tls = app.get(TLS)
        #: The port's TLS when this server terminates it (never behind the front).
        self.tls = None if behind_front else tls
        self.server = grpc.aio.server(interceptors=grpc_interceptors(self.tls) if self.tls else None,
                                      options=server_options(config))
        handlers: dict[str, grpc.RpcMethodHandler] = {
            "ServerLive": self._unary_handler("ServerLive", self._server_live),
            "ServerReady": self._unary_handler("ServerReady", self._server_ready),
            "ModelReady": self._unary_handler("ModelReady", self._model_ready),
            "ServerMetadata": self._unary_handler("ServerMetadata", self._server_metadata),
            "ModelMetadata": self._unary_handler("ModelMetadata", self._model_metadata),
            "ModelConfig": self._unary_handler("ModelConfig", self._model_config),
            "ModelStatistics": self._unary_handler("ModelStatistics", self._model_statistics),
            "ModelInfer": self._unary_handler("ModelInfer", self._model_infer),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(self._model_stream_infer),
        }
        for name in CONTROL:
            handlers[name] = self._unary_handler(name, self._control(name))
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        health_pb2_grpc.add_HealthServicer_to_server(HealthService(app), self.server)
        self.port = 0
        #: The client certificate's subject for the access log (mutual TLS only: it costs a lookup per call).
        self._client_subject = _no_client
        if tls is not None and tls.mutual:
            self._client_subject = front_client_subject if behind_front else grpc_client_subject

    async def start(self, host: str, port: int) -> None:
        if self.tls is not None:  # new connections ask self.tls for the certificate in force
            self.port = self.server.add_secure_port(f"{host}:{port}", GrpcCredentials(self.tls).credentials())
        else:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise OSError(f"cannot listen for gRPC on {host}:{port} (listen.grpc_port)")
        await self.server.start()

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.server.stop(grace_s)
        await self.channel.close()

    # -- the outer part of every unary RPC: identity, telemetry, refusals ------------------------------------

    def _unary_handler(self, name: str, handler: Handler) -> grpc.RpcMethodHandler:
        path = f"/{SERVICE}/{name}"

        async def run(payload: bytes, context: grpc.aio.ServicerContext) -> bytes:
            metadata = dict(context.invocation_metadata() or ())
            scope = self.core.request(GRPC, metadata.get("x-request-id"), metadata.get("traceparent"),
                                      method="grpc", path=path, client=self._client_subject(context),
                                      tracestate=metadata.get("tracestate"))
            passed_on: _PassedOn | None = None
            async with scope:
                try:
                    answer = await handler(payload, context, scope)
                except _PassedOn as e:
                    passed_on = e
                    scope.answered(e.code.name)
                else:
                    scope.answered("OK")
            if scope.refusal is not None:
                await _abort(context, scope, scope.refusal)
            context.set_trailing_metadata((("x-request-id", scope.request_id),))
            if passed_on is not None:
                await context.abort(passed_on.code, passed_on.details)
            return answer

        return grpc.unary_unary_rpc_method_handler(run)

    def _timeout(self, context: grpc.aio.ServicerContext) -> float:
        """The client's deadline, bounded by proxy.upstream_timeout_s."""
        bound = self.core.settings.upstream_timeout_s
        remaining = context.time_remaining()
        return bound if remaining is None else max(0.001, min(bound, remaining))

    def _forwarded(self, context: grpc.aio.ServicerContext, ctx: RequestContext) -> tuple[tuple[str, str], ...]:
        """The request id, and the trace context: the sidecar's span's when the request is traced (so
        Triton's spans are its children), else the client's as it came."""
        if ctx.upstream_trace:
            return (("x-request-id", ctx.request_id), *ctx.upstream_trace)
        metadata = dict(context.invocation_metadata() or ())
        passed = [(key, metadata[key]) for key in FORWARDED_METADATA if key in metadata]
        return (("x-request-id", ctx.request_id), *passed)

    async def _call(self, name: str, payload: bytes, context: grpc.aio.ServicerContext, ctx: RequestContext,
                    model: str = "") -> bytes:
        """A unary call to Triton for a document; failures become the core's refusals."""
        try:
            return await self._unary[name](payload, timeout=min(self._timeout(context), self.config.triton.timeout_s),
                                           metadata=self._forwarded(context, ctx))
        except grpc.aio.AioRpcError as e:
            if e.code() in _CLIENT_CODES:
                raise _PassedOn(e.code(), e.details() or "") from e
            raise self.core.upstream_refusal(model, upstream_failure(e), signal=False) from e

    # -- health and metadata -----------------------------------------------------------------------------------

    async def _server_live(self, payload: bytes, context: grpc.aio.ServicerContext, ctx: RequestContext) -> bytes:
        return pb.ServerLiveResponse(live=self.app[WATCH].live).SerializeToString()

    async def _server_ready(self, payload: bytes, context: grpc.aio.ServicerContext, ctx: RequestContext) -> bytes:
        return pb.ServerReadyResponse(ready=not self.app[READINESS].problems()).SerializeToString()

    async def _model_ready(self, payload: bytes, context: grpc.aio.ServicerContext, ctx: RequestContext) -> bytes:
        request = pb.ModelReadyRequest.FromString(payload)
        self.core.resolve(ctx, request.name, request.version)
        if self.app[READINESS].model_problems(request.name):
            return pb.ModelReadyResponse(ready=False).SerializeToString()
        return await self._call("ModelReady", payload, context, ctx, request.name)

    async def _server_metadata(self, payload: bytes, context: grpc.aio.ServicerContext, ctx: RequestContext
                               ) -> bytes:
        response = pb.ServerMetadataResponse.FromString(await self._call("ServerMetadata", payload, context, ctx))
        kept = exposed_extensions(self.core, list(response.extensions))
        del response.extensions[:]
        response.extensions.extend(kept)
        return response.SerializeToString()

    async def _model_metadata(self, payload: bytes, context: grpc.aio.ServicerContext, ctx: RequestContext
                              ) -> bytes:
        request = pb.ModelMetadataRequest.FromString(payload)
        self.core.resolve(ctx, request.name, request.version)
        answer = await self._call("ModelMetadata", payload, context, ctx, request.name)
        return self._hidden(request.name, answer, pb.ModelMetadataResponse, None, hide_in_metadata)

    async def _model_config(self, payload: bytes, context: grpc.aio.ServicerContext, ctx: RequestContext) -> bytes:
        request = pb.ModelConfigRequest.FromString(payload)
        self.core.resolve(ctx, request.name, request.version)
        answer = await self._call("ModelConfig", payload, context, ctx, request.name)
        return self._hidden(request.name, answer, pb.ModelConfigResponse, "config", hide_in_config)

    def _hidden(self, model: str, answer: bytes, message: Any, part: str | None,
                hide: Callable[[Any, Callable[[str], bool]], tuple[dict[str, Any], list[str]]]) -> bytes:
        """The document without the model's hidden outputs, hidden by the very code HTTP uses."""
        is_hidden = self.core.filter.for_model(model)
        if is_hidden is None:
            return answer
        response = message.FromString(answer)
        target = getattr(response, part) if part else response
        doc, dropped = hide(json_format.MessageToDict(target, preserving_proto_field_name=True), is_hidden)
        if not dropped:
            return answer
        self.core.telemetry.filtered(model, dropped)
        target.Clear()
        json_format.ParseDict(doc, target)
        return response.SerializeToString()

    async def _model_statistics(self, payload: bytes, context: grpc.aio.ServicerContext, ctx: RequestContext
                                ) -> bytes:
        if not self.core.settings.allow_statistics:
            raise Refusal(Reason.FORBIDDEN_ENDPOINT, "statistics are not exposed through the sidecar "
                                                     "(proxy.allow_statistics is off)")
        request = pb.ModelStatisticsRequest.FromString(payload)
        if request.name:
            self.core.resolve(ctx, request.name, request.version)
        return await self._call("ModelStatistics", payload, context, ctx, request.name)

    def _control(self, name: str) -> Handler:
        async def refuse(payload: bytes, context: grpc.aio.ServicerContext, ctx: RequestContext) -> bytes:
            raise Refusal(Reason.FORBIDDEN_ENDPOINT, f"{name} is part of Triton's control API, which stays inside "
                                                     "the pod; only inference, metadata, config, readiness and "
                                                     "health are served here")

        return refuse

    # -- inference -----------------------------------------------------------------------------------------------

    async def _model_infer(self, payload: bytes, context: grpc.aio.ServicerContext, ctx: RequestContext) -> bytes:
        request = _parse_infer(payload)
        model = request.model_name
        self.core.resolve(ctx, model, request.model_version)
        metadata = dict(context.invocation_metadata() or ())
        version = self.core.pinned(model, request.model_version, metadata.get(VERSION_HEADER))
        exchange = GrpcInferExchange(self, payload, request, self._forwarded(context, ctx), self._timeout(context))
        answer = await self.core.infer(model, version, exchange, cohort_of(self.core, model, metadata), ctx=ctx)
        if answer.error is not None:
            raise _PassedOn(*answer.error)
        return answer.payload

    async def _model_stream_infer(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
                                  ) -> AsyncIterator[bytes]:
        """One stream through ServingCore.stream (the rules HTTP generate_stream follows too): every
        request admitted and validated as it comes (its model's breaker slot held while the stream
        is open), every response screened as it passes. A refusal of one request is an in-stream
        error (as Triton sends them) unless the model or Triton cannot be trusted any more: then the
        stream ends with that status (UNAVAILABLE for a quarantine)."""
        core = self.core
        metadata = dict(context.invocation_metadata() or ())
        ctx = core.request(GRPC, metadata.get("x-request-id"), metadata.get("traceparent"), method="grpc",
                           path=f"/{SERVICE}/ModelStreamInfer", client=self._client_subject(context),
                           tracestate=metadata.get("tracestate"))
        async with ctx:
            exchange = GrpcStreamExchange(self, self.upstream_stream(metadata=self._forwarded(context, ctx)))
            async with core.stream(exchange, started=ctx.started) as stream:
                await stream.open()
                forwarding = asyncio.create_task(self._forward_requests(requests, stream, exchange, ctx),
                                                 name="grpc-stream-requests")
                try:
                    async for batch in stream:
                        for payload in batch:
                            yield payload
                finally:
                    forwarding.cancel()
                    for outcome in await asyncio.gather(forwarding, return_exceptions=True):
                        if isinstance(outcome, Exception):
                            log.error("grpc_stream_requests_crashed", cause=repr(outcome), exc_info=outcome)
                if stream.ending is not None:
                    raise stream.ending  # the stream ends with the refusal's code (the scope counts it)
            ctx.answered("OK")
        if ctx.refusal is not None:
            await _abort(context, ctx, ctx.refusal)

    async def _forward_requests(self, requests: AsyncIterator[bytes], stream: OpenStream[bytes],
                                exchange: GrpcStreamExchange, ctx: RequestContext) -> None:
        """The client's requests to Triton, each admitted by the stream first."""
        core = self.core
        try:
            async for payload in requests:
                try:
                    request = _parse_infer(payload)
                    core.resolve(ctx, request.model_name, request.model_version)
                    await stream.join(request.model_name, request.model_version,
                                      lambda spec, r=request: validate_decoded_request(spec, *decode_infer_request(r)))
                except Refusal as e:
                    if e.reason.grpc_code == "UNAVAILABLE":
                        stream.end(e)
                        return
                    if e.before_triton:
                        core.telemetry.rejected(ctx, e.reason.value)
                    stream.emit(_stream_error(e.message, e.reason.value, request_id=""))
                    continue
                await exchange.write(payload, stream)
            await exchange.upstream.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            return  # Triton's side ended: the stream's reader says how


class GrpcStreamExchange:
    """ModelStreamInfer's side of ServingCore.stream: Triton's responses in, screened, out."""

    def __init__(self, front: GrpcFront, upstream: Any) -> None:
        self.front = front
        self.upstream = upstream
        self._states = front.app[STATES]
        settings = front.core.settings
        self._first_s = settings.upstream_timeout_s
        self._idle_s = front.core.config.generation.idle_timeout_s
        #: Requests sent whose final response has not come yet, and whether the oldest of them has
        #: answered once (then the next response is a continuation, bounded by idle_timeout_s).
        self._outstanding = 0
        self._answering = False
        self._parsed: tuple[bytes, Any] | None = None

    async def open(self) -> bool:
        return True  # the call to Triton is open; requests follow as the client sends them

    async def write(self, payload: bytes, stream: OpenStream[bytes]) -> None:
        self._outstanding += 1
        if self._outstanding == 1:
            stream.touch()  # the stream owed nothing: the silence bound counts from this request
        await self.upstream.write(payload)

    async def receive(self) -> Sequence[bytes]:
        try:
            payload = await self.upstream.read()
        except grpc.aio.AioRpcError as e:
            raise upstream_failure(e) from e
        if payload is grpc.aio.EOF:
            return ()
        response = pb.ModelStreamInferResponse.FromString(payload)
        self._parsed = (payload, response)
        if response.error_message or _final(response.infer_response):
            self._outstanding = max(0, self._outstanding - 1)
            self._answering = False
        else:
            self._answering = True
        return (payload,)

    def screen(self, payload: bytes, policy_for: Callable[[str], OutputPolicy]) -> EventVerdict[bytes] | None:
        parsed = self._parsed
        response = parsed[1] if parsed is not None and parsed[0] is payload else (
            pb.ModelStreamInferResponse.FromString(payload))
        if response.error_message:
            # Triton's own in-stream error: passed on, and a passive signal for the stream's model.
            verdict = triton_error(500, response.error_message)
            return EventVerdict(payload, error=f"Triton answered: {response.error_message}",
                                stub_dead=isinstance(verdict, StubUnhealthy))
        model = response.infer_response.model_name
        if model not in self._states:
            return None
        original = response.infer_response.SerializeToString()
        screened = screen_infer_response(GrpcAnswer(original), policy_for(model))
        event = payload
        if screened.answer.payload is not original:
            response.infer_response.ParseFromString(screened.answer.payload)
            event = response.SerializeToString()
        return EventVerdict(event, model, dropped=screened.dropped, non_finite=screened.non_finite,
                            request_id=response.infer_response.id)

    @staticmethod
    def in_stream(refusal: Refusal, verdict: EventVerdict[bytes] | None) -> bytes:
        """A gRPC stream goes on after one bad response: Triton's error passed on as it came, the
        sidecar's own (NaN/Inf withheld, a response that is not v2) in Triton's in-stream form."""
        if verdict is not None and verdict.error:
            return verdict.event
        return _stream_error(refusal.message, refusal.reason.value,
                             request_id=verdict.request_id if verdict is not None else "")

    def silence_bound(self, events: int) -> float | None:
        """Nothing owed: no bound (the client paces a bidirectional stream). A request waiting for its
        first response: upstream_timeout_s; one in the middle of its responses: idle_timeout_s."""
        if not self._outstanding:
            return None
        return self._idle_s if self._answering else self._first_s

    def close(self) -> None:
        self.upstream.cancel()  # a client that leaves cancels Triton's side too


def _final(response: Any) -> bool:
    """Triton marks the last response of a request (decoupled models send several)."""
    flag = response.parameters.get("triton_final_response")
    return flag is None or flag.bool_param


def _no_client(context: grpc.aio.ServicerContext) -> str:
    return ""


def _parse_infer(payload: bytes) -> pb.ModelInferRequest:
    try:
        return pb.ModelInferRequest.FromString(payload)
    except Exception as e:
        raise Refusal(Reason.MALFORMED, f"not a ModelInferRequest: {cut(str(e))}") from e


def _stream_error(message: str, reason: str, *, request_id: str) -> bytes:
    response = pb.ModelStreamInferResponse(error_message=f"[{reason}] {message}")
    if request_id:
        response.infer_response.id = request_id
    return response.SerializeToString()


async def _abort(context: grpc.aio.ServicerContext, ctx: RequestContext, refusal: Refusal) -> None:
    trailing = [("x-request-id", ctx.request_id), (REASON_KEY, refusal.reason.value)]
    if refusal.retry_after is not None:
        trailing.append(("grpc-retry-pushback-ms", str(refusal.retry_after * 1000)))
    context.set_trailing_metadata(tuple(trailing))
    await context.abort(getattr(grpc.StatusCode, refusal.reason.grpc_code), refusal.message)


class HealthService(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 for kubelet gRPC probes and grpc-health-probe: service "" is the pod's
    readiness, a model's name that model (SERVING only while its golden requests pass). With
    listen.grpc_front: rust the data plane's gRPC front answers these calls itself from the statuses
    sidecar.fronts.http_front publishes by the same rule (http_routes.serving_status), with the same
    message for an unknown name (the module's); this class serves the grpcio front, and the calls the
    Rust front hands over before the first publish or while the control plane is stalled."""

    #: How often (s) Watch looks for a change of status.
    WATCH_PERIOD_S = 0.5

    def __init__(self, app: web.Application) -> None:
        self.app = app

    def _status(self, service: str) -> int | None:
        ready = serving_status(self.app, service)
        if ready is None:
            return None
        return health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        status = self._status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, unknown_health_service(request.service))
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        last = None
        while True:
            status = self._status(request.service)
            if status is None:
                status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            await asyncio.sleep(self.WATCH_PERIOD_S)


async def grpc_front(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: the gRPC server runs as long as the app (listen.grpc_port 0 = none)."""
    config = app[CONFIG]
    if not config.listen.grpc_port:
        yield
        return
    behind_front = config.listen.grpc_front == "rust"
    front = GrpcFront(app, behind_front=behind_front)
    if behind_front:
        # Behind the data plane's gRPC front (sidecar/fronts/http_front.py), which owns
        # listen.grpc_port and hands this server every call it does not serve itself.
        await front.start("127.0.0.1", 0)
        app[GRPC_BACK_PORT] = front.port
        log.info("grpc_behind_front", back=f"127.0.0.1:{front.port}", triton=config.triton.grpc_url)
    else:
        await front.start(config.listen.host, config.listen.grpc_port)
        log.info("grpc_listening", listen=f"{config.listen.host}:{front.port}", triton=config.triton.grpc_url)
    try:
        yield
    finally:
        await front.stop(grace_s=1.0)


"""The gRPC port's TLS: credentials built from the material sidecar.fronts.tls loads and watches, and
the per-call check of the client certificate's SANs.

`grpc.dynamic_ssl_server_credentials`, whose fetcher gRPC core calls before every new connection's
handshake, hands out the material of the newest reload; SANs are checked per call by
`AllowedSansInterceptor`, because gRPC's server credentials have no hook to refuse a verified client
certificate during the handshake. None of it runs with `listen.grpc_front: rust`: the data plane
terminates TLS on the port itself (dataplane/src/front/grpc/, rustls, SANs refused at the handshake),
the server here listens in plaintext on loopback behind it and reads the client's subject from the
header the front sets (`front_client_subject`). A module of its own so that grpc is imported only
with a gRPC port (sidecar.fronts.grpc_server imports it; about 12 MB of resident memory an HTTP-only
sidecar does not carry: bench/RESULTS.md §4c).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import grpc
import grpc.aio
import structlog

from sidecar.fronts.tls import ServerTls, TlsMaterial

log = structlog.get_logger("sidecar.tls")


def _certificate_configuration(material: TlsMaterial) -> Any:
    return grpc.ssl_server_certificate_configuration([(material.key_pem, material.cert_pem)],
                                                     root_certificates=material.ca_pem)


class GrpcCredentials:
    """The gRPC port's server credentials over `tls`: each new connection gets the newest material."""

    def __init__(self, tls: ServerTls) -> None:
        self._tls = tls
        self._generation = tls.generation

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(_certificate_configuration(self._tls.material), self._fetch,
                                                   require_client_authentication=self._tls.mutual)

    def _fetch(self) -> Any:
        """Called by gRPC core before every new connection's handshake: the new set after a reload,
        else None (keep the one in use)."""
        generation = self._tls.generation
        if generation == self._generation:
            return None
        self._generation = generation
        return _certificate_configuration(self._tls.material)


def grpc_interceptors(tls: ServerTls) -> list[grpc.aio.ServerInterceptor]:
    return [AllowedSansInterceptor(tls)] if tls.allowed_sans else []


class AllowedSansInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call whose client certificate carries none of `tls.client_allowed_sans` with
    UNAUTHENTICATED before any handler runs (the handshake itself cannot be refused from Python)."""

    def __init__(self, tls: ServerTls) -> None:
        self._tls = tls

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _guarded(handler, self._tls)


def grpc_client_sans(context: grpc.aio.ServicerContext) -> set[str]:
    auth = context.auth_context()
    return {v.decode() for v in auth.get("x509_subject_alternative_name", ())}


def grpc_client_subject(context: grpc.aio.ServicerContext) -> str:
    """The client certificate's subject on a mutual-TLS gRPC call, or ""."""
    values = context.auth_context().get("x509_subject", ())
    return values[0].decode(errors="replace") if values else ""


#: Set by the data plane's gRPC front on every call it passes through (listen.grpc_front: rust): the
#: verified client certificate's RFC 4514 subject, percent-encoded as grpc-message is. The front
#: removes any the client sent, so behind it the header is the handshake's word, never the client's.
CLIENT_SUBJECT_HEADER = "x-sidecar-client-subject"


def front_client_subject(context: grpc.aio.ServicerContext) -> str:
    """The client certificate's subject of a call the data plane's gRPC front passed through, or ""."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_SUBJECT_HEADER:
            return unquote(value) if isinstance(value, str) else ""
    return ""


async def _refuse_grpc(tls: ServerTls, context: grpc.aio.ServicerContext) -> None:
    if grpc_client_sans(context) & tls.allowed_sans:
        return
    tls.handshake_failed("client_san_not_allowed")
    log.warning("tls_client_refused", reason="client_san_not_allowed", protocol="grpc",
                client_subject=grpc_client_subject(context), peer=context.peer())
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "the client certificate carries none of the SANs this server allows (tls.client_allowed_sans)")


def _guarded(handler: grpc.RpcMethodHandler, tls: ServerTls) -> grpc.RpcMethodHandler:
    options = {"request_deserializer": handler.request_deserializer,
               "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await _refuse_grpc(tls, context)
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **options)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await _refuse_grpc(tls, context)
            async for item in inner_us(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, **options)
    if handler.stream_stream is not None:
        inner_ss = handler.stream_stream

        async def stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await _refuse_grpc(tls, context)
            async for item in inner_ss(requests, context):
                yield item

        return grpc.stream_stream_rpc_method_handler(stream_stream, **options)
    inner_su = handler.stream_unary

    async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse_grpc(tls, context)
        return await inner_su(requests, context)

    return grpc.stream_unary_rpc_method_handler(stream_unary, **options)

"""TLS and mutual TLS on the sidecar's ports, with certificates rotated without a restart.

`ServerTls` owns the certificate, key and client CA named in `tls.*`: it reads and checks them once at
start-up (a bad file stops the start with one line naming it: `TlsFileError`, exit 2), then watches
them the way golden files are watched (`sidecar.health.reload.file_key`: stat() follows symlinks, so
the kubelet's `..data` symlink swap of a Secret volume is a new file). A complete new set builds a new
`ssl.SSLContext` and a new gRPC certificate configuration, used by every connection accepted after the
swap; connections already open keep the context they were made with. A set that does not load is
refused (`tls_reload_refused` naming the file, `reload_failures{what="tls"}`) and the old one stays.

Why not the reloader of config and golden files (`LiveConfig.run`): it polls every second and applies
changes through the app's config plumbing; a certificate needs neither, only the same file identity,
so that is what is shared. The watch here polls twice a second so a swap is served within ~0.5 s
(plus the kubelet's own sync delay), well inside the 2 s the manifests promise.

The HTTP port: each accepted connection first completes its TLS handshake here (`loop.start_tls` with
the context in force), so a failed handshake is counted by reason
(`tls_handshake_failures_total{reason}`) instead of vanishing into asyncio's debug log, and a client
certificate without an allowed SAN is refused before the connection reaches any HTTP code. Only then
is the connection handed to the listener's protocol, which never knows the bytes were encrypted.

The gRPC port builds its credentials from the same material (sidecar.fronts.grpc_tls, imported only
with a gRPC port: grpc is about 12 MB of resident memory an HTTP-only sidecar never needs).

With `listen.front: rust` the data plane terminates TLS on the HTTP port (dataplane/src/front/tls.rs,
rustls): it reads no file itself, so the PEM bytes checked here are handed to it at start and again
at every rotation (`add_reload_listener`); it counts its failed handshakes under the same reasons.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from sidecar.config import ConfigError, TlsSection
from sidecar.health.reload import FileKey, file_key
from sidecar.metrics import SidecarMetrics

if TYPE_CHECKING:
    from cryptography import x509

log = structlog.get_logger("sidecar.tls")


#: How often (s) the certificate files are compared with what was loaded: a few stat() calls.
TLS_POLL_S = 0.5


#: Bound (s) on one TLS handshake: a client that opens a socket and sends nothing must not hold a
#: connection forever (nginx's ssl_handshake_timeout and asyncio's default are both 60 s; loopback
#: and in-cluster handshakes take milliseconds).
HANDSHAKE_TIMEOUT_S = 10.0


#: The bounded `reason` label of tls_handshake_failures_total.
HANDSHAKE_REASONS = ("not_tls", "protocol_version", "no_client_certificate", "client_certificate_rejected",
                     "client_san_not_allowed", "timeout", "client_closed", "other")


_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


class TlsFileError(ConfigError):
    """A certificate, key or CA file that cannot be used; the message names the key and the file."""


@dataclass(frozen=True)
class TlsMaterial:
    """One complete, checked set of files, and what each listener builds from it."""

    context: ssl.SSLContext
    #: The PEM bytes the context was built from, for the gRPC port's credentials (sidecar.fronts.grpc_tls).
    key_pem: bytes
    cert_pem: bytes
    ca_pem: bytes | None
    #: notAfter of the served (leaf) certificate, as a Unix time.
    not_after: float
    serial: int
    subject: str


def _read(key: str, path: str, named: str | None = None) -> bytes:
    """The bytes of `path` (a resolved name); errors name the file as configured (`named`)."""
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise TlsFileError(f"tls.{key} {named or path}: cannot read: {e.strerror}") from e


def _certificates(key: str, path: str, pem: bytes) -> list[x509.Certificate]:
    from cryptography import x509

    try:
        certificates = x509.load_pem_x509_certificates(pem)
    except ValueError as e:
        raise TlsFileError(f"tls.{key} {path}: not a PEM certificate: {e}") from e
    return certificates


def load_material(section: TlsSection, *, now: Callable[[], float] = time.time) -> TlsMaterial:
    """Read and check the files of `section` and build both listeners' credentials from them."""
    # Resolve the symlinks once: the kubelet may swap `..data` while we read, and every read below
    # (ours and OpenSSL's) must see the same generation of the Secret. (The kubelet removes the old
    # generation after the swap: a read of a resolved path that is gone fails and is read again.)
    cert_path = os.path.realpath(section.cert_file)
    key_path = os.path.realpath(section.key_file)
    # cryptography is imported here, not at the top: about 9 MB of RSS that a sidecar without TLS
    # (the default) never needs (issue 18: an idle sidecar stays under 80 MB).
    from cryptography.hazmat.primitives import serialization

    cert_pem, key_pem = _read("cert_file", cert_path, section.cert_file), _read("key_file", key_path, section.key_file)
    chain = _certificates("cert_file", section.cert_file, cert_pem)
    leaf = chain[0]
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as e:
        raise TlsFileError(f"tls.key_file {section.key_file}: not an unencrypted PEM private key: "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    if key.public_key() != leaf.public_key():
        raise TlsFileError(f"tls.key_file {section.key_file}: is not the key of the certificate in "
                           f"tls.cert_file {section.cert_file} (a renewal half done?)")
    not_after = leaf.not_valid_after_utc.timestamp()
    if not_after <= now():
        raise TlsFileError(f"tls.cert_file {section.cert_file}: the certificate expired at "
                           f"{leaf.not_valid_after_utc.isoformat()} (serial {leaf.serial_number:x})")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _VERSIONS[section.min_version]
    try:
        context.load_cert_chain(cert_path, key_path)
    except (ssl.SSLError, OSError) as e:
        raise TlsFileError(f"tls.cert_file {section.cert_file}: OpenSSL refused it with tls.key_file: {e}") from e
    ca_pem = None
    if section.client_ca_file:
        ca_pem = _read("client_ca_file", os.path.realpath(section.client_ca_file), section.client_ca_file)
        _certificates("client_ca_file", section.client_ca_file, ca_pem)
        try:
            context.load_verify_locations(cadata=ca_pem.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError) as e:
            raise TlsFileError(f"tls.client_ca_file {section.client_ca_file}: not a CA bundle: {e}") from e
        context.verify_mode = ssl.CERT_REQUIRED
    # HTTP/1.1 only: the listener speaks no HTTP/2 (gRPC has its own port).
    context.set_alpn_protocols(["http/1.1"])
    return TlsMaterial(context, key_pem, cert_pem, ca_pem, not_after, leaf.serial_number, leaf.subject.rfc4514_string())


#: ssl's long attribute names as RFC 4514 writes them (and as gRPC core reports a client's subject).
_SHORT_NAMES = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU", "countryName": "C",
                "stateOrProvinceName": "ST", "localityName": "L", "domainComponent": "DC", "userId": "UID"}


def subject_of(peercert: dict[str, Any] | None) -> str:
    """The RFC 4514 subject of ssl's getpeercert() dict ("CN=client,O=bank"), or ""."""
    if not peercert:
        return ""
    return ",".join(f"{_SHORT_NAMES.get(name, name)}={value}"
                    for rdn in reversed(peercert.get("subject", ())) for name, value in rdn)


def _sans_of(peercert: dict[str, Any] | None) -> set[str]:
    return {value for kind, value in (peercert or {}).get("subjectAltName", ()) if kind in ("DNS", "URI")}


def handshake_reason(error: BaseException) -> str:
    """The bounded label for a failed handshake (OpenSSL's reason codes, asyncio's timeouts)."""
    # asyncio aborts a handshake that outlasts ssl_handshake_timeout with this error and message.
    if isinstance(error, TimeoutError) or (isinstance(error, ConnectionAbortedError)
                                           and "taking longer than" in str(error)):
        return "timeout"
    if isinstance(error, (ConnectionError, EOFError, ssl.SSLEOFError)):
        return "client_closed"
    if isinstance(error, ssl.SSLError):
        reason = error.reason or ""
        if reason in ("HTTP_REQUEST", "WRONG_VERSION_NUMBER", "HTTPS_PROXY_REQUEST", "UNEXPECTED_RECORD",
                      "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"):
            return "not_tls"
        if reason in ("UNSUPPORTED_PROTOCOL", "TLSV1_ALERT_PROTOCOL_VERSION", "NO_PROTOCOLS_AVAILABLE"):
            return "protocol_version"
        if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
            return "no_client_certificate"
        if reason in ("CERTIFICATE_VERIFY_FAILED", "TLSV1_ALERT_UNKNOWN_CA"):
            return "client_certificate_rejected"
        return "other"
    return "other"


class ServerTls:
    """The TLS material in force for both listeners, its watch, and its metrics."""

    def __init__(self, section: TlsSection, *, metrics: SidecarMetrics, clock: Callable[[], float] = time.time) -> None:
        self.section = section
        self._metrics = metrics
        self._clock = clock
        self._seen = self._file_keys()
        self.material = load_material(section, now=clock)
        #: Bumped on every successful reload; the gRPC fetcher compares it with what it last handed out.
        self.generation = 0
        self.allowed_sans = frozenset(section.client_allowed_sans)
        self.mutual = bool(section.client_ca_file)
        #: Told of every new set before it is in force (the Rust front's rustls configuration): one
        #: that raises TlsFileError refuses the set, as a file that does not load does.
        self._reload_listeners: list[Callable[[TlsMaterial], None]] = []
        metrics.reload_failures.labels(what="tls")
        for reason in HANDSHAKE_REASONS:  # the series, at zero (counted by the data plane's atomics)
            metrics.requests.tls_handshake_failed(reason, 0)
        self._served(self.material)

    @property
    def context(self) -> ssl.SSLContext:
        return self.material.context

    def add_reload_listener(self, listener: Callable[[TlsMaterial], None]) -> None:
        """`listener(material)` is called with each new set before it is put in force."""
        self._reload_listeners.append(listener)

    def _files(self) -> list[str]:
        return [f for f in (self.section.cert_file, self.section.key_file, self.section.client_ca_file) if f]

    def _file_keys(self) -> tuple[FileKey, ...]:
        return tuple(file_key(Path(f)) for f in self._files())

    def _served(self, material: TlsMaterial) -> None:
        self._metrics.tls_cert_expiry.labels(cert_file=self.section.cert_file).set(material.not_after)
        log.info("tls_certificate_loaded", serial=f"{material.serial:x}", subject=material.subject,
                 not_after=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(material.not_after)),
                 cert_file=self.section.cert_file, mutual_tls=bool(self.section.client_ca_file))

    def reload_if_changed(self) -> bool:
        """Load the files again if any changed on disk; True when a new set is in force."""
        keys = self._file_keys()
        if keys == self._seen:
            return False
        # Recorded before reading: a file that changes again while being read is read again next pass.
        self._seen = keys
        try:
            material = load_material(self.section, now=self._clock)
            for listener in self._reload_listeners:
                listener(material)
        except TlsFileError as e:
            self._metrics.reload_failures.labels(what="tls").inc()
            log.error("tls_reload_refused", cause=str(e), serial=f"{self.material.serial:x}",
                      action="the certificate in force is kept; fix the files (a complete set) to reload")
            return False
        self.material = material
        self.generation += 1
        self._served(material)
        return True

    async def watching(self, app: web.Application) -> AsyncIterator[None]:
        """cleanup_ctx: the files are watched as long as the app runs."""
        task = asyncio.create_task(self.watch(), name="tls-watch")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def watch(self, poll_s: float = TLS_POLL_S) -> None:
        """Compare the files every `poll_s` until cancelled; never ends on an error."""
        while True:
            await asyncio.sleep(poll_s)
            try:
                self.reload_if_changed()
            except Exception as e:  # a bug here must not stop the rotation of later renewals
                log.error("tls_watch_error", cause=repr(e))

    # -- HTTP ---------------------------------------------------------------------------------------------

    def handshake_failed(self, reason: str) -> None:
        self._metrics.requests.tls_handshake_failed(reason)

    def client_refusal(self, peercert: dict[str, Any] | None) -> str:
        """Why a verified client certificate may not talk to us ("" when it may)."""
        if self.allowed_sans and not (_sans_of(peercert) & self.allowed_sans):
            return "client_san_not_allowed"
        return ""

    def protocol_factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """For `loop.create_server`: each connection does its handshake, then `make()` serves it."""
        return lambda: _TlsHandshake(self, make)


class _TlsHandshake(asyncio.Protocol):
    """A connection until its TLS handshake is done: then the real protocol takes the TLS transport."""

    def __init__(self, tls: ServerTls, make: Callable[[], asyncio.Protocol]) -> None:
        self._tls = tls
        self._make = make
        #: Decrypted bytes received between the end of the handshake and the hand-over: at most one
        #: read's worth, since the hand-over happens in the next loop iteration.
        self._early: list[bytes] = []
        self._eof = False
        self._lost = False
        self._task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # No byte may reach this protocol before start_tls takes the transport: the ClientHello is
        # for the TLS layer. start_tls resumes reading itself once its own protocol is in place.
        transport.pause_reading()  # type: ignore[attr-defined]
        self._task = asyncio.get_running_loop().create_task(self._handshake(transport))  # type: ignore[arg-type]

    async def _handshake(self, transport: asyncio.Transport) -> None:
        loop = asyncio.get_running_loop()
        try:
            secure = await loop.start_tls(transport, self, self._tls.context, server_side=True,
                                          ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
        except asyncio.CancelledError:
            transport.abort()
            raise
        except Exception as e:
            self._tls.handshake_failed(handshake_reason(e))
            transport.abort()
            return
        if secure is None or self._lost:
            self._tls.handshake_failed("client_closed")
            return
        refusal = self._tls.client_refusal(secure.get_extra_info("peercert"))
        if refusal:
            self._tls.handshake_failed(refusal)
            log.warning("tls_client_refused", reason=refusal,
                        client_subject=subject_of(secure.get_extra_info("peercert")),
                        peer=str(secure.get_extra_info("peername")))
            secure.abort()
            return
        protocol = self._make()
        secure.set_protocol(protocol)
        protocol.connection_made(secure)
        for data in self._early:
            protocol.data_received(data)
        self._early.clear()
        if self._eof and not protocol.eof_received():
            secure.close()

    def data_received(self, data: bytes) -> None:
        self._early.append(data)

    def eof_received(self) -> bool | None:
        self._eof = True
        return True  # keep the transport open: the real protocol decides when it sees the EOF

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True

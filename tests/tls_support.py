"""Throwaway certificates for the TLS tests (a CA, server and client certificates made in the test),
a Secret volume laid out as the kubelet lays it out (files behind a `..data` symlink, swapped whole),
and small TLS clients that report which certificate a new connection was served."""

from __future__ import annotations

import asyncio
import os
import ssl
from pathlib import Path

from cryptography import x509

from sidecar.devtools.certificates import Issued, issue, make_ca, server_cert

__all__ = [
    "HttpsConnection",
    "Issued",
    "SecretVolume",
    "client_context",
    "issue",
    "make_ca",
    "served_serial",
    "server_cert",
]


class SecretVolume:
    """A Kubernetes Secret volume: <dir>/tls.crt -> ..data/tls.crt, ..data -> ..<generation>/, and an
    update writes a new generation folder and renames a new `..data` link over the old one (atomic),
    exactly as the kubelet's AtomicWriter does; then the old folder is removed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._generation = 0

    @property
    def cert_file(self) -> Path:
        return self.root / "tls.crt"

    @property
    def key_file(self) -> Path:
        return self.root / "tls.key"

    @property
    def ca_file(self) -> Path:
        return self.root / "ca.crt"

    def write(self, cert_pem: bytes, key_pem: bytes, ca_pem: bytes) -> None:
        self._generation += 1
        folder = self.root / f"..2026_12_03_{self._generation:04d}"
        folder.mkdir()
        (folder / "tls.crt").write_bytes(cert_pem)
        (folder / "tls.key").write_bytes(key_pem)
        (folder / "ca.crt").write_bytes(ca_pem)
        data = self.root / "..data"
        old = os.readlink(data) if data.is_symlink() else None
        tmp = self.root / "..data_tmp"
        os.symlink(folder.name, tmp)
        os.rename(tmp, data)
        for name in ("tls.crt", "tls.key", "ca.crt"):
            link = self.root / name
            if not link.is_symlink():
                os.symlink(f"..data/{name}", link)
        if old is not None:
            for child in (self.root / old).iterdir():
                child.unlink()
            (self.root / old).rmdir()

    def install(self, server: Issued, ca: Issued) -> None:
        self.write(server.cert_pem, server.key_pem, ca.cert_pem)


def client_context(ca: Issued | None, client: Issued | None = None, folder: Path | None = None,
                   alpn: tuple[str, ...] = ("http/1.1",)) -> ssl.SSLContext:
    """A client context that trusts `ca` (None: trusts nothing, verifies nothing) and presents `client`."""
    context = ssl.create_default_context()
    if ca is None:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context.load_verify_locations(cadata=ca.cert_pem.decode())
    if client is not None:
        assert folder is not None
        cert, key = client.write(folder, f"client-{client.cert.serial_number:x}")
        context.load_cert_chain(cert, key)
    context.set_alpn_protocols(list(alpn))
    return context


async def served_serial(port: int, ca: Issued, *, alpn: tuple[str, ...] = ("http/1.1",)) -> int:
    """The serial of the certificate a new TLS connection to 127.0.0.1:port is served."""
    _, writer = await asyncio.wait_for(asyncio.open_connection(
        "127.0.0.1", port, ssl=client_context(ca, alpn=alpn), server_hostname="localhost"), 10)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der).serial_number
    finally:
        writer.close()


class HttpsConnection:
    """One long-lived keep-alive HTTPS connection, for requests one after the other."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int, context: ssl.SSLContext) -> HttpsConnection:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname="localhost"), 10)
        return cls(reader, writer)

    @property
    def serial(self) -> int:
        der = self.writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der).serial_number

    async def request(self, method: str, path: str, body: bytes = b"",
                      content_type: str = "application/json", *, chunked: bool = False) -> tuple[int, bytes]:
        """One request (its body in two chunks when `chunked`) and its answer's status and body."""
        framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
        head = (f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {content_type}\r\n"
                f"{framing}\r\n\r\n").encode()
        if chunked:
            half = len(body) // 2
            body = b"".join(f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in (body[:half], body[half:]))
            body += b"0\r\n\r\n"
        self.writer.write(head + body)
        await self.writer.drain()
        status_line = await asyncio.wait_for(self.reader.readline(), 30)
        if not status_line:
            raise ConnectionError("the server closed the connection")
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        return int(status_line.split()[1]), await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()

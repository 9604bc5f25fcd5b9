"""Throwaway certificates for the TLS tests (a CA, server and client certificates made in the test),
a Secret volume laid out as the kubelet lays it out (files behind a `..data` symlink, swapped whole),
and small TLS clients that report which certificate a new connection was served."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Issued:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())

    def write(self, folder: Path, name: str) -> tuple[Path, Path]:
        folder.mkdir(parents=True, exist_ok=True)
        cert, key = folder / f"{name}.crt", folder / f"{name}.key"
        cert.write_bytes(self.cert_pem)
        key.write_bytes(self.key_pem)
        return cert, key


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "triton-sidecar tests"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(cn: str = "test CA") -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return Issued(cert, key)


def issue(ca: Issued, cn: str, *, dns: tuple[str, ...] = (), uris: tuple[str, ...] = (), ips: tuple[str, ...] = (),
          client: bool = False, days: float = 30, not_before_days: float = -1) -> Issued:
    """A leaf certificate signed by `ca`: a server one (serverAuth) or a client one (clientAuth)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.UniformResourceIdentifier(u) for u in uris]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now + datetime.timedelta(days=not_before_days))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH if client
                                                     else ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return Issued(builder.sign(ca.key, hashes.SHA256()), key)


def server_cert(ca: Issued, days: float = 30) -> Issued:
    return issue(ca, "sidecar", dns=("localhost",), ips=("127.0.0.1",), days=days)


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
                      content_type: str = "application/json") -> tuple[int, bytes]:
        head = (f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
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

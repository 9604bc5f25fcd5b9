"""Throwaway certificates for tests, benchmarks and demos: a private CA, server and client certificates.

Never for production: keys are generated in memory and written unencrypted where the caller says.
"""

from __future__ import annotations

import datetime
import ipaddress
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

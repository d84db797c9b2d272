"""Test certificates made at test time with `cryptography` (no private key is ever committed):
a CA, a server certificate for 127.0.0.1/localhost and a client certificate, as PEM files."""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from types import SimpleNamespace

import pytest


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, key, issuer_name, issuer_key, ca: bool, sans=None):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def make_certs(folder: Path) -> SimpleNamespace:
    """PEM paths: ca, server_cert, server_key, client_cert, client_key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    def write(name: str, data: bytes) -> str:
        path = folder / name
        path.write_bytes(data)
        return str(path)

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    pem = serialization.Encoding.PEM
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("pagoda test CA", ca_key, _name("pagoda test CA"), ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _issue("localhost", server_key, ca.subject, ca_key, ca=False,
                    sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _issue("pagoda test client", client_key, ca.subject, ca_key, ca=False)
    return SimpleNamespace(ca=write("ca.pem", ca.public_bytes(pem)),
                           server_cert=write("server.pem", server.public_bytes(pem)),
                           server_key=write("server.key", key_pem(server_key)),
                           client_cert=write("client.pem", client.public_bytes(pem)),
                           client_key=write("client.key", key_pem(client_key)))


@pytest.fixture(scope="session")
def test_certs(tmp_path_factory) -> SimpleNamespace:
    return make_certs(tmp_path_factory.mktemp("certs"))

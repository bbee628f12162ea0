"""Certificates made for a test (the `cryptography` package): a CA, a server certificate for
localhost / 127.0.0.1, a client certificate the CA signed, and a client certificate of
another CA, each as PEM files in one folder."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class PKI:
    ca: Path  # the CA's certificate
    server_cert: Path
    server_key: Path
    client_cert: Path  # signed by `ca`
    client_key: Path
    stranger_cert: Path  # a client certificate of another CA
    stranger_key: Path
    other_key: Path  # a key of no certificate here
    encrypted_key: Path  # the server's key with a passphrase

    def read(self, name: str) -> bytes:
        return getattr(self, name).read_bytes()


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def _leaf(cn: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
          server: bool) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    import ipaddress

    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.ExtendedKeyUsage(
             [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
             critical=False))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return b.sign(ca_key, hashes.SHA256()), key


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey, password: bytes | None = None) -> Path:
    enc = (serialization.BestAvailableEncryption(password) if password
           else serialization.NoEncryption())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8, enc))
    return path


def make_pki(folder: Path) -> PKI:
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _ca("kvserve test CA")
    server, server_key = _leaf("localhost", ca, ca_key, server=True)
    client, client_key = _leaf("kvserve test client", ca, ca_key, server=False)
    other_ca, other_ca_key = _ca("another CA")
    stranger, stranger_key = _leaf("stranger", other_ca, other_ca_key, server=False)
    return PKI(
        ca=_write_cert(folder / "ca.pem", ca),
        server_cert=_write_cert(folder / "server.pem", server),
        server_key=_write_key(folder / "server.key", server_key),
        client_cert=_write_cert(folder / "client.pem", client),
        client_key=_write_key(folder / "client.key", client_key),
        stranger_cert=_write_cert(folder / "stranger.pem", stranger),
        stranger_key=_write_key(folder / "stranger.key", stranger_key),
        other_key=_write_key(folder / "other.key", _key()),
        encrypted_key=_write_key(folder / "encrypted.key", server_key, b"secret"),
    )

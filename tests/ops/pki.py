"""A throwaway certificate authority for tests: a CA and a server certificate for 127.0.0.1 it signed,
written as PEM files (the `cryptography` package, a test dependency)."""
import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True, slots=True)
class Pki:
    ca: Path                 # the CA's certificate: what clients trust
    cert: Path               # the server's certificate, for 127.0.0.1 and localhost
    key: Path                # the server's key


def name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def certificate(subject: str, key, issuer: str, signer, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer)).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False, decipher_only=False),
                            critical=True)
    else:
        b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                         x509.DNSName("localhost")]), critical=False)
    return b.sign(signer, hashes.SHA256())


def pem(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def make_pki(directory: Path, label: str = "tokenbus test") -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = certificate(f"{label} CA", ca_key, f"{label} CA", ca_key, ca=True)
    cert = certificate("127.0.0.1", key, f"{label} CA", ca_key, ca=False)
    return Pki(pem(directory / "ca.pem", ca.public_bytes(serialization.Encoding.PEM)),
               pem(directory / "server.pem", cert.public_bytes(serialization.Encoding.PEM)),
               pem(directory / "server-key.pem", key.private_bytes(serialization.Encoding.PEM,
                                                                  serialization.PrivateFormat.PKCS8,
                                                                  serialization.NoEncryption())))

"""`rlmesh tls-init`: a throw-away certificate authority and one certificate per tier, for mutual TLS
on a local or lab mesh. Each certificate's common name is its tier (learner, rollout, reward) and
it carries the tier as a DNS name, plus localhost and the loopback addresses, so clients can check
a server against the tier they dial. The CA's key is never written: nobody can issue more
certificates from it, and a new run makes a new CA."""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rlmesh.services.auth import TIERS


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "rlmesh"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_certificates(output: str | Path, *, tiers: tuple[str, ...] = TIERS, days: int = 30,
                      extra_names: tuple[str, ...] = ()) -> dict[str, Path]:
    """Write ca.crt and <tier>.crt / <tier>.key (keys mode 0600) into `output`; returns the paths."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("rlmesh-ca")).issuer_name(_name("rlmesh-ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    paths = {"ca": out / "ca.crt"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for tier in tiers:
        key = ec.generate_private_key(ec.SECP256R1())
        names = [x509.DNSName(n) for n in dict.fromkeys((tier, "localhost", *extra_names))]
        names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "::1")]
        cert = (x509.CertificateBuilder().subject_name(_name(tier)).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        paths[tier] = out / f"{tier}.crt"
        paths[tier].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(out / f"{tier}.key", key)
    return paths

"""Cluster credentials: mutual TLS under a CA of the cluster's own, on the data plane and the
nodes' admin ports.

A cluster's credentials are three PEM files in one directory, named as in a Kubernetes TLS
Secret (the operator mounts one there): ``ca.crt`` (the cluster's CA), ``tls.crt`` and
``tls.key`` (a certificate the CA signed, and its key).  Nodes and clients hold the same set:
a node accepts a connection only from a peer whose certificate the cluster CA signed, and a
client talks only to a node whose certificate it signed -- so a peer without the credentials
can neither read nor write, and nothing crosses the wire in plain text.  Names are not checked
(pods come and go under addresses nobody knows in advance): holding a certificate of the
cluster's CA is what makes a peer a member.  The certificate still names ``CERT_NAME`` and
loopback, for tools that insist on checking a name.  A node's admin port serves HTTPS with the
same certificate; there a client certificate is optional for the open endpoints (probes,
metrics) and required, beside the node token, for the guarded ones.

``generate`` makes a fresh set (an ECDSA P-256 CA and certificate); ``kvring up`` does so for
each local cluster and the operator for each CacheCluster.  TLS 1.3 only; no session tickets
(a client's idle connection must stay silent until it asks something).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
# The name every cluster certificate carries (with loopback's addresses), for clients that check
# names against the certificate, which kvring's own do not: Prometheus's ``server_name``, curl's
# ``--resolve kvring-node:PORT:ADDRESS`` (or 127.0.0.1 as is, on the machine of ``kvring up``).
CERT_NAME = "kvring-node"


class CredentialsError(ValueError):
    """The credentials directory is missing a file, or its files do not form a set."""


@dataclass(frozen=True)
class ClusterCredentials:
    """A directory holding ``ca.crt``, ``tls.crt`` and ``tls.key``."""

    directory: Path

    @classmethod
    def at(cls, directory: str | os.PathLike) -> ClusterCredentials:
        """The credentials in ``directory``; ``CredentialsError`` naming what is missing."""
        creds = cls(Path(directory))
        if not creds.directory.is_dir():
            raise CredentialsError(f"TLS directory {creds.directory} does not exist (it needs ca.crt, tls.crt and "
                                   "tls.key; `kvring up` makes them, or mount the cluster's Secret)")
        missing = [name for name in (CA_FILE, CERT_FILE, KEY_FILE) if not (creds.directory / name).is_file()]
        if missing:
            raise CredentialsError(f"TLS directory {creds.directory} lacks {', '.join(missing)} (it needs ca.crt, "
                                   "tls.crt and tls.key; `kvring up` makes them, or mount the cluster's Secret)")
        return creds

    @property
    def ca(self) -> Path:
        return self.directory / CA_FILE

    @property
    def cert(self) -> Path:
        return self.directory / CERT_FILE

    @property
    def key(self) -> Path:
        return self.directory / KEY_FILE

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        ctx = ssl.create_default_context(purpose, cafile=str(self.ca))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False  # membership is the CA's signature, not an address
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_cert_chain(str(self.cert), str(self.key))
        except (ssl.SSLError, OSError) as exc:
            raise CredentialsError(f"cannot load {self.cert} and {self.key}: {exc}") from None
        return ctx

    def server_context(self) -> ssl.SSLContext:
        """A node's side: the peer must show a certificate the cluster CA signed."""
        ctx = self._context(ssl.Purpose.CLIENT_AUTH)
        ctx.num_tickets = 0
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """A client's side: the node must show a certificate the cluster CA signed."""
        return self._context(ssl.Purpose.SERVER_AUTH)

    def admin_server_context(self) -> ssl.SSLContext:
        """A node's admin port: a client's certificate is asked for but optional (kubelet probes
        and Prometheus read the open endpoints without one), and checked against the cluster CA
        when shown; the guarded endpoints then require one (``cachenode/http.py``)."""
        ctx = self.server_context()
        ctx.verify_mode = ssl.CERT_OPTIONAL
        return ctx


def verifying_context(ca_pem: bytes) -> ssl.SSLContext:
    """A client's side without a certificate of its own: the peer must show one that the CA in
    ``ca_pem`` signed (the operator reading a node's open ``/stats``)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca_pem.decode("ascii", errors="replace"))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # membership is the CA's signature, not an address
    return ctx


def admin_context(url: str, tls: ssl.SSLContext | None) -> ssl.SSLContext | None:
    """The TLS context for a request to a node's admin port at ``url`` (None: plain HTTP).

    A node with the cluster's credentials serves its admin port over TLS and registers an
    ``https://`` address.  A client that holds credentials never sends a request (nor the node
    token in it) in plain text, and one without them cannot check an ``https://`` node: either
    mismatch is a one-line ``CredentialsError``, not a silent downgrade."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme == "https":
        if tls is None:
            raise CredentialsError(f"the node at {url} serves its admin port over TLS: give the cluster's "
                                   "credentials (--tls-dir or KVRING_TLS_DIR)")
        return tls
    if scheme == "http":
        if tls is not None:
            raise CredentialsError(f"the node at {url} serves its admin port in plain HTTP while this cluster's "
                                   "credentials are given: refusing to send requests unencrypted")
        return None
    raise CredentialsError(f"{url!r} is not an http:// or https:// address")


def generate(directory: str | os.PathLike, cluster: str, days: int = 3650) -> ClusterCredentials:
    """Write a new CA and a certificate it signed into ``directory`` (the key readable by the
    owner only); returns them."""
    files = credentials_pem(cluster, days)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        target = path / name
        target.write_bytes(data)
        if name == KEY_FILE:
            target.chmod(0o600)
    return ClusterCredentials.at(path)


def credentials_pem(cluster: str, days: int = 3650) -> dict[str, bytes]:
    """A new CA and a certificate it signed, as PEM: ``{"ca.crt", "tls.crt", "tls.key"}`` (what
    the operator puts in a Secret)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvring cluster {cluster} CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvring cluster {cluster}")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName(CERT_NAME), x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address("::1"))]),
                critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return {
        CA_FILE: ca.public_bytes(pem),
        CERT_FILE: cert.public_bytes(pem),
        KEY_FILE: key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    }

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

Credentials follow their directory (``common.follow``): each context a ``ClusterCredentials``
hands out is built from the files as they are (looked at again at most every ``RELOAD_CHECK``
seconds, whenever a connection is made), so a Secret that Kubernetes updates in its volume, or files replaced in
place, take effect on the next connection without a restart.  A set that does not load (a key
that is not the certificate's, a half-written file) is not taken: the last good one stays, and
``reload_error`` says why.  ``ca.crt`` may hold several CAs, all of them trusted; a rotation to a
new CA goes in the three steps of ``rotation_step`` (trust both, present the new, drop the old),
each taken once every holder has loaded the one before.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import ipaddress
import logging
import os
import re
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .follow import RELOAD_CHECK, Followed, stamp

logger = logging.getLogger(__name__)

CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
# The name every cluster certificate carries (with loopback's addresses), for clients that check
# names against the certificate, which kvring's own do not: Prometheus's ``server_name``, curl's
# ``--resolve kvring-node:PORT:ADDRESS`` (or 127.0.0.1 as is, on the machine of ``kvring up``).
CERT_NAME = "kvring-node"


class CredentialsError(ValueError):
    """The credentials directory is missing a file, or its files do not form a set."""


# The TLS context to use for the next connection, whatever the credentials are by then.
ContextSource = Callable[[], ssl.SSLContext]
_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


class Role(enum.Enum):
    """What a context is for."""

    SERVER = "server"  # a node's data port: the peer must show a certificate of the cluster
    CLIENT = "client"  # a client of the nodes: the node must show one
    ADMIN_SERVER = "admin-server"  # a node's admin port: a client certificate is optional


@dataclass(frozen=True)
class LoadedSet:
    """What a process has loaded of its credentials: fingerprints (the first 16 hex digits of a
    SHA-256 of the DER) of the certificate it shows and of every CA it trusts, when the
    certificate expires, and when the set was loaded (Unix seconds)."""

    cert: str
    trusted: tuple[str, ...]
    not_after: float
    loaded_at: float

    def as_dict(self) -> dict:
        return {"cert": self.cert, "trusted": list(self.trusted), "not_after": self.not_after,
                "loaded_at": self.loaded_at}


class ClusterCredentials(Followed):
    """A directory holding ``ca.crt``, ``tls.crt`` and ``tls.key``, and the contexts built from
    what it holds now, followed as it changes (``common.follow``).  ``on_reload(fn)`` has
    ``fn(before, after)`` called, on the thread that noticed, each time a new set is taken."""

    refusal = CredentialsError
    kept = "keeping the loaded cluster credentials"

    def __init__(self, directory: str | os.PathLike, *, check_interval: float = RELOAD_CHECK) -> None:
        """The credentials in ``directory``, loaded; ``CredentialsError`` naming what is missing
        or does not load."""
        super().__init__(check_interval)
        self.directory = Path(directory)
        self._listeners: list[Callable[[LoadedSet, LoadedSet], None]] = []
        self._stamp = self._present()
        self._contexts, self._digest, self.loaded = self._load()

    def __repr__(self) -> str:
        return f"ClusterCredentials({str(self.directory)!r})"

    @classmethod
    def at(cls, directory: str | os.PathLike, *, check_interval: float = RELOAD_CHECK) -> ClusterCredentials:
        """The credentials in ``directory``, loaded (as the constructor)."""
        return cls(directory, check_interval=check_interval)

    @property
    def ca(self) -> Path:
        return self.directory / CA_FILE

    @property
    def cert(self) -> Path:
        return self.directory / CERT_FILE

    @property
    def key(self) -> Path:
        return self.directory / KEY_FILE

    def server_context(self) -> ssl.SSLContext:
        """A node's side: the peer must show a certificate a trusted CA signed."""
        return self._current(Role.SERVER)

    def client_context(self) -> ssl.SSLContext:
        """A client's side: the node must show a certificate a trusted CA signed."""
        return self._current(Role.CLIENT)

    def admin_server_context(self) -> ssl.SSLContext:
        """A node's admin port: a client's certificate is asked for but optional (kubelet probes
        and Prometheus read the open endpoints without one), and checked against the trusted CAs
        when shown; the guarded endpoints then require one (``cachenode/http.py``)."""
        return self._current(Role.ADMIN_SERVER)

    def on_reload(self, fn: Callable[[LoadedSet, LoadedSet], None]) -> None:
        self._listeners.append(fn)

    def _current(self, role: Role) -> ssl.SSLContext:
        self._look_if_due()
        return self._contexts[role]

    def _reload(self) -> bool:
        now = self._present()
        if now == self._stamp:
            return False
        contexts, digest, loaded = self._load()
        self._stamp = now
        if digest == self._digest:  # touched, or back to the set in use
            return False
        before = self.loaded
        self._contexts, self._digest, self.loaded = contexts, digest, loaded
        logger.info("cluster credentials in %s reloaded: certificate %s, trusting %s", self.directory,
                    loaded.cert, ", ".join(loaded.trusted))
        for fn in self._listeners:
            fn(before, loaded)
        return True

    def _present(self) -> tuple:
        """The three files' stamps; ``CredentialsError`` naming those missing."""
        if not self.directory.is_dir():
            raise CredentialsError(f"TLS directory {self.directory} does not exist (it needs ca.crt, tls.crt and "
                                   "tls.key; `kvring up` makes them, or mount the cluster's Secret)")
        paths = (self.ca, self.cert, self.key)
        now = stamp(paths)
        missing = [path.name for path, st in zip(paths, now) if st is None]
        if missing:
            raise CredentialsError(f"TLS directory {self.directory} lacks {', '.join(missing)} (it needs ca.crt, "
                                   "tls.crt and tls.key; `kvring up` makes them, or mount the cluster's Secret)")
        return now

    def _read(self) -> tuple[bytes, bytes, bytes]:
        try:
            return self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes()
        except OSError as exc:
            raise CredentialsError(f"cannot read the credentials in {self.directory}: {exc}") from None

    def _load(self) -> tuple[dict[Role, ssl.SSLContext], bytes, LoadedSet]:
        """Contexts of every role from the files, which must not change while they load (files
        replaced one by one could otherwise pair one set's key with another's certificate)."""
        for _ in range(3):
            files = self._read()
            contexts = {role: self._context(role) for role in Role}
            if self._read() == files:
                return contexts, hashlib.sha256(b"".join(files)).digest(), describe(files[0], files[1])
        raise CredentialsError(f"the credentials in {self.directory} kept changing while they loaded")

    def _context(self, role: Role) -> ssl.SSLContext:
        purpose = ssl.Purpose.SERVER_AUTH if role is Role.CLIENT else ssl.Purpose.CLIENT_AUTH
        try:
            ctx = ssl.create_default_context(purpose, cafile=str(self.ca))
        except (ssl.SSLError, OSError) as exc:
            raise CredentialsError(f"cannot load the CA certificates in {self.ca}: {exc}") from None
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False  # membership is the CA's signature, not an address
        ctx.verify_mode = ssl.CERT_OPTIONAL if role is Role.ADMIN_SERVER else ssl.CERT_REQUIRED
        try:
            ctx.load_cert_chain(str(self.cert), str(self.key))
        except (ssl.SSLError, OSError) as exc:
            raise CredentialsError(f"cannot load {self.cert} and {self.key}: {exc}") from None
        if role is not Role.CLIENT:
            ctx.num_tickets = 0
        return ctx


def _fingerprint(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()[:16]


def _certificates(pem: bytes) -> list[bytes]:
    """The DER of each certificate in a PEM bundle."""
    return [ssl.PEM_cert_to_DER_cert(block.decode("ascii")) for block in _PEM_CERT.findall(pem)]


def describe(ca_pem: bytes, cert_pem: bytes) -> LoadedSet:
    from cryptography import x509

    der = _certificates(cert_pem)[0]  # the certificate shown (a chain's first): it loaded, so it is there
    not_after = x509.load_der_x509_certificate(der).not_valid_after_utc.timestamp()
    return LoadedSet(cert=_fingerprint(der), trusted=tuple(_fingerprint(c) for c in _certificates(ca_pem)),
                     not_after=not_after, loaded_at=round(time.time(), 3))


class RotationStep(enum.Enum):
    """The three steps from one set of credentials to another (``rotation_step``)."""

    TRUST = "trust"  # every holder trusts the old CA and the new, and shows the old certificate
    PRESENT = "present"  # every holder shows the new certificate, still trusting both
    DROP = "drop"  # the old CA is no longer trusted: the new set alone


def rotation_step(old: dict[str, bytes], new: dict[str, bytes], step: RotationStep) -> dict[str, bytes]:
    """The files (``{"ca.crt", "tls.crt", "tls.key"}``) a step of the rotation from ``old`` to
    ``new`` puts in place.  Each step needs every holder to have loaded the one before: until all
    trust the new CA, none may show its certificate, and until none shows the old, none may stop
    trusting it."""
    if step is RotationStep.DROP:
        return dict(new)
    both = old[CA_FILE].rstrip(b"\n") + b"\n" + new[CA_FILE]
    shown = old if step is RotationStep.TRUST else new
    return {CA_FILE: both, CERT_FILE: shown[CERT_FILE], KEY_FILE: shown[KEY_FILE]}


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
    # Each CA's name is its own: during a rotation two CAs of one cluster are trusted side by side,
    # and a verifier picks a certificate's issuer by name (then by key identifier, given).
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                            f"kvring cluster {cluster} CA {now:%Y-%m-%d} {os.urandom(4).hex()}")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
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
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
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

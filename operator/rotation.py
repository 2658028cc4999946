"""Credentials rotation: a CacheCluster's CA, certificate and node token replaced while it serves,
with no request refused on the way.  The decisions, as pure functions over plain data.

A rotation is asked for by giving the annotation ``ROTATE_ANNOTATION`` a new value (``kubectl
annotate kvc NAME kvring.io/rotate-credentials=$(date +%s) --overwrite``).  The operator makes a
new set (a CA of its own, a certificate it signed, a token) and keeps it, beside the old one, in
the Secret ``<name>-tls-rotation``.  Then the status passes take the cluster's Secrets through
three steps (``common.tls.RotationStep``), which the nodes, the admin API and the vLLM pods
follow from their mounted volumes without a restart:

1. trust: ``<name>-tls`` trusts the old CA and the new and shows the old certificate; the node
   token file lists the old token, then the new (clients send the first, nodes accept each);
2. present: the new certificate is shown, both CAs still trusted; the new token comes first;
3. drop: the new set alone; the old CA and token are refused from then on, and the nodes close
   the connections the old CA had admitted.

A step is followed by the next once every registered node reports it loaded (``/stats``: the
fingerprints of what it shows and trusts, and of its tokens) and ``rotationStepSeconds`` have
passed since it was written: long enough for the clients the operator cannot see (vLLM pods
mounting the Secrets) to have been given it by their kubelet.  A node that does not take a step
holds the rotation there (the status says which), never past it: going on would cut it off.

The rotation in progress is kept in the annotation ``ROTATION_ANNOTATION`` (as a scale-in is,
so an operator that restarts carries on), and the request it finished in ``ROTATED_ANNOTATION``.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvring.common.nodetoken import token_fingerprint
from kvring.common.tls import CA_FILE, CERT_FILE, KEY_FILE, RotationStep, describe, rotation_step

logger = logging.getLogger(__name__)

ROTATE_ANNOTATION = "kvring.io/rotate-credentials"  # set by people: a new value asks for a rotation
ROTATION_ANNOTATION = "kvring.io/credentials-rotation"  # the operator's: the rotation in progress
ROTATED_ANNOTATION = "kvring.io/credentials-rotated"  # the operator's: the request last carried out
STEPS = tuple(RotationStep)
_FILES = (CA_FILE, CERT_FILE, KEY_FILE)
_TOKEN, _OLD = "token", "old-"


@dataclass(frozen=True)
class Rotation:
    """A rotation in progress: the request it answers, its step, and when that step was written."""

    request: str
    step: RotationStep
    since: float  # unix time

    def to_annotation(self) -> str:
        return json.dumps({"request": self.request, "step": self.step.value, "since": round(self.since, 3)},
                          separators=(",", ":"))

    @classmethod
    def from_annotation(cls, raw: str | None) -> Rotation | None:
        """Read the annotation; a malformed one is ignored (with a warning: the request, still
        unanswered, starts a rotation again)."""
        if not raw:
            return None
        try:
            data = json.loads(raw)
            return cls(request=str(data["request"]), step=RotationStep(data["step"]), since=float(data["since"]))
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring a malformed %s annotation %r: %s", ROTATION_ANNOTATION, raw, exc)
            return None

    def after(self, now: float) -> Rotation | None:
        """The next step, written at ``now``; None after the last."""
        at = STEPS.index(self.step)
        return Rotation(self.request, STEPS[at + 1], now) if at + 1 < len(STEPS) else None


@dataclass(frozen=True)
class CredentialSets:
    """The old credentials and the new, as ``<name>-tls-rotation`` keeps them (``tls`` empty for a
    cluster without TLS: its token alone rotates)."""

    request: str
    old_tls: Mapping[str, bytes]
    new_tls: Mapping[str, bytes]
    old_token: str
    new_token: str

    @classmethod
    def fresh(cls, request: str, old_tls: Mapping[str, bytes], new_tls: Mapping[str, bytes],
              old_token: str) -> CredentialSets:
        return cls(request, dict(old_tls), dict(new_tls), old_token.strip().splitlines()[0].strip(),
                   secrets.token_hex(32))

    def tls_files(self, step: RotationStep) -> dict[str, bytes]:
        """``<name>-tls``'s files at ``step`` ({} without TLS)."""
        if not self.new_tls:
            return {}
        return rotation_step(dict(self.old_tls), dict(self.new_tls), step)

    def token_lines(self, step: RotationStep) -> list[str]:
        """The node token file's lines at ``step``: the first is what clients send."""
        return {RotationStep.TRUST: [self.old_token, self.new_token],
                RotationStep.PRESENT: [self.new_token, self.old_token],
                RotationStep.DROP: [self.new_token]}[step]

    def expected(self, step: RotationStep) -> Loaded:
        """What a node that took ``step`` reports in ``/stats``."""
        tokens = tuple(token_fingerprint(t) for t in self.token_lines(step))
        files = self.tls_files(step)
        if not files:
            return Loaded(None, (), tokens)
        loaded = describe(files[CA_FILE], files[CERT_FILE])
        return Loaded(loaded.cert, loaded.trusted, tokens)

    def to_secret_data(self) -> dict[str, str]:
        data = {_TOKEN: self.new_token, _OLD + _TOKEN: self.old_token}
        for name in _FILES:
            if self.new_tls:
                data[name] = self.new_tls[name].decode()
                data[_OLD + name] = self.old_tls[name].decode()
        return {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}

    @classmethod
    def from_secret(cls, secret: Mapping[str, Any]) -> CredentialSets | None:
        """Read ``<name>-tls-rotation``; None if it is not one (a warning says why)."""
        try:
            data = {k: base64.b64decode(v, validate=True) for k, v in (secret.get("data") or {}).items()}
            request = secret["metadata"]["annotations"][ROTATION_ANNOTATION]
            tls = all(name in data for name in _FILES)
            return cls(request=request,
                       old_tls={n: data[_OLD + n] for n in _FILES} if tls else {},
                       new_tls={n: data[n] for n in _FILES} if tls else {},
                       old_token=data[_OLD + _TOKEN].decode(), new_token=data[_TOKEN].decode())
        except (KeyError, TypeError, binascii.Error, UnicodeDecodeError) as exc:
            logger.warning("the rotation Secret %s is not one: %s", secret.get("metadata", {}).get("name"), exc)
            return None


@dataclass(frozen=True)
class Loaded:
    """What a node has loaded of its credentials, as it reports it: the certificate it shows and
    the CAs it trusts (fingerprints; None and () without TLS), and its tokens' fingerprints."""

    cert: str | None
    trusted: tuple[str, ...]
    tokens: tuple[str, ...]

    @classmethod
    def of_stats(cls, stats: Mapping[str, Any] | None) -> Loaded | None:
        """From a node's ``/stats`` (None: it did not answer, or predates rotations)."""
        creds = (stats or {}).get("credentials")
        if not isinstance(creds, dict) or not isinstance(creds.get("node_token"), dict):
            return None
        tls = creds.get("tls") or {}
        return cls(tls.get("cert"), tuple(tls.get("trusted") or ()), tuple(creds["node_token"].get("accepted") or ()))


def behind(expected: Loaded, members: Mapping[str, Any], stats: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The registered nodes that have not reported ``expected`` loaded (sorted)."""
    return sorted(node_id for node_id in members if Loaded.of_stats(stats.get(node_id)) != expected)


@dataclass(frozen=True)
class RotationView:
    """A rotation in progress, for ``status.credentials``."""

    request: str
    step: RotationStep
    since: float
    waiting_for: tuple[str, ...]  # nodes that have not taken the step yet

    def as_dict(self, iso: Callable[[float], str]) -> dict[str, Any]:
        return {"request": self.request, "step": self.step.value, "since": iso(self.since),
                "waitingFor": list(self.waiting_for)}


def wanted(annotations: Mapping[str, str]) -> str | None:
    """The rotation request not yet carried out, if any."""
    request = (annotations.get(ROTATE_ANNOTATION) or "").strip()
    return request if request and request != annotations.get(ROTATED_ANNOTATION) else None


def step_done(rotation: Rotation, waiting: list[str], now: float, step_seconds: float) -> bool:
    """Whether every node has taken the step and it has stood ``step_seconds``."""
    return not waiting and now - rotation.since >= step_seconds

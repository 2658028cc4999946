"""The status pass's part in a credentials rotation (``rotation.py`` decides): it starts one when
asked, writes each step into the cluster's Secrets, and moves on once every node has taken it.

Each pass writes the step the ``ROTATION_ANNOTATION`` records (patching a Secret only where it
differs), so a pass that died between writing the next step and recording it leaves the Secrets
one step ahead of the record for a moment; the next pass writes them back one step.  Any two
adjacent steps work together, so that costs nothing but the step's wait again.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf

from kvring.common.tls import RotationStep, credentials_pem

from . import rotation as rot
from .kube import KubeClient, KubeError
from .naming import NODE_TOKEN_KEY, node_token_secret, rotation_secret, tls_secret
from .render_nodes import labels
from .spec import ClusterSpec

logger = logging.getLogger(__name__)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Rotator:
    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube

    async def advance(self, name: str, namespace: str, cs: ClusterSpec, annotations: Mapping[str, str],
                      body: kopf.Body, patch: kopf.Patch, members: Mapping[str, Any] | None,
                      stats: Mapping[str, Mapping[str, Any]]) -> rot.RotationView | None:
        """One pass of the rotation in progress, or the start of a requested one; what the status
        says of it (None: none in progress).  Waits, changing nothing, while etcd is unreadable."""
        current = rot.Rotation.from_annotation(annotations.get(rot.ROTATION_ANNOTATION))
        now = time.time()
        try:
            if current is None:
                request = rot.wanted(annotations)
                if request is None or members is None:
                    return None
                sets = await self._sets(name, namespace, cs, request, body)
                current = rot.Rotation(request, RotationStep.TRUST, now)
                await self._write(name, namespace, sets, current.step)
                patch.metadata.annotations[rot.ROTATION_ANNOTATION] = current.to_annotation()
                kopf.info(body, reason="CredentialsRotation", message=_said(current, cs))
                return rot.RotationView(request, current.step, now, tuple(sorted(members)))
            sets = await self._kept(name, namespace, current.request)
            if sets is None:
                kopf.warn(body, reason="CredentialsRotation",
                          message=f"the rotation {current.request!r} is held at step {current.step.value}: its "
                                  f"Secret {rotation_secret(name)} is missing or unreadable, and with it the new "
                                  "set; put it back, or remove the annotation "
                                  f"{rot.ROTATION_ANNOTATION} to start the rotation over from the Secrets as "
                                  "they stand")
                return rot.RotationView(current.request, current.step, current.since, tuple(sorted(members or ())))
            await self._write(name, namespace, sets, current.step)
            if members is None:
                return rot.RotationView(current.request, current.step, current.since, ())
            waiting = rot.behind(sets.expected(current.step), members, stats)
            if not rot.step_done(current, waiting, now, cs.rotation_step_seconds):
                return rot.RotationView(current.request, current.step, current.since, tuple(waiting))
            following = current.after(now)
            if following is None:
                await self.kube.delete_owned("v1", "Secret", namespace, rotation_secret(name), body.metadata.uid)
                patch.metadata.annotations[rot.ROTATION_ANNOTATION] = None
                patch.metadata.annotations[rot.ROTATED_ANNOTATION] = current.request
                kopf.info(body, reason="CredentialsRotated",
                          message=f"rotation {current.request!r} done: every node holds the new credentials and "
                                  "token alone; the old CA and token are refused")
                return None
            await self._write(name, namespace, sets, following.step)
            patch.metadata.annotations[rot.ROTATION_ANNOTATION] = following.to_annotation()
            kopf.info(body, reason="CredentialsRotation", message=_said(following, cs))
            return rot.RotationView(following.request, following.step, now, tuple(sorted(members)))
        except KubeError as exc:  # the next pass tries again; this one's status goes on
            logger.warning("%s/%s: credentials rotation: %s", namespace, name, exc)
            return None if current is None else rot.RotationView(current.request, current.step, current.since, ())

    async def _sets(self, name: str, namespace: str, cs: ClusterSpec, request: str,
                    body: kopf.Body) -> rot.CredentialSets:
        """The sets of ``request``: kept ones (a start that did not get recorded), else new ones
        from the Secrets as they are, kept in ``<name>-tls-rotation`` before anything changes."""
        kept = await self._kept(name, namespace, request)
        if kept is not None:
            return kept
        token_secret = await self.kube.get("v1", "Secret", namespace, node_token_secret(name))
        old_token = base64.b64decode((token_secret or {}).get("data", {}).get(NODE_TOKEN_KEY, "")).decode()
        old_tls: dict[str, bytes] = {}
        new_tls: dict[str, bytes] = {}
        if cs.tls:
            tls = await self.kube.get("v1", "Secret", namespace, tls_secret(name))
            old_tls = {k: base64.b64decode(v) for k, v in (tls or {}).get("data", {}).items()}
            new_tls = credentials_pem(f"{namespace}/{name}")
        if not old_token.strip() or (cs.tls and not old_tls):
            raise KubeError(f"the Secrets {node_token_secret(name)} and {tls_secret(name)} are not there yet")
        sets = rot.CredentialSets.fresh(request, old_tls, new_tls, old_token)
        secret = {"apiVersion": "v1", "kind": "Secret",
                  "metadata": {"name": rotation_secret(name), "namespace": namespace, "labels": labels(name),
                               "annotations": {rot.ROTATION_ANNOTATION: request}},
                  "type": "Opaque", "data": sets.to_secret_data()}
        kopf.adopt(secret, owner=body)
        # One of another request's (given up) goes first.
        await self.kube.delete_owned("v1", "Secret", namespace, rotation_secret(name), body.metadata.uid)
        await self.kube.create(secret)
        return sets

    async def _kept(self, name: str, namespace: str, request: str) -> rot.CredentialSets | None:
        secret = await self.kube.get("v1", "Secret", namespace, rotation_secret(name))
        sets = rot.CredentialSets.from_secret(secret) if secret is not None else None
        return sets if sets is not None and sets.request == request else None

    async def _write(self, name: str, namespace: str, sets: rot.CredentialSets, step: RotationStep) -> None:
        """Put ``step`` into ``<name>-tls`` and ``<name>-node-token`` where they differ."""
        token = {NODE_TOKEN_KEY: _b64(("\n".join(sets.token_lines(step)) + "\n").encode())}
        wanted = [(node_token_secret(name), token)]
        files = sets.tls_files(step)
        if files:
            wanted.insert(0, (tls_secret(name), {k: _b64(v) for k, v in files.items()}))
        for secret_name, data in wanted:
            current = await self.kube.get("v1", "Secret", namespace, secret_name)
            if current is None or current.get("data") != data:
                await self.kube.patch("v1", "Secret", namespace, secret_name, {"data": data})


def _said(rotation: rot.Rotation, cs: ClusterSpec) -> str:
    what = {RotationStep.TRUST: "every node and client trusts the new CA beside the old and accepts the new token",
            RotationStep.PRESENT: "nodes and clients show the new certificate and send the new token",
            RotationStep.DROP: "the old CA and token are dropped"}[rotation.step]
    return (f"rotation {rotation.request!r}, step {rotation.step.value} of trust/present/drop: {what}; the next "
            f"step follows once every node has taken this one and {cs.rotation_step_seconds} s have passed")

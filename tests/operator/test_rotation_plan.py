"""The credentials rotation's decisions (``operator/rotation.py``), as pure functions: the record
it keeps, the sets it keeps, what a node that took a step reports, and when a step is done."""

from __future__ import annotations

import base64

from kvring.common.nodetoken import token_fingerprint
from kvring.common.tls import CA_FILE, CERT_FILE, KEY_FILE, RotationStep, credentials_pem, describe
from kvring.operator.rotation import (ROTATE_ANNOTATION, ROTATED_ANNOTATION, ROTATION_ANNOTATION, CredentialSets,
                                      Loaded, Rotation, behind, step_done, wanted)

OLD, NEW = credentials_pem("ns/a"), credentials_pem("ns/a")


def _stats(loaded: Loaded) -> dict:
    return {"credentials": {"tls": {"cert": loaded.cert, "trusted": list(loaded.trusted), "reloads": 1},
                            "node_token": {"accepted": list(loaded.tokens), "reloads": 1}}}


def test_the_record_goes_trust_present_drop_and_a_malformed_one_is_ignored():
    r = Rotation("r1", RotationStep.TRUST, 100.0)
    assert Rotation.from_annotation(r.to_annotation()) == r
    assert [s.step for s in (r, r.after(1), r.after(1).after(2))] == list(RotationStep)
    assert r.after(1).after(2).after(3) is None and r.after(7).since == 7
    for raw in ("", None, "{", '{"request": "x", "step": "sideways", "since": 1}', '{"step": "trust"}'):
        assert Rotation.from_annotation(raw) is None


def test_a_request_is_wanted_until_it_is_carried_out():
    assert wanted({}) is None and wanted({ROTATE_ANNOTATION: "  "}) is None
    assert wanted({ROTATE_ANNOTATION: "2026-11-29"}) == "2026-11-29"
    assert wanted({ROTATE_ANNOTATION: "2026-11-29", ROTATED_ANNOTATION: "2026-11-29"}) is None
    assert wanted({ROTATE_ANNOTATION: "again", ROTATED_ANNOTATION: "2026-11-29"}) == "again"


def test_the_sets_survive_their_secret_and_say_what_each_step_holds():
    sets = CredentialSets.fresh("r1", OLD, NEW, "o" * 64 + "\n")
    secret = {"metadata": {"name": "a-tls-rotation", "annotations": {ROTATION_ANNOTATION: "r1"}},
              "data": sets.to_secret_data()}
    assert CredentialSets.from_secret(secret) == sets
    assert CredentialSets.from_secret({"metadata": {"name": "x"}, "data": sets.to_secret_data()}) is None
    assert len(sets.new_token) == 64 and sets.new_token != sets.old_token == "o" * 64
    assert [sets.token_lines(s) for s in RotationStep] == [[sets.old_token, sets.new_token],
                                                           [sets.new_token, sets.old_token], [sets.new_token]]
    old_ca, new_ca = (describe(s[CA_FILE], s[CERT_FILE]).trusted[0] for s in (OLD, NEW))
    old_cert, new_cert = (describe(s[CA_FILE], s[CERT_FILE]).cert for s in (OLD, NEW))
    trust, present, drop = (sets.expected(s) for s in RotationStep)
    assert (trust.cert, trust.trusted) == (old_cert, (old_ca, new_ca))
    assert (present.cert, present.trusted) == (new_cert, (old_ca, new_ca))
    assert (drop.cert, drop.trusted) == (new_cert, (new_ca,))
    assert drop.tokens == (token_fingerprint(sets.new_token),)
    assert sets.tls_files(RotationStep.DROP) == NEW and sets.tls_files(RotationStep.TRUST)[KEY_FILE] == OLD[KEY_FILE]
    # A cluster without TLS rotates its token alone.
    bare = CredentialSets.fresh("r2", {}, {}, "p" * 64)
    assert bare.tls_files(RotationStep.TRUST) == {} and bare.expected(RotationStep.PRESENT).cert is None
    again = CredentialSets.from_secret({"metadata": {"name": "b", "annotations": {ROTATION_ANNOTATION: "r2"}},
                                        "data": bare.to_secret_data()})
    assert again == bare and base64.b64decode(bare.to_secret_data()["token"]).decode() == bare.new_token


def test_a_step_is_done_once_every_node_reports_it_and_it_has_stood_long_enough():
    sets = CredentialSets.fresh("r1", OLD, NEW, "o" * 64)
    members = {"a-0": object(), "a-1": object()}
    trust = sets.expected(RotationStep.TRUST)
    stats = {"a-0": _stats(trust), "a-1": _stats(sets.expected(RotationStep.DROP))}
    assert behind(trust, members, stats) == ["a-1"]
    assert behind(trust, members, {"a-0": _stats(trust)}) == ["a-1"]  # no answer: not taken
    assert behind(trust, members, {"a-0": _stats(trust), "a-1": {"node_id": "a-1"}}) == ["a-1"]  # an older node
    stats["a-1"] = _stats(trust)
    assert behind(trust, members, stats) == []
    r = Rotation("r1", RotationStep.TRUST, 100.0)
    assert not step_done(r, [], 150.0, 120) and step_done(r, [], 220.0, 120) and not step_done(r, ["a-1"], 900.0, 120)

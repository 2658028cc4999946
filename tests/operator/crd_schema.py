"""The CacheCluster CRD's openAPIV3Schema as a JSON Schema validator, plus API-server defaulting.

Kubernetes' structural schemas are OpenAPI v3 with a few extensions; ``jsonschema``'s
Draft4Validator checks them after small translations:
- ``x-kubernetes-*`` keys are dropped (``x-kubernetes-int-or-string`` becomes
  ``anyOf: [integer, string]`` where the schema does not already say so);
- ``nullable: true`` becomes a ``null`` type;
- objects with ``properties`` and without ``x-kubernetes-preserve-unknown-fields`` refuse other
  keys, as ``kubectl apply`` (strict server-side field validation) does; ``metadata`` is left open.
Defaults are applied by ``apply_defaults`` the way the API server does: a missing property with a
default gets it, then nested defaults.  The CEL rules (``x-kubernetes-validations``) are
evaluated by ``rule_failures`` with ``cel`` (cel-rust), as the API server does on a create or an
update: at each node of the schema that holds rules, ``self`` is the object's value there and
``oldSelf`` the previous version's; a rule naming ``oldSelf`` (a transition rule) runs only on
an update where both values exist.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import cel
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "cachecluster.yaml"
EXAMPLES = ROOT / "crds" / "examples"


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def openapi_schema(crd: dict[str, Any] | None = None) -> dict[str, Any]:
    crd = crd or load_crd()
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    return version["schema"]["openAPIV3Schema"]


def to_draft4(node: Any) -> Any:
    """One schema node, translated (see the module docstring)."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {name: to_draft4(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = to_draft4(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [to_draft4(sub) for sub in value]
        else:
            out[key] = copy.deepcopy(value)
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def cr_validator(crd: dict[str, Any] | None = None) -> jsonschema.Draft4Validator:
    schema = to_draft4(openapi_schema(crd))
    schema["properties"]["metadata"].pop("additionalProperties", None)
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def schema_errors(obj: dict[str, Any], crd: dict[str, Any] | None = None) -> list[str]:
    """Every schema violation of one custom resource, as "path: message"."""
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                  for e in cr_validator(crd).iter_errors(obj))


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """``value`` with the schema's defaults filled in, as the API server stores it."""
    value = copy.deepcopy(value)
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in set(value) - set(schema.get("properties", {})):
                value[name] = apply_defaults(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def load_examples(folder: str = "") -> dict[str, dict[str, Any]]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted((EXAMPLES / folder).glob("*.yaml"))}


def validation_rules(schema: dict[str, Any], at: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dict]]:
    """Every ``x-kubernetes-validations`` rule under ``schema`` with the property path it is at."""
    found = [(at, rule) for rule in schema.get("x-kubernetes-validations", [])]
    for name, sub in schema.get("properties", {}).items():
        found += validation_rules(sub, (*at, name))
    return found


def _at(obj: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        if not isinstance(obj, dict) or name not in obj:
            return None
        obj = obj[name]
    return obj


def rule_failures(new: dict[str, Any], old: dict[str, Any] | None = None,
                  crd: dict[str, Any] | None = None) -> list[str]:
    """The messages of the CRD's CEL rules that ``new`` breaks (an update of ``old`` if given)."""
    failures = []
    for path, rule in validation_rules(openapi_schema(crd)):
        value, previous = _at(new, path), _at(old, path) if old is not None else None
        transition = "oldSelf" in rule["rule"]
        if value is None or (transition and previous is None):
            continue
        if not cel.evaluate(rule["rule"], {"self": value, **({"oldSelf": previous} if transition else {})}):
            failures.append(rule["message"])
    return failures

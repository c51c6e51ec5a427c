"""Strict offline validation of custom resources against the CRDs vendored in tests/e2e/k8s-crds/ (see its
SOURCES.md: the files as released, pinned by tag and commit).

A CRD's openAPIV3Schema is what the API server checks; it prunes unknown fields silently instead of refusing them.
Strict here means what kubeconform's --strict means for CRDs: every object schema that lists its properties and
does not keep unknown fields (x-kubernetes-preserve-unknown-fields) refuses any other key, so a misspelt field is
an error. Not checked: the CEL rules (x-kubernetes-validations), which need the API server.
"""
import copy
import functools
import pathlib

import jsonschema
import yaml

CRDS = pathlib.Path(__file__).resolve().parent / "k8s-crds"


def _strict(schema):
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.lru_cache(maxsize=None)
def _schemas():
    """{(apiVersion, kind): strict JSON schema} of every served version of every vendored CRD."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for v in crd["spec"]["versions"]:
                if v.get("served"):
                    schema = copy.deepcopy(v["schema"]["openAPIV3Schema"])
                    out[(f"{group}/{v['name']}", kind)] = (_strict(schema), path.name)
    return out


def known(obj):
    return (obj.get("apiVersion"), obj.get("kind")) in _schemas()


def validate(obj):
    """Raises AssertionError naming the object, the vendored file and every violation."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    assert key in _schemas(), f"no vendored CRD serves {key}: vendored {sorted(_schemas())}"
    schema, source = _schemas()[key]
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(obj), key=lambda e: list(e.absolute_path))
    assert not errors, (f'{obj["kind"]} {obj["metadata"]["name"]} is not valid against {source}:\n' +
                        "\n".join(f'  {"/".join(map(str, e.absolute_path)) or "(top)"}: {e.message[:300]}'
                                  for e in errors[:20]))

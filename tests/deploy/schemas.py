"""Strict, offline schema checks for every kind under deploy/, each against schemas a package ships:

- Kubernetes' own kinds: the strict JSON schemas of kubernetes-validate (unknown fields rejected).
- ServiceMonitor: prometheus-operator's CRD as the pydantic models of cloudcoil-models-prometheus-
  operator. Those ignore unknown fields, so a field the model dropped is reported as unknown.
- KServe's kinds: the models the KServe SDK generates from its CRDs (their ``openapi_types`` and
  ``attribute_map``, read from the source so the SDK's own dependencies need not be installed);
  Kubernetes types inside them (containers, probes, metadata) go to kubernetes-validate's schemas.

``problems(doc, version)`` lists what is wrong with one document against Kubernetes ``version`` (one of
``VERSIONS``); empty means valid.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import re
from importlib.resources import files

import jsonschema
import kubernetes_validate
from referencing import Registry, Resource

# The oldest and newest Kubernetes kubernetes-validate knows: a field too new or since removed fails one.
VERSIONS = (kubernetes_validate.utils.all_versions()[0], kubernetes_validate.latest_version())
_TABLES = ("openapi_types", "attribute_map")  # what an SDK model class says about its fields
_PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}


def problems(doc: dict, version: str) -> list[str]:
    group = doc["apiVersion"].rpartition("/")[0]
    check = {"monitoring.coreos.com": _prometheus_operator, "serving.kserve.io": _kserve}.get(group, _kubernetes)
    return check(doc, version)


def _kubernetes(doc: dict, version: str) -> list[str]:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(map(str, exc.path))}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [exc.message]
    return []


def _prometheus_operator(doc: dict, version: str) -> list[str]:
    import pydantic
    from cloudcoil.models.prometheus_operator import v1

    try:
        model = getattr(v1, doc["kind"]).model_validate(doc)
    except pydantic.ValidationError as exc:
        return [str(exc)]
    return _dropped(doc, model.model_dump(mode="json", by_alias=True, exclude_unset=True), doc["kind"])


def _dropped(given, kept, path: str) -> list[str]:
    """Paths present in ``given`` but not in ``kept``: the fields a lenient model did not know."""
    found = []
    if isinstance(given, dict):
        for key, value in given.items():
            where = f"{path}.{key}"
            found += [f"{where}: unknown field"] if key not in kept else _dropped(value, kept[key], where)
    elif isinstance(given, list):
        for i, (g, k) in enumerate(zip(given, kept, strict=True)):
            found += _dropped(g, k, f"{path}[{i}]")
    return found


def _kserve(doc: dict, version: str) -> list[str]:
    group_version = doc["apiVersion"].rpartition("/")[2]  # v1alpha1, v1beta1
    return _walk(doc, f"V{group_version[1:]}{doc['kind']}", doc["kind"], version)


@functools.cache
def _kserve_models() -> dict[str, tuple[dict, dict]]:
    """SDK class name -> (openapi_types, attribute_map), parsed from kserve/models/*.py."""
    try:
        root = importlib.metadata.distribution("kserve").locate_file("kserve/models")
    except importlib.metadata.PackageNotFoundError:
        raise AssertionError("no KServe SDK: `make test` installs it (the Makefile's KSERVE)") from None
    models = {}
    for source in root.glob("*.py"):
        for node in ast.parse(source.read_text()).body:
            if isinstance(node, ast.ClassDef):
                tables = {s.targets[0].id: ast.literal_eval(s.value) for s in node.body
                          if isinstance(s, ast.Assign) and getattr(s.targets[0], "id", "") in _TABLES}
                if len(tables) == 2:
                    models[node.name] = (tables["openapi_types"], tables["attribute_map"])
    return models


def _walk(value, type_name: str, path: str, version: str) -> list[str]:
    if m := re.fullmatch(r"list\[(.+)\]", type_name):
        if not isinstance(value, list):
            return [f"{path}: expected a list"]
        return [p for i, item in enumerate(value) for p in _walk(item, m[1], f"{path}[{i}]", version)]
    if m := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        if not isinstance(value, dict):
            return [f"{path}: expected a mapping"]
        return [p for key, item in value.items() for p in _walk(item, m[1], f"{path}.{key}", version)]
    if type_name in _PRIMITIVES:
        ok = isinstance(value, _PRIMITIVES[type_name]) and not (type_name == "int" and isinstance(value, bool))
        return [] if ok else [f"{path}: expected {type_name}, got {value!r}"]
    model = _kserve_models().get(type_name)
    if model is None:
        return _kubernetes_type(value, type_name, path, version)
    if not isinstance(value, dict):
        return [f"{path}: expected a {type_name} mapping"]
    types, attributes = model
    by_key = {key: attr for attr, key in attributes.items()}
    found = []
    for key, item in value.items():
        where = f"{path}.{key}"
        found += [f"{where}: unknown field"] if key not in by_key else _walk(item, types[by_key[key]], where, version)
    return found


def _kubernetes_type(value, type_name: str, path: str, version: str) -> list[str]:
    """A Kubernetes type the SDK names V1<Type> (V1Container, V1Probe, V1ObjectMeta)."""
    defs, registry = _kubernetes_definitions(version)
    keys = [k for k in defs["$defs"] if type_name.startswith("V1") and k.endswith(f".v1.{type_name[2:]}")]
    if len(keys) != 1:
        return [f"{path}: no schema for {type_name} (found {keys})"]
    validator = jsonschema.Draft202012Validator({"$ref": f"{defs['$id']}#/$defs/{keys[0]}"}, registry=registry)
    return [f"{path}.{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(value)]


@functools.cache
def _kubernetes_definitions(version: str):
    text = files("kubernetes_validate").joinpath(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json")
    defs = json.loads(text.read_text())
    return defs, Resource.from_contents(defs) @ Registry()

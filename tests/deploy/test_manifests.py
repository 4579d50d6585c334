"""Every manifest under deploy/ validates strictly and offline, against the oldest and the newest
Kubernetes the schemas cover (tests/deploy/schemas.py says which schemas): each file kustomize reads,
and what `kubectl kustomize` renders from each kustomization."""

import copy

import pytest

from .manifests import DEPLOY, KUSTOMIZATIONS, load, needs_kubectl, rel, render, resource_files
from .schemas import VERSIONS, problems

# Not a Kubernetes object: Helm values for prometheus-adapter (test_defaults_agree checks its rule).
NOT_OBJECTS = {DEPLOY / "prometheus-adapter" / "values.yaml"}


def test_every_yaml_file_is_a_kustomization_a_resource_or_known():
    accounted = {*resource_files(), *(k / "kustomization.yaml" for k in KUSTOMIZATIONS), *NOT_OBJECTS}
    unchecked = {p.resolve() for p in DEPLOY.rglob("*.y*ml")} - {p.resolve() for p in accounted}
    assert not unchecked, f"manifests no test validates: {sorted(map(rel, unchecked))}"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", resource_files(), ids=rel)
def test_resource_files_validate(path, version):
    for doc in load(path):
        assert problems(doc, version) == [], f"{doc['kind']} in {rel(path)}"


@needs_kubectl
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=rel)
def test_rendered_kustomizations_validate(directory, version):
    docs = render(directory)
    assert docs, f"{rel(directory)} renders nothing"
    for doc in docs:
        assert problems(doc, version) == [], f"{doc['kind']} {doc['metadata']['name']} from {rel(directory)}"


# One misspelling per kind of schema (Kubernetes', the ServiceMonitor's, KServe's, and Kubernetes'
# inside KServe's): each must be caught, or the checks above could pass on anything.
@pytest.mark.parametrize("file, path, wrong", [
    ("base/deployment.yaml", ["spec", "template", "spec", "containers", 0], "readinesProbe"),
    ("base/hpa.yaml", ["spec"], "minReplica"),
    ("base/servicemonitor.yaml", ["spec", "endpoints", 0], "intervall"),
    ("kserve/inferenceservice.yaml", ["spec", "predictor", "model"], "storageURI"),
    ("kserve/servingruntime.yaml", ["spec", "containers", 0, "readinessProbe"], "httpGett"),
])
def test_a_misspelled_field_is_rejected(file, path, wrong):
    doc = copy.deepcopy(load(DEPLOY / file)[0])
    node = doc
    for key in path:
        node = node[key]
    node[wrong] = 1
    found = problems(doc, VERSIONS[-1])
    assert found and wrong in " ".join(found), found

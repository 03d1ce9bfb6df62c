"""examples/kuberay/raycluster.yaml cannot run here (no Kubernetes): its schema is checked instead.

Pod templates are checked against the Kubernetes core v1 schema (kubernetes-validate, strict:
unknown fields fail); the RayCluster's own fields against the part of KubeRay's ray.io/v1
RayCluster spec that the manifest uses (written here: KubeRay's CRD is not vendored)."""

from __future__ import annotations

import os

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install kubernetes-validate)"
)

from conftest import ROOT  # noqa: E402

MANIFEST = os.path.join(ROOT, "examples", "kuberay", "raycluster.yaml")
K8S_VERSION = "1.33.0"

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
#: The RayCluster (ray.io/v1) fields this manifest uses, with KubeRay's types; templates are
#: PodTemplateSpecs, checked separately against Kubernetes' own schema.
RAYCLUSTER_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["headGroupSpec"],
            "additionalProperties": False,
            "properties": {
                "rayVersion": {"type": "string"},
                "headGroupSpec": {
                    "type": "object",
                    "required": ["template"],
                    "additionalProperties": False,
                    "properties": {"rayStartParams": _STR_MAP, "template": {"type": "object"}},
                },
                "workerGroupSpecs": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["groupName", "template"],
                        "additionalProperties": False,
                        "properties": {
                            "groupName": {"type": "string"},
                            "replicas": _INT32,
                            "minReplicas": _INT32,
                            "maxReplicas": _INT32,
                            "rayStartParams": _STR_MAP,
                            "template": {"type": "object"},
                        },
                    },
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def manifest() -> dict:
    with open(MANIFEST) as f:
        return yaml.safe_load(f)


def _templates(manifest: dict) -> dict[str, dict]:
    spec = manifest["spec"]
    out = {"head": spec["headGroupSpec"]["template"]}
    out.update({g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]})
    return out


def test_raycluster_fields(manifest):
    jsonschema.validate(manifest, RAYCLUSTER_SCHEMA)
    for group in manifest["spec"]["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_pod_templates_against_the_kubernetes_schema(manifest):
    for name, template in _templates(manifest).items():
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
        kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)


def test_a_broken_template_is_caught(manifest):
    template = _templates(manifest)["boltzlabs-workers"]
    bad = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": template}
    bad = yaml.safe_load(yaml.safe_dump(bad))
    bad["template"]["spec"]["containers"][0]["securityContext"]["privileged"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_workers_get_what_the_namespaces_sandbox_needs_and_the_head_does_not(manifest):
    templates = _templates(manifest)
    worker = templates["boltzlabs-workers"]["spec"]["containers"][0]["securityContext"]
    assert worker["privileged"] is True and worker["runAsUser"] == 0
    head = templates["head"]["spec"]["containers"][0]["securityContext"]
    assert head["capabilities"]["drop"] == ["ALL"] and not head.get("privileged")
    assert manifest["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no workers on the head

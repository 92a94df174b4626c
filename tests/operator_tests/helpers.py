"""Test helpers without a cluster: the CRD file, its defaults, and InferenceService bodies.

The builders read specs as the API server stores them (defaults filled in by the CRD schema).
``with_defaults`` applies the CRD's defaults the way the API server does, so unit tests feed the
builders exactly what the operator receives; a cluster test checks the two agree on the example.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceservices.quire.dev.yaml"
PEERING_CRD_PATH = ROOT / "crds" / "kopfpeerings.kopf.dev.yaml"
MANIFESTS = Path(__file__).resolve().parent / "manifests"
EXAMPLE_PATH = MANIFESTS / "example.yaml"


def load_crd() -> dict[str, Any]:
    crd: dict[str, Any] = yaml.safe_load(CRD_PATH.read_text())
    return crd


def root_schema() -> dict[str, Any]:
    (version,) = load_crd()["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def with_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` with the schema's ``default``s filled in, recursively, as the API server
    defaults a structural schema: a missing property with a default gets a copy of it, and
    defaulting continues inside it (so ``engine: {}`` gains ``blockSize: 16``)."""
    if isinstance(value, dict):
        result = dict(value)
        for key, sub in schema.get("properties", {}).items():
            if key not in result and "default" in sub:
                result[key] = copy.deepcopy(sub["default"])
            if key in result:
                result[key] = with_defaults(result[key], sub)
        return result
    if isinstance(value, list) and "items" in schema:
        return [with_defaults(item, schema["items"]) for item in value]
    return value


def load_example() -> dict[str, Any]:
    example: dict[str, Any] = yaml.safe_load(EXAMPLE_PATH.read_text())
    return example


def inference_service(
    spec: dict[str, Any],
    *,
    name: str = "llm",
    namespace: str = "ml",
    uid: str = "0b5c8a5e-1111-4222-8333-944455556666",
    generation: int = 1,
) -> dict[str, Any]:
    """A stored-looking InferenceService body: metadata as the API server sets it, spec
    defaulted by the CRD."""
    body = {
        "apiVersion": "quire.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": generation},
        "spec": spec,
    }
    defaulted: dict[str, Any] = with_defaults(body, root_schema())
    return defaulted


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    """A built status's conditions by type: (status, reason, message)."""
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in status["conditions"]}

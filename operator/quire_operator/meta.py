"""Who the operator is to the API server, and how the objects it makes are marked.

Every child object (Deployment, Service, HPA, PDB and, through the pod template, the pods) is named
after its InferenceService, carries the labels below, and has the InferenceService as its
controller owner reference, so deleting the InferenceService lets the API server's garbage
collector delete them: the operator has no deletion handler and sets no finalizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GROUP = "quire.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"

# The one server-side-apply field manager: every field the operator sets is owned under this name.
FIELD_MANAGER = "quire-operator"

NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
PART_OF_LABEL = "app.kubernetes.io/part-of"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
APP_NAME = "quire-engine"
# The operator watches its children through this label only (a server-side label selector), so
# its watch streams carry nothing else of the cluster's.
MANAGED_BY_SELECTOR = f"{MANAGED_BY_LABEL}={FIELD_MANAGER}"


@dataclass(frozen=True)
class ObjectRef:
    """The InferenceService a child belongs to."""

    name: str
    namespace: str
    uid: str


def selector_labels(name: str) -> dict[str, str]:
    """The Deployment's selector. Immutable once the Deployment exists: never add to it."""
    return {NAME_LABEL: APP_NAME, INSTANCE_LABEL: name}


def selector_string(name: str) -> str:
    """``selector_labels`` as a label-selector string (status.selector, pod listing)."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(name).items()))


def labels(name: str) -> dict[str, str]:
    """The labels of every child object and pod."""
    return {
        **selector_labels(name),
        COMPONENT_LABEL: "inference-server",
        PART_OF_LABEL: "quire",
        MANAGED_BY_LABEL: FIELD_MANAGER,
    }


def owner_reference(ref: ObjectRef) -> dict[str, Any]:
    """Controller reference to the InferenceService.

    ``blockOwnerDeletion`` makes a foreground deletion of the InferenceService wait for its
    children, so ``kubectl delete --cascade=foreground`` returns once they are gone.
    """
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": ref.name,
        "uid": ref.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(ref: ObjectRef) -> dict[str, Any]:
    """``metadata`` for a child object: same name and namespace, labels, owner reference."""
    return {
        "name": ref.name,
        "namespace": ref.namespace,
        "labels": labels(ref.name),
        "ownerReferences": [owner_reference(ref)],
    }


def owned_by(obj: dict[str, Any], ref: ObjectRef) -> bool:
    """Whether ``obj`` (API JSON) has this InferenceService among its owners."""
    owners = obj.get("metadata", {}).get("ownerReferences") or []
    return any(owner.get("uid") == ref.uid for owner in owners)

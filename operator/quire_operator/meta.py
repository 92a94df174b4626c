"""Who the operator is to the API server, and how the objects it makes are marked.

Every child object (Deployment, Service, HPA, PDB, InferencePool and, through the pod template,
the pods) is named after its InferenceService; the Endpoint Picker's objects are named
``<name>-epp`` (builders/endpoint_picker.py); kinds.py lists every kind. All carry the labels
below, with the InferenceService's name as ``app.kubernetes.io/instance``, and have the
InferenceService as their controller owner reference, so deleting the InferenceService lets the
API server's garbage collector delete them: the operator has no deletion handler and sets no
finalizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from quire_operator.kinds import Kind

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
ENGINE_COMPONENT = "inference-server"
# The pod label the Gateway API Inference Extension's endpoint picker reads to pick an engine's
# metric names. "vllm" selects vllm:num_requests_waiting, vllm:num_requests_running,
# vllm:kv_cache_usage_perc, vllm:cache_config_info and vllm:lora_requests_info, which the engine
# exports under those names. Set on engine pods only, never in a selector.
ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"
ENGINE_TYPE = "vllm"
# The operator watches its children through this label only (a server-side label selector), so
# its watch streams carry nothing else of the cluster's.
MANAGED_BY_SELECTOR = f"{MANAGED_BY_LABEL}={FIELD_MANAGER}"


@dataclass(frozen=True)
class ObjectRef:
    """The InferenceService a child belongs to."""

    name: str
    namespace: str
    uid: str


class ChildKey(NamedTuple):
    """One child object of an InferenceService: its kind and name (in the same namespace)."""

    kind: Kind
    name: str


def selector_labels(name: str, app: str = APP_NAME) -> dict[str, str]:
    """A Deployment's selector (the engine's unless ``app`` names another). Immutable once the
    Deployment exists: never add to it."""
    return {NAME_LABEL: app, INSTANCE_LABEL: name}


def selector_string(name: str, app: str = APP_NAME) -> str:
    """``selector_labels`` as a label-selector string (status.selector, pod listing)."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(name, app).items()))


def labels(name: str, app: str = APP_NAME, component: str = ENGINE_COMPONENT) -> dict[str, str]:
    """The labels of a child object and its pods: the engine's unless ``app`` and ``component``
    name another part (the Endpoint Picker's pods must never match the engine's selector)."""
    return {
        **selector_labels(name, app),
        COMPONENT_LABEL: component,
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


def object_meta(
    ref: ObjectRef, name: str | None = None, object_labels: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``metadata`` for a child object: its name (default: the InferenceService's), the same
    namespace, labels (default: the engine's), the owner reference."""
    return {
        "name": ref.name if name is None else name,
        "namespace": ref.namespace,
        "labels": labels(ref.name) if object_labels is None else dict(object_labels),
        "ownerReferences": [owner_reference(ref)],
    }


def owned_by(obj: dict[str, Any], ref: ObjectRef) -> bool:
    """Whether ``obj`` (API JSON) has this InferenceService among its owners."""
    owners = obj.get("metadata", {}).get("ownerReferences") or []
    return any(owner.get("uid") == ref.uid for owner in owners)

"""Pure builder: InferenceService -> its Gateway API Inference Extension ``InferencePool``.

With ``spec.routing.mode: InferencePool`` a Gateway that implements the Inference Extension
(Istio, kgateway, agentgateway, Envoy Gateway, ...) sends each request of an HTTPRoute whose
backendRef is this pool to the engine pod the pool's Endpoint Picker chooses by engine state
(queue, KV-cache usage, prefix-cache affinity) instead of to any pod.

Ownership (server-side apply, field manager ``quire-operator``): the operator owns the pool's
``spec`` exactly as built here; ``status`` belongs to the Gateways (each parent writes its own
entry of ``status.parents``), which the operator only reads (observed/views.py). The pool is named
after the InferenceService, like its Service, so an HTTPRoute names either one the same way.
"""

from __future__ import annotations

from typing import Any

from quire_operator import meta
from quire_operator.builders.deployment import ENGINE_PORT
from quire_operator.builders.leader_worker_set import pod_selector
from quire_operator.kinds import Kind
from quire_operator.spec.view import InferenceService

# The Endpoint Picker's ext_proc gRPC port, on its container and its Service (GIE's default).
EPP_GRPC_PORT = 9002


def epp_name(name: str) -> str:
    """The name of the Endpoint Picker's objects (Deployment, Service, ServiceAccount, Role,
    RoleBinding, ConfigMap) of InferenceService ``name``."""
    return f"{name}-epp"


def build_inference_pool(isvc: InferenceService) -> dict[str, Any] | None:
    """The pool of exactly this InferenceService's engine pods (the engine Deployment's own
    selector, which no other service's pods or the Endpoint Picker's carry), on the engine's
    container port; None unless routing is on."""
    if not isvc.routing.enabled:
        return None
    name = isvc.ref.name
    return {
        "apiVersion": Kind.INFERENCE_POOL.api_version,
        "kind": Kind.INFERENCE_POOL.value,
        "metadata": meta.object_meta(isvc.ref),
        "spec": {
            "selector": {"matchLabels": pod_selector(isvc)},  # multi-node: leaders only
            "targetPorts": [{"number": ENGINE_PORT}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": epp_name(name),
                "port": {"number": EPP_GRPC_PORT},
                "failureMode": isvc.routing.failure_mode.value,
            },
        },
    }

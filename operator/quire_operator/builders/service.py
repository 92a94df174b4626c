"""Pure builder: InferenceService -> its Service (named after it, the engine's port).

Ownership (server-side apply, field manager ``quire-operator``): the operator owns every field.
"""

from __future__ import annotations

from typing import Any

from quire_operator import meta
from quire_operator.builders.deployment import PORT_NAME
from quire_operator.builders.leader_worker_set import pod_selector
from quire_operator.spec.view import InferenceService


def build_service(isvc: InferenceService) -> dict[str, Any]:
    port = {
        "name": PORT_NAME,
        "port": isvc.service.port,
        "targetPort": PORT_NAME,
        "protocol": "TCP",
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta.object_meta(isvc.ref),
        "spec": {
            "type": isvc.service.type,
            "selector": pod_selector(isvc),  # a multi-node replica: its leader only
            "ports": [port],
        },
    }

"""Pure builder: InferenceService -> its PodDisruptionBudget, while it can have more than one
replica (``None`` otherwise: the reconciler then deletes the one it owns).

Ownership (server-side apply, field manager ``quire-operator``): the operator owns every field.
"""

from __future__ import annotations

from typing import Any

from quire_operator import meta
from quire_operator.spec.view import InferenceService


def build_pdb(isvc: InferenceService) -> dict[str, Any] | None:
    """A budget of one voluntary disruption at a time; None when there can be only one replica
    (a budget over a single pod either blocks node drains or protects nothing)."""
    if isvc.max_replicas <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta.object_meta(isvc.ref),
        "spec": {
            "selector": {"matchLabels": meta.selector_labels(isvc.ref.name)},
            "maxUnavailable": 1,
            # A replica that is not ready (still loading, crash-looping) serves nothing, so
            # evicting it must never be what blocks a node drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }

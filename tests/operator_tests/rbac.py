"""The operator's RBAC as the API server stores the chart's rules, derived from kinds.py's table.

The chart (charts/quire/templates/_helpers.tpl, ``quire.rbac.rules``) writes one rule per kind in
the table's order, kinds of one API group with the same verbs side by side in one rule; around
them the rules of the InferenceService itself and those the operator holds only to grant them
to the Endpoint Picker's Role. Each is an API call the operator makes; the chart says why.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from quire_operator import meta
from quire_operator.builders.endpoint_picker import OBJECTIVES_GROUP
from quire_operator.kinds import OWNED, RESOURCES, Kind, Verb


def rule(group: str, resource: str, *verbs: str) -> dict[str, Any]:
    return {"apiGroups": [group], "resources": [resource], "verbs": list(verbs)}


def kind_rules(kinds: Iterable[Kind]) -> list[dict[str, Any]]:
    """The rules of ``kinds``, in order, neighbours of one group with the same verbs merged."""
    rules: list[dict[str, Any]] = []
    for kind in kinds:
        resource = RESOURCES[kind]
        verbs = [verb.value for verb in resource.verbs]
        last = rules[-1] if rules else None
        if last is not None and last["apiGroups"] == [resource.group] and last["verbs"] == verbs:
            last["resources"].append(resource.plural)
        else:
            rules.append(rule(resource.group, resource.plural, *verbs))
    return rules


READ = (Verb.GET.value, Verb.LIST.value, Verb.WATCH.value)
# The rules every mode grants (a Role in namespaced mode, part of the ClusterRole otherwise),
# exactly as the API server stores them.
NAMESPACED_RULES = [
    rule(meta.GROUP, meta.PLURAL, "get", "list", "watch", "patch"),
    rule(meta.GROUP, f"{meta.PLURAL}/status", "patch"),
    rule(meta.GROUP, f"{meta.PLURAL}/finalizers", "update"),
    *kind_rules(OWNED),
    {
        "apiGroups": [OBJECTIVES_GROUP],
        "resources": ["inferenceobjectives", "inferencemodelrewrites"],
        "verbs": list(READ),
    },
    *kind_rules(kind for kind in RESOURCES if not RESOURCES[kind].owned),
]


def peering_rule(plural: str) -> dict[str, Any]:
    return rule("kopf.dev", plural, "get", "list", "watch", "create", "patch")

"""The kinds of object the operator touches besides its InferenceServices: one table.

Each row says where the kind is served (group, version, plural), whether its CRD is optional
(the operator runs without KEDA, the Gateway API Inference Extension or LeaderWorkerSet: such a
kind goes through the custom-objects API and is watched only where served at start), which
change of it calls for a reconcile (``Watch``; ``NOT_WATCHED`` kinds are repaired on the next
reconcile), and the RBAC verbs the operator needs on it. The handlers (what to watch), the
children client (how to call it, whether it is served), the reconcile's CRD-missing reports and
the chart's RBAC test read this table; the chart's rules (charts/quire/templates/_helpers.tpl)
follow its order.

``owned``: the kind is a child of an InferenceService (its controller owner reference); pods are
only caused (through a Deployment, a LeaderWorkerSet or a Job) and Events only posted.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple


class Verb(enum.StrEnum):
    GET = "get"
    LIST = "list"
    WATCH = "watch"
    CREATE = "create"
    PATCH = "patch"
    DELETE = "delete"


class Watch(enum.Enum):
    """Which change of a watched object calls for its InferenceService's reconcile: the rest is
    status churn (an HPA rewrites its status every sync) that costs nothing."""

    NOT_WATCHED = "not watched"
    EVERY_EVENT = "every event"  # its status feeds the InferenceService's
    RESOURCE_VERSION = "resource version"  # no generation: moves only when someone edits it
    GENERATION = "generation"  # its spec
    HPA_STATE = "hpa state"  # spec generation, replica choice, condition verdicts
    SCALED_OBJECT_STATE = "scaled object state"  # spec generation, condition verdicts
    JOB_STATE = "job state"  # running and failed pods, condition verdicts


class Kind(enum.StrEnum):
    """A kind by its name, as in an object's ``kind`` (so it compares equal to that string)."""

    DEPLOYMENT = "Deployment"
    SERVICE = "Service"
    HPA = "HorizontalPodAutoscaler"
    PDB = "PodDisruptionBudget"
    PVC = "PersistentVolumeClaim"
    JOB = "Job"
    SCALED_OBJECT = "ScaledObject"
    INFERENCE_POOL = "InferencePool"
    LEADER_WORKER_SET = "LeaderWorkerSet"
    SERVICE_ACCOUNT = "ServiceAccount"
    CONFIG_MAP = "ConfigMap"
    ROLE = "Role"
    ROLE_BINDING = "RoleBinding"
    POD = "Pod"
    SECRET = "Secret"
    EVENT = "Event"

    @property
    def resource(self) -> Resource:
        return RESOURCES[self]

    @property
    def group(self) -> str:
        return RESOURCES[self].group

    @property
    def version(self) -> str:
        return RESOURCES[self].version

    @property
    def plural(self) -> str:
        return RESOURCES[self].plural

    @property
    def api_version(self) -> str:
        resource = RESOURCES[self]
        return f"{resource.group}/{resource.version}" if resource.group else resource.version


class Resource(NamedTuple):
    group: str  # "" for the core API
    version: str
    plural: str
    optional_crd: bool
    watch: Watch
    verbs: tuple[Verb, ...]
    owned: bool = True


_V = Verb
# Watched children: read (is the name ours?), applied (create, patch), deleted when no longer
# wanted, listed and watched to repair drift.
WATCHED = (_V.GET, _V.LIST, _V.WATCH, _V.CREATE, _V.PATCH, _V.DELETE)
# Applied and deleted, never listed or watched.
APPLIED = (_V.GET, _V.CREATE, _V.PATCH, _V.DELETE)
READ = (_V.GET, _V.LIST, _V.WATCH)

RESOURCES: Mapping[Kind, Resource] = MappingProxyType(
    {
        Kind.DEPLOYMENT: Resource("apps", "v1", "deployments", False, Watch.EVERY_EVENT, WATCHED),
        Kind.SERVICE: Resource("", "v1", "services", False, Watch.RESOURCE_VERSION, WATCHED),
        Kind.HPA: Resource(
            "autoscaling", "v2", "horizontalpodautoscalers", False, Watch.HPA_STATE, WATCHED
        ),
        Kind.PDB: Resource(
            "policy", "v1", "poddisruptionbudgets", False, Watch.GENERATION, WATCHED
        ),
        # The model cache: the claim's phase (Bound) and the download Job's progress feed the
        # status; finished Jobs are left to the garbage collector (no delete).
        Kind.PVC: Resource("", "v1", "persistentvolumeclaims", False, Watch.EVERY_EVENT, WATCHED),
        Kind.JOB: Resource("batch", "v1", "jobs", False, Watch.JOB_STATE, WATCHED[:-1]),
        Kind.SCALED_OBJECT: Resource(
            "keda.sh", "v1alpha1", "scaledobjects", True, Watch.SCALED_OBJECT_STATE, WATCHED
        ),
        # Every change matters: the Gateways write their verdicts on the pool into its status.
        Kind.INFERENCE_POOL: Resource(
            "inference.networking.k8s.io", "v1", "inferencepools", True, Watch.EVERY_EVENT, WATCHED
        ),
        # Not watched: its pods are.
        Kind.LEADER_WORKER_SET: Resource(
            "leaderworkerset.x-k8s.io", "v1", "leaderworkersets", True, Watch.NOT_WATCHED, APPLIED
        ),
        # The Endpoint Picker's: not watched (the operator may not list ConfigMaps, and needs no
        # watch on RBAC objects).
        Kind.SERVICE_ACCOUNT: Resource(
            "", "v1", "serviceaccounts", False, Watch.NOT_WATCHED, APPLIED
        ),
        Kind.CONFIG_MAP: Resource("", "v1", "configmaps", False, Watch.NOT_WATCHED, APPLIED),
        Kind.ROLE: Resource(
            "rbac.authorization.k8s.io", "v1", "roles", False, Watch.NOT_WATCHED, APPLIED
        ),
        Kind.ROLE_BINDING: Resource(
            "rbac.authorization.k8s.io", "v1", "rolebindings", False, Watch.NOT_WATCHED, APPLIED
        ),
        # Engine, Endpoint Picker and download pods: explain an unready replica, carry the
        # download's outcome; never changed.
        Kind.POD: Resource("", "v1", "pods", False, Watch.EVERY_EVENT, READ, owned=False),
        # Only spec.apiKeySecretRef's, read to call a replica's LoRA endpoints (spec.lora).
        Kind.SECRET: Resource(
            "", "v1", "secrets", False, Watch.NOT_WATCHED, (_V.GET,), owned=False
        ),
        # One per status transition, on the InferenceService.
        Kind.EVENT: Resource(
            "", "v1", "events", False, Watch.NOT_WATCHED, (_V.CREATE,), owned=False
        ),
    }
)

OWNED = tuple(kind for kind in Kind if RESOURCES[kind].owned)
OPTIONAL = tuple(kind for kind in Kind if RESOURCES[kind].optional_crd)

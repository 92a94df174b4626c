"""Pure: one InferenceService -> every child it wants, in apply order, as its applied
configuration, or None where the spec wants none (the reconciler deletes the one it owns, since
an apply cannot express "absent").

Split in two because the model cache's objects are observed even when the rest cannot be built:
``model_cache_children`` never raises, ``engine_children`` raises ``ValueError`` for a spec that
cannot be built (a KEDA backend with no Prometheus address anywhere).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quire_operator.builders.autoscaling import build_autoscalers
from quire_operator.builders.deployment import build_deployment, cache_claim_name
from quire_operator.builders.disruption_budget import build_pdb
from quire_operator.builders.endpoint_picker import routing_children
from quire_operator.builders.leader_worker_set import build_leader_worker_set
from quire_operator.builders.model_cache import (
    CACHE_COMPONENT,
    build_adapter_job,
    build_claim,
    build_job,
)
from quire_operator.builders.service import build_service
from quire_operator.config import OperatorConfig
from quire_operator.kinds import Kind
from quire_operator.meta import COMPONENT_LABEL, ChildKey
from quire_operator.spec.lora import AdapterKind
from quire_operator.spec.view import InferenceService

# Each child -> its applied configuration, or None: delete it if it is ours.
Wanted = dict[ChildKey, dict[str, Any] | None]


def adapter_jobs(isvc: InferenceService, config: OperatorConfig) -> dict[str, dict[str, Any]]:
    """Each hf:// adapter's name -> its download Job (none without spec.lora or a cache)."""
    if isvc.lora is None or isvc.model.cache is None:
        return {}
    hf = (a for a in isvc.lora.adapters if a.kind is AdapterKind.HF)
    return {adapter.name: build_adapter_job(isvc, config, adapter) for adapter in hf}


def model_cache_children(
    isvc: InferenceService,
    config: OperatorConfig,
    adapters: Mapping[str, dict[str, Any]] | None = None,
) -> Wanted:
    """The cache's claim (None when the cache is turned off), the model's download Job and one
    per hf:// adapter (``adapters``: ``adapter_jobs`` already built, else built here); finished
    Jobs of earlier specs (and of adapters taken out of the spec) stay as records until the
    InferenceService goes."""
    claim = ChildKey(Kind.PVC, cache_claim_name(isvc.ref.name))
    cache = isvc.model.cache
    if cache is None:
        return {claim: None}
    built = adapter_jobs(isvc, config) if adapters is None else adapters
    jobs = [build_job(isvc, config), *built.values()]
    return {
        claim: build_claim(isvc, cache),
        **{ChildKey(Kind.JOB, job["metadata"]["name"]): job for job in jobs},
    }


def download_job(cache: Wanted) -> str | None:
    """The name of the model's download Job among ``model_cache_children``, if the spec has a
    cache (the adapters' Jobs carry another component label)."""
    return next(
        (
            key.name
            for key, obj in cache.items()
            if key.kind == Kind.JOB
            and obj is not None
            and obj["metadata"]["labels"][COMPONENT_LABEL] == CACHE_COMPONENT
        ),
        None,
    )


def engine_children(isvc: InferenceService, config: OperatorConfig) -> Wanted:
    """The engine's Deployment or LeaderWorkerSet, Service, autoscaler and PDB. A multi-node
    replica is a LeaderWorkerSet group instead of a Deployment's pod; the other one is deleted
    when the spec switches (None), so the kinds never run side by side."""
    name = isvc.ref.name
    multi = isvc.parallelism.multi_node
    return {
        ChildKey(Kind.DEPLOYMENT, name): None if multi else build_deployment(isvc, config),
        ChildKey(Kind.LEADER_WORKER_SET, name): build_leader_worker_set(isvc, config)
        if multi
        else None,
        ChildKey(Kind.SERVICE, name): build_service(isvc),
        **{ChildKey(kind, name): obj for kind, obj in build_autoscalers(isvc, config)},
        ChildKey(Kind.PDB, name): build_pdb(isvc),
    }


def routing(isvc: InferenceService, config: OperatorConfig) -> Wanted:
    """The InferencePool and the Endpoint Picker's objects (each None with routing off)."""
    return dict(routing_children(isvc, config))

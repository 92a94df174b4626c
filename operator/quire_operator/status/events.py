"""Kubernetes Events on the InferenceService: one per transition, for ``kubectl describe``.

``transitions`` is pure: it compares the status before and after a reconcile and names what a
person looks for (a generation applied, a scale, a scale to and from zero, Ready or RoutingReady
gained or lost, Degraded and why, the recovery, a LoRA adapter failed or loaded everywhere). An
unchanged status yields nothing, so a reconcile loop that finds the world as it was posts no
Event: Events cannot flood. ``EventRecorder`` posts them (core/v1 Events, the ones ``kubectl
describe`` lists); an Event that
cannot be posted is logged and never fails a reconcile.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from quire_operator import meta
from quire_operator.children import TIMEOUT
from quire_operator.meta import ObjectRef

logger = logging.getLogger(__name__)

NORMAL, WARNING = "Normal", "Warning"
# Progressing reasons that mean the generation's children were applied.
_APPLIED = frozenset({"RollingOut", "RolloutComplete"})
# RoutingReady gained and lost (like Ready; present only with routing on, so turning routing off
# is no loss).
_ROUTING = ("RoutingReady", "RoutingReady", "RoutingNotReady")


@dataclass(frozen=True)
class Transition:
    type: str  # Normal or Warning
    reason: str
    message: str


def _conditions(status: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c["type"]: c for c in status.get("conditions") or []}


def _idle(conditions: Mapping[str, Mapping[str, Any]]) -> bool:
    """Not ready only because the autoscaler scaled to zero (minReplicas 0)."""
    ready = conditions.get("Ready", {}).get("reason") == "ScaledToZero"
    return ready and conditions.get("ScaledToZero", {}).get("status") == "True"


def transitions(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[Transition]:
    """What changed between two statuses, in the order a reader wants it."""
    old, new = _conditions(before), _conditions(after)
    found: list[Transition] = []
    generation = after.get("observedGeneration")
    # Applied: this generation's children are in place now and were not before (a new
    # generation, or the same one no longer blocked by a problem).
    was_applied = old.get("Progressing", {}).get("reason") in _APPLIED
    applied = new.get("Progressing", {}).get("reason") in _APPLIED
    if applied and (not was_applied or before.get("observedGeneration") != generation):
        found.append(Transition(NORMAL, "Applied", f"applied generation {generation}"))
    # Scaled: the Deployment's replicas moved (the HPA, kubectl scale, the spec); not its
    # first appearance.
    was, now = before.get("desiredReplicas"), after.get("desiredReplicas")
    if was_applied and applied and was != now:
        found.append(Transition(NORMAL, "Scaled", f"scaled from {was} to {now} replicas"))
    degraded, was_degraded = new.get("Degraded", {}), old.get("Degraded", {})
    if degraded.get("status") == "True" and (
        was_degraded.get("status") != "True" or was_degraded.get("reason") != degraded["reason"]
    ):
        found.append(Transition(WARNING, degraded["reason"], degraded["message"]))
    elif degraded.get("status") == "False" and was_degraded.get("status") == "True":
        message = f"no longer degraded ({was_degraded.get('reason')} resolved)"
        found.append(Transition(NORMAL, "Recovered", message))
    # Scale to zero and back (present only with minReplicas 0): Normal both ways, expected.
    zero, was_zero = new.get("ScaledToZero", {}), old.get("ScaledToZero", {})
    if zero.get("status") == "True" and was_zero.get("status") == "False":
        found.append(Transition(NORMAL, "ScaledToZero", "scaled to 0 replicas (idle)"))
    elif zero.get("status") == "False" and was_zero.get("status") == "True":
        message = f"scaled from 0 to {after.get('desiredReplicas')} replicas"
        found.append(Transition(NORMAL, "ScaledFromZero", message))
    for kind, gained, lost in (("Ready", "Ready", "NotReady"), _ROUTING):
        now_, then = new.get(kind, {}), old.get(kind, {})
        if now_.get("status") != then.get("status"):
            if now_.get("status") == "True":
                found.append(Transition(NORMAL, gained, now_["message"]))
            elif then.get("status") == "True" and now_.get("status") == "False":
                if kind == "Ready" and _idle(new):
                    continue  # scaled to zero on purpose: no Warning
                found.append(Transition(WARNING, lost, now_["message"]))
    # The host tier's memory limit warning: once when it appears or its text changes.
    warning = (after.get("hostTier") or {}).get("warning")
    if warning and warning != (before.get("hostTier") or {}).get("warning"):
        found.append(Transition(WARNING, "HostTierMemory", warning))
    found += _adapter_transitions(before, after)
    return found


def _adapter_transitions(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[Transition]:
    """Per adapter of status.adapters: a Warning when it fails (or fails anew, with another
    message), a Normal when it becomes loaded on every ready replica."""
    old = {a.get("name"): a for a in before.get("adapters") or []}
    found = []
    for adapter in after.get("adapters") or []:
        name, state, message = adapter["name"], adapter["state"], adapter.get("message", "")
        was = old.get(name, {})
        changed = was.get("state") != state
        if state == "Failed" and (changed or was.get("message") != message):
            found.append(Transition(WARNING, "AdapterFailed", f"adapter {name}: {message}"))
        elif state == "Loaded" and changed:
            found.append(Transition(NORMAL, "AdapterLoaded", f"adapter {name}: {message}"))
    return found


class EventRecorder:
    """Posts Events about InferenceServices as ``quire-operator``."""

    def __init__(self, api: client.ApiClient) -> None:
        self._core = client.CoreV1Api(api)

    def post(self, ref: ObjectRef, transition: Transition) -> None:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event: Any = {
            "metadata": {
                "generateName": f"{ref.name}.",
                "namespace": ref.namespace,
            },
            "involvedObject": {
                "apiVersion": meta.API_VERSION,
                "kind": meta.KIND,
                "name": ref.name,
                "namespace": ref.namespace,
                "uid": ref.uid,
            },
            "type": transition.type,
            "reason": transition.reason,
            "message": transition.message[:1024],
            "source": {"component": meta.FIELD_MANAGER},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self._core.create_namespaced_event(ref.namespace, event, _request_timeout=TIMEOUT)
        except (ApiException, OSError, urllib3.exceptions.HTTPError) as err:
            # The status already says it; a lost Event must not fail or repeat a reconcile.
            logger.warning("cannot post Event %s: %s", transition.reason, err)

"""Level-triggered reconcile of one InferenceService against the API server.

Every trigger (the InferenceService created, changed or seen at startup; a child object or pod
changed or deleted; a retry; the periodic resync) runs the same ``Reconciler.reconcile(namespace,
name)``: read the latest InferenceService, parse it once into its typed view (spec/), build its
children once (builders/), apply them under the ownership rules (converge.py: each child name
free or already ours, deletions of what the spec no longer wants), observe what came of it
(observe.py) and write the status if it changed (status/), with one Event per transition.
Reading the latest object instead of the event's copy means a late event can never re-apply an
older spec.

Ownership:
- ``status`` of the InferenceService is written by merge patch under the field manager of the
  children (``meta.FIELD_MANAGER``); the children's ownership rules are converge.py's.
- One lock per (namespace, name) stripe serializes reconciles of an object within the process;
  kopf peering keeps a second operator process paused, so nothing else writes these fields.
- The operator reads one Secret only: with ``spec.lora`` and ``spec.apiKeySecretRef``, the API key
  it calls the replicas' LoRA endpoints with (reconcile/adapters.py). A missing API key or model
  token Secret shows in the pods' status (the kubelet's CreateContainerConfigError names it),
  which the status reports.
"""

from __future__ import annotations

import datetime
import logging
import threading
import zlib
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from quire_operator import meta
from quire_operator.builders.desired import Wanted, adapter_jobs, model_cache_children
from quire_operator.children import TIMEOUT, Children
from quire_operator.config import OperatorConfig
from quire_operator.kinds import Kind
from quire_operator.reconcile.adapters import AdapterLoader
from quire_operator.reconcile.converge import Converger
from quire_operator.reconcile.observe import Observer
from quire_operator.spec.parsing import read
from quire_operator.spec.view import InferenceService
from quire_operator.status.conditions import Problem, build_status
from quire_operator.status.events import EventRecorder, transitions
from quire_operator.status.metrics import OperatorMetrics

logger = logging.getLogger("quire_operator.reconcile")

MERGE = "application/merge-patch+json"
_LOCK_STRIPES = 64
# Returned (not reported) while an adapter is on its way to a replica: retried with backoff.
_ADAPTERS_PENDING = Problem("AdaptersPending", "adapters still loading", retry=True)


def _log_changes(namespace: str, name: str, before: dict[str, Any], after: dict[str, Any]) -> None:
    """One line per condition flip and per newly applied generation: the operator's story."""
    if before.get("observedGeneration") != after["observedGeneration"]:
        logger.info("%s/%s: reconciled generation %s", namespace, name, after["observedGeneration"])
    old = {c["type"]: c["status"] for c in before.get("conditions") or []}
    for condition in after["conditions"]:
        if old.get(condition["type"]) != condition["status"]:
            logger.info(
                "%s/%s: %s=%s (%s: %s)",
                namespace,
                name,
                condition["type"],
                condition["status"],
                condition["reason"],
                condition["message"],
            )


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    """Holds the API clients; safe to call from kopf's handler threads and the requeue thread."""

    def __init__(
        self,
        api: client.ApiClient,
        config: OperatorConfig,
        now: Callable[[], str] = _now,
        events: EventRecorder | None = None,
        metrics: OperatorMetrics | None = None,
    ) -> None:
        self._config = config
        self._now = now
        self._events = events if events is not None else EventRecorder(api)
        self.metrics = metrics if metrics is not None else OperatorMetrics()
        self._converger = Converger(Children(api), config)
        self._observer = Observer(api, config)
        self._adapters = AdapterLoader(api)
        self._custom = client.CustomObjectsApi(api)
        self._locks = [threading.Lock() for _ in range(_LOCK_STRIPES)]

    def reconcile(self, namespace: str, name: str) -> Problem | None:
        """Converge one InferenceService; returns why its spec is not applied, if it is not.
        Raises ``ApiException`` for failures worth retrying (``children.retriable``)."""
        stripe = zlib.crc32(f"{namespace}/{name}".encode()) % _LOCK_STRIPES
        with self._locks[stripe]:
            body = self._read_inference_service(namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return None  # gone or going: the garbage collector removes the children
            spec = read(body)  # the one parse of this reconcile
            # Built once: applied by the converger, named in the status by the observer.
            cache: Wanted = {}
            downloads: dict[str, str] = {}  # hf:// adapter -> its download Job
            if isinstance(spec, InferenceService):
                built = adapter_jobs(spec, self._config)
                downloads = {name: job["metadata"]["name"] for name, job in built.items()}
                cache = model_cache_children(spec, self._config, built)
            problem, ours = self._converger.converge(spec, cache)
            adapters = None
            if isinstance(spec, InferenceService) and spec.lora is not None:
                found = {key.name: obj for key, obj in ours.items() if key.kind == Kind.JOB}
                adapters = self._adapters.sync(spec, downloads, found)
            observed = self._observer.observe(spec, problem, ours, cache, adapters)
            previous = body.get("status") or {}
            status = build_status(observed, previous, self._now())
            if status != previous:
                self._write_status(namespace, name, status, previous)
                _log_changes(namespace, name, previous, status)
                ref = spec.identity.ref
                for transition in transitions(previous, status):
                    self._events.post(ref, transition)
                    self.metrics.count(body, transition)
            if problem is None and adapters is not None and adapters.pending:
                return _ADAPTERS_PENDING
            return problem

    def _read_inference_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            body = self._custom.get_namespaced_custom_object(
                meta.GROUP, meta.VERSION, namespace, meta.PLURAL, name, _request_timeout=TIMEOUT
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        if not isinstance(body, dict):  # the client types custom objects as `object`
            raise TypeError(f"expected a JSON object for {namespace}/{name}, got {type(body)}")
        return body

    def _write_status(
        self, namespace: str, name: str, status: dict[str, Any], previous: dict[str, Any]
    ) -> None:
        # A merge patch keeps keys it does not name: a key the status no longer has (routing
        # turned off) is removed by naming it with null.
        gone = {key: None for key in previous.keys() - status.keys()}
        try:
            self._custom.patch_namespaced_custom_object_status(
                meta.GROUP,
                meta.VERSION,
                namespace,
                meta.PLURAL,
                name,
                {"status": {**status, **gone}},
                field_manager=meta.FIELD_MANAGER,
                _content_type=MERGE,
                _request_timeout=TIMEOUT,
            )
        except ApiException as err:
            if err.status != 404:  # deleted meanwhile: nothing left to report on
                raise

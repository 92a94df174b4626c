"""Bring every ready replica's LoRA adapters to ``spec.lora.adapters``, level-triggered.

Each reconcile of an InferenceService with ``spec.lora`` asks every ready engine pod which
adapters it serves (``GET /v1/models``), then loads what is missing and unloads what the spec no
longer names, through the engine's runtime endpoints. Nothing is remembered between reconciles:
a replica that restarts comes back with none and is filled again by the reconcile its pod's
Ready event starts; an adapter someone unloaded by hand is loaded again at the next one.

Ownership:
- The operator owns every adapter on its replicas: the engine flags come from ``spec.lora``
  (``--lora-modules`` is refused in extraArgs), so an adapter the spec does not name is unloaded.
  An adapter served from another path than the spec's (the uri or revision changed) is unloaded
  and loaded again from the new one.
- An hf:// adapter of the model cache is loaded only once its download Job has completed (the
  engine would read a half-written directory otherwise); without a cache the replica downloads
  it itself during the load (``hf://org/name@revision``).
- A load the engine refuses (bad files, a rank above maxLoraRank, another base model) is that
  adapter's failure on that pod; the other adapters and pods go on. It is tried again at the next
  reconcile (a Job, pod or spec change, or the periodic resync), not in a loop.
- A pod that does not answer, or a load still running there, leaves the adapter pending and asks
  for a retry (``pending``), so it converges without waiting for the resync.
- The replicas are called at once (up to ``_PARALLEL_PODS``), each by its own ``_PodPass``, which
  only that thread touches.
- The API key, when the spec has one, is read from its Secret once per reconcile that calls a
  replica: the runtime endpoints sit behind it.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from quire_operator import meta
from quire_operator.builders.deployment import ENGINE_PORT
from quire_operator.builders.lora import adapter_path
from quire_operator.children import TIMEOUT
from quire_operator.observed import engine_api
from quire_operator.observed.engine_api import EngineCallError
from quire_operator.observed.views import JobView, ServingPod, parse_job, parse_serving_pod
from quire_operator.spec.lora import Adapter
from quire_operator.spec.view import InferenceService
from quire_operator.status.adapters import AdapterObservation, PodFailure

logger = logging.getLogger("quire_operator.adapters")
# Replicas called at once in one reconcile (each call is I/O: the replica's HTTP answer).
_PARALLEL_PODS = 8


@dataclass(frozen=True)
class AdapterSync:
    """What one pass found and did: each adapter's observation, in the spec's order, and
    whether something is still on its way (worth a retry soon)."""

    adapters: tuple[AdapterObservation, ...]
    pending: bool


def _download_wait(job_name: str, job: JobView | None) -> tuple[str | None, bool]:
    """(why an hf:// adapter of the model cache cannot be loaded yet, whether its download
    failed)."""
    if job is None:
        return f"its download Job {job_name} does not exist yet", False
    if job.finished("Complete") is not None:
        return None, False
    failed = job.finished("Failed")
    if failed is not None:
        return f"download Job {job_name} failed: {failed.reason}: {failed.message}", True
    return f"downloading (Job {job_name})", False


class KeyUnreadable(RuntimeError):
    """The replicas' API key cannot be read; the message says why."""


class _PodPass:
    """One pod's adapters brought to the spec; collects what came of each."""

    def __init__(self, pod: ServingPod, api_key: str | None) -> None:
        self.pod = pod
        self.url = f"http://{pod.ip}:{ENGINE_PORT}"
        self.api_key = api_key
        self.loaded: set[str] = set()
        self.failed: dict[str, str] = {}
        self.pending = False

    def sync(self, loadable: Sequence[Adapter], wanted: set[str], cached: bool) -> None:
        try:
            served = engine_api.served_adapters(self.url, self.api_key)
        except EngineCallError as err:
            logger.info("pod %s: cannot list adapters: %s", self.pod.name, err)
            self.pending = True
            return
        for name in served.keys() - wanted:
            self._unload(name, "not in spec.lora.adapters")
        for adapter in loadable:
            path = adapter_path(adapter, cached)
            root = served.get(adapter.name)
            if root == path:
                self.loaded.add(adapter.name)
                continue
            if root is not None and not self._unload(adapter.name, f"served from {root}"):
                continue
            self._load(adapter, path)

    def _unload(self, name: str, why: str) -> bool:
        try:
            engine_api.unload_adapter(self.url, self.api_key, name)
        except EngineCallError as err:
            # Still finishing its requests (the engine goes on), or already gone.
            self.pending = self.pending or err.pending
            return False
        logger.info("pod %s: unloaded adapter %s (%s)", self.pod.name, name, why)
        return True

    def _load(self, adapter: Adapter, path: str) -> None:
        try:
            engine_api.load_adapter(self.url, self.api_key, adapter.name, path)
        except EngineCallError as err:
            if err.pending:
                self.pending = True
            else:
                self.failed[adapter.name] = str(err)
                logger.warning("pod %s: adapter %s refused: %s", self.pod.name, adapter.name, err)
            return
        self.loaded.add(adapter.name)
        logger.info("pod %s: loaded adapter %s from %s", self.pod.name, adapter.name, path)


class AdapterLoader:
    """Calls the API server (pods, the API key's Secret) and the replicas; no state between
    calls."""

    def __init__(self, api: client.ApiClient) -> None:
        self._api = api
        self._core = client.CoreV1Api(api)

    def sync(
        self,
        isvc: InferenceService,
        jobs: Mapping[str, str],
        ours: Mapping[str, Mapping[str, Any]],
    ) -> AdapterSync | None:
        """``jobs``: each hf:// adapter's download Job name; ``ours``: our Jobs as applied, by
        name. None without ``spec.lora``."""
        if isvc.lora is None:
            return None
        waits: dict[str, tuple[str | None, bool]] = {}
        for adapter in isvc.lora.adapters:
            name = jobs.get(adapter.name)  # an hf:// adapter of the model cache
            if name is not None:
                found = ours.get(name)
                waits[adapter.name] = _download_wait(name, parse_job(found) if found else None)
        loadable = [a for a in isvc.lora.adapters if waits.get(a.name, (None, False))[0] is None]
        wanted = {adapter.name for adapter in isvc.lora.adapters}
        pods = self._serving_pods(isvc)
        callable_pods = pods
        try:
            api_key = self._api_key(isvc) if pods else None  # read once, only to call a replica
        except KeyUnreadable as err:  # no replica can be called: every adapter says why
            waits = {adapter.name: (str(err), True) for adapter in isvc.lora.adapters}
            api_key, callable_pods = None, []
        passes = [_PodPass(pod, api_key) for pod in callable_pods]
        cached = isvc.model.cache is not None
        if passes:  # the replicas at once: a slow load on one does not hold up the others
            with ThreadPoolExecutor(min(len(passes), _PARALLEL_PODS)) as pool:
                list(pool.map(lambda one: one.sync(loadable, wanted, cached), passes))
        observed = []
        for adapter in isvc.lora.adapters:
            wait, download_failed = waits.get(adapter.name, (None, False))
            observed.append(
                AdapterObservation(
                    name=adapter.name,
                    uri=adapter.uri,
                    ready_pods=len(pods),
                    loaded_on=tuple(sorted(p.pod.name for p in passes if adapter.name in p.loaded)),
                    failures=tuple(
                        PodFailure(p.pod.name, p.failed[adapter.name])
                        for p in sorted(passes, key=lambda p: p.pod.name)
                        if adapter.name in p.failed
                    ),
                    job=jobs.get(adapter.name),
                    waiting_for=wait,
                    download_failed=download_failed,
                )
            )
        return AdapterSync(tuple(observed), any(p.pending for p in passes))

    def _serving_pods(self, isvc: InferenceService) -> list[ServingPod]:
        listed = self._core.list_namespaced_pod(
            isvc.ref.namespace,
            label_selector=meta.selector_string(isvc.ref.name),
            _request_timeout=TIMEOUT,
        )
        items = self._api.sanitize_for_serialization(listed)["items"]
        found = (parse_serving_pod(item) for item in items)
        return sorted((pod for pod in found if pod is not None), key=lambda pod: pod.name)

    def _api_key(self, isvc: InferenceService) -> str | None:
        """spec.apiKeySecretRef's key; ``KeyUnreadable`` when the operator may not read it (the
        chart's rbac.readApiKeySecrets is off) or it is not there."""
        ref = isvc.api_key
        if ref is None:
            return None
        try:
            secret = self._core.read_namespaced_secret(
                ref.name, isvc.ref.namespace, _request_timeout=TIMEOUT
            )
        except ApiException as err:
            if err.status == 403:
                raise KeyUnreadable(
                    f"the operator may not read the API key Secret {ref.name} to load adapters "
                    "(the chart's rbac.readApiKeySecrets is off)"
                ) from None
            if err.status == 404:
                raise KeyUnreadable(f"the API key Secret {ref.name} does not exist") from None
            raise
        value = (secret.data or {}).get(ref.key)
        if not value:
            raise KeyUnreadable(f"the API key Secret {ref.name} has no key {ref.key!r}")
        return base64.b64decode(value).decode()

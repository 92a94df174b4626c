"""Pure builders of ``spec.lora``'s part of an engine pod: its flags, the adapter volumes, and the
path each adapter is loaded from.

Layout inside the engine container (``--lora-dir /adapters``; adapters are loaded by a path
relative to it, so the engine resolves them wherever that directory really is):

- ``/adapters/hf``: the model cache's claim again, read-only; an hf:// adapter is
  ``hf/<org>/<name>/@<revision>``, the directory its download Job fills (model_cache.py).
- ``/adapters/pvc/<claim>``: each claim a pvc:// adapter names, read-only (the model's own claim
  is the ``model`` volume mounted a second time); the adapter is ``pvc/<claim>/<path>``.
- file:// adapters are absolute paths in the image.
- Without a model cache, an hf:// adapter is ``hf://org/name@revision``: each replica downloads it
  as it loads it (the engine's ``HF_HOME``, under its scratch ``/tmp``), with the model's Hub
  endpoint and token (``deployment.hub_env``).

Only the claims are part of the pod template: adding an hf:// adapter, or a pvc:// one on a claim
already mounted, changes no pod (the operator loads it at runtime); an adapter on a new claim
adds a volume, which rolls the replicas.
"""

from __future__ import annotations

import hashlib
from typing import Any

from quire_operator.spec.lora import Adapter, AdapterKind, LoRASpec
from quire_operator.spec.view import InferenceService, ModelKind

ADAPTER_DIR = "/adapters"
ENGINE_HF_HOME = "/tmp/huggingface"
HF_SUBDIR = "hf"
PVC_SUBDIR = "pvc"
# The model's volume name in the pod (deployment._model_volume).
MODEL_VOLUME = "model"
# Flags spec.lora sets; spec.engine.extraArgs may not repeat them (deployment.MANAGED_FLAGS).
LORA_FLAGS = (
    "--enable-lora",
    "--no-enable-lora",
    "--max-loras",
    "--max-lora-rank",
    "--max-cpu-loras",
    "--lora-modules",
    "--lora-dir",
    "--allow-runtime-lora-updating",
    "--no-allow-runtime-lora-updating",
)


def adapter_path(adapter: Adapter, cached: bool) -> str:
    """What ``/v1/load_lora_adapter`` is given for ``adapter`` (and what ``/v1/models`` shows
    as its root once loaded): relative to ADAPTER_DIR, an absolute path in the image, or, for
    an hf:// adapter without a model cache (``cached`` False), ``hf://org/name[@revision]``,
    which the engine downloads itself."""
    if adapter.kind is AdapterKind.HF and not cached:
        at = f"@{adapter.revision}" if adapter.revision is not None else ""
        return f"hf://{adapter.location}{at}"
    if adapter.kind is AdapterKind.HF:
        return f"{HF_SUBDIR}/{adapter.cache_subdir}"
    if adapter.kind is AdapterKind.PVC:
        return f"{PVC_SUBDIR}/{adapter.location}/{adapter.sub_path}".rstrip("/")
    return adapter.location


def lora_args(lora: LoRASpec) -> list[str]:
    """The engine's LoRA flags: on, loadable at runtime, the limits. No adapter is a flag."""
    args = [
        "--enable-lora",
        "--allow-runtime-lora-updating",
        "--lora-dir", ADAPTER_DIR,
        "--max-loras", str(lora.max_loras),
        "--max-lora-rank", str(lora.max_lora_rank),
    ]  # fmt: skip
    if lora.max_cpu_loras is not None:
        args += ["--max-cpu-loras", str(lora.max_cpu_loras)]
    return args


def _claim_volume_name(claim: str) -> str:
    """A volume name (a DNS-1123 label) for an adapter claim: stable whatever else is mounted."""
    return f"lora-{hashlib.sha256(claim.encode()).hexdigest()[:12]}"


def adapter_volumes(
    isvc: InferenceService, cache_claim: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, the engine's mounts) for ``isvc``'s adapters; ``cache_claim``: the model
    cache's claim when the spec has one (already the ``model`` volume)."""
    lora = isvc.lora
    if lora is None:
        return [], []
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if cache_claim is not None and any(a.kind is AdapterKind.HF for a in lora.adapters):
        mounts.append({"name": MODEL_VOLUME, "mountPath": f"{ADAPTER_DIR}/{HF_SUBDIR}"})
    model = isvc.model
    for claim in lora.claims():
        name = _claim_volume_name(claim)
        if model.kind is ModelKind.PVC and model.location == claim:
            name = MODEL_VOLUME  # one volume per claim in a pod
        else:
            source = {"claimName": claim, "readOnly": True}
            volumes.append({"name": name, "persistentVolumeClaim": source})
        mounts.append({"name": name, "mountPath": f"{ADAPTER_DIR}/{PVC_SUBDIR}/{claim}"})
    return volumes, [{**mount, "readOnly": True} for mount in mounts]

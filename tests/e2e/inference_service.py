"""The InferenceService the end-to-end tests make: the embedded tiny model on CPU, with small
limits so that pressure is reachable with a few clients."""

from __future__ import annotations

from typing import Any

GROUP, VERSION, PLURAL = "quire.dev", "v1alpha1", "inferenceservices"


def tiny_inference_service(
    name: str,
    *,
    num_blocks: int,
    max_num_seqs: int,
    max_model_len: int = 256,
    engine: dict[str, Any] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """``spec`` adds top-level fields (``replicas``, ``autoscaling``, ``routing``); ``engine``
    adds ``spec.engine`` fields, its ``extraArgs`` after ``--num-blocks``."""
    engine = dict(engine or {})
    extra_args = ["--num-blocks", str(num_blocks), *engine.pop("extraArgs", ())]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"uri": "tiny"},
            "engine": {
                "dtype": "float32",
                "maxNumSeqs": max_num_seqs,
                "maxModelLen": max_model_len,
                "extraArgs": extra_args,
                **engine,
            },
            "resources": {"gpus": 0, "requests": {"cpu": "100m", "memory": "256Mi"}},
            **spec,
        },
    }

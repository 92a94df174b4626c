"""Pure builder: the host memory a pod's KV host tier takes, added to its memory request and limit.

Ownership: this module owns the rule that sizes an engine pod for ``spec.engine.
kvOffloadingSizeGiB`` and the quantity arithmetic it needs; ``deployment`` calls it for every
engine container (the Deployment's pod and each LeaderWorkerSet pod).

The rule: ``spec.resources`` describe the engine without its tier, and the operator adds the
tier's share of each pod on top of them — to the memory request always (the scheduler must find
the tier's memory on the node: the engine maps it lazily, so a pod that fits at start is killed
later, when the tier fills) and to the memory limit when one is set (the limit keeps its headroom
over the request). A pod holds ``tensor`` of the replica's ``tensor x nodes`` ranks and each rank
its heads' share of the tier, so a pod's share is the tier over ``nodes``.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from quire_operator.spec.view import QUANTITY, InferenceService

GIB = 1 << 30
MIB = 1 << 20
# Decimal (k = 10^3 ... E = 10^18) and binary (Ki = 2^10 ... Ei = 2^60) suffixes, and the
# sub-unit ones a memory quantity may still carry (m, u, n).
_SUFFIXES = {
    "": Decimal(1),
    **{s: Decimal(10) ** (3 * i) for i, s in enumerate("kMGTPE", 1)},
    **{f"{s}i": Decimal(2) ** (10 * i) for i, s in enumerate("KMGTPE", 1)},
    "m": Decimal(10) ** -3,
    "u": Decimal(10) ** -6,
    "n": Decimal(10) ** -9,
}


def quantity_bytes(value: str | int) -> int:
    """A memory quantity as written in a pod spec ("512Mi", "1.5G", "1e9", 1073741824) -> bytes,
    rounded up as the API server rounds a memory quantity. ValueError for anything else."""
    if isinstance(value, int):
        return value
    match = QUANTITY.match(value.strip())
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    number, suffix = Decimal(match[1]), match[3] or ""
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        scaled = number * Decimal(10) ** int(suffix[1:])
    else:
        scaled = number * _SUFFIXES[suffix]
    return int(scaled.to_integral_value(rounding="ROUND_CEILING"))


def bytes_quantity(size: int) -> str:
    """Bytes -> the shortest exact quantity: "9Gi", "272Mi", or plain bytes."""
    for suffix, unit in (("Gi", GIB), ("Mi", MIB), ("Ki", 1 << 10)):
        if size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


def tier_bytes_per_pod(isvc: InferenceService) -> int:
    """The host tier's share of one engine pod, in bytes (0 without a tier)."""
    gib = Decimal(str(isvc.engine.kv_offloading_size_gib))
    return int((gib * GIB / isvc.parallelism.nodes).to_integral_value(rounding="ROUND_CEILING"))


def with_host_tier(isvc: InferenceService, resources: dict[str, Any]) -> dict[str, Any]:
    """``resources`` (a container's, as built) with the tier's share added to the memory request
    (set to it when there is none) and to the memory limit when there is one."""
    tier = tier_bytes_per_pod(isvc)
    if tier == 0:
        return resources
    out = {key: dict(value) for key, value in resources.items()}
    requests = out.setdefault("requests", {})
    requests["memory"] = bytes_quantity(quantity_bytes(requests.get("memory", 0)) + tier)
    limits = out.get("limits", {})
    if "memory" in limits:
        limits["memory"] = bytes_quantity(quantity_bytes(limits["memory"]) + tier)
    return out


def limit_warning(isvc: InferenceService) -> str | None:
    """A warning when ``spec.resources.limits.memory`` is below the tier's share of a pod: a
    limit that small reads as the pod's whole budget, while the rule above adds the tier on top
    of it. None when there is no tier, no memory limit, or the limit is larger."""
    tier = tier_bytes_per_pod(isvc)
    limit = isvc.resources.limits.get("memory")
    if tier == 0 or limit is None or quantity_bytes(limit) >= tier:
        return None
    total = bytes_quantity(quantity_bytes(limit) + tier)
    return (
        f"resources.limits.memory {limit} is below the host tier's {bytes_quantity(tier)} per "
        f"pod: the operator adds the tier on top of spec.resources (the pod's limit is {total}); "
        "if the limit was meant for the whole pod, lower engine.kvOffloadingSizeGiB"
    )

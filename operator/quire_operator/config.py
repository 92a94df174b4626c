"""Operator-wide settings that shape the objects it builds (set by ``quire-operator`` flags)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ENGINE_IMAGE = "quire-engine:0.1.0"


@dataclass(frozen=True)
class OperatorConfig:
    # Used when an InferenceService leaves spec.engine.image out, so one operator upgrade moves
    # every such service to the engine release it was tested with.
    engine_image: str = DEFAULT_ENGINE_IMAGE
    # The cluster's DNS domain, for status.url (kubelet --cluster-domain).
    cluster_domain: str = "cluster.local"
    # Prometheus URL for KEDA ScaledObjects whose spec names none (--prometheus-address).
    prometheus_address: str | None = None

    def __post_init__(self) -> None:
        if not self.engine_image:
            raise ValueError("engine_image must not be empty")
        if not self.cluster_domain or self.cluster_domain.startswith("."):
            raise ValueError(f"cluster_domain must be a DNS name; got {self.cluster_domain!r}")
        address = self.prometheus_address
        if address is not None and not address.startswith(("http://", "https://")):
            raise ValueError(f"prometheus_address must be an http(s) URL; got {address!r}")

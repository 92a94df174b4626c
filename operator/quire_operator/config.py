"""Operator-wide settings that shape the objects it builds (set by ``quire-operator`` flags)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ENGINE_IMAGE = "quire-engine:0.1.0"
# The Gateway API Inference Extension release the routing is built and tested against: its
# InferencePool API, its Endpoint Picker's flags, config format and RBAC. The one place that names
# it: the chart's InferencePool CRD (tools/sync_gie_crd.py) and the default Endpoint Picker image
# follow it, and tests check both.
GIE_VERSION = "v1.5.0"
DEFAULT_EPP_IMAGE = f"registry.k8s.io/gateway-api-inference-extension/epp:{GIE_VERSION}"


@dataclass(frozen=True)
class OperatorConfig:
    # Used when an InferenceService leaves spec.engine.image out, so one operator upgrade moves
    # every such service to the engine release it was tested with.
    engine_image: str = DEFAULT_ENGINE_IMAGE
    # The cluster's DNS domain, for status.url (kubelet --cluster-domain).
    cluster_domain: str = "cluster.local"
    # Prometheus URL for KEDA ScaledObjects whose spec names none (--prometheus-address).
    prometheus_address: str | None = None
    # The Endpoint Picker image run for InferenceServices with spec.routing.mode InferencePool.
    epp_image: str = DEFAULT_EPP_IMAGE

    def __post_init__(self) -> None:
        if not self.engine_image:
            raise ValueError("engine_image must not be empty")
        if not self.epp_image:
            raise ValueError("epp_image must not be empty")
        if not self.cluster_domain or self.cluster_domain.startswith("."):
            raise ValueError(f"cluster_domain must be a DNS name; got {self.cluster_domain!r}")
        address = self.prometheus_address
        if address is not None and not address.startswith(("http://", "https://")):
            raise ValueError(f"prometheus_address must be an http(s) URL; got {address!r}")

"""An InferenceService as frozen dataclasses: the typed view every builder and the reconcile read.

spec/parsing.py makes it from the custom object (the one reader of it); ``__post_init__`` re-checks
the invariants the builders rely on and raises ``ValueError`` naming the field, for objects that
reached the operator without the CRD's checks (an older CRD, a hand-made dict in a test). A spec
that does not parse still has an ``Identity`` (``InvalidSpec``): enough to report it and to find
the children it already has.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from quire_operator.meta import ObjectRef
from quire_operator.spec.lora import AdapterKind, LoRASpec

# A Kubernetes quantity (resource.Quantity's grammar, without the sign).
QUANTITY = re.compile(r"^(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")
_URL = re.compile(r"^https?://\S+$")
# The engine's own bounds (quire_engine.core.config; tests/test_config_agreement.py checks them).
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # powers of two up to MAX_BLOCK_SIZE
MAX_GPU_MEMORY_UTILIZATION = 1.0


class ModelKind(enum.Enum):
    TINY = "tiny"  # the engine's embedded test model: nothing to fetch or mount
    HF = "hf"  # downloaded from the Hugging Face Hub (init container, or the model cache's Job)
    PVC = "pvc"  # a PersistentVolumeClaim mounted read-only
    FILE = "file"  # a path already inside the image


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


class CacheAccessMode(enum.Enum):
    READ_WRITE_MANY = "ReadWriteMany"  # replicas on any node mount the volume
    READ_WRITE_ONCE = "ReadWriteOnce"  # the Job and every replica must share one node


@dataclass(frozen=True)
class ModelCache:
    """spec.model.cache: the volume an hf:// model is downloaded into once, for every replica."""

    size: str | int  # a quantity as written
    storage_class_name: str | None = None  # None: the cluster's default StorageClass
    access_mode: CacheAccessMode = CacheAccessMode.READ_WRITE_MANY

    def __post_init__(self) -> None:
        valid = self.size > 0 if isinstance(self.size, int) else QUANTITY.match(self.size)
        if not valid:
            raise ValueError(f"model.cache.size must be a quantity such as 20Gi: {self.size!r}")


@dataclass(frozen=True)
class ModelSource:
    kind: ModelKind
    # hf: "org/name"; pvc: the claim name; file: the absolute path; tiny: "tiny".
    location: str
    # pvc: the path inside the claim ("" for its root); hf: the one file of the repository's
    # root to fetch and serve (a GGUF file, "" for the whole repository).
    sub_path: str
    revision: str | None
    served_name: str
    hf_token: SecretKeyRef | None
    # hf only: where huggingface_hub downloads from (HF_ENDPOINT: a mirror); None: the Hub.
    hf_endpoint: str | None = None
    # hf only: download once into a shared volume instead of into each pod.
    cache: ModelCache | None = None

    def __post_init__(self) -> None:
        if self.hf_token is not None and self.kind is not ModelKind.HF:
            raise ValueError("model.hfTokenSecretRef applies only to hf:// models")
        if self.revision is not None and self.kind is not ModelKind.HF:
            raise ValueError("model.revision applies only to hf:// models")
        if self.cache is not None and self.kind is not ModelKind.HF:
            raise ValueError(
                "model.cache applies only to hf:// models (pvc:// and file:// models are "
                "already on a volume or in the image)"
            )
        one_file = self.kind is ModelKind.HF and self.sub_path
        if one_file and ("/" in self.sub_path or not self.sub_path.endswith(".gguf")):
            raise ValueError(
                f"model.uri: the one file of an hf:// repository is a .gguf file at its root: "
                f"{self.sub_path!r}"
            )
        if self.hf_endpoint is not None and self.kind is not ModelKind.HF:
            raise ValueError("model.hfEndpoint applies only to hf:// models")
        if self.hf_endpoint is not None and not _URL.match(self.hf_endpoint):
            raise ValueError(f"model.hfEndpoint must be an http(s) URL: {self.hf_endpoint!r}")


@dataclass(frozen=True)
class EngineSpec:
    """``quire-engine serve`` settings; ``image`` is None when the operator's default applies."""

    image: str | None
    image_pull_policy: str | None
    block_size: int
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int | None
    max_model_len: int | None
    enable_prefix_caching: bool
    preemption_mode: str
    swap_space_gib: float
    dtype: str
    extra_args: tuple[str, ...]
    # What the KV pool stores (--kv-cache-dtype): auto (the model's dtype) or an 8-bit format.
    kv_cache_dtype: str = "auto"
    # The host tier under the prefix cache (--kv-offloading-size, GiB for all tensor-parallel
    # ranks together; 0: none). Host memory the pod needs on top of the model and the swap pool.
    kv_offloading_size_gib: float = 0.0
    # Drain on SIGTERM (``--shutdown-timeout``): in-flight requests get this long to finish.
    shutdown_timeout_s: int = 30
    # preStop sleep before SIGTERM, so endpoints drop the pod before the engine stops taking work.
    pre_stop_delay_s: int = 5

    def __post_init__(self) -> None:
        if self.shutdown_timeout_s < 0 or self.pre_stop_delay_s < 0:
            raise ValueError("engine.shutdownTimeoutSeconds and preStopDelaySeconds must be >= 0")
        if self.block_size not in BLOCK_SIZES:
            sizes = f"{BLOCK_SIZES[0]}..{BLOCK_SIZES[-1]}"
            raise ValueError(f"engine.blockSize must be a power of two, {sizes}: {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= MAX_GPU_MEMORY_UTILIZATION:
            utilization, most = self.gpu_memory_utilization, MAX_GPU_MEMORY_UTILIZATION
            raise ValueError(f"engine.gpuMemoryUtilization must be in (0, {most:g}]: {utilization}")


@dataclass(frozen=True)
class ResourceSpec:
    gpus: int
    gpu_resource_name: str
    # sizeLimit of the memory-backed /dev/shm volume (a quantity as written), so a runaway
    # writer is evicted instead of eating the node's memory.
    shared_memory: str | int = "1Gi"
    # cpu/memory quantities exactly as written (strings or integers), for the container.
    requests: Mapping[str, str | int] = field(default_factory=dict)
    limits: Mapping[str, str | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.gpus < 0:
            raise ValueError(f"resources.gpus must be >= 0; got {self.gpus}")


@dataclass(frozen=True)
class Placement:
    """Pod placement, passed through to the pod spec as written."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    priority_class_name: str | None = None
    service_account_name: str | None = None
    image_pull_secrets: tuple[str, ...] = ()


class AutoscalingBackend(enum.Enum):
    HPA = "hpa"  # an autoscaling/v2 HPA on Pods metrics (prometheus-adapter serves them)
    KEDA = "keda"  # a KEDA ScaledObject with Prometheus triggers; KEDA owns its HPA


@dataclass(frozen=True)
class KedaSettings:
    """ScaledObject settings; ``server_address`` None means the operator's default."""

    server_address: str | None = None
    polling_interval_s: int = 15
    cooldown_period_s: int = 300
    fallback_failure_threshold: int | None = None
    fallback_replicas: int | None = None


@dataclass(frozen=True)
class ScaleToZero:
    """The Endpoint Picker's hold queue while no replica is ready (used with minReplicas 0)."""

    queue_size: int = 100
    hold_timeout_s: int = 300

    def __post_init__(self) -> None:
        if self.queue_size < 1 or self.hold_timeout_s < 1:
            raise ValueError(
                "autoscaling.scaleToZero.queueSize and holdTimeoutSeconds must be >= 1"
            )


@dataclass(frozen=True)
class Autoscaling:
    enabled: bool
    min_replicas: int
    max_replicas: int | None
    target_kv_cache_utilization: float | None
    target_queue_depth: float | None
    target_preemption_rate: float | None
    # HPA ``behavior`` (scaleUp/scaleDown), defaulted by the CRD, passed through.
    behavior: Mapping[str, Any]
    backend: AutoscalingBackend = AutoscalingBackend.HPA
    target_kv_cache_demand: float | None = None
    keda: KedaSettings = field(default_factory=KedaSettings)
    scale_to_zero: ScaleToZero = field(default_factory=ScaleToZero)

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            raise ValueError(f"autoscaling.minReplicas must be >= 0: {self.min_replicas}")
        if self.min_replicas == 0 and self.backend is not AutoscalingBackend.KEDA:
            raise ValueError(
                "autoscaling.minReplicas 0 (scale to zero) needs backend keda: an HPA cannot "
                "scale to zero replicas"
            )
        if not self.enabled:
            return
        if self.max_replicas is None:
            raise ValueError("autoscaling.maxReplicas is required when autoscaling is enabled")
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.minReplicas must not exceed maxReplicas")
        targets = (
            self.target_kv_cache_utilization,
            self.target_kv_cache_demand,
            self.target_queue_depth,
            self.target_preemption_rate,
        )
        if all(target is None for target in targets):
            raise ValueError("autoscaling needs at least one target")

    @property
    def scales_to_zero(self) -> bool:
        return self.enabled and self.min_replicas == 0


@dataclass(frozen=True)
class ServiceSpec:
    type: str
    port: int


class RoutingMode(enum.Enum):
    SERVICE = "Service"  # the Service alone: kube-proxy spreads connections over the replicas
    INFERENCE_POOL = "InferencePool"  # plus an InferencePool and its Endpoint Picker


class FailureMode(enum.Enum):
    """What a Gateway does while the Endpoint Picker does not answer (InferencePool's
    endpointPickerRef.failureMode)."""

    FAIL_CLOSE = "FailClose"  # refuse the request
    FAIL_OPEN = "FailOpen"  # send it to a replica the Gateway picks itself


# The Endpoint Picker's scorer weights, bounded as in the CRD.
MAX_SCORER_WEIGHT = 100
# metadata.name + "-epp" names the Endpoint Picker's Service, a DNS-1035 label (63 characters).
MAX_ROUTED_NAME = 59


@dataclass(frozen=True)
class ScorerWeights:
    """Weights of the Endpoint Picker's scorers (0 leaves a scorer out); defaults as GIE's.

    ``lora_affinity``: GIE's default profile has no LoRA scorer, so its default is Quire's.
    It is above the queue scorer's, whose min-max normalised score gives a whole weight to
    one waiting request: below it, one request waiting on a replica would send an adapter's
    requests to a replica busy with another adapter, where they wait for its step to drain
    (``--max-loras`` slots, first come first served)."""

    queue: int = 2
    kv_cache_utilization: int = 2
    prefix_cache: int = 3
    lora_affinity: int = 3

    def __post_init__(self) -> None:
        weights = (self.queue, self.kv_cache_utilization, self.prefix_cache, self.lora_affinity)
        if any(not 0 <= w <= MAX_SCORER_WEIGHT for w in weights):
            raise ValueError(f"routing.scorerWeights must be 0..{MAX_SCORER_WEIGHT}: {weights}")
        if not any(weights):
            raise ValueError("routing.scorerWeights: at least one weight must be above 0")


@dataclass(frozen=True)
class Routing:
    mode: RoutingMode = RoutingMode.SERVICE
    failure_mode: FailureMode = FailureMode.FAIL_CLOSE
    weights: ScorerWeights = field(default_factory=ScorerWeights)
    # The Endpoint Picker container's cpu/memory quantities exactly as written.
    epp_requests: Mapping[str, str | int] = field(default_factory=dict)
    epp_limits: Mapping[str, str | int] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.mode is RoutingMode.INFERENCE_POOL


@dataclass(frozen=True)
class Parallelism:
    """How one replica shards its model: ``tensor`` ranks per pod (one GPU each on GPU pods) over
    ``nodes`` pods. More than one node: the replica is a LeaderWorkerSet group, not a pod."""

    tensor: int = 1
    nodes: int = 1

    def __post_init__(self) -> None:
        if self.tensor < 1 or self.nodes < 1:
            raise ValueError(
                f"parallelism.tensor and nodes must be >= 1; got {self.tensor}, {self.nodes}"
            )

    @property
    def ranks(self) -> int:
        """The engine's --tensor-parallel-size: the ranks of all the replica's pods."""
        return self.tensor * self.nodes

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1


@dataclass(frozen=True)
class Identity:
    """Who an InferenceService is and the few facts its status states whether or not its spec
    parses: its URL's port, whether it asks for an API key, routing, scale to zero and a model
    cache (so an invalid edit keeps reporting the parts it had, and Degraded says why)."""

    ref: ObjectRef
    generation: int
    port: int
    api_key: bool
    routed: bool
    scales_to_zero: bool
    model_cache: bool


@dataclass(frozen=True)
class InvalidSpec:
    """An InferenceService whose spec cannot be parsed: its identity and the parser's reason."""

    identity: Identity
    error: str


@dataclass(frozen=True)
class InferenceService:
    """One parsed InferenceService: identity plus spec."""

    ref: ObjectRef
    generation: int
    model: ModelSource
    engine: EngineSpec
    resources: ResourceSpec
    placement: Placement
    replicas: int
    autoscaling: Autoscaling
    service: ServiceSpec
    # The Secret key the engine reads its API key from (env QUIRE_API_KEY); None: no key.
    api_key: SecretKeyRef | None = None
    routing: Routing = field(default_factory=Routing)
    parallelism: Parallelism = field(default_factory=Parallelism)
    lora: LoRASpec | None = None  # None: LoRA off

    def __post_init__(self) -> None:
        for adapter in self.lora.adapters if self.lora is not None else ():
            if adapter.name == self.model.served_name:
                raise ValueError(
                    f"lora.adapters[].name {adapter.name!r} is the model's served name"
                )
            hub = adapter.kind is AdapterKind.HF and self.model.cache is None
            if hub and self.parallelism.multi_node:
                raise ValueError(
                    f"lora.adapters[{adapter.name}]: an hf:// adapter without spec.model.cache "
                    "is downloaded by the replica's first pod only, and every node's ranks read "
                    "it: set spec.model.cache (or serve it from pvc://) with parallelism.nodes > 1"
                )
        if self.routing.enabled and len(self.ref.name) > MAX_ROUTED_NAME:
            raise ValueError(
                f"metadata.name must be at most {MAX_ROUTED_NAME} characters with routing "
                f"mode InferencePool (the Endpoint Picker's Service is named <name>-epp)"
            )
        weights = self.routing.weights
        if self.lora is None and not (
            weights.queue or weights.kv_cache_utilization or (weights.prefix_cache)
        ):
            raise ValueError(
                "routing.scorerWeights: only loraAffinity is above 0, and it scores only with "
                "spec.lora: set another weight above 0"
            )
        if self.autoscaling.scales_to_zero and not self.routing.enabled:
            raise ValueError(
                "autoscaling.minReplicas 0 needs routing.mode InferencePool: its Endpoint Picker "
                "holds the requests that arrive while no replica runs"
            )

    @property
    def max_replicas(self) -> int:
        """The most replicas the Deployment can have (decides whether a PDB is worth it)."""
        if self.autoscaling.enabled and self.autoscaling.max_replicas is not None:
            return self.autoscaling.max_replicas
        return self.replicas

    @property
    def identity(self) -> Identity:
        return Identity(
            ref=self.ref,
            generation=self.generation,
            port=self.service.port,
            api_key=self.api_key is not None,
            routed=self.routing.enabled,
            scales_to_zero=self.autoscaling.scales_to_zero,
            model_cache=self.model.cache is not None,
        )

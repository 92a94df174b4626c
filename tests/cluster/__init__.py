"""A real Kubernetes control plane for tests: official binaries built from Go modules, on loopback.

- ``build``: builds and caches etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
  kubectl, kwok and helm (``ensure_binaries``).
- ``launcher``: ``ControlPlane`` starts them on 127.0.0.1 with two fake kwok nodes.
- ``nodes``: names, labels and taints of those nodes, for tests to use.
- ``addons_build`` / ``addons``: KEDA, prometheus-adapter and Prometheus, built or fetched on
  demand and started next to a ``ControlPlane`` (the autoscaling tests in tests/e2e).
- ``python -m tests.cluster up``: the same cluster for a person at a shell.
"""

from .build import Binaries, BuildError, GoUnavailable, ensure_binaries, find_binaries
from .launcher import ControlPlane
from .process import ClusterError

__all__ = [
    "Binaries",
    "BuildError",
    "ClusterError",
    "ControlPlane",
    "GoUnavailable",
    "ensure_binaries",
    "find_binaries",
]

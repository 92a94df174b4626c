"""helm install / upgrade / uninstall of charts/quire into the real test cluster, and its RBAC.

The proof that the chart's RBAC is sufficient is the real operator at work under the chart's
identity: the test takes a token for the chart's ServiceAccount from the TokenRequest API, writes
a kubeconfig with nothing but that token, and runs ``quire-operator`` with it and with the very
arguments of the Deployment the chart installed. (kwok runs no containers, so the Deployment's own
pod is Running in name only; the operator process runs on this machine.) The example
InferenceServices of examples/ must then become Ready, with their Deployment, Service and HPA,
and nothing in the operator's log may say Forbidden.

The proof that it is not broader: the exact rules the API server stores (derived from the
operator's table of kinds, rbac.py), and ``kubectl auth can-i`` asked as that ServiceAccount (a
SelfSubjectAccessReview) for what it must and must not do.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from quire_operator.config import GIE_VERSION
from tests.cluster.client import ClusterHandle, wait_for
from tests.cluster.process import ManagedProcess, free_port
from tests.operator_tests.api import condition
from tests.operator_tests.gie import POOL_CRD, pool_crd_removed, pool_crd_served
from tests.operator_tests.rbac import NAMESPACED_RULES, peering_rule

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "quire"
EXAMPLES = ROOT / "examples"
CRD_NAMES = ("inferenceservices.quire.dev", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev")
ROUTED = "tiny-cpu-routed"  # examples/tiny-cpu-routed.yaml


@dataclass
class Release:
    """A helm release of the chart, and a kubeconfig that authenticates as its ServiceAccount."""

    name: str
    namespace: str
    service_account: str
    kubeconfig: Path

    @property
    def operator(self) -> str:
        return f"{self.name}-operator"


def helm_ok(cluster: ClusterHandle, *args: str) -> str:
    proc = cluster.helm(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def kubectl_json(cluster: ClusterHandle, *args: str) -> Any:
    proc = cluster.kubectl(*args, "--output=json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def service_account_kubeconfig(
    cluster: ClusterHandle, namespace: str, service_account: str, path: Path
) -> Path:
    """A kubeconfig whose only credential is a TokenRequest token of the ServiceAccount."""
    token = cluster.kubectl("create", "token", service_account, "-n", namespace, "--duration=1h")
    assert token.returncode == 0, token.stderr
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    (entry,) = admin["clusters"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": entry["cluster"]}],
        "users": [{"name": service_account, "user": {"token": token.stdout.strip()}}],
        "contexts": [{"name": "sa", "context": {"cluster": "test", "user": service_account}}],
        "current-context": "sa",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


@contextlib.contextmanager
def installed(
    cluster: ClusterHandle, namespace: str, tmp_path: Path, *values: str
) -> Iterator[Release]:
    """``helm install`` a uniquely named release (its cluster-scoped names must not collide with
    another test's); uninstalled at the end if the test did not."""
    name = f"quire-{uuid.uuid4().hex[:6]}"
    out = helm_ok(
        cluster, "install", name, str(CHART), "--namespace", namespace, "--wait", "--timeout=90s",
        *values,
    )  # fmt: skip
    # NOTES.txt tells the user that uninstalling keeps the CRDs.
    assert "leaves the CRDs" in out.replace("\n", " ")
    account = f"{name}-operator"
    kubeconfig = service_account_kubeconfig(cluster, namespace, account, tmp_path / "sa.kubeconfig")
    try:
        yield Release(name, namespace, account, kubeconfig)
    finally:
        cluster.helm("uninstall", name, "--namespace", namespace, "--wait")


@pytest.fixture
def release(cluster: ClusterHandle, namespace: str, tmp_path: Path) -> Iterator[Release]:
    """The chart installed with default values: cluster-wide."""
    with installed(cluster, namespace, tmp_path) as release:
        yield release


@pytest.fixture
def workload(cluster: ClusterHandle) -> Iterator[str]:
    """A second namespace, where the InferenceServices go (not the operator's namespace), that
    admits only pods meeting the "restricted" Pod Security Standard."""
    name = f"w-{uuid.uuid4().hex[:10]}"
    created = cluster.kubectl("create", "namespace", name)
    assert created.returncode == 0, created.stderr
    restricted = "pod-security.kubernetes.io/enforce=restricted"
    labelled = cluster.kubectl("label", "namespace", name, restricted)
    assert labelled.returncode == 0, labelled.stderr
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false")


def operator_argv(cluster: ClusterHandle, release: Release) -> list[str]:
    """The installed operator Deployment's container args (the chart's own)."""
    deployment = cluster.json(
        cluster.apps.read_namespaced_deployment(release.operator, release.namespace)
    )
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args: list[str] = container["args"]
    return args


class OperatorRun(NamedTuple):
    process: ManagedProcess
    metrics_url: str  # the operator's Prometheus metrics

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as answer:
            return str(answer.read().decode())


@contextlib.contextmanager
def run_operator(cluster: ClusterHandle, release: Release, log_path: Path) -> Iterator[OperatorRun]:
    """``quire-operator`` on this machine, with the chart's args and its ServiceAccount token.
    Only --liveness and --metrics-bind-address move to free loopback ports; everything else is
    what the pod would run."""
    port, metrics_port = free_port(), free_port()
    moved = ("--liveness=", "--metrics-bind-address=")
    args = [a for a in operator_argv(cluster, release) if not a.startswith(moved)]
    script = Path(sys.executable).with_name("quire-operator")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "quire_operator"]
    env = shutil.which("env") or "/usr/bin/env"
    argv = [
        env, f"KUBECONFIG={release.kubeconfig}", f"PYTHONPATH={ROOT / 'operator'}",
        *command, *args, f"--liveness=http://127.0.0.1:{port}/healthz",
        f"--metrics-bind-address=127.0.0.1:{metrics_port}",
    ]  # fmt: skip
    process = ManagedProcess("quire-operator", argv, log_path)
    try:

        def healthy() -> int | None:
            assert process.exited() is None, process.describe_failure(lines=60)
            url = f"http://127.0.0.1:{port}/healthz"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as answer:
                return int(answer.status)
            return None

        wait_for("the operator's liveness endpoint", healthy, lambda s: s == 200, timeout_s=60)
        yield OperatorRun(process, f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        process.stop(grace_s=15)


def apply_example(cluster: ClusterHandle, namespace: str, name: str) -> None:
    applied = cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / name))
    assert applied.returncode == 0, applied.stderr


def apply_routed_example(cluster: ClusterHandle, namespace: str) -> None:
    """The routed example's InferenceService (its Gateway and HTTPRoute need a Gateway API
    implementation, which the test cluster has not)."""
    (isvc, *_gateway) = yaml.safe_load_all((EXAMPLES / "tiny-cpu-routed.yaml").read_text())
    applied = subprocess.run(
        [str(cluster.binaries.kubectl), "apply", "-n", namespace, "-f", "-"],
        input=json.dumps(isvc), text=True, capture_output=True, env=cluster.env(), timeout=60,
        check=False,
    )  # fmt: skip
    assert applied.returncode == 0, applied.stderr


def wait_ready(cluster: ClusterHandle, namespace: str, name: str) -> Any:
    return wait_for(
        f"InferenceService {namespace}/{name} to be Ready",
        lambda: kubectl_json(cluster, "get", "inferenceservice", name, "-n", namespace),
        lambda qis: condition(qis, "Ready").get("status") == "True",
        timeout_s=60,
    )


def can_i(cluster: ClusterHandle, release: Release, *args: str) -> bool:
    """``kubectl auth can-i`` asked by the ServiceAccount itself (its own token)."""
    proc = cluster.kubectl("--kubeconfig", str(release.kubeconfig), "auth", "can-i", *args)
    assert proc.stdout.strip() in {"yes", "no"}, proc.stdout + proc.stderr
    return proc.stdout.strip() == "yes"


def forbidden_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "forbidden" in line.lower()]


def assert_no_wildcards(rules: list[dict[str, Any]]) -> None:
    for rule in rules:
        for field in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
            assert "*" not in rule.get(field, []), rule


def test_install_reconcile_upgrade_uninstall_cluster_wide(
    cluster: ClusterHandle, release: Release, workload: str, tmp_path: Path
) -> None:
    operator = release.operator
    # What helm installed: the operator Deployment (kwok makes its pod Running) and the RBAC.
    deployment = cluster.json(cluster.apps.read_namespaced_deployment(operator, release.namespace))
    assert deployment["status"]["availableReplicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == release.service_account
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert "--metrics-bind-address=0.0.0.0:8081" in pod["containers"][0]["args"]
    assert {"name": "metrics", "containerPort": 8081, "protocol": "TCP"} in pod["containers"][0][
        "ports"
    ]
    role = kubectl_json(cluster, "get", "clusterrole", operator)
    assert role["rules"] == [*NAMESPACED_RULES, peering_rule("clusterkopfpeerings")]
    assert_no_wildcards(role["rules"])
    binding = kubectl_json(cluster, "get", "clusterrolebinding", operator)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": operator,
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": release.service_account, "namespace": release.namespace}
    ]

    # Sufficient: the real operator, as the ServiceAccount, reconciles the examples.
    with run_operator(cluster, release, tmp_path / "operator.log") as run:
        apply_example(cluster, workload, "tiny-cpu.yaml")
        apply_example(cluster, workload, "gpu-autoscaling.yaml")
        # As the README's tour tells users to wait for it.
        waited = cluster.kubectl(
            "wait", "--for=condition=Ready", "inferenceservice/tiny-cpu", "-n", workload,
            "--timeout=60s",
        )  # fmt: skip
        assert waited.stdout == "inferenceservice.quire.dev/tiny-cpu condition met\n", waited.stderr
        tiny = wait_ready(cluster, workload, "tiny-cpu")
        assert tiny["status"]["readyReplicas"] == 1
        assert tiny["status"]["url"] == f"http://tiny-cpu.{workload}.svc.cluster.local:8000"
        wait_ready(cluster, workload, "qwen-0-5b")
        # The operator's own metrics count the Events it posted (on the chart's metrics port
        # in the pod; moved to loopback here).
        ready_events = (
            f'quire_operator_events_total{{name="tiny-cpu",namespace="{workload}",'
            'reason="Ready",type="Normal"} 1.0'
        )
        wait_for(
            "the operator's metrics to count tiny-cpu's Ready Event",
            run.metrics,
            lambda text: ready_events in text.splitlines(),
            timeout_s=30,
        )
        hpa = cluster.json(
            cluster.autoscaling.read_namespaced_horizontal_pod_autoscaler("qwen-0-5b", workload)
        )
        assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == [
            "quire_kv_cache_usage_ratio",
            "quire_num_requests_waiting",
        ]
        # Autoscaling off: the operator deletes the HPA it no longer needs (the delete verb).
        patched = cluster.kubectl(
            "patch", "inferenceservice", "qwen-0-5b", "-n", workload, "--type=merge",
            "-p", '{"spec": {"autoscaling": {"enabled": false}}}',
        )  # fmt: skip
        assert patched.returncode == 0, patched.stderr
        wait_for(
            "the operator to delete the HPA",
            lambda: cluster.kubectl("get", "hpa", "qwen-0-5b", "-n", workload).returncode,
            lambda rc: rc != 0,
            timeout_s=30,
        )
        peering = kubectl_json(cluster, "get", "clusterkopfpeering", operator)
        assert peering["metadata"]["name"] == operator

        # Routing: the operator creates the Endpoint Picker's Role and RoleBinding, which RBAC
        # admits only because the chart grants the operator everything that Role grants.
        apply_routed_example(cluster, workload)
        routed = wait_for(
            "the routed example RoutingReady",
            lambda: kubectl_json(cluster, "get", "inferenceservice", ROUTED, "-n", workload),
            lambda qis: condition(qis, "RoutingReady").get("status") == "True",
            timeout_s=60,
        )
        assert routed["status"]["routing"]["inferencePool"] == ROUTED
        role = kubectl_json(cluster, "get", "role", f"{ROUTED}-epp", "-n", workload)
        assert role["metadata"]["ownerReferences"][0]["name"] == ROUTED
        # Routing off: the operator deletes what it made for it (the delete verbs).
        patched = cluster.kubectl(
            "patch", "inferenceservice", ROUTED, "-n", workload, "--type=merge",
            "-p", '{"spec": {"routing": {"mode": "Service"}}}',
        )  # fmt: skip
        assert patched.returncode == 0, patched.stderr
        for kind in ("inferencepool", "deployment", "service", "configmap", "role", "rolebinding"):
            name = ROUTED if kind == "inferencepool" else f"{ROUTED}-epp"
            wait_for(
                f"the operator to delete {kind} {name}",
                functools.partial(cluster.kubectl, "get", kind, name, "-n", workload),
                lambda got: got.returncode != 0 and "NotFound" in got.stderr,
                timeout_s=30,
            )
        log = run.process.log_path.read_text()
    assert not forbidden_lines(log), "\n".join(forbidden_lines(log))
    # With OwnerReferencesPermissionEnforcement on (tests/cluster/launcher.py), these owner
    # references were admitted only because the chart grants update on the finalizers.
    tiny = cluster.json(cluster.apps.read_namespaced_deployment("tiny-cpu", workload))
    (owner,) = tiny["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["controller"], owner["blockOwnerDeletion"]) == (
        "InferenceService",
        True,
        True,
    )

    # Not broader: what the ServiceAccount may and may not do, asked as itself.
    allowed = [
        ("list", "inferenceservices.quire.dev", "--all-namespaces"),
        ("patch", "inferenceservices.quire.dev", "--subresource=status", "-n", workload),
        ("patch", "deployments.apps", "-n", workload),
        ("delete", "horizontalpodautoscalers.autoscaling", "-n", workload),
        ("watch", "pods", "--all-namespaces"),
        ("update", "inferenceservices.quire.dev", "--subresource=finalizers", "-n", workload),
        ("create", "events", "-n", workload),
        ("create", "clusterkopfpeerings.kopf.dev"),
        ("create", "roles.rbac.authorization.k8s.io", "-n", workload),
        ("delete", "inferencepools.inference.networking.k8s.io", "-n", workload),
        ("delete", "deployments.apps", "-n", workload),
        # By name only, for the API key of services with LoRA adapters (rbac.readApiKeySecrets).
        ("get", "secrets", "-n", workload),
    ]
    denied = [
        ("*", "*", "--all-namespaces"),
        ("list", "secrets", "--all-namespaces"),
        ("list", "secrets", "-n", workload),
        ("watch", "secrets", "-n", workload),
        ("update", "secrets", "-n", workload),
        ("create", "pods", "-n", workload),
        ("delete", "pods", "-n", workload),
        ("create", "pods/exec", "-n", workload),
        ("update", "deployments.apps", "-n", workload),
        ("create", "inferenceservices.quire.dev", "-n", workload),
        ("update", "inferenceservices.quire.dev", "-n", workload),
        ("delete", "inferenceservices.quire.dev", "-n", workload),
        ("create", "namespaces"),
        ("list", "namespaces"),
        ("list", "customresourcedefinitions.apiextensions.k8s.io"),
        ("delete", "customresourcedefinitions.apiextensions.k8s.io"),
        ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
        ("bind", "clusterroles.rbac.authorization.k8s.io"),
        ("escalate", "clusterroles.rbac.authorization.k8s.io"),
        ("impersonate", "serviceaccounts", "-n", workload),
        # --subresource: "serviceaccounts/token" alone would ask about a ServiceAccount named
        # "token", which the operator may create (the Endpoint Picker's are its own).
        ("create", "serviceaccounts", "--subresource=token", "-n", release.namespace),
        ("create", "serviceaccounts", "--subresource=token", "-n", workload),
        ("list", "configmaps", "-n", release.namespace),
        ("list", "configmaps", "-n", workload),
        ("watch", "serviceaccounts", "-n", workload),
        ("escalate", "roles.rbac.authorization.k8s.io", "-n", workload),
        ("bind", "roles.rbac.authorization.k8s.io", "-n", workload),
        ("create", "clusterroles.rbac.authorization.k8s.io"),
        ("create", "inferenceobjectives.inference.networking.x-k8s.io", "-n", workload),
        ("list", "kopfpeerings.kopf.dev", "-n", workload),
    ]
    assert [a for a in allowed if not can_i(cluster, release, *a)] == []
    assert [d for d in denied if can_i(cluster, release, *d)] == []

    # helm upgrade: new values roll the operator Deployment; the release has two revisions.
    helm_ok(
        cluster, "upgrade", release.name, str(CHART), "--namespace", release.namespace,
        "--reuse-values", "--set", "operator.logLevel=debug", "--set", "engineImage.tag=0.1.1",
        "--wait", "--timeout=90s",
    )  # fmt: skip
    args = operator_argv(cluster, release)
    assert "--verbose" in args and "--engine-image=quire-engine:0.1.1" in args
    history = json.loads(
        helm_ok(cluster, "history", release.name, "-n", release.namespace, "-o", "json")
    )
    assert [(h["revision"], h["status"]) for h in history] == [(1, "superseded"), (2, "deployed")]

    # helm uninstall: the operator and its RBAC go; the CRDs stay (helm never deletes crds/),
    # and so does every InferenceService, now unreconciled.
    out = helm_ok(cluster, "uninstall", release.name, "--namespace", release.namespace, "--wait")
    *kept, last = [line for line in out.splitlines() if line]
    assert last == f'release "{release.name}" uninstalled'
    # The InferencePool CRD, if this release installed it (the session's first install does).
    assert kept in (
        [],
        [
            "These resources were kept due to the resource policy:",
            f"[CustomResourceDefinition] {POOL_CRD}",
        ],
    ), out
    for kind, name, scope in [
        ("deployment", operator, ["-n", release.namespace]),
        ("serviceaccount", release.service_account, ["-n", release.namespace]),
        ("clusterrole", operator, []),
        ("clusterrolebinding", operator, []),
        ("configmap", f"{release.name}-dashboard", ["-n", release.namespace]),
    ]:
        gone = cluster.kubectl("get", kind, name, *scope)
        assert gone.returncode == 1 and "NotFound" in gone.stderr, (kind, gone.stdout)
    for crd in (*CRD_NAMES, POOL_CRD):
        assert cluster.kubectl("get", "crd", crd).returncode == 0, crd
    assert cluster.kubectl("get", "inferenceservice", "tiny-cpu", "-n", workload).returncode == 0
    # The ServiceAccount is gone, and its token with it (once the API server's cache catches up).
    wait_for(
        "the deleted ServiceAccount's token to be refused",
        lambda: cluster.kubectl("--kubeconfig", str(release.kubeconfig), "auth", "whoami"),
        lambda whoami: whoami.returncode == 1 and "Unauthorized" in whoami.stderr,
        timeout_s=30,
    )


def test_pool_crd_is_installed_where_missing_and_left_to_its_owner_otherwise(
    cluster: ClusterHandle, namespace: str, tmp_path: Path
) -> None:
    with pool_crd_removed(cluster):
        with installed(
            cluster, namespace, tmp_path, "--set", "routing.installCRDs=false"
        ) as without:
            assert POOL_CRD not in helm_ok(
                cluster, "get", "manifest", without.name, "-n", namespace
            )
            assert not pool_crd_served(cluster)

        # Missing: the release installs it, kept on uninstall (deleting it would delete every
        # InferencePool of the cluster).
        with installed(cluster, namespace, tmp_path) as first:
            crd = kubectl_json(cluster, "get", "crd", POOL_CRD)
            annotations = crd["metadata"]["annotations"]
            assert annotations["meta.helm.sh/release-name"] == first.name
            assert annotations["helm.sh/resource-policy"] == "keep"
            assert annotations["inference.networking.k8s.io/bundle-version"] == GIE_VERSION
            assert pool_crd_served(cluster)

            # Present and someone else's (here: the first release's): a second release leaves
            # it alone instead of failing on an object it cannot own.
            second_dir = tmp_path / "second"
            second_dir.mkdir()
            with installed(cluster, namespace, second_dir) as second:
                manifest = helm_ok(cluster, "get", "manifest", second.name, "-n", namespace)
                assert POOL_CRD not in manifest
                crd = kubectl_json(cluster, "get", "crd", POOL_CRD)
                assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == first.name
        assert pool_crd_served(cluster)  # both releases uninstalled: the CRD stays


def test_namespaced_mode_is_confined_to_one_namespace(
    cluster: ClusterHandle, namespace: str, workload: str, tmp_path: Path
) -> None:
    watch = f"operator.watchNamespace={workload}"
    with installed(cluster, namespace, tmp_path, "--set", watch) as release:
        operator = release.operator
        # No cluster-scoped RBAC at all: a Role and RoleBinding in the watched namespace.
        selector = f"app.kubernetes.io/instance={release.name}"
        for kind in ("clusterrole", "clusterrolebinding"):
            assert kubectl_json(cluster, "get", kind, "-l", selector)["items"] == []
        role = kubectl_json(cluster, "get", "role", operator, "-n", workload)
        assert role["rules"] == [*NAMESPACED_RULES, peering_rule("kopfpeerings")]
        binding = kubectl_json(cluster, "get", "rolebinding", operator, "-n", workload)
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": release.service_account, "namespace": namespace}
        ]

        with run_operator(cluster, release, tmp_path / "operator.log") as run:
            apply_example(cluster, workload, "tiny-cpu.yaml")
            apply_example(cluster, namespace, "tiny-cpu.yaml")  # outside its namespace
            wait_ready(cluster, workload, "tiny-cpu")
            ignored = kubectl_json(cluster, "get", "inferenceservice", "tiny-cpu", "-n", namespace)
            assert "status" not in ignored
            assert cluster.kubectl("get", "deployment", "tiny-cpu", "-n", namespace).returncode == 1
            peering = kubectl_json(cluster, "get", "kopfpeering", operator, "-n", workload)
            assert peering["metadata"]["namespace"] == workload
            log = run.process.log_path.read_text()
        assert "--namespace=" + workload in operator_argv(cluster, release)
        assert not forbidden_lines(log), "\n".join(forbidden_lines(log))

        assert can_i(cluster, release, "patch", "deployments.apps", "-n", workload)
        assert can_i(cluster, release, "list", "inferenceservices.quire.dev", "-n", workload)
        for denied in [
            ("list", "inferenceservices.quire.dev", "--all-namespaces"),
            ("list", "inferenceservices.quire.dev", "-n", namespace),
            ("patch", "deployments.apps", "-n", namespace),
            ("get", "secrets", "-n", namespace),
            ("get", "secrets", "-n", "kube-system"),
            ("list", "secrets", "-n", workload),
            ("create", "clusterkopfpeerings.kopf.dev"),
        ]:
            assert not can_i(cluster, release, *denied), denied

"""The helm chart (charts/quire) and the observability kit, against the real control plane.

Files first (no cluster): the chart's CRDs are copies of crds/, values.yaml and its schema declare
the same keys, the Grafana dashboard and the prometheus-adapter rules name only series the engine
exports. Then helm itself (marked ``cluster``): lint, renders the API server accepts in a
server-side dry run (defaults, and a values file that sets every key), schema errors as a user
sees them, and the PodMonitor/ServiceMonitor against the Prometheus Operator's real CRDs. Only
the dry runs start the control plane; lint and template need just the cached helm binary.

The install, RBAC and upgrade/uninstall tests live in test_chart_install.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from quire_engine.engine.metrics import ServerMetrics
from quire_operator import meta
from quire_operator.builders.deployment import PORT_NAME
from quire_operator.builders.endpoint_picker import METRICS_PORT, build_epp_deployment
from quire_operator.builders.hpa import (
    KV_CACHE_METRIC,
    KV_DEMAND_METRIC,
    PREEMPTION_METRIC,
    QUEUE_METRIC,
)
from quire_operator.config import DEFAULT_EPP_IMAGE, GIE_VERSION, OperatorConfig
from quire_operator.settings import operator_settings
from tests.cluster.build import K8S_VERSION, Binaries
from tests.cluster.client import ClusterHandle, wait_for
from tests.cluster.pytest_plugin import unavailable
from tests.operator_tests.gie import (
    POOL_CRD,
    POOL_CRD_FILE,
    apply_crds,
    go_module_dir,
    install_gateway_api_crds,
)
from tests.operator_tests.test_routing_builders import routed

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "quire"
FULL_VALUES = Path(__file__).with_name("chart-values-full.yaml")
RELEASE = "quire"

# The Prometheus Operator release whose CRDs (PodMonitor, ServiceMonitor) the monitors are checked
# against. Its Go module ships them under example/prometheus-operator-crd/, so the Go module proxy
# that already serves the test cluster's sources serves these too.
PROMETHEUS_OPERATOR = ("github.com/prometheus-operator/prometheus-operator", "v0.85.0")
MONITOR_CRDS = ("podmonitors", "servicemonitors")

# Labels Prometheus adds to every scraped series (PodMonitor/ServiceMonitor targets), and the
# histogram bucket label: a query may group by them although the engine does not export them.
SCRAPE_LABELS = {"namespace", "pod", "le"}


def load_all(text: str) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


# ---------------------------------------------------------------------------- files, no cluster


def test_chart_crds_are_byte_copies_of_the_top_level_crds() -> None:
    # crds/ is the source of truth; helm installs every manifest in charts/quire/crds/. The
    # top-level crds/README.md is documentation of the folder, not a manifest.
    top = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").iterdir()}
    assert "inferenceservices.quire.dev.yaml" in top
    assert chart.keys() == top.keys(), "charts/quire/crds/ must hold exactly the CRDs of crds/"
    stale = sorted(name for name in top if chart[name] != top[name])
    assert not stale, f"charts/quire/crds/ differs from crds/ in {stale}: cp crds/*.yaml there"


def test_chart_pool_crd_and_picker_image_are_the_operators_gie_release() -> None:
    # One GIE release everywhere: the operator's constant, the CRD the chart installs (GIE stamps
    # its release into every CRD it ships) and the Endpoint Picker image the chart passes.
    crd = yaml.safe_load(POOL_CRD_FILE.read_text())
    assert crd["metadata"]["name"] == POOL_CRD
    assert crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == (
        GIE_VERSION
    )
    assert [v["name"] for v in crd["spec"]["versions"]] == ["v1"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["routing"] == {"eppImage": DEFAULT_EPP_IMAGE, "installCRDs": True}
    assert DEFAULT_EPP_IMAGE.endswith(f"/epp:{GIE_VERSION}")


def test_operator_needs_no_cluster_scans() -> None:
    # The chart's RBAC has no cluster-wide read of CRDs or namespaces (a namespaced install must
    # not need one). kopf would list and watch every CRD, and in namespaced mode every namespace,
    # unless scanning is off; refused, it logs 403s for a minute and holds the watches back.
    assert operator_settings().scanning.disabled is True


def schema_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    """Dotted paths of every property the schema declares, down to closed objects' leaves."""
    paths: set[str] = set()
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        paths.add(path)
        if sub.get("additionalProperties") is False:
            paths |= schema_paths(sub, f"{path}.")
    return paths


def value_paths(values: dict[str, Any], closed: set[str], prefix: str = "") -> set[str]:
    """Dotted paths of values.yaml, descending only into objects the schema closes."""
    paths: set[str] = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        paths.add(path)
        if isinstance(value, dict) and path in closed:
            paths |= value_paths(value, closed, f"{path}.")
    return paths


def closed_objects(schema: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for key, sub in schema.get("properties", {}).items():
        if sub.get("additionalProperties") is False:
            out.add(f"{prefix}{key}")
            out |= closed_objects(sub, f"{prefix}{key}.")
    return out


def test_values_and_schema_declare_the_same_keys() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    closed = closed_objects(schema)
    # Every object of our own is closed, so helm refuses a misspelt key instead of ignoring it.
    assert schema["additionalProperties"] is False
    assert {"image", "operator", "serviceAccount", "monitoring", "dashboard"} <= closed
    assert value_paths(values, closed) == schema_paths(schema)
    # Every leaf is documented or constrained (a type, an enum or a pattern).
    for path in schema_paths(schema):
        node: dict[str, Any] = schema
        for key in path.split("."):
            node = node["properties"][key]
        assert {"type", "enum"} & node.keys(), f"{path} is unconstrained"


def test_full_values_file_sets_every_key_to_a_non_default() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    closed = closed_objects(schema)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    full = yaml.safe_load(FULL_VALUES.read_text())
    assert value_paths(full, closed) == value_paths(values, closed)

    def leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and path in closed:
                out |= leaves(value, f"{path}.")
            else:
                out[path] = value
        return out

    defaults, chosen = leaves(values), leaves(full)
    # rbac.create/serviceAccount.create/... default to true: those stay true in the full file.
    same = {path for path in defaults if defaults[path] == chosen[path]}
    assert same == {
        "rbac.create",
        "serviceAccount.create",
        "adapterRules.enabled",
        "dashboard.enabled",
    }


def engine_series() -> dict[str, set[str]]:
    """Every sample name the engine exports -> its label names (from the real registry)."""
    metrics = ServerMetrics("m")
    series: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


METRIC = re.compile(r"\bquire_[a-z0-9_]+\b")


def check_promql(expr: str, series: dict[str, set[str]]) -> None:
    """Every quire_* series in ``expr`` exists, and every label it groups or filters by is one
    the engine exports on it (or one the scrape adds)."""
    names = set(METRIC.findall(expr))
    assert names, expr
    unknown = names - series.keys()
    assert not unknown, f"{expr}: the engine exports no {sorted(unknown)}"
    labels = set.intersection(*(series[n] for n in names)) | SCRAPE_LABELS
    grouped = {
        label.strip()
        for clause in re.findall(r"\bby \(([^)]*)\)", expr)
        for label in clause.split(",")
        if label.strip() and not label.strip().startswith("<<")
    }
    filtered = set(re.findall(r"([a-z_]+)=~?\"", expr))
    assert grouped | filtered <= labels, f"{expr}: labels {sorted((grouped | filtered) - labels)}"


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CHART / "dashboards" / "quire.json").read_text())
    return data


def test_dashboard_panels_cover_the_serving_signals() -> None:
    board = dashboard()
    assert board["uid"] == "quire-overview"
    panels = board["panels"]
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in panels}
    wanted = {
        "KV cache usage": ["quire_kv_cache_usage_ratio"],
        "Requests waiting (queue)": ["quire_num_requests_waiting"],
        "Requests running / swapped": ["quire_num_requests_running"],
        "Preemptions / s": ["rate(quire_preemptions_total"],
        "Prefix cache hit rate": ["quire_prefix_cache_hits_total", "quire_prefix_cache_queries"],
        "Time to first token (p50, p99)": [
            "histogram_quantile(0.5, sum by (le",
            "histogram_quantile(0.99, sum by (le",
            "quire_time_to_first_token_seconds_bucket",
        ],
        "Inter-token latency (p50, p99)": [
            "histogram_quantile(0.5,",
            "histogram_quantile(0.99,",
            "quire_inter_token_latency_seconds_bucket",
        ],
        "Tokens / s": ["rate(quire_generation_tokens_total", "rate(quire_prompt_tokens_total"],
    }
    for title, needles in wanted.items():
        assert title in exprs, f"no panel {title!r}"
        for needle in needles:
            assert needle in exprs[title], f"{title}: {needle!r} not in {exprs[title]}"
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in panels}
    assert units["KV cache usage"] == units["Prefix cache hit rate"] == "percentunit"
    assert units["Time to first token (p50, p99)"] == "s"


def test_dashboard_queries_name_only_exported_series() -> None:
    series = engine_series()
    board = dashboard()
    for panel in board["panels"]:
        for target in panel["targets"]:
            check_promql(target["expr"], series)
            # Every query follows the dashboard's namespace and model pickers.
            assert 'namespace=~"$namespace", model_name=~"$model"' in target["expr"]
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            check_promql(variable["definition"], series)


def test_dashboard_layout_is_a_valid_grid() -> None:
    panels = dashboard()["panels"]
    ids = [p["id"] for p in panels]
    assert len(set(ids)) == len(ids)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]  # Grafana's 24 columns
        area = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]


# ------------------------------------------------------------------------------ helm, a cluster


# helm lint and helm template never contact a cluster: these tests take only the cached binaries
# (the ``binaries`` fixture), and only the server-side dry runs start the control plane.
NAMESPACE = "quire-system"


def helm(binaries: Binaries, *args: str) -> subprocess.CompletedProcess[str]:
    """The cached helm with no kubeconfig at all (output captured, never raises)."""
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    return subprocess.run(
        [str(binaries.helm), *args], capture_output=True, text=True, env=env, timeout=120,
        check=False,
    )  # fmt: skip


def helm_template(
    binaries: Binaries, namespace: str, *args: str
) -> subprocess.CompletedProcess[str]:
    return helm(
        binaries,
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        namespace,
        "--kube-version",
        K8S_VERSION,
        *args,
    )


def render(binaries: Binaries, namespace: str, *args: str) -> list[Any]:
    proc = helm_template(binaries, namespace, *args)
    assert proc.returncode == 0, proc.stderr
    return load_all(proc.stdout)


def kinds(docs: list[Any]) -> list[tuple[str, str]]:
    return sorted((d["kind"], d["metadata"]["name"]) for d in docs)


def server_dry_run(cluster: ClusterHandle, docs: list[Any]) -> list[str]:
    """``kubectl apply --dry-run=server``: the API server validates (and defaults) each object
    exactly as on a real apply, admission included, and stores nothing."""
    manifest = yaml.safe_dump_all(docs)
    proc = subprocess.run(
        [str(cluster.binaries.kubectl), "apply", "--dry-run=server", "-o", "name", "-f", "-"],
        input=manifest,
        capture_output=True,
        text=True,
        env=cluster.env(),
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return sorted(proc.stdout.split())


@pytest.mark.cluster
def test_helm_lint_is_clean(binaries: Binaries) -> None:
    for extra in ([], ["--values", str(FULL_VALUES)]):
        proc = helm(binaries, "lint", "--strict", str(CHART), *extra)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.splitlines() == [
            "==> Linting " + str(CHART),
            "",
            "1 chart(s) linted, 0 chart(s) failed",
        ]


@pytest.mark.cluster
def test_default_render_is_accepted_by_the_api_server(
    cluster: ClusterHandle, namespace: str
) -> None:
    docs = render(cluster.binaries, namespace)
    operator = f"{RELEASE}-operator"
    assert kinds(docs) == [
        ("ClusterRole", operator),
        ("ClusterRoleBinding", operator),
        ("ConfigMap", f"{RELEASE}-adapter-rules"),
        ("ConfigMap", f"{RELEASE}-dashboard"),
        ("CustomResourceDefinition", POOL_CRD),
        ("Deployment", operator),
        ("ServiceAccount", operator),
    ]
    # No monitoring.coreos.com in the default capabilities: "auto" renders no PodMonitor.
    assert server_dry_run(cluster, docs) == sorted(
        [
            f"clusterrole.rbac.authorization.k8s.io/{operator}",
            f"clusterrolebinding.rbac.authorization.k8s.io/{operator}",
            f"configmap/{RELEASE}-adapter-rules",
            f"configmap/{RELEASE}-dashboard",
            f"customresourcedefinition.apiextensions.k8s.io/{POOL_CRD}",
            f"deployment.apps/{operator}",
            f"serviceaccount/{operator}",
        ]
    )
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert container["ports"] == [
        {"name": "liveness", "containerPort": 8080, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 8081, "protocol": "TCP"},
    ]
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    assert "--metrics-bind-address=0.0.0.0:8081" in container["args"]
    assert container["resources"] == {
        "requests": {"cpu": "50m", "memory": "128Mi"},
        "limits": {"memory": "256Mi"},
    }
    assert container["image"] == "quire-operator:0.1.0"
    assert "--engine-image=quire-engine:0.1.0" in container["args"]
    assert f"--epp-image={DEFAULT_EPP_IMAGE}" in container["args"]


@pytest.fixture(scope="module")
def monitoring_crds(
    cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """The Prometheus Operator's PodMonitor and ServiceMonitor CRDs, installed for this module's
    tests and removed afterwards."""
    module, version = PROMETHEUS_OPERATOR
    crd_dir = go_module_dir(module, version, tmp_path_factory.mktemp("gomod"))
    files = [
        crd_dir / "example" / "prometheus-operator-crd" / f"monitoring.coreos.com_{plural}.yaml"
        for plural in MONITOR_CRDS
    ]
    apply_crds(cluster, files, [f"{plural}.monitoring.coreos.com" for plural in MONITOR_CRDS])
    try:
        yield
    finally:
        cluster.kubectl("delete", "--wait=false", *[f"--filename={f}" for f in files])


@pytest.mark.cluster
def test_full_values_render_is_accepted_by_the_api_server(
    cluster: ClusterHandle, namespace: str, monitoring_crds: None
) -> None:
    here = [
        f"--set={key}={namespace}"
        for key in ("operator.watchNamespace", "adapterRules.namespace", "dashboard.namespace")
    ]
    docs = render(cluster.binaries, namespace, "--values", str(FULL_VALUES), *here)
    operator = f"{RELEASE}-operator"
    # Namespaced mode: a Role and RoleBinding in the watched namespace, nothing cluster-wide.
    assert kinds(docs) == [
        ("ConfigMap", f"{RELEASE}-adapter-rules"),
        ("ConfigMap", f"{RELEASE}-dashboard"),
        ("Deployment", operator),
        ("PodMonitor", f"{RELEASE}-endpoint-picker"),
        ("PodMonitor", f"{RELEASE}-engine"),
        ("PodMonitor", f"{RELEASE}-operator"),
        ("Role", operator),
        ("RoleBinding", operator),
        ("ServiceAccount", "quire-operator-sa"),
        ("ServiceMonitor", f"{RELEASE}-engine"),
        ("ValidatingAdmissionPolicy", f"{RELEASE}-engine-images"),
        ("ValidatingAdmissionPolicyBinding", f"{RELEASE}-engine-images"),
    ]
    accepted = server_dry_run(cluster, docs)
    assert len(accepted) == len(docs)
    assert f"podmonitor.monitoring.coreos.com/{RELEASE}-engine" in accepted

    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}
    by_kind = {d["kind"]: d for d in docs if d["kind"] != "PodMonitor"}
    by_kind["PodMonitor"] = monitors[f"{RELEASE}-engine"]
    (container,) = by_kind["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["args"] == [
        f"--namespace={namespace}",
        "--engine-image=registry.example.com/quire/quire-engine:0.1.0-cu128",
        "--epp-image=registry.example.com/mirror/gateway-api-inference-extension/epp:v1.5.0",
        "--cluster-domain=cluster.example",
        "--liveness=http://0.0.0.0:9090/healthz",
        "--metrics-bind-address=0.0.0.0:9091",
        f"--peering={operator}",
        "--log-format=json",
        "--prometheus-address=http://prometheus.monitoring.svc:9090",
        "--verbose",
        "--priority=100",
    ]
    assert container["image"] == "registry.example.com/quire/quire-operator:0.1.0-rc.1"
    monitor = by_kind["PodMonitor"]["spec"]
    assert monitor["namespaceSelector"] == {"matchNames": [namespace]}
    assert monitor["podMetricsEndpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "10s"}
    ]
    # The operator's own metrics: its pod, in the release namespace, its labels kept.
    operator_monitor = monitors[f"{RELEASE}-operator"]["spec"]
    assert operator_monitor["namespaceSelector"] == {"matchNames": [namespace]}
    assert operator_monitor["podMetricsEndpoints"] == [
        {"port": "metrics", "path": "/metrics", "honorLabels": True, "interval": "10s"}
    ]
    pod_labels = by_kind["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert operator_monitor["selector"]["matchLabels"].items() <= pod_labels.items()
    dashboards = [d for d in docs if d["metadata"]["name"] == f"{RELEASE}-dashboard"]
    assert dashboards[0]["metadata"]["labels"]["grafana_dashboard_quire"] == "yes"
    assert dashboards[0]["metadata"]["annotations"] == {"grafana_folder": "LLM serving"}


@pytest.mark.cluster
def test_chart_pool_crd_is_a_byte_copy_of_the_go_modules_file() -> None:
    # tools/sync_gie_crd.py --check fetches GIE_VERSION's module through the Go module proxy.
    if shutil.which("go") is None:
        unavailable("no `go` on PATH to fetch the Gateway API Inference Extension module")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "sync_gie_crd.py"), "--check"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.cluster
def test_pool_crd_renders_as_the_modules_file_kept_on_uninstall(binaries: Binaries) -> None:
    (crd,) = [d for d in render(binaries, NAMESPACE) if d["kind"] == "CustomResourceDefinition"]
    wanted = yaml.safe_load(POOL_CRD_FILE.read_text())
    # The only addition: helm uninstall must never delete the CRD (and every InferencePool).
    wanted["metadata"]["annotations"]["helm.sh/resource-policy"] = "keep"
    assert crd == wanted
    off = render(binaries, NAMESPACE, "--set", "routing.installCRDs=false")
    assert [d for d in off if d["kind"] == "CustomResourceDefinition"] == []


@pytest.mark.cluster
def test_secrets_are_readable_by_name_only_and_only_while_asked(binaries: Binaries) -> None:
    def secret_rules(*args: str) -> list[dict[str, Any]]:
        (role,) = [d for d in render(binaries, NAMESPACE, *args) if d["kind"] == "ClusterRole"]
        return [r for r in role["rules"] if "secrets" in r["resources"]]

    assert secret_rules() == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]
    assert secret_rules("--set", "rbac.readApiKeySecrets=false") == []


@pytest.mark.cluster
def test_monitors_render_only_when_the_api_exists_or_asked(binaries: Binaries) -> None:
    monitoring = ["--api-versions", "monitoring.coreos.com/v1/PodMonitor"]

    def monitor_kinds(*args: str) -> list[str]:
        return sorted(
            d["kind"] for d in render(binaries, NAMESPACE, *args) if "Monitor" in d["kind"]
        )

    assert monitor_kinds() == []
    # Three PodMonitors: the engines', the Endpoint Pickers' and the operator's.
    assert monitor_kinds(*monitoring) == ["PodMonitor"] * 3
    assert monitor_kinds(*monitoring, "--set", "monitoring.podMonitor.enabled=false") == []
    assert monitor_kinds("--set", "monitoring.podMonitor.enabled=true") == ["PodMonitor"] * 3
    no_metrics = ["--set", "operator.metricsPort=0"]
    assert monitor_kinds(*monitoring, *no_metrics) == ["PodMonitor"] * 2
    rendered = render(binaries, NAMESPACE, *no_metrics)
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "--metrics-bind-address=0" in container["args"]
    assert [p["name"] for p in container["ports"]] == ["liveness"]
    assert monitor_kinds("--set", "monitoring.serviceMonitor.enabled=true") == ["ServiceMonitor"]


@pytest.mark.cluster
def test_schema_rejects_bad_values_with_readable_messages(binaries: Binaries) -> None:
    bad = [
        "--set", "operator.replicas=0",
        "--set", "operator.replica=2",
        "--set", "operator.logLevel=loud",
        "--set", "monitoring.podMonitor.enabled=maybe",
        "--set", "image.tag=latest build",
    ]  # fmt: skip
    proc = helm_template(binaries, NAMESPACE, *bad)
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line]
    assert lines[:2] == [
        "Error: values don't meet the specifications of the schema(s) in the following chart(s):",
        "quire:",
    ]
    # helm lists the errors in no fixed order (Go map iteration), hence a sorted comparison.
    assert sorted(lines[2:]) == sorted(
        [
            "- at '/operator': validation failed",
            "  - at '/operator/replicas': minimum: got 0, want 1",
            "  - at '/operator/logLevel': value must be one of 'info', 'debug'",
            "  - at '/operator': additional properties 'replica' not allowed",
            "- at '/monitoring/podMonitor/enabled': value must be one of true, false, 'auto'",
            "- at '/image/tag': 'latest build' does not match pattern "
            "'^([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$'",
        ]
    )


@pytest.mark.cluster
def test_adapter_rules_serve_exactly_the_metrics_the_operator_hpas_use(
    binaries: Binaries,
) -> None:
    (configmap,) = [
        d
        for d in render(binaries, NAMESPACE)
        if d["metadata"]["name"] == f"{RELEASE}-adapter-rules"
    ]
    rules = yaml.safe_load(configmap["data"]["config.yaml"])["rules"]
    exposed = {rule["name"]["as"]: rule for rule in rules}
    assert exposed.keys() == {KV_CACHE_METRIC, KV_DEMAND_METRIC, QUEUE_METRIC, PREEMPTION_METRIC}
    series = engine_series()
    for name, rule in exposed.items():
        # Discovery: one engine series, with the scrape's pod labels; the name regex matches it.
        (source,) = METRIC.findall(rule["seriesQuery"])
        assert source in series, name
        assert rule["seriesQuery"] == f'{source}{{namespace!="",pod!=""}}'
        assert re.fullmatch(rule["name"]["matches"], source), name
        # Association: Pods metrics (namespace + pod), as the HPA's `type: Pods` asks for.
        assert rule["resources"] == {
            "overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        }
        query = rule["metricsQuery"]
        assert "<<.Series>>{<<.LabelMatchers>>}" in query and "by (<<.GroupBy>>)" in query
        check_promql(query.replace("<<.Series>>", source), series)
    assert exposed[PREEMPTION_METRIC]["metricsQuery"] == (
        "sum by (<<.GroupBy>>) (rate(<<.Series>>{<<.LabelMatchers>>}[1m]))"
    )
    assert METRIC.findall(exposed[PREEMPTION_METRIC]["seriesQuery"]) == ["quire_preemptions_total"]


@pytest.mark.cluster
def test_monitors_select_the_engine_pods_the_operator_makes(binaries: Binaries) -> None:
    both = [f"--set=monitoring.{kind}.enabled=true" for kind in ("podMonitor", "serviceMonitor")]
    docs = render(binaries, NAMESPACE, *both)
    monitors = {d["kind"]: d["spec"] for d in docs if d["metadata"]["name"] == f"{RELEASE}-engine"}
    engine_labels = meta.labels("any-service")
    for kind, endpoints in (("PodMonitor", "podMetricsEndpoints"), ("ServiceMonitor", "endpoints")):
        selector = monitors[kind]["selector"]["matchLabels"]
        # Every engine pod and Service carries these labels, and nothing else of the cluster does.
        assert selector.items() <= engine_labels.items()
        assert selector[meta.MANAGED_BY_LABEL] == meta.FIELD_MANAGER
        assert monitors[kind]["namespaceSelector"] == {"any": True}
        assert [e["port"] for e in monitors[kind][endpoints]] == [PORT_NAME]
    (picker,) = [d["spec"] for d in docs if d["metadata"]["name"] == f"{RELEASE}-endpoint-picker"]
    # Every Endpoint Picker pod carries these labels, and no engine pod does.
    picker_pod = build_epp_deployment(routed(), OperatorConfig())["spec"]["template"]
    selector = picker["selector"]["matchLabels"]
    assert selector.items() <= picker_pod["metadata"]["labels"].items()
    assert not selector.items() <= engine_labels.items()
    assert picker["namespaceSelector"] == {"any": True}
    assert picker["podMetricsEndpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s"}
    ]
    (container,) = picker_pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == METRICS_PORT
    assert "--metrics-endpoint-auth=false" in container["args"]


@pytest.mark.cluster
def test_yaml_lookalike_names_stay_strings(binaries: Binaries) -> None:
    # A release "y" in namespace "on" watching namespace "no": YAML 1.1 reads all three as
    # booleans unless the templates quote them.
    args = ["--set", "operator.watchNamespace=no", "--set", "monitoring.podMonitor.enabled=true"]
    proc = helm(
        binaries,
        "template", "y", str(CHART), "--namespace", "on", "--kube-version", K8S_VERSION, *args,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for doc in load_all(proc.stdout):
        metadata = doc["metadata"]
        assert metadata.get("namespace", "-") in {"on", "no", "-"}, doc["kind"]
        for key, value in metadata.get("labels", {}).items():
            assert isinstance(key, str) and isinstance(value, str), (doc["kind"], key, value)
        for subject in doc.get("subjects", []):
            assert subject["namespace"] == "on"


@pytest.mark.cluster
def test_examples_are_valid_inference_services(
    cluster: ClusterHandle, namespace: str, tmp_path: Path
) -> None:
    # The chart's CRD, applied as helm would (the operator tests' fixture may have done it).
    applied = cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds")
    )
    assert applied.returncode == 0, applied.stderr
    waited = cluster.kubectl(
        "wait", "--for=condition=Established", "crd/inferenceservices.quire.dev"
    )
    assert waited.returncode == 0, waited.stderr
    # The routed example's Gateway and HTTPRoute, against the Gateway API's own CRDs.
    install_gateway_api_crds(cluster, tmp_path)
    docs = [
        doc for p in sorted((ROOT / "examples").glob("*.yaml")) for doc in load_all(p.read_text())
    ]
    for doc in docs:
        doc["metadata"]["namespace"] = namespace
    assert server_dry_run(cluster, docs) == [
        "gateway.gateway.networking.k8s.io/inference-gateway",
        "httproute.gateway.networking.k8s.io/tiny-cpu-routed",
        "inferenceservice.quire.dev/qwen-0-5b",
        "inferenceservice.quire.dev/qwen-0-5b-keda",
        "inferenceservice.quire.dev/qwen-0-5b-mig",
        "inferenceservice.quire.dev/qwen-0-5b-zero",
        "inferenceservice.quire.dev/tiny-cpu",
        "inferenceservice.quire.dev/tiny-cpu-routed",
    ]
    specs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "InferenceService"}
    assert specs["tiny-cpu-routed"]["routing"] == {"mode": "InferencePool"}
    (route,) = [d for d in docs if d["kind"] == "HTTPRoute"]
    # The route's backend is the pool the operator names after the InferenceService.
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "tiny-cpu-routed"}
    ]
    (gateway,) = [d for d in docs if d["kind"] == "Gateway"]
    assert [p["name"] for p in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]
    assert specs["tiny-cpu"]["resources"]["gpus"] == 0
    assert specs["qwen-0-5b"]["autoscaling"]["enabled"] is True
    assert {"targetQueueDepth", "targetKVCacheUtilization"} <= specs["qwen-0-5b"][
        "autoscaling"
    ].keys()
    assert specs["qwen-0-5b-mig"]["resources"]["gpuResourceName"] == "nvidia.com/mig-1g.10gb"


@pytest.mark.cluster
def test_engine_image_allow_list_is_enforced_by_the_api_server(
    cluster: ClusterHandle, namespace: str
) -> None:
    allowed = "--set=admission.allowedEngineImages={registry.example.com/quire/}"
    assert not [d for d in render(cluster.binaries, namespace) if "Admission" in d["kind"]]
    docs = [d for d in render(cluster.binaries, namespace, allowed) if "Admission" in d["kind"]]
    assert [d["kind"] for d in docs] == [
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]
    manifest = yaml.safe_dump_all(docs)
    applied = subprocess.run(
        [str(cluster.binaries.kubectl), "apply", "-f", "-"], input=manifest, text=True,
        capture_output=True, env=cluster.env(), timeout=60, check=False,
    )  # fmt: skip
    assert applied.returncode == 0, applied.stderr
    try:

        def create(name: str, image: str | None) -> subprocess.CompletedProcess[str]:
            engine = {} if image is None else {"image": image}
            body = {
                "apiVersion": f"{meta.GROUP}/{meta.VERSION}",
                "kind": meta.KIND,
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"model": {"uri": "tiny"}, "engine": engine},
            }
            return subprocess.run(
                [str(cluster.binaries.kubectl), "create", "--dry-run=server", "-f", "-"],
                input=json.dumps(body), text=True, capture_output=True, env=cluster.env(),
                timeout=60, check=False,
            )  # fmt: skip

        # The API server picks a new policy up within a second or two.
        refused = wait_for(
            "the policy to refuse a foreign image",
            lambda: create("foreign", "docker.io/someone/miner:latest"),
            lambda proc: proc.returncode != 0,
            timeout_s=30,
        )
        assert (
            "spec.engine.image docker.io/someone/miner:latest is not allowed here: it must start "
            "with one of registry.example.com/quire/"
        ) in refused.stderr
        assert create("ours", "registry.example.com/quire/quire-engine:0.1.0").returncode == 0
        assert create("default", None).returncode == 0  # the operator's own engine image
    finally:
        for doc in reversed(docs):
            kind = doc["kind"].lower()
            cluster.kubectl("delete", "--ignore-not-found", kind, doc["metadata"]["name"])

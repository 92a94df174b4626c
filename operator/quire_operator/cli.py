"""``quire-operator``: run the InferenceService operator (kopf) against the current cluster.

It talks to the API server of the in-cluster service account, or of $KUBECONFIG outside a
cluster. Scope: ``--namespace`` (repeatable) or ``--all-namespaces``.

Peering: every replica of the operator joins the kopf peering object named by ``--peering``
(a ClusterKopfPeering when cluster-wide, a KopfPeering per namespace otherwise; the CRDs are in
crds/kopfpeerings.kopf.dev.yaml) and only the one with the highest ``--priority`` works; the
others pause until it leaves (at exit) or its keep-alive lapses (``--peering-lifetime`` after a
crash). The operator creates its peering object if it is missing. Equal priorities would pause
everyone, so the default priority is random per process; set ``POD_ID`` to the pod's name so a
restarted container takes its own place at once. ``--standalone`` skips peering.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import socket
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import kopf
from kubernetes import client, config

from quire_operator import meta
from quire_operator.config import DEFAULT_ENGINE_IMAGE, DEFAULT_EPP_IMAGE, OperatorConfig
from quire_operator.handlers import register
from quire_operator.kinds import OPTIONAL, Kind
from quire_operator.peering import PeeringGate, ensure_peering
from quire_operator.reconcile.reconciler import Reconciler
from quire_operator.requeue import Requeue, RequeueConfig
from quire_operator.settings import operator_settings
from quire_operator.status.metrics import OperatorMetrics, parse_bind_address

logger = logging.getLogger("quire_operator")


def build_parser() -> argparse.ArgumentParser:
    description = "Run the Quire InferenceService operator (kopf) against the current cluster."
    parser = argparse.ArgumentParser(prog="quire-operator", description=description)
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        dest="namespaces",
        metavar="NAMESPACE",
        help="namespace to serve (repeatable)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="serve every namespace")
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="liveness endpoint URL (200 while the operator runs); '' disables it",
    )
    parser.add_argument(
        "--metrics-bind-address",
        default=":8081",
        help="HOST:PORT or :PORT where the operator's Prometheus metrics are served (its Events "
        "and wake-ups from zero, docs/metrics.md); '' or 0 disables them (default :8081)",
    )
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument("--peering", default="quire-operator", help="peering object name")
    peering.add_argument("--standalone", action="store_true", help="run without peering")
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority; the highest works, the rest wait (default: random)",
    )
    parser.add_argument(
        "--peering-lifetime",
        type=int,
        default=60,
        help="seconds a replica that stopped without leaving (a crash) still counts as working",
    )
    parser.add_argument(
        "--engine-image",
        default=os.environ.get("QUIRE_ENGINE_IMAGE", DEFAULT_ENGINE_IMAGE),
        help="engine image for InferenceServices that name none [env QUIRE_ENGINE_IMAGE]",
    )
    parser.add_argument(
        "--epp-image",
        default=os.environ.get("QUIRE_EPP_IMAGE", DEFAULT_EPP_IMAGE),
        help="Endpoint Picker image for InferenceServices routed through an InferencePool "
        "[env QUIRE_EPP_IMAGE]",
    )
    parser.add_argument("--cluster-domain", default="cluster.local", help="for status.url")
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=300.0,
        help="reconcile every InferenceService this often, whatever the events (default 300)",
    )
    parser.add_argument(
        "--prometheus-address",
        default=os.environ.get("QUIRE_PROMETHEUS_ADDRESS") or None,
        help="Prometheus URL for KEDA ScaledObjects that name none [env QUIRE_PROMETHEUS_ADDRESS]",
    )
    parser.add_argument("--log-format", choices=["text", "json"], default="text")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    return parser


def api_client() -> client.ApiClient:
    """A client of its own (the library-wide default configuration is left alone)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    return config.new_client_from_config()


def served_groups(api: client.ApiClient) -> set[tuple[str, str]]:
    """(group, version) of every API the server serves."""
    groups = client.ApisApi(api).get_api_versions().groups
    return {(g.name, v.version) for g in groups for v in g.versions}


def require_crd(served: set[tuple[str, str]]) -> None:
    """Refuse to start unless the API server serves InferenceServices: kopf resolves resources
    once at startup (settings.py), so an operator started before its CRD would serve nothing."""
    if (meta.GROUP, meta.VERSION) not in served:
        raise SystemExit(
            f"quire-operator: the API server does not serve {meta.API_VERSION} InferenceServices; "
            "install the CRD first: kubectl apply -f crds/inferenceservices.quire.dev.yaml"
        )


def _lister(
    api: client.ApiClient, namespaces: Sequence[str] | None
) -> Callable[[], list[tuple[str, str]]]:
    """(namespace, name) of every InferenceService in scope, for the periodic resync."""
    custom = client.CustomObjectsApi(api)

    def list_keys() -> list[tuple[str, str]]:
        lists: list[Any]
        if namespaces is None:
            lists = [custom.list_cluster_custom_object(meta.GROUP, meta.VERSION, meta.PLURAL)]
        else:
            lists = [
                custom.list_namespaced_custom_object(meta.GROUP, meta.VERSION, ns, meta.PLURAL)
                for ns in namespaces
            ]
        return [
            (item["metadata"]["namespace"], item["metadata"]["name"])
            for found in lists
            for item in found["items"]
        ]

    return list_keys


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        metrics_address = parse_bind_address(args.metrics_bind_address)
    except ValueError as err:
        parser.error(str(err))
    log_format = kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.FULL
    kopf.configure(verbose=args.verbose, log_format=log_format)
    if not args.verbose:
        # kopf logs every handler call at INFO, one line per pod or Deployment event; the
        # reconciler's own INFO lines (condition flips, generations applied) tell the story.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        # One line per liveness probe (every few seconds, forever) says nothing either.
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    operator_config = OperatorConfig(
        engine_image=args.engine_image,
        cluster_domain=args.cluster_domain,
        prometheus_address=args.prometheus_address,
        epp_image=args.epp_image,
    )
    api = api_client()
    served = served_groups(api)
    require_crd(served)
    metrics = OperatorMetrics()
    if metrics_address is not None:
        metrics.serve(metrics_address)
    # Kinds with an optional CRD are watched where served at start (status.autoscaler follows
    # KEDA's ScaledObjects, status.routing the InferencePools); otherwise read on each reconcile.
    watched = frozenset(kind for kind in OPTIONAL if (kind.group, kind.version) in served)
    pool = Kind.INFERENCE_POOL
    if pool not in watched:
        logger.info(
            "%s/%s InferencePools are not served: routed InferenceServices report "
            "InferencePoolCRDMissing until the CRD is installed (then restart the operator to "
            "watch pools; until then they are read on each reconcile)",
            pool.group,
            pool.version,
        )
    namespaces = None if args.all_namespaces else list(dict.fromkeys(args.namespaces))
    if not args.standalone:
        ensure_peering(api, args.peering, namespaces)
    registry = kopf.OperatorRegistry()
    # A bare registry has no login handlers; kopf's own connection then loads the same sources
    # (in-cluster service account, else $KUBECONFIG) as api_client() above.
    kopf.on.login(registry=registry)(kopf.login_via_client)
    settings = operator_settings()
    settings.peering.lifetime = args.peering_lifetime
    priority = args.priority if args.priority is not None else random.randint(1, 2**31 - 1)
    # kopf takes its peering identity from POD_ID; set one when it is not, so the requeue's
    # PeeringGate knows which keep-alive in the peering object is this process's.
    os.environ.setdefault("POD_ID", f"{socket.gethostname()}/{os.getpid()}-{uuid.uuid4().hex[:6]}")
    if args.standalone:
        active: Callable[[], bool] = lambda: True  # noqa: E731
    else:
        gate = PeeringGate(api, args.peering, namespaces, os.environ["POD_ID"], priority)
        active = gate.active
    requeue = Requeue(
        Reconciler(api, operator_config, metrics=metrics),
        _lister(api, namespaces),
        active,
        RequeueConfig(resync_s=args.resync_seconds),
    )
    register(registry, settings, requeue.run, watched)
    logger.info(
        "serving %s; peering %s",
        "all namespaces" if namespaces is None else ", ".join(namespaces),
        "off" if args.standalone else f"{args.peering!r} at priority {priority}",
    )
    requeue.start()
    try:
        kopf.run(
            registry=registry,
            settings=settings,
            clusterwide=namespaces is None,
            namespaces=namespaces or (),
            standalone=args.standalone,
            peering_name=None if args.standalone else args.peering,
            priority=priority,
            liveness_endpoint=args.liveness or None,
        )
    finally:
        requeue.stop()
        api.close()
    return 0

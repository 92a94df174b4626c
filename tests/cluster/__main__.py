"""Command line for humans and CI: ``python -m tests.cluster {build,up,paths}``.

- ``build``: build and cache every binary (prints where); instant when already cached.
- ``up``: start a cluster, print the ``export`` lines for KUBECONFIG and PATH, and keep it
  running until Ctrl-C (or SIGTERM); everything is stopped and removed on the way out.
  ``--autoscaling`` adds Prometheus, KEDA and prometheus-adapter (see addons.py); ``build
  --autoscaling`` builds them.
- ``paths``: print the cached binaries' paths (nothing is built).

``--routing`` (``build`` and ``up``): Gateway API Inference Extension's Endpoint Picker and
Envoy (routing_build.py); ``up --routing`` also installs GIE's CRDs, runs the engine and EPP pods
of one namespace as local processes (pod_runner.py) and puts Envoy in front of the first EPP that
serves (gateway.py).

``--lws`` (``build`` and ``up``): the LeaderWorkerSet controller (lws_build.py); ``up --lws`` runs
it with its webhooks and CRDs (lws.py), as the ``lws`` pytest fixture does.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
import time
from types import FrameType

from .addons import AutoscalingStack
from .addons_build import ensure_autoscaling_binaries
from .build import BuildError, ensure_binaries, find_binaries, missing_binaries
from .gateway import Gateway, GatewayConfig
from .launcher import ControlPlane
from .lws import LwsStack
from .lws_build import ensure_lws_binaries
from .pod_runner import PodRunner
from .process import ClusterError, free_port
from .routing import RoutingStack
from .routing_build import ensure_routing_binaries, find_routing_binaries


def _build(args: argparse.Namespace) -> int:
    started = time.monotonic()
    _print_paths(ensure_binaries())
    if args.autoscaling:
        _print_paths(ensure_autoscaling_binaries())
    if args.routing:
        _print_paths(ensure_routing_binaries())
    if args.lws:
        _print_paths(ensure_lws_binaries())
    print(f"# ready in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0


def _paths(_: argparse.Namespace) -> int:
    binaries = find_binaries()
    if binaries is None:
        print(f"not built yet (missing: {', '.join(missing_binaries())}); run: "
              "python -m tests.cluster build", file=sys.stderr)  # fmt: skip
        return 1
    _print_paths(binaries)
    routing = find_routing_binaries()
    if routing is None:
        print("# routing add-on (EPP, Envoy) not built: python -m tests.cluster build --routing")
    else:
        _print_paths(routing)
    return 0


def _print_paths(binaries: object) -> None:
    """One ``name path`` line per field of a binaries dataclass (a tuple field: one per path)."""
    for name, value in vars(binaries).items():
        for path in value if isinstance(value, tuple) else (value,):
            print(f"{name:24} {path}")


class _RoutingUp:
    """``up --routing``: the kubelet stand-in for one namespace, and a gateway that follows the
    first EPP pod serving there (restarted on the same port when that EPP changes)."""

    def __init__(self, stack: RoutingStack, namespace: str) -> None:
        self.stack = stack
        self.namespace = namespace
        self.port = free_port()
        self.runner: PodRunner = stack.pod_runner(
            namespace, "", on_event=lambda event: print(f"# {event}", flush=True)
        )
        self.gateway: Gateway | None = None
        self.reported = 0

    def follow(self) -> None:
        for error in self.runner.errors[self.reported :]:
            print(f"# pod runner: {error}", file=sys.stderr, flush=True)
        self.reported = len(self.runner.errors)
        epps = self.runner.epps()
        # With no EPP serving, the gateway stays and shows the failure mode (503, FailClose).
        followed = self.gateway.config if self.gateway is not None else None
        if not epps or (isinstance(followed, GatewayConfig) and followed.epp == epps[0].address):
            return
        if self.gateway is not None:
            self.gateway.stop()
            self.stack.gateways.remove(self.gateway)
        gateway = Gateway(
            self.stack.binaries.envoy, GatewayConfig(epp=epps[0].address), self.stack.workdir,
            self.stack.log_dir, name="envoy", port=self.port,
        )  # fmt: skip
        self.stack.gateways.append(gateway)
        self.gateway = gateway.start()
        print(f"# gateway {gateway.url} now routes through EPP pod {epps[0].pod}", flush=True)


def _up(args: argparse.Namespace) -> int:
    binaries = ensure_binaries()
    addons = ensure_autoscaling_binaries() if args.autoscaling else None
    routing_binaries = ensure_routing_binaries() if args.routing else None
    lws_binaries = ensure_lws_binaries() if args.lws else None
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    cluster = ControlPlane(binaries, startup_timeout_s=args.timeout)
    stack = None
    routing = None
    lws = None
    try:
        # Ctrl-C here raises KeyboardInterrupt; start() stops what it had started first.
        cluster.start()
        if addons is not None:
            stack = AutoscalingStack(cluster, addons)
            stack.start_prometheus()
            stack.start_keda()
            stack.start_prometheus_adapter(stack.chart_adapter_rules())
        if routing_binaries is not None:
            routing = RoutingStack(cluster, routing_binaries)
            routing.install_crds()
        if lws_binaries is not None:
            lws = LwsStack(cluster, lws_binaries)
            lws.start()
    except ClusterError as err:
        if lws is not None:
            lws.stop()
        if routing is not None:
            routing.stop()
        if stack is not None:
            stack.stop()
        cluster.stop(keep_logs=True)
        print(f"cluster failed to start: {err}\nlogs kept in {cluster.log_dir}", file=sys.stderr)
        return 1
    # From now on SIGTERM (e.g. from a supervising script) and Ctrl-C both end the wait loop
    # below, so shutdown happens in one place, in order.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    path = ":".join(str(d) for d in binaries.bin_dirs())
    print(f"# control plane ready in {cluster.startup_s:.1f}s; logs in {cluster.log_dir}")
    print(f"export KUBECONFIG={shlex.quote(str(cluster.kubeconfig))}")
    print(f'export PATH={shlex.quote(path)}:"$PATH"')
    if stack is not None:
        print(f"# Prometheus {stack.prometheus_url} scrapes the file-SD targets in "
              f"{stack.targets_file}; KEDA and prometheus-adapter are registered "
              "(kubectl get apiservices). Run quire-operator with "
              f"--prometheus-address={stack.prometheus_url}")  # fmt: skip
    if lws is not None:
        print("# the LeaderWorkerSet controller runs with its webhooks and CRDs (with --routing, "
              "a group's engine pods run here too)")  # fmt: skip
    follower = None
    if routing is not None:
        follower = _RoutingUp(routing, args.namespace)
        print(f"# pod IPs: {cluster.pod_network.cidr} (loopback). GIE's CRDs are installed; in "
              f"namespace {args.namespace!r} every Running pod whose container is quire-engine "
              "(command) or the EPP (image .../epp:TAG) runs here as a process on its pod's IP "
              f"(logs in {cluster.log_dir}). Once an EPP pod serves, Envoy listens on "
              f"http://127.0.0.1:{follower.port} (e.g. curl it at /v1/completions).")  # fmt: skip
    print("# Ctrl-C stops the cluster and deletes its files", flush=True)
    failed = False
    try:
        while not stop.wait(1.0):
            if follower is not None:
                follower.follow()
            dead = cluster.dead_components() + (stack.dead_components() if stack else [])
            if lws is not None and lws.process is not None and lws.process.exited() is not None:
                dead.append(lws.process.name)
            if dead:
                print(f"component(s) exited: {', '.join(dead)}\n{cluster.log_report()}",
                      file=sys.stderr)  # fmt: skip
                failed = True
                break
    finally:
        if lws is not None:
            lws.stop()
        if routing is not None:
            routing.stop()
        if stack is not None:
            stack.stop()
        cluster.stop(keep_logs=failed)
    if failed:
        print(f"logs kept in {cluster.log_dir}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build and cache the binaries")
    build.add_argument("--autoscaling", action="store_true", help="also KEDA, adapter, Prometheus")
    build.add_argument("--routing", action="store_true", help="also the GIE EPP and Envoy")
    build.add_argument("--lws", action="store_true", help="also the LeaderWorkerSet controller")
    build.set_defaults(func=_build)
    sub.add_parser("paths", help="print the cached binaries").set_defaults(func=_paths)
    up = sub.add_parser("up", help="run a cluster until Ctrl-C")
    up.add_argument("--timeout", type=float, default=90.0, help="startup timeout in seconds")
    up.add_argument(
        "--autoscaling", action="store_true", help="also Prometheus, KEDA, prometheus-adapter"
    )
    up.add_argument(
        "--routing", action="store_true", help="also GIE's CRDs, EPP/engine pods run locally, Envoy"
    )
    up.add_argument("--lws", action="store_true", help="also the LeaderWorkerSet controller")
    up.add_argument(
        "--namespace", default="default", help="with --routing: the namespace whose pods run here"
    )
    up.set_defaults(func=_up)
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())

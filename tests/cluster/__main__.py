"""Command line for humans and CI: ``python -m tests.cluster {build,up,paths}``.

- ``build``: build and cache every binary (prints where); instant when already cached.
- ``up``: start a cluster, print the ``export`` lines for KUBECONFIG and PATH, and keep it
  running until Ctrl-C (or SIGTERM); everything is stopped and removed on the way out.
  ``--autoscaling`` adds Prometheus, KEDA and prometheus-adapter (see addons.py); ``build
  --autoscaling`` builds them.
- ``paths``: print the cached binaries' paths (nothing is built).
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
from .launcher import ControlPlane
from .process import ClusterError


def _build(args: argparse.Namespace) -> int:
    started = time.monotonic()
    binaries = ensure_binaries()
    for name, path in vars(binaries).items():
        print(f"{name:24} {path}")
    if args.autoscaling:
        for name, path in vars(ensure_autoscaling_binaries()).items():
            print(f"{name:24} {path}")
    print(f"# ready in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0


def _paths(_: argparse.Namespace) -> int:
    binaries = find_binaries()
    if binaries is None:
        print(f"not built yet (missing: {', '.join(missing_binaries())}); run: "
              "python -m tests.cluster build", file=sys.stderr)  # fmt: skip
        return 1
    for name, path in vars(binaries).items():
        print(f"{name:24} {path}")
    return 0


def _up(args: argparse.Namespace) -> int:
    binaries = ensure_binaries()
    addons = ensure_autoscaling_binaries() if args.autoscaling else None
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    cluster = ControlPlane(binaries, startup_timeout_s=args.timeout)
    stack = None
    try:
        # Ctrl-C here raises KeyboardInterrupt; start() stops what it had started first.
        cluster.start()
        if addons is not None:
            stack = AutoscalingStack(cluster, addons)
            stack.start_prometheus()
            stack.start_keda()
            stack.start_prometheus_adapter(stack.chart_adapter_rules())
    except ClusterError as err:
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
    print("# Ctrl-C stops the cluster and deletes its files", flush=True)
    failed = False
    try:
        while not stop.wait(1.0):
            dead = cluster.dead_components() + (stack.dead_components() if stack else [])
            if dead:
                print(f"component(s) exited: {', '.join(dead)}\n{cluster.log_report()}",
                      file=sys.stderr)  # fmt: skip
                failed = True
                break
    finally:
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
    build.set_defaults(func=_build)
    sub.add_parser("paths", help="print the cached binaries").set_defaults(func=_paths)
    up = sub.add_parser("up", help="run a cluster until Ctrl-C")
    up.add_argument("--timeout", type=float, default=90.0, help="startup timeout in seconds")
    up.add_argument(
        "--autoscaling", action="store_true", help="also Prometheus, KEDA, prometheus-adapter"
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

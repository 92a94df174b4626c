"""Envoy as an inference gateway in front of an Endpoint Picker, the way GIE's gateways run it.

The bootstrap follows the reference Envoy configuration of Gateway API Inference Extension
(test/testdata/envoy.yaml of the module):

- one listener on 127.0.0.1 with an ``http_connection_manager`` whose ``ext_proc`` filter streams
  every request to the EPP over gRPC (headers, bodies in ``FULL_DUPLEX_STREAMED`` mode, trailers:
  the EPP reads the model and prompt from the body before it picks);
- the EPP answers with the ``x-gateway-destination-endpoint: <podIP>:<port>`` header and asks for
  the route to be recomputed; the matching route sends the request to an ``ORIGINAL_DST`` cluster
  that connects to exactly the address in that header;
- the ext_proc cluster speaks HTTP/2 and, like the EPP's default ``--secure-serving``, TLS
  without verification (the EPP makes itself a self-signed certificate).

Failure mode (the InferencePool's ``endpointPickerRef.failureMode``): ``FailClose`` answers
``status_on_error`` (503) when the EPP cannot be reached, errs or times out; ``FailOpen`` sets
``failure_mode_allow`` and sends requests the EPP did not route to ``fallback`` (a fixed address
standing in for "an endpoint of the gateway's picking"). Envoy can fail open in
``FULL_DUPLEX_STREAMED`` mode only until the first body chunk went to the EPP; so the EPP cluster
is health-checked (TCP, every ``health_check_interval_s``) and never panic-routed, and once the
check has marked the EPP down ext_proc fails before sending anything and the request goes to
``fallback``. A request caught in between (the EPP died, the check has not run yet) fails closed.
Every wait is bounded: connecting to the EPP or an engine, each ext_proc message, and each
request as a whole.

Ownership: a ``Gateway`` owns its bootstrap file (in ``work_dir``), its Envoy process (a
``ManagedProcess``: own session, SIGKILLed if this process dies) and its log
(``log_dir/<name>.log``, with one access-log line per request naming the upstream host).
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from .process import ManagedProcess, free_port, wait_until

DESTINATION_HEADER = "x-gateway-destination-endpoint"  # GIE's endpoint picker protocol
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"  # noqa: E501
_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_FILE_LOG = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"
ACCESS_LOG_FORMAT = (
    "[%START_TIME%] %REQ(:METHOD)% %REQ(:PATH)% %RESPONSE_CODE% flags=%RESPONSE_FLAGS% "
    f"upstream=%UPSTREAM_HOST% picked=%REQ({DESTINATION_HEADER})% "
    "details=%RESPONSE_CODE_DETAILS% id=%REQ(X-REQUEST-ID)% %DURATION%ms\n"
)


class FailureMode(StrEnum):
    """The InferencePool API's ``EndpointPickerFailureMode`` values."""

    FAIL_CLOSE = "FailClose"
    FAIL_OPEN = "FailOpen"


@dataclass(frozen=True)
class GatewayConfig:
    epp: str  # "host:port" of the EPP's ext_proc gRPC listener
    epp_tls: bool = True  # False when the EPP runs with --secure-serving=false
    failure_mode: FailureMode = FailureMode.FAIL_CLOSE
    fallback: str | None = None  # "host:port" FailOpen sends unrouted requests to
    status_on_error: int = 503  # what FailClose answers when the EPP fails
    connect_timeout_s: float = 1.0  # to the EPP and to engines
    message_timeout_s: float = 10.0  # each ext_proc round trip (the EPP scrapes nothing inline)
    request_timeout_s: float = 120.0  # a whole request, response streaming included
    health_check_interval_s: float = 1.0  # how soon Envoy sees the EPP go (or come back)
    retry_after_s: int = 5  # the Retry-After of the Gateway's own refusals (see local_reply)

    def __post_init__(self) -> None:
        if (self.failure_mode is FailureMode.FAIL_OPEN) != (self.fallback is not None):
            raise ValueError("a fallback address is needed for FailOpen, and only for it")


def _address(host_port: str) -> dict[str, Any]:
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {host_port!r}")
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _static_cluster(name: str, host_port: str, timeout: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": timeout,
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(host_port)}}]}],
        },
    }


def bootstrap(config: GatewayConfig, listen_port: int, admin_port: int) -> dict[str, Any]:
    """The Envoy bootstrap (JSON shape of envoy.config.bootstrap.v3.Bootstrap)."""
    connect = f"{config.connect_timeout_s}s"
    ext_proc: dict[str, Any] = {
        "@type": _EXT_PROC,
        "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}},
        # GIE's gateways: headers, full-duplex streamed bodies (the EPP needs the request body
        # to pick, and sees the response to account for it), trailers as the mode requires.
        "processing_mode": {
            "request_header_mode": "SEND",
            "response_header_mode": "SEND",
            "request_body_mode": "FULL_DUPLEX_STREAMED",
            "response_body_mode": "FULL_DUPLEX_STREAMED",
            "request_trailer_mode": "SEND",
            "response_trailer_mode": "SEND",
        },
        "message_timeout": f"{config.message_timeout_s}s",
        "failure_mode_allow": config.failure_mode is FailureMode.FAIL_OPEN,
        "status_on_error": {"code": config.status_on_error},
    }
    picked = {"prefix": "/", "headers": [{"name": DESTINATION_HEADER, "present_match": True}]}
    timeout = f"{config.request_timeout_s}s"
    routes: list[dict[str, Any]] = [
        {"match": picked, "route": {"cluster": "original_destination", "timeout": timeout}}
    ]
    clusters: list[dict[str, Any]] = [
        {
            "name": "original_destination",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": connect,
            "original_dst_lb_config": {
                "use_http_header": True,
                "http_header_name": DESTINATION_HEADER,
            },
        },
        {
            **_static_cluster("epp", config.epp, connect),
            # Active health checks (GIE's reference has them too) and no panic routing: with the
            # EPP down, ext_proc fails as it opens its stream, before any body is sent, which
            # is the only point where FULL_DUPLEX_STREAMED can still fail open.
            "health_checks": [
                {
                    "timeout": connect,
                    "interval": f"{config.health_check_interval_s}s",
                    "no_traffic_interval": f"{config.health_check_interval_s}s",
                    "unhealthy_threshold": 1,
                    "healthy_threshold": 1,
                    "tcp_health_check": {},
                }
            ],
            "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": _HTTP_OPTIONS,
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            },
        },
    ]
    if config.epp_tls:
        # No validation context: the EPP's certificate is self-signed (as in GIE's reference).
        tls = {"@type": _TLS, "common_tls_context": {"alpn_protocols": ["h2"]}}
        clusters[1]["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": tls,
        }
    if config.fallback is not None:
        clusters.append(_static_cluster("fallback", config.fallback, connect))
        routes.append(
            {"match": {"prefix": "/"}, "route": {"cluster": "fallback", "timeout": timeout}}
        )
    else:
        # Reached only if the EPP let a request through unrouted, which GIE's EPP never does.
        body = {"inline_string": "no endpoint picked\n"}
        routes.append({"match": {"prefix": "/"}, "direct_response": {"status": 503, "body": body}})
    ext_proc_filter = {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc}
    manager = {
        "local_reply_config": local_reply(config.retry_after_s),
        # A held request sends nothing while it waits: the idle timeout must not cut it before
        # the route's own timeout does.
        "stream_idle_timeout": timeout,
    }
    return _bootstrap(routes, clusters, [ext_proc_filter], listen_port, admin_port, manager)


def local_reply(retry_after_s: int) -> dict[str, Any]:
    """The Gateway's own refusals as OpenAI-shaped 503s with ``Retry-After``.

    The picker's flow control refuses a request it cannot hold (queue full) with 429 and one held
    past its deadline with 503; FailClose answers 503 when the picker cannot be reached. These are
    Envoy local replies (ext_proc's immediate responses included); engines' own answers pass
    through untouched. A 429 becomes 503: the client did nothing wrong, the service is busy, and
    OpenAI clients retry a 503 after ``Retry-After``."""

    def mapper(status: int, code: str) -> dict[str, Any]:
        error = {"message": "%LOCAL_REPLY_BODY%", "type": "server_error", "code": code}
        return {
            "filter": {
                "status_code_filter": {
                    "comparison": {
                        "op": "EQ",
                        "value": {"default_value": status, "runtime_key": f"reply_{status}"},
                    }
                }
            },
            "status_code": 503,
            "headers_to_add": [
                {
                    "header": {"key": "retry-after", "value": str(retry_after_s)},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                }
            ],
            "body_format_override": {
                "json_format": {"error": error},
                "content_type": "application/json",
            },
        }

    return {"mappers": [mapper(429, "queue_full"), mapper(503, "no_replica_available")]}


@dataclass(frozen=True)
class ServiceConfig:
    """The plain Service's data path: each request to one of ``endpoints`` ("podIP:port")
    picked at random, as kube-proxy picks among a Service's ready endpoints, blind to their
    state. The test cluster has no kube-proxy (and its Services no endpoints: EndpointSlices
    refuse loopback addresses), so this Envoy stands in for it when a test compares routing
    by engine state with what a Service gives."""

    endpoints: tuple[str, ...]
    connect_timeout_s: float = 1.0
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("a Service stand-in needs at least one endpoint")
        for endpoint in self.endpoints:
            _address(endpoint)


def service_bootstrap(config: ServiceConfig, listen_port: int, admin_port: int) -> dict[str, Any]:
    """Envoy as ``config``'s Service: one STATIC cluster of the endpoints, RANDOM balancing."""
    cluster = {
        "name": "service",
        "type": "STATIC",
        "lb_policy": "RANDOM",
        "connect_timeout": f"{config.connect_timeout_s}s",
        "load_assignment": {
            "cluster_name": "service",
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address(e)}} for e in config.endpoints]}
            ],
        },
    }
    timeout = f"{config.request_timeout_s}s"
    routes = [{"match": {"prefix": "/"}, "route": {"cluster": "service", "timeout": timeout}}]
    return _bootstrap(routes, [cluster], [], listen_port, admin_port)


def _bootstrap(
    routes: list[dict[str, Any]],
    clusters: list[dict[str, Any]],
    filters: list[dict[str, Any]],
    listen_port: int,
    admin_port: int,
    manager_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One HTTP listener on 127.0.0.1 (``routes`` behind ``filters`` and the router, one
    access-log line per request on stdout; ``manager_options`` added to its connection manager)
    and the admin endpoint."""
    access_log = {
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": _FILE_LOG,
            "path": "/dev/stdout",
            "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}},
        },
    }
    manager = {
        "@type": _HCM,
        "stat_prefix": "gateway",
        # A client's x-request-id is kept (and logged), so a test can tell its requests apart.
        "preserve_external_request_id": True,
        "access_log": [access_log],
        "route_config": {
            "name": "inference",
            "virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": routes}],
        },
        "http_filters": [
            *filters,
            {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}},
        ],
        **(manager_options or {}),
    }
    listener = {
        "name": "gateway",
        "address": _address(f"127.0.0.1:{listen_port}"),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }
    return {
        "admin": {"address": _address(f"127.0.0.1:{admin_port}")},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    }


class Gateway:
    """Envoy running ``bootstrap(config)``; ``start`` returns once its admin says /ready."""

    def __init__(
        self,
        envoy: Path,
        config: GatewayConfig | ServiceConfig,
        work_dir: Path,
        log_dir: Path,
        *,
        name: str = "envoy",
        port: int = 0,
        startup_timeout_s: float = 60.0,
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.envoy = envoy
        self.config = config
        self.work_dir = work_dir
        self.log_dir = log_dir
        self.startup_timeout_s = startup_timeout_s
        self.port = port  # 0: a free one at start
        self.admin_port = 0
        self.process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        """The gateway's base URL, e.g. ``http://127.0.0.1:PORT`` (OpenAI clients add ``/v1``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self) -> Gateway:
        self.port, self.admin_port = self.port or free_port(), free_port()
        path = self.work_dir / f"{self.name}.json"
        if isinstance(self.config, ServiceConfig):
            document = service_bootstrap(self.config, self.port, self.admin_port)
        else:
            document = bootstrap(self.config, self.port, self.admin_port)
        path.write_text(json.dumps(document, indent=2))
        argv = [
            str(self.envoy), "--config-path", str(path), "--log-level", "warn",
            # Several Envoys may run on one machine: no shared-memory hot-restart region to
            # collide on; one worker thread is plenty for tests.
            "--disable-hot-restart", "--concurrency", "1",
            # Access-log lines reach the log within 100 ms (the default waits up to 10 s).
            "--file-flush-interval-msec", "100",
        ]  # fmt: skip
        self.process = ManagedProcess(self.name, argv, self.log_path)
        wait_until(
            "Envoy admin /ready",
            lambda: _get(f"{self.admin_url}/ready")[0] == 200,
            timeout_s=self.startup_timeout_s,
            watch=[self.process],
        )
        return self

    def stop(self) -> None:
        """Idempotent."""
        if self.process is not None:
            self.process.stop()
            self.process = None

    def epp_healthy(self) -> bool:
        """Whether Envoy's health check currently counts the EPP as up."""
        return self.stats().get("cluster.epp.membership_healthy", 0) > 0

    def stats(self) -> dict[str, int]:
        """Envoy's counters and gauges (``/stats``), e.g. ``cluster.epp.upstream_cx_connect_fail``,
        ``http.gateway.ext_proc.failure_mode_allowed``, ``cluster.original_destination.upstream_rq_200``."""  # noqa: E501
        _, text = _get(f"{self.admin_url}/stats")
        values: dict[str, int] = {}
        for line in text.splitlines():
            name, sep, value = line.partition(": ")
            if sep and value.strip().isdigit():
                values[name] = int(value)
        return values

    def access_log(self) -> list[str]:
        """The access-log lines so far (one per request; see ACCESS_LOG_FORMAT)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [line for line in lines if line.startswith("[") and " upstream=" in line]


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return int(resp.status), resp.read().decode(errors="replace")

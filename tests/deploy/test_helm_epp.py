"""The chart in ``mode: epp``: `kvroute epp`'s Deployment and Service and the
InferencePool whose Endpoint Picker they are, rendered by real Helm.

The InferencePool is validated against GIE's published CRD (``tests/fixtures/gie``: its
``openAPIV3Schema`` with a JSON Schema validator, and its two CEL rules spelled out);
the container's argv is parsed by `kvroute epp`'s own parser and its config file by
kvroute's own Settings, and the rendered command is run for real once.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import stop
from tests.deploy.test_helm import (
    CHART,
    NAMESPACE,
    ROOT,
    argv_in,
    container,
    helm,
    notes,
    of_kind,
    one,
    render,
)

jsonschema = pytest.importorskip("jsonschema")

CRD = ROOT / "tests" / "fixtures" / "gie" / "inference.networking.k8s.io_inferencepools.yaml"
LABELS = {"app": "vllm-qwen3", "tier": "serving"}
EPP: dict[str, Any] = {
    "mode": "epp",
    "epp": {"inferencePool": {"matchLabels": LABELS, "targetPort": 8001}},
    # the rest of config.discovery.k8s is kept (its label_selector and port are the pool's)
    "config": {
        "discovery": {
            "k8s": {
                "label_selector": "replaced=by-the-pool",
                "events_port": 5557,
                "replay_port": 5657,
            }
        }
    },
}


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema: dict[str, Any] = v1["schema"]["openAPIV3Schema"]
    return schema


def crd_errors(pool: dict[str, Any]) -> list[str]:
    """What the API server would refuse in ``pool``: the schema's errors, then the CRD's
    CEL rules (``x-kubernetes-validations``) written out."""
    validator = jsonschema.Draft202012Validator(crd_schema())
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(pool)]
    spec = pool.get("spec", {})
    ref = spec.get("endpointPickerRef", {})
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        errors.append("endpointPickerRef: port is required when kind is 'Service'")
    numbers = [p.get("number") for p in spec.get("targetPorts", [])]
    if len(numbers) != len(set(numbers)):
        errors.append("targetPorts: port number must be unique")
    return errors


def epp_argv(docs: list[dict[str, Any]], root: Path) -> list[str]:
    argv = argv_in(docs, one(docs, "Deployment"), root)
    assert argv[:2] == ["kvroute", "epp"], argv
    return argv[2:]


def test_helm_lint_passes_in_epp_mode() -> None:
    report = helm.lint(CHART, EPP, namespace=NAMESPACE, strict=True)
    assert report["errors"] == [], report


def test_the_rendered_inference_pool_is_valid_against_gie_s_crd() -> None:
    (pool,) = of_kind(render(EPP), "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert crd_errors(pool) == []


def test_the_crd_check_refuses_what_the_api_server_would() -> None:
    (pool,) = of_kind(render(EPP), "InferencePool")
    bad = yaml.safe_load(yaml.safe_dump(pool))
    bad["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    del bad["spec"]["endpointPickerRef"]["port"]
    bad["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    errors = crd_errors(bad)
    assert any("FailSometimes" in e for e in errors)
    assert any("port is required" in e for e in errors)
    assert any("unique" in e for e in errors)


def test_the_pool_s_picker_is_the_rendered_epp_service_and_its_grpc_port(tmp_path: Path) -> None:
    docs = render(EPP)
    (pool,) = of_kind(docs, "InferencePool")
    service = one(docs, "Service")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["kind"] == "Service" and ref["name"] == service["metadata"]["name"]
    (grpc_port,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    assert ref["port"]["number"] == grpc_port["port"]
    assert grpc_port["appProtocol"] == "kubernetes.io/h2c"
    assert ref["failureMode"] == "FailClose"
    c = container(one(docs, "Deployment"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    from router.epp.main import _parser

    args, _ = _parser().parse_known_args(epp_argv(docs, tmp_path))
    assert args.grpc_port == ports["grpc"] and args.grpc_host == "0.0.0.0"
    assert args.metrics_port == ports["metrics"] and args.metrics_host == "0.0.0.0"
    assert c["livenessProbe"]["grpc"] == {"port": ports["grpc"], "service": "liveness"}
    assert c["readinessProbe"]["grpc"] == {"port": ports["grpc"], "service": "readiness"}
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_kvroute_discovers_the_pool_s_pods_with_its_selector_and_port(
    tmp_path: Path, no_kvroute_env: None
) -> None:
    from router.config import Settings
    from router.epp.main import _parser

    docs = render(EPP)
    (pool,) = of_kind(docs, "InferencePool")
    _, rest = _parser().parse_known_args(epp_argv(docs, tmp_path))
    settings = Settings.load(rest, env_config=False)
    k8s = settings.discovery.k8s
    assert settings.discovery.kind == "k8s" and k8s is not None
    selector = dict(pair.split("=") for pair in k8s.label_selector.split(","))
    assert selector == pool["spec"]["selector"]["matchLabels"] == LABELS
    assert [{"number": k8s.port}] == pool["spec"]["targetPorts"]
    assert (k8s.events_port, k8s.replay_port) == (5557, 5657)  # the rest of config kept


def test_several_target_ports_are_the_pool_s_and_kvroute_s_one_endpoint_each(
    tmp_path: Path, no_kvroute_env: None
) -> None:
    from router.config import Settings
    from router.epp.main import _parser

    values = {**EPP, "epp": {**EPP["epp"], "inferencePool": {**EPP["epp"]["inferencePool"]}}}
    values["epp"]["inferencePool"]["targetPorts"] = [8000, 8001, 8002]
    docs = render(values)
    (pool,) = of_kind(docs, "InferencePool")
    assert pool["spec"]["targetPorts"] == [{"number": 8000}, {"number": 8001}, {"number": 8002}]
    assert crd_errors(pool) == []
    _, rest = _parser().parse_known_args(epp_argv(docs, tmp_path))
    k8s = Settings.load(rest, env_config=False).discovery.k8s
    assert k8s is not None
    assert k8s.ports == [8000, 8001, 8002]
    assert (k8s.events_port, k8s.replay_port) == (5557, 5657)


def test_target_ports_repeating_a_port_or_more_than_8_fail_with_the_reason() -> None:
    pool = EPP["epp"]["inferencePool"]
    twice = {**EPP, "epp": {**EPP["epp"], "inferencePool": {**pool, "targetPorts": [80, 80]}}}
    with pytest.raises(Exception, match="targetPorts': items at 0 and 1 are equal"):
        render(twice)
    many = {**pool, "targetPorts": list(range(8000, 8009))}
    with pytest.raises(Exception, match="targetPorts': maxItems"):
        render({**EPP, "epp": {**EPP["epp"], "inferencePool": many}})


def test_epp_mode_may_list_and_watch_pods_for_discovery() -> None:
    docs = render(EPP)
    (role,) = of_kind(docs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True


def test_epp_mode_without_the_pool_s_labels_fails_with_the_reason() -> None:
    with pytest.raises(Exception, match=r"epp\.inferencePool\.matchLabels"):
        render({"mode": "epp"})


def test_proxy_mode_renders_no_inference_pool() -> None:
    assert of_kind(render({}), "InferencePool") == []
    assert "InferencePool" in notes(EPP) and "InferencePool" not in notes({})


def test_the_rendered_epp_command_runs_and_answers_its_grpc_health_checks(
    tmp_path: Path,
) -> None:
    """The rendered argv and config (no pool: the embedded simulated fleet), run for real
    on loopback ports (later flags win), answer the probes' gRPC health services."""
    grpc = pytest.importorskip("grpc")
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    values = {"mode": "epp", "epp": {"inferencePool": {"create": False}}}
    values["config"] = {"fleet": {"pods": 2}}
    argv = epp_argv(render(values), tmp_path)
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "router.cli", "epp", *argv, "--grpc-host", "127.0.0.1"]
    cmd += ["--grpc-port", str(ports[0]), "--metrics-host", "127.0.0.1"]
    cmd += ["--metrics-port", str(ports[1])]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        statuses: dict[str, int] = {}
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(f"127.0.0.1:{ports[0]}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    statuses = {
                        s: stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=2).status
                        for s in ("liveness", "readiness")
                    }
                except grpc.RpcError:
                    time.sleep(0.2)
                    continue
                if set(statuses.values()) == {health_pb2.HealthCheckResponse.SERVING}:
                    break
                time.sleep(0.2)
        assert proc.poll() is None, proc.communicate(timeout=5)[1].decode()[-2000:]
        assert set(statuses.values()) == {health_pb2.HealthCheckResponse.SERVING}, statuses
    finally:
        stop(proc)
    assert proc.returncode == 0  # SIGTERM: drained and exited cleanly


@pytest.fixture
def no_kvroute_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVROUTE_"):
            monkeypatch.delenv(name)

"""deploy/kubernetes/: parsed, structurally complete, and consistent with the code
(ports, flags, image, job config, rules file, alert rules)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.deploy.files import (
    DEPLOY,
    KUBERNETES,
    check_command,
    find,
    load_docs,
    load_yaml,
    manifests,
    of_kind,
    pod_spec,
)
from trainmover import ports
from trainmover.runtime.config import load_config
from trainmover.services.health_monitor.config import load as load_hm_settings
from trainmover.services.health_monitor.rules import load_rules

COVERS = [
    "kubernetes/kustomization.yaml",
    "kubernetes/namespace.yaml",
    "kubernetes/job-config.yaml",
    "kubernetes/health-monitor.yaml",
    "kubernetes/planner.yaml",
    "kubernetes/executor.yaml",
    "kubernetes/training.yaml",
    "kubernetes/monitoring.yaml",
    "kubernetes/rendezvous.yaml",
]

NAMESPACE = "trainmover"
SERVICES = ("health-monitor", "planner", "executor")
MOUNT = "/etc/trainmover"


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    assert len(found) == 1, f"{workload['metadata']['name']}: no container {name}"
    return found[0]


def named_port(c: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def job_config_data() -> dict[str, str]:
    return find("ConfigMap", "trainmover-job")["data"]  # type: ignore[no-any-return]


KUBERNETES_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
"""The oldest Kubernetes the manifests claim to work with, and the newest schemas known."""
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule"}
"""Prometheus Operator kinds: no bundled schema; checked field by field below."""


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_the_kubernetes_api_schemas(version: str) -> None:
    """Strict: unknown fields (a misspelt probe) and wrong types fail, as the API would."""
    checked = 0
    for doc in manifests():
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, version, strict=True)
            checked += 1
    assert checked == len(manifests()) - len(CUSTOM_KINDS)


def test_every_object_is_complete_and_in_the_namespace() -> None:
    for doc in manifests():
        assert {"apiVersion", "kind", "metadata"} <= set(doc), doc
        meta = doc["metadata"]
        assert meta["name"].startswith("trainmover")
        assert meta["labels"]["app.kubernetes.io/part-of"] == "trainmover"
        if doc["kind"] != "Namespace":
            assert meta["namespace"] == NAMESPACE, meta["name"]


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load_yaml(KUBERNETES / "kustomization.yaml")
    assert kustomization["namespace"] == NAMESPACE
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    assert find("Namespace", NAMESPACE)


@pytest.mark.parametrize("service", SERVICES)
def test_service_deployment(service: str) -> None:
    deployment = find("Deployment", f"trainmover-{service}")
    assert deployment["apiVersion"] == "apps/v1"
    # One replica: the planner and executor are single writers, the monitor dedups alone.
    assert deployment["spec"]["replicas"] == 1
    if service != "health-monitor":
        assert deployment["spec"]["strategy"]["type"] == "Recreate"
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()

    c = container(deployment, service)
    assert c["image"] == ports.IMAGE
    command = check_command(["trainmover", *c["args"]])
    assert command.service == service
    assert named_port(c, "http") == command.http_port == ports.DEFAULT_HTTP_PORTS[service]
    for probe in ("livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == ports.HEALTH_PATH and get["port"] == "http", probe
    check_job_config_use(deployment, c, command.flags)
    env = {e["name"]: e for e in c["env"]}
    assert env[ports.NATS_URL_ENV]["valueFrom"]["secretKeyRef"]["name"] == "trainmover-nats"
    if service == "health-monitor":
        token = env[ports.WEBHOOK_TOKEN_ENV]["valueFrom"]["secretKeyRef"]
        assert token["name"] == "trainmover-webhook-token"


def check_job_config_use(
    workload: dict[str, Any], c: dict[str, Any], flags: dict[str, str | None]
) -> None:
    """Every file a flag names under /etc/trainmover is a key of the mounted ConfigMap."""
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    assert volumes[mounts[MOUNT]]["configMap"]["name"] == "trainmover-job"
    assert flags["--job-config"] == f"{MOUNT}/job.yaml"
    data = job_config_data()
    for value in flags.values():
        if value and value.startswith(MOUNT + "/"):
            assert value.removeprefix(MOUNT + "/") in data, value


@pytest.mark.parametrize("service", SERVICES)
def test_service_objects_route_to_their_pods(service: str) -> None:
    svc = find("Service", f"trainmover-{service}")
    deployment = find("Deployment", f"trainmover-{service}")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (port,) = svc["spec"]["ports"]
    assert port["name"] == "http" and port["targetPort"] == "http"
    assert port["port"] == ports.DEFAULT_HTTP_PORTS[service]


def test_job_config_map_is_a_valid_job_and_health_monitor_config(tmp_path: Path) -> None:
    data = job_config_data()
    job_file = tmp_path / "job.yaml"
    job_file.write_text(data["job.yaml"])
    job = load_config(job_file)  # the runtime's own loader: layout and model agree
    settings = load_hm_settings(["--job-config", str(job_file)], env={})
    assert settings.jobs == [job.job]
    assert settings.rules == f"{MOUNT}/health-monitor-rules.yaml"
    # The rules in the ConfigMap are the shipped rules file, byte for byte.
    assert data["health-monitor-rules.yaml"] == (DEPLOY / "health-monitor-rules.yaml").read_text()
    assert load_rules(DEPLOY / "health-monitor-rules.yaml").rules


def test_training_pods_match_the_layout(tmp_path: Path) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text(job_config_data()["job.yaml"])
    layout = load_config(job_file).layout
    headless = find("Service", "trainmover-machines")
    assert headless["spec"]["clusterIP"] == "None"
    (port,) = headless["spec"]["ports"]
    assert port["port"] == ports.DEFAULT_HTTP_PORTS["sidecar"]

    standbys = 0
    for sts in of_kind("StatefulSet"):
        name = sts["metadata"]["name"]
        if name == RENDEZVOUS_SERVICE:
            continue
        assert sts["spec"]["serviceName"] == "trainmover-machines"
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert headless["spec"]["selector"].items() <= pod_labels.items()
        assert sts["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        c = container(sts, "sidecar")
        assert c["image"] == ports.IMAGE
        command = check_command(["trainmover", *c["args"]])
        assert command.service == "sidecar"
        assert named_port(c, "http") == command.http_port
        for probe in ("livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": ports.HEALTH_PATH, "port": "http"}
        check_job_config_use(sts, c, command.flags)
        # The machine name is the pod's name, through the downward API.
        assert command.flags["--machine"] == "$(POD_NAME)"
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert "secretKeyRef" in env[ports.NATS_URL_ENV]["valueFrom"]
        # Every machine, standby or not, has the GPUs of one machine of the layout.
        assert c["resources"]["limits"]["nvidia.com/gpu"] == layout.ranks_per_machine
        if "--standby" in command.flags:
            assert name == "trainmover-standby"
            standbys += sts["spec"]["replicas"]
        else:
            assert name == "trainmover-train"
            assert sts["spec"]["replicas"] == layout.machines
    assert standbys >= 1


def test_service_monitor_scrapes_every_trainmover_service() -> None:
    monitor = find("ServiceMonitor", "trainmover")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == ports.METRICS_PATH
    selected = [
        s for s in of_kind("Service") if selector.items() <= s["metadata"]["labels"].items()
    ]
    names = {s["metadata"]["name"] for s in selected}
    assert names == {f"trainmover-{s}" for s in (*SERVICES, "rendezvous")} | {"trainmover-machines"}
    for svc in selected:
        assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    # The same relabelling as the plain scrape config: `job` of a sample -> trainmover_job.
    relabel = endpoint["metricRelabelings"]
    assert relabel[0] == {"sourceLabels": ["exported_job"], "targetLabel": "trainmover_job"}
    assert relabel[1] == {"action": "labeldrop", "regex": "exported_job"}


def test_prometheus_rule_is_the_shipped_alert_rules() -> None:
    rule = find("PrometheusRule", "trainmover")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule["spec"]) == {"groups"}
    assert rule["spec"] == load_yaml(DEPLOY / "prometheus" / "trainmover-alerts.yaml")


def test_files_parse_as_the_kinds_they_hold() -> None:
    kinds = {p.name: [d["kind"] for d in load_docs(p)] for p in KUBERNETES.glob("*.yaml")}
    assert kinds["namespace.yaml"] == ["Namespace"]
    assert kinds["job-config.yaml"] == ["ConfigMap"]
    assert kinds["training.yaml"] == ["Service", "StatefulSet", "StatefulSet"]
    assert kinds["monitoring.yaml"] == ["ServiceMonitor", "PrometheusRule"]
    for service in SERVICES:
        assert kinds[f"{service}.yaml"] == ["Deployment", "Service"]
    assert kinds["rendezvous.yaml"] == ["StatefulSet", "Service", "PodDisruptionBudget"]


RENDEZVOUS_SERVICE = "trainmover-rendezvous"


def test_rendezvous_replicas_serve_the_store_off_the_training_pods() -> None:
    sts = find("StatefulSet", RENDEZVOUS_SERVICE)
    # Two replicas on two nodes, a node drain taking one at a time: no store SPOF.
    assert sts["spec"]["replicas"] == 2
    spread = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (rule,) = spread["requiredDuringSchedulingIgnoredDuringExecution"]
    assert rule["topologyKey"] == "kubernetes.io/hostname"
    pdb = find("PodDisruptionBudget", RENDEZVOUS_SERVICE)
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"] == sts["spec"]["selector"]
    c = container(sts, "rendezvous")
    assert c["image"] == ports.IMAGE
    command = check_command(["trainmover", *c["args"]])
    assert command.service == "rendezvous"
    listed = command.flags["--replicas"].split(",")
    names = [f"{RENDEZVOUS_SERVICE}-{i}.{sts['spec']['serviceName']}" for i in range(2)]
    assert listed == [f"{n}:{ports.RENDEZVOUS_PORT}" for n in names]
    assert ports.RENDEZVOUS_PORT == named_port(c, "store")
    # Each pod's ordinal is its place in the list.
    (index,) = c["env"]
    assert command.flags["--replica-index"] == f"$({index['name']})"
    assert index["valueFrom"]["fieldRef"]["fieldPath"].endswith("['apps.kubernetes.io/pod-index']")
    assert named_port(c, "http") == command.http_port
    # Reachable from other pods: both listeners on every address of the pod.
    assert command.flags["--store-host"] == command.flags["--http-host"] == "0.0.0.0"
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": ports.HEALTH_PATH, "port": "http"}

    svc = find("Service", RENDEZVOUS_SERVICE)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    by_name = {p["name"]: p for p in svc["spec"]["ports"]}
    assert by_name["store"]["port"] == ports.RENDEZVOUS_PORT
    assert by_name["http"]["port"] == ports.DEFAULT_HTTP_PORTS["rendezvous"]
    assert {p["targetPort"] for p in by_name.values()} == {"store", "http"}


def test_every_sidecar_points_at_the_rendezvous_service() -> None:
    svc = find("Service", RENDEZVOUS_SERVICE)
    store = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "store")
    replicas = find("StatefulSet", RENDEZVOUS_SERVICE)
    expected = ",".join(
        f"{RENDEZVOUS_SERVICE}-{i}.{RENDEZVOUS_SERVICE}:{store}"
        for i in range(replicas["spec"]["replicas"])
    )
    for sts in of_kind("StatefulSet"):
        if sts["metadata"]["name"] == RENDEZVOUS_SERVICE:
            continue
        command = check_command(["trainmover", *container(sts, "sidecar")["args"]])
        # Every replica by its name in the pods' own namespace, in the replicas' order.
        assert command.flags["--rendezvous"] == expected

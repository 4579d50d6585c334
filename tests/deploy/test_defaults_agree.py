"""The manifests agree with the service they deploy: ports, probes, the drain and the grace period are
checked against the settings `fusedserve serve` resolves in that container (Settings' defaults, then
the image's ENV, then the manifest's env), the app's own routes and metrics, and the Dockerfile."""

import os
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import generate_latest

from fusedserve.service.app import create_app
from fusedserve.service.settings import Settings
from fusedserve.service.stats.metrics import Metrics

from .manifests import DEPLOY, image, load, needs_kubectl, one, render

BASE = DEPLOY / "base"
KSERVE = DEPLOY / "kserve"
READY, LIVE = "/v2/health/ready", "/v2/health/live"


@pytest.fixture
def settings_in(monkeypatch):
    """Settings as `fusedserve serve` builds them inside ``container`` of a manifest."""

    def resolve(container: dict) -> Settings:
        for key in [k for k in os.environ if k.startswith("FUSEDSERVE_")]:
            monkeypatch.delenv(key)
        env = {**image()["env"], **{e["name"]: e["value"] for e in container.get("env", [])}}
        for key, value in env.items():
            if key.startswith("FUSEDSERVE_"):
                monkeypatch.setenv(key, value)
        return Settings()

    return resolve


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def port_number(container: dict, port) -> int:
    """A probe's or Service's port: a number, or the name of one of the container's ports."""
    return port if isinstance(port, int) else {p["name"]: p["containerPort"] for p in container["ports"]}[port]


def app_routes() -> set[str]:
    app = create_app(Settings(model_repository=DEPLOY))  # routes only: the lifespan never runs
    return set(app.openapi()["paths"])


def check_probes(box: dict, settings: Settings) -> None:
    routes = app_routes()
    for name, path in (("startupProbe", READY), ("readinessProbe", READY), ("livenessProbe", LIVE)):
        if name not in box:
            continue
        probe = box[name]["httpGet"]
        assert probe["path"] == path and path in routes, f"{name} asks {probe['path']}"
        assert port_number(box, probe["port"]) == settings.port, f"{name} asks port {probe['port']}"


def test_deployment_ports_and_probes_follow_the_settings(settings_in):
    box = container(one(load(BASE / "deployment.yaml"), "Deployment"))
    settings = settings_in(box)
    # The kubelet probes the pod's IP: the server must listen on every interface.
    assert settings.host in ("0.0.0.0", "::"), settings.host
    assert port_number(box, "http") == settings.port
    assert port_number(box, "grpc") == settings.grpc_port
    check_probes(box, settings)


def test_startup_probe_allows_at_least_the_images_warm_up_period():
    probe = container(one(load(BASE / "deployment.yaml"), "Deployment"))["startupProbe"]
    budget_s = probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]
    assert budget_s >= image()["start_period_s"], f"startup budget {budget_s} s < the HEALTHCHECK's start period"


def test_grace_period_outlasts_prestop_drain_and_the_longest_request(settings_in):
    pod = one(load(BASE / "deployment.yaml"), "Deployment")["spec"]["template"]["spec"]
    box = container({"spec": {"template": {"spec": pod}}})
    settings = settings_in(box)
    command = box["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    needed_s = float(command[1]) + settings.drain_grace_s + settings.request_timeout_ms / 1000
    assert pod["terminationGracePeriodSeconds"] > needed_s, (pod["terminationGracePeriodSeconds"], needed_s)


def test_pod_runs_as_the_images_user():
    pod = one(load(BASE / "deployment.yaml"), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == image()["user"]


def test_service_and_servicemonitor_reach_the_metrics_route():
    box = container(one(load(BASE / "deployment.yaml"), "Deployment"))
    service = one(load(BASE / "service.yaml"), "Service")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {"http", "grpc"}, ports
    for name, port in ports.items():  # each Service port reaches the container port of its name
        assert port_number(box, port["targetPort"]) == port_number(box, name)
    (endpoint,) = one(load(BASE / "servicemonitor.yaml"), "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] in app_routes()


def test_hpa_scales_on_an_exported_metric_published_by_the_adapter(settings_in):
    hpa = one(load(BASE / "hpa.yaml"), "HorizontalPodAutoscaler")
    deployment = one(load(BASE / "deployment.yaml"), "Deployment")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    pods = next(m["pods"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods")
    assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in hpa["spec"]["metrics"])
    (rule,) = yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    assert rule["name"]["as"] == pods["metric"]["name"]
    series = rule["seriesQuery"].split("{")[0]
    metrics = Metrics()
    metrics.watch_queues({"m": SimpleNamespace(queued_rows=0)})
    assert f"# TYPE {series} gauge" in generate_latest(metrics.registry).decode()
    # A full batch waiting behind the running one, on average: the model is saturated.
    settings = settings_in(container(deployment))
    assert int(pods["target"]["averageValue"]) == settings.max_batch_size


@needs_kubectl
def test_cpu_overlay_drops_the_gpu_and_sizes_torch_threads_to_its_cpu_limit(settings_in):
    deployment = one(render(DEPLOY / "overlays" / "cpu"), "Deployment")
    box = container(deployment)
    assert box["image"].endswith(":cpu")
    assert "nvidia.com/gpu" not in box["resources"]["limits"]
    assert "tolerations" not in deployment["spec"]["template"]["spec"]
    assert settings_in(box).torch_threads == int(box["resources"]["limits"]["cpu"])


def test_kserve_runtime_serves_the_v2_protocol_from_the_storage_mount(settings_in):
    runtime = one(load(KSERVE / "servingruntime.yaml"), "ServingRuntime")
    service = one(load(KSERVE / "inferenceservice.yaml"), "InferenceService")
    (box,) = runtime["spec"]["containers"]
    settings = settings_in(box)
    assert str(settings.model_repository) == "/mnt/models"  # where KServe's storage initializer writes
    assert [p["containerPort"] for p in box["ports"]] == [settings.port]
    check_probes(box, settings)
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"] == ["v2"]

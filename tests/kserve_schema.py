"""KServe's API as a JSON Schema, for checking the manifests under k8s/kserve/ offline.

Taken from KServe's Python SDK (the `kserve` package on PyPI, pinned below), whose models are
generated from the same Go types as KServe's CRDs: each model class lists its fields (attribute_map,
JSON names), their types (openapi_types) and which are required (its constructor refuses None for
them). Every KServe object is closed (no unknown field), as the API server's structural schema prunes
or refuses them; the Kubernetes types inside (V1Container, V1Volume, V1ObjectMeta, ...) are checked
against kubernetes-validate's strict schemas for the Kubernetes version asked for.

Why not KServe's CRD files: they are not published as a package any registry serves here, and the
SDK is: one wheel of 0.5 MB, read as data (never imported: importing it pulls in fastapi, pandas, ...).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

#: The KServe release whose API the manifests are checked against (its SDK wheel on PyPI).
KSERVE_VERSION = "0.21.0"
K8S_DEFINITIONS = "https://kubernetes.io/api/_definitions.json"
#: Which Kubernetes API group wins when a class name (V1Condition) exists in several.
_GROUP_PREFERENCE = ("io.k8s.api.core.", "io.k8s.apimachinery.pkg.apis.meta.", "io.k8s.apimachinery.pkg.api.")
_SCALARS = {"str": {"type": "string"}, "int": {"type": "integer"}, "float": {"type": "number"},
            "bool": {"type": "boolean"}, "datetime": {"type": "string"}, "date": {"type": "string"},
            "object": {}}
#: Types met while building a schema that neither the SDK nor Kubernetes' schemas define.
UNCHECKED_TYPES: set[str] = set()
#: Top-level kinds: the SDK model and the apiVersion the API server serves them under.
KINDS = {
    "ServingRuntime": ("V1alpha1ServingRuntime", "serving.kserve.io/v1alpha1"),
    "ClusterServingRuntime": ("V1alpha1ClusterServingRuntime", "serving.kserve.io/v1alpha1"),
    "InferenceService": ("V1beta1InferenceService", "serving.kserve.io/v1beta1"),
}


@dataclass(frozen=True)
class SdkModel:
    name: str
    types: dict[str, str]  # python attribute -> openapi type
    json_names: dict[str, str]  # python attribute -> JSON field
    required: frozenset[str]  # python attributes


def download_sdk(into: Path) -> Path:
    """The pinned SDK wheel (pip's cache makes a second run offline)."""
    into.mkdir(parents=True, exist_ok=True)
    found = sorted(into.glob(f"kserve-{KSERVE_VERSION}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--quiet",
                        "--no-deps", "--only-binary=:all:", "-d", str(into), f"kserve=={KSERVE_VERSION}"],
                       check=True, timeout=300)
        found = sorted(into.glob(f"kserve-{KSERVE_VERSION}-*.whl"))
    assert found, f"pip download put no kserve {KSERVE_VERSION} wheel in {into}"
    return found[0]


def sdk_models(wheel: Path) -> dict[str, SdkModel]:
    """Every model class of the SDK, read from its source without importing it."""
    models = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not re.fullmatch(r"kserve/models/v\w+\.py", name):
                continue
            source = archive.read(name).decode()
            for node in ast.parse(source).body:
                if not isinstance(node, ast.ClassDef):
                    continue
                fields = {t.id: ast.literal_eval(s.value) for s in node.body if isinstance(s, ast.Assign)
                          for t in s.targets if isinstance(t, ast.Name) and t.id in ("openapi_types", "attribute_map")}
                if set(fields) != {"openapi_types", "attribute_map"}:
                    continue
                required = frozenset(re.findall(r"Invalid value for `(\w+)`, must not be `None`", source))
                models[node.name] = SdkModel(node.name, fields["openapi_types"], fields["attribute_map"], required)
    return models


@cache
def _k8s_classes(k8s_version: str) -> dict[str, str]:
    """Kubernetes client class name (V1Container) -> definition key (io.k8s.api.core.v1.Container)."""
    definitions = kubernetes_definitions(k8s_version)["$defs"]
    classes: dict[str, str] = {}
    for key in sorted(definitions, key=lambda k: next(
            (i for i, prefix in enumerate(_GROUP_PREFERENCE) if k.startswith(prefix)), len(_GROUP_PREFERENCE))):
        *_, version, kind = key.split(".")
        classes.setdefault(version[:1].upper() + version[1:] + kind, key)
        # The generator's name for a type it could not shorten: the Go package path, camel-cased
        # (io.k8s.api.apps.v1.DeploymentStrategy is K8sIoApiAppsV1DeploymentStrategy).
        if key.startswith("io.k8s."):
            parts = ["k8s", "io", *key.split(".")[2:]]
            classes.setdefault("".join(part[:1].upper() + part[1:] for part in parts), key)
    return classes


@cache
def kubernetes_definitions(k8s_version: str) -> dict[str, Any]:
    import kubernetes_validate.utils as kv

    version = [v for v in kv.all_versions() if kv.major_minor(v) <= kv.major_minor(k8s_version)][-1]
    return kv.schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", k8s_version)


def _type_schema(openapi_type: str, models: dict[str, SdkModel], k8s_version: str) -> dict[str, Any]:
    if openapi_type in _SCALARS:
        return dict(_SCALARS[openapi_type])
    if m := re.fullmatch(r"list\[(.+)\]", openapi_type):
        return {"type": "array", "items": _type_schema(m.group(1), models, k8s_version)}
    if m := re.fullmatch(r"dict\(str, ?(.+)\)", openapi_type):
        return {"type": "object", "additionalProperties": _type_schema(m.group(1), models, k8s_version)}
    if openapi_type in models:
        return {"$ref": f"#/$defs/{openapi_type}"}
    if openapi_type in _k8s_classes(k8s_version):
        return {"$ref": f"{K8S_DEFINITIONS}#/$defs/{_k8s_classes(k8s_version)[openapi_type]}"}
    if openapi_type.startswith("Knative"):
        return {}  # Knative's duck types (conditions, URLs) appear in `status` only, which no manifest sets
    # A type the SDK names but does not ship (V1alpha1WorkerSpec in 0.21.0), or a Kubernetes type
    # newer than the Kubernetes version asked for (V1PodSchedulingGroup before 1.35): left unchecked
    # and listed, so a test can see that no manifest uses such a field.
    UNCHECKED_TYPES.add(openapi_type)
    return {"x-unchecked": openapi_type}


def _reachable(root: str, models: dict[str, SdkModel]) -> list[SdkModel]:
    """The KServe models a kind's manifest can contain (its status left out), root first."""
    seen, queue = [], [root]
    while queue:
        name = queue.pop(0)
        if name in seen:
            continue
        seen.append(name)
        model = models[name]
        queue += [t for attr, type_ in model.types.items() if not (name == root and attr == "status")
                  for t in re.findall(r"V\d\w+", type_) if t in models]
    return [models[name] for name in seen]


def schema_for(kind: str, models: dict[str, SdkModel], k8s_version: str) -> dict[str, Any]:
    """A closed JSON Schema (Draft 2020-12) for one KServe kind."""
    model_name, api_version = KINDS[kind]
    defs = {}
    for model in _reachable(model_name, models):
        if model.name == model_name:
            # A manifest never carries status: the controller writes it.
            model = SdkModel(model.name, {a: t for a, t in model.types.items() if a != "status"},
                             model.json_names, model.required)
        defs[model.name] = {
            "type": "object",
            "properties": {model.json_names[attr]: _type_schema(t, models, k8s_version)
                           for attr, t in model.types.items()},
            "required": sorted(model.json_names[attr] for attr in model.required if attr in model.json_names),
            "additionalProperties": False,
        }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "allOf": [{"$ref": f"#/$defs/{model_name}"}],
        "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind},
                       "metadata": {"required": ["name"]}},
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "$defs": defs,
    }


def validation_problems(obj: dict[str, Any], models: dict[str, SdkModel], k8s_version: str) -> list[str]:
    """Every place where `obj` breaks KServe's API (empty: valid), each as `path: message`."""
    import jsonschema
    from referencing import Registry, Resource

    schema = schema_for(obj["kind"], models, k8s_version)
    registry = Resource.from_contents(kubernetes_definitions(k8s_version)) @ Registry()
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    # A field whose type is unchecked fails too: "x-unchecked" is no keyword, so it is found here.
    unchecked = [f"{'.'.join(map(str, path))}: its type {name} is not in the schemas, so it is not checked"
                 for path, name in _unchecked_fields(obj, schema, validator)]
    return unchecked + [f"{'.'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message[:300]}"
                        for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))]


def _unchecked_fields(obj: Any, schema: dict[str, Any], validator: Any) -> list[tuple[list[Any], str]]:
    """(path, type) of every value in `obj` whose schema is an unchecked type."""
    found = []

    def walk(value: Any, node: dict[str, Any], path: list[Any]) -> None:
        while "$ref" in node and node["$ref"].startswith("#/$defs/"):
            node = schema["$defs"][node["$ref"].split("/")[-1]]
        if "x-unchecked" in node:
            found.append((path, node["x-unchecked"]))
        elif isinstance(value, dict) and "properties" in node:
            for key, item in value.items():
                if key in node["properties"]:
                    walk(item, node["properties"][key], [*path, key])
        elif isinstance(value, list) and "items" in node:
            for i, item in enumerate(value):
                walk(item, node["items"], [*path, i])

    walk(obj, schema["$defs"][schema["allOf"][0]["$ref"].split("/")[-1]], [])
    return found

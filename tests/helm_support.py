"""Shared helpers of the Helm chart tests (tests/test_helm_chart*.py).

Renders deploy/helm/kvstore offline with the Helm SDK (``helm-python-sdk``,
import name ``helm_python``) or, without it, a ``helm`` binary on PATH; lints
it as ``helm lint --strict`` does; and parses the manifests into
:class:`Rendered` objects with small accessors (one workload's container, its
``--flag=value`` arguments, its env). The values files of
tests/data/helm_values/ (one deployment shape each) are rendered once per test
session (:func:`rendered_cases`); :func:`render_docs` renders ad-hoc values and
:func:`validation_problems` checks manifests against the Kubernetes schemas
(kubernetes-validate, strict) or, for the ServiceMonitor CRD, the small schema
below.

Importing this module skips the importing test module when yaml, jsonschema,
kubernetes-validate or both Helm backends are missing.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")
kv_utils = pytest.importorskip(
    "kubernetes_validate.utils",
    reason='kubernetes-validate is not installed: pip install "kubernetes-validate>=1.37"',
)

try:
    import helm_python
except ImportError:  # the helm binary is the fallback
    helm_python = None

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "kvstore"
VALUES_DIR = Path(__file__).resolve().parent / "data" / "helm_values"
OUTPUT_DIR = Path(__file__).resolve().parent / "output" / "helm"
RELEASE = "kv"
NAMESPACE = "kvstore"
CASES = sorted(p.stem for p in VALUES_DIR.glob("*.yaml"))

HELM_BIN = shutil.which("helm")
if helm_python is None and HELM_BIN is None:
    pytest.skip(
        'neither the Helm SDK nor a helm binary is available: pip install "helm-python-sdk>=0.2.2,<0.3"',
        allow_module_level=True,
    )


def _kube_versions() -> list[str]:
    """Oldest version the chart allows and newest with shipped schemas."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    match = re.search(r">=\s*v?(\d+\.\d+)", chart["kubeVersion"])
    assert match, f"Chart.yaml kubeVersion {chart['kubeVersion']!r} has no lower bound"
    key = lambda v: tuple(map(int, v.split(".")))  # noqa: E731
    shipped = [kv_utils.major_minor(v) for v in kv_utils.all_versions()]
    oldest = max(match.group(1), shipped[0], key=key)
    return sorted({oldest, shipped[-1]}, key=key)


KUBE_VERSIONS = _kube_versions()

# Subset of the Prometheus Operator's ServiceMonitor CRD (monitoring.coreos.com/v1)
# covering every field the chart can render; unknown fields are errors, as in
# the strict core schemas.
_RELABEL_LIST = {"type": "array", "items": {"type": "object"}}
_SECRET_KEY_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["key"],
    "properties": {
        "name": {"type": "string"},
        "key": {"type": "string", "pattern": r"^[-._a-zA-Z0-9]+$"},
        "optional": {"type": "boolean"},
    },
}
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "jobLabel": {"type": "string"},
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "matchExpressions": {"type": "array"},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": r"^(0|([0-9]+(ms|s|m|h))+)$"},
                            "scrapeTimeout": {"type": "string", "pattern": r"^(0|([0-9]+(ms|s|m|h))+)$"},
                            "honorLabels": {"type": "boolean"},
                            "authorization": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "type": {"type": "string"},
                                    "credentials": _SECRET_KEY_SELECTOR,
                                },
                            },
                            "relabelings": _RELABEL_LIST,
                            "metricRelabelings": _RELABEL_LIST,
                        },
                    },
                },
            },
        },
    },
}
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR_SCHEMA}


# --------------------------------------------------------------------------- helm


def load_values(case: str) -> dict[str, Any]:
    return yaml.safe_load((VALUES_DIR / f"{case}.yaml").read_text()) or {}


def _render_sdk(values: dict[str, Any]) -> dict[str, str]:
    with helm_python.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def _render_cli(values_file: Path) -> dict[str, str]:
    out = subprocess.run(
        [HELM_BIN, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(values_file)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    manifests: dict[str, str] = {}
    for part in re.split(r"^---\s*$", out, flags=re.M):
        match = re.search(r"^# Source: (\S+)", part, flags=re.M)
        if match:
            manifests[match.group(1)] = manifests.get(match.group(1), "") + "\n---\n" + part
    return manifests


def render(values: dict[str, Any], values_file: Path | None = None) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would produce."""
    if helm_python is not None:
        return _render_sdk(values)
    if values_file is None:
        OUTPUT_DIR.mkdir(parents=True, exist_ok=True)
        values_file = OUTPUT_DIR / "_values.json"
        values_file.write_text(json.dumps(values))
    return _render_cli(values_file)


def render_error(values: dict[str, Any]) -> str:
    """Render values that must be refused; returns the error message."""
    if helm_python is not None:
        with pytest.raises(helm_python.HelmError) as exc_info:
            render(values)
        return str(exc_info.value)
    with pytest.raises(subprocess.CalledProcessError) as exc_info:
        render(values)
    return exc_info.value.stderr


def lint(case: str, kube_version: str) -> list[str]:
    """Findings of `helm lint --strict` at warning level or worse."""
    values_file = VALUES_DIR / f"{case}.yaml"
    if helm_python is not None:
        report = helm_python.lint(
            CHART, load_values(case), strict=True, namespace=NAMESPACE, kube_version=f"v{kube_version}.0"
        )
        return [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2] + [
            e for e in report["errors"] if e
        ]
    proc = subprocess.run(
        [
            HELM_BIN,
            "lint",
            str(CHART),
            "--strict",
            "--namespace",
            NAMESPACE,
            "--kube-version",
            f"v{kube_version}.0",
            "-f",
            str(values_file),
        ],
        capture_output=True,
        text=True,
    )
    return [] if proc.returncode == 0 else [proc.stdout + proc.stderr]


# ---------------------------------------------------------------------- rendered


@dataclass
class Rendered:
    case: str
    docs: list[dict[str, Any]]
    notes: str | None
    by_kind: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for doc in self.docs:
            self.by_kind.setdefault(doc["kind"], []).append(doc)

    def all(self, kind: str) -> list[dict[str, Any]]:
        return self.by_kind.get(kind, [])

    def one(self, kind: str, component: str) -> dict[str, Any]:
        found = [d for d in self.all(kind) if component_of(d) == component]
        assert len(found) == 1, f"{self.case}: expected one {kind} of component {component}, got {len(found)}"
        return found[0]

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return next((d for d in self.all(kind) if d["metadata"]["name"] == name), None)

    def workloads(self) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] in ("StatefulSet", "Deployment", "Job")]


def component_of(doc: dict[str, Any]) -> str | None:
    return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def container(workload: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    if name is None:
        assert len(containers) == 1
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def flags_of(container: dict[str, Any]) -> dict[str, str]:
    """--name=value arguments of a container as {name: value}."""
    flags = {}
    for arg in container.get("args", []):
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            flags[name] = value
    return flags


def fullname(name: str) -> str:
    return f"{RELEASE}-kvstore-{name}"


def write_output(case: str, manifests: dict[str, str]) -> None:
    OUTPUT_DIR.mkdir(parents=True, exist_ok=True)
    # The directory ignores itself, so test output never lands in a commit.
    (OUTPUT_DIR / ".gitignore").write_text("*\n")
    parts = [
        f"# Source: {path}\n{text.strip()}\n"
        for path, text in sorted(manifests.items())
        if path.endswith(".yaml")
        and text.strip()
        and not all(not line.strip() or line.lstrip().startswith("#") for line in text.splitlines())
    ]
    (OUTPUT_DIR / f"{case}.yaml").write_text("---\n".join(parts))


def manifests_to_docs(manifests: dict[str, str]) -> list[dict[str, Any]]:
    """The Kubernetes objects of rendered templates (NOTES.txt and empty documents left out)."""
    return [
        doc for path, text in manifests.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc
    ]


def render_docs(values: dict[str, Any], case: str = "inline") -> Rendered:
    """Render ad-hoc values (not a file of tests/data/helm_values/)."""
    manifests = render(values)
    notes = next((text for path, text in manifests.items() if path.endswith("NOTES.txt")), None)
    return Rendered(case, manifests_to_docs(manifests), notes)


@functools.cache
def rendered_cases() -> dict[str, Rendered]:
    """Every values file of tests/data/helm_values/, rendered once per session."""
    result = {}
    for case in CASES:
        manifests = render(load_values(case), VALUES_DIR / f"{case}.yaml")
        write_output(case, manifests)
        # `helm template` leaves NOTES.txt out; the SDK renders it.
        notes = next((text for path, text in manifests.items() if path.endswith("NOTES.txt")), None)
        result[case] = Rendered(case, manifests_to_docs(manifests), notes)
    return result


def validation_problems(docs: list[dict[str, Any]], versions: list[str] = KUBE_VERSIONS) -> list[str]:
    """Schema violations of rendered manifests: Kubernetes schemas in strict mode
    for each version, CRD_SCHEMAS for the custom resources."""
    problems = []
    for doc in docs:
        what = f"{doc['kind']}/{doc['metadata']['name']}"
        crd_schema = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        if crd_schema is not None:
            errors = sorted(jsonschema.Draft202012Validator(crd_schema).iter_errors(doc), key=str)
            problems += [f"{what}: {list(e.path)}: {e.message}" for e in errors]
            continue
        for version in versions:
            try:
                kv_utils.validate(doc, version, strict=True)
            except kv_utils.ValidationError as exc:
                problems.append(f"{what} (Kubernetes {version}): {list(exc.path)}: {exc.message}")
            except kv_utils.SchemaNotFoundError as exc:
                problems.append(f"{what}: no schema ({exc.message}); add one to CRD_SCHEMAS")
    return problems

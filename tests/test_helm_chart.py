"""Offline tests of the Helm chart in deploy/helm/kvstore.

For every values file in tests/data/helm_values/ (one deployment shape each)
the chart is rendered with the Helm SDK, linted as ``helm lint --strict`` does,
and every rendered manifest is validated against the Kubernetes JSON schemas
with kubernetes-validate in strict mode (unknown fields are errors), for the
oldest Kubernetes version the chart supports (Chart.yaml kubeVersion) and the
newest one kubernetes-validate ships. The ServiceMonitor is a CRD outside the
core schemas: it is checked against the small schema below instead. Then each
shape is checked for what it must produce (replicas, Redis wiring, TLS
mounts and flags, NVMe volumes, ...), and every shape for the invariants of a
sound chart (labels, selectors, named ports, volumes, env references).

The rendered manifests of each shape are written to
tests/output/helm/<shape>.yaml (a self-ignoring directory) for inspection.

No cluster, Docker or network is needed. Install the tools (the ``test``
extra lists them)::

    pip install "helm-python-sdk>=0.2.2,<0.3" "kubernetes-validate>=1.37"

``helm-python-sdk`` bundles Helm's Go SDK as a shared library (import name
``helm_python``). Without it a ``helm`` binary on PATH is used instead; with
neither the tests are skipped, saying so.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import textwrap
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


def _load_values(case: str) -> dict[str, Any]:
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
            CHART, _load_values(case), strict=True, namespace=NAMESPACE, kube_version=f"v{kube_version}.0"
        )
        return [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2] + [
            e for e in report["errors"] if e
        ]
    proc = subprocess.run(
        [HELM_BIN, "lint", str(CHART), "--strict", "--namespace", NAMESPACE,
         "--kube-version", f"v{kube_version}.0", "-f", str(values_file)],
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
        found = [d for d in self.all(kind) if _component(d) == component]
        assert len(found) == 1, f"{self.case}: expected one {kind} of component {component}, got {len(found)}"
        return found[0]

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return next((d for d in self.all(kind) if d["metadata"]["name"] == name), None)

    def workloads(self) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] in ("StatefulSet", "Deployment", "Job")]


def _component(doc: dict[str, Any]) -> str | None:
    return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def _container(workload: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    if name is None:
        assert len(containers) == 1
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _flags(container: dict[str, Any]) -> dict[str, str]:
    """--name=value arguments of a container as {name: value}."""
    flags = {}
    for arg in container.get("args", []):
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            flags[name] = value
    return flags


def _fullname(name: str) -> str:
    return f"{RELEASE}-kvstore-{name}"


def _write_output(case: str, manifests: dict[str, str]) -> None:
    OUTPUT_DIR.mkdir(parents=True, exist_ok=True)
    # The directory ignores itself, so test output never lands in a commit.
    (OUTPUT_DIR / ".gitignore").write_text("*\n")
    parts = [
        f"# Source: {path}\n{text.strip()}\n"
        for path, text in sorted(manifests.items())
        if path.endswith(".yaml") and text.strip() and not all(
            not line.strip() or line.lstrip().startswith("#") for line in text.splitlines()
        )
    ]
    (OUTPUT_DIR / f"{case}.yaml").write_text("---\n".join(parts))


@pytest.fixture(scope="module")
def rendered() -> dict[str, Rendered]:
    result = {}
    for case in CASES:
        manifests = render(_load_values(case), VALUES_DIR / f"{case}.yaml")
        _write_output(case, manifests)
        docs = [
            doc
            for path, text in manifests.items()
            if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text)
            if doc
        ]
        # `helm template` leaves NOTES.txt out; the SDK renders it.
        notes = next((text for path, text in manifests.items() if path.endswith("NOTES.txt")), None)
        result[case] = Rendered(case, docs, notes)
    return result


# ------------------------------------------------------------------ every shape


def test_cases_present() -> None:
    expected = {"default", "external-redis", "no-nvme", "tls", "replicas3"}
    assert expected <= set(CASES), f"missing values files: {expected - set(CASES)}"


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("case", CASES)
def test_lint_strict(case: str, kube_version: str) -> None:
    assert lint(case, kube_version) == []


@pytest.mark.parametrize("case", CASES)
def test_manifests_validate(rendered: dict[str, Rendered], case: str) -> None:
    docs = rendered[case].docs
    assert docs, f"{case}: nothing rendered"
    problems = []
    for doc in docs:
        what = f"{doc['kind']}/{doc['metadata']['name']}"
        crd_schema = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        if crd_schema is not None:
            errors = sorted(jsonschema.Draft202012Validator(crd_schema).iter_errors(doc), key=str)
            problems += [f"{what}: {list(e.path)}: {e.message}" for e in errors]
            continue
        for version in KUBE_VERSIONS:
            try:
                kv_utils.validate(doc, version, strict=True)
            except kv_utils.ValidationError as exc:
                problems.append(f"{what} (Kubernetes {version}): {list(exc.path)}: {exc.message}")
            except kv_utils.SchemaNotFoundError as exc:
                problems.append(f"{what}: no schema ({exc.message}); add one to CRD_SCHEMAS")
    assert problems == []


@pytest.mark.parametrize("case", CASES)
def test_labels_and_names(rendered: dict[str, Rendered], case: str) -> None:
    for doc in rendered[case].docs:
        meta = doc["metadata"]
        what = f"{doc['kind']}/{meta['name']}"
        assert meta["name"].startswith(f"{RELEASE}-kvstore"), f"{what}: not named after the release"
        assert len(meta["name"]) <= 63, what
        labels = meta.get("labels", {})
        for key in ("helm.sh/chart", "app.kubernetes.io/name", "app.kubernetes.io/instance",
                    "app.kubernetes.io/managed-by", "app.kubernetes.io/version"):
            assert key in labels, f"{what}: missing label {key}"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert meta.get("namespace") == NAMESPACE, f"{what}: namespace not set to the release's"
    for sts in rendered[case].all("StatefulSet"):
        # Pods get a controller-revision-hash label of <name>-<10 chars>.
        assert len(sts["metadata"]["name"]) <= 52, sts["metadata"]["name"]


@pytest.mark.parametrize("case", CASES)
def test_workloads_are_consistent(rendered: dict[str, Rendered], case: str) -> None:
    r = rendered[case]
    for wl in r.workloads():
        what = f"{wl['kind']}/{wl['metadata']['name']}"
        spec = wl["spec"]
        pod = spec["template"]["spec"]
        pod_labels = spec["template"]["metadata"]["labels"]
        if wl["kind"] != "Job":
            selector = spec["selector"]["matchLabels"]
            assert selector.items() <= pod_labels.items(), f"{what}: selector does not match its pods"
            assert "app.kubernetes.io/component" in selector, f"{what}: selector would match other components"
        if wl["kind"] == "StatefulSet":
            governing = r.get("Service", spec["serviceName"])
            assert governing is not None, f"{what}: serviceName {spec['serviceName']} not rendered"
            assert governing["spec"].get("clusterIP") == "None", f"{what}: governing Service is not headless"
        assert pod["securityContext"]["runAsNonRoot"] is True, what
        assert pod.get("automountServiceAccountToken") is False, what
        assert r.get("ServiceAccount", pod["serviceAccountName"]) is not None, what
        volumes = {v["name"] for v in pod.get("volumes", [])}
        volumes |= {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
        for c in pod.get("initContainers", []) + pod["containers"]:
            cwhat = f"{what} container {c['name']}"
            assert ":" in c["image"] and not c["image"].endswith(":latest"), f"{cwhat}: unpinned image"
            assert "resources" in c, f"{cwhat}: no resources"
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{cwhat}: mounts undeclared volume {mount['name']}"
            # $(VAR) in env values and args must name a variable defined before use.
            defined: set[str] = set()
            for env in c.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", env.get("value", "")):
                    assert ref in defined, f"{cwhat}: env {env['name']} refers to undefined $({ref})"
                defined.add(env["name"])
            for arg in c.get("args", []) + c.get("command", []):
                for ref in re.findall(r"\$\((\w+)\)", arg):
                    assert ref in defined, f"{cwhat}: argument {arg!r} refers to undefined $({ref})"
        for c in pod["containers"]:
            if wl["kind"] != "Job":
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert probe in c, f"{what} container {c['name']}: no {probe}"


@pytest.mark.parametrize("case", CASES)
def test_services_reach_pods(rendered: dict[str, Rendered], case: str) -> None:
    r = rendered[case]
    for svc in r.all("Service"):
        what = f"Service/{svc['metadata']['name']}"
        selector = svc["spec"]["selector"]
        targets = [
            wl for wl in r.workloads()
            if selector.items() <= wl["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(targets) == 1, f"{what}: selects {len(targets)} workloads"
        port_names = {p["name"] for c in targets[0]["spec"]["template"]["spec"]["containers"]
                      for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"{what}: targetPort {port['targetPort']} not on the pods"


# ------------------------------------------------------------------ each shape


def test_default(rendered: dict[str, Rendered]) -> None:
    r = rendered["default"]
    sts = r.one("StatefulSet", "store")
    assert sts["spec"]["replicas"] == 1
    assert not r.all("PodDisruptionBudget"), "a PDB over one replica would block node drains"
    assert not r.all("ServiceMonitor") and not r.all("Job")

    store = _container(sts, "store")
    assert store["command"] == ["kvstore"] and store["args"][0] == "serve"
    flags = _flags(store)
    assert flags["listen"] == "0.0.0.0:7070"
    assert flags["dram"] == "4GiB"
    assert flags["nvme-dir"] == "/var/lib/kvstore/nvme" and flags["nvme"] == "100GiB"
    assert flags["metrics-port"] == "9090"
    assert flags["drain-seconds"] == "45", "grace period 60 s - preStop 5 s - 10 s to exit"
    assert "tls-cert" not in flags and "tenants" not in flags and "config" not in flags

    # Memory sized from the DRAM tier: 4GiB + 1GiB overhead, request == limit.
    resources = store["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "5Gi"
    assert resources["requests"]["cpu"] == "2" and "cpu" not in resources["limits"]

    # NVMe on a PVC per pod: nvme.size plus 10%.
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "nvme"
    assert claim["spec"]["resources"]["requests"]["storage"] == "110Gi"
    assert "storageClassName" not in claim["spec"], "the default class is used when none is set"
    assert {"name": "nvme", "mountPath": "/var/lib/kvstore/nvme"} in store["volumeMounts"]

    # Probes use the store's gRPC health service.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert store[probe]["grpc"] == {"port": 7070}
    assert store["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60

    # Advertised address from the downward API.
    env = _env(store)
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["KVSTORE_ADVERTISE"]["value"] == "$(POD_IP):7070"

    # In-chart Redis, wired into the store and the workers.
    redis_url = f"redis://{_fullname('redis')}.{NAMESPACE}.svc.cluster.local:6379/0"
    assert env["KVSTORE_REDIS"]["value"] == redis_url
    redis = r.one("StatefulSet", "redis")
    assert _container(redis)["image"].startswith("docker.io/library/redis:")
    assert r.get("Service", _fullname("redis")) is not None
    for component, module, port in (("prefill", "prefill_node", 7080), ("decode", "decode_node", 7090)):
        worker = _container(r.one("Deployment", component))
        assert worker["command"] == ["python", "-m", module]
        assert _flags(worker) == {"listen": f"0.0.0.0:{port}", "store": redis_url, "model": "smollm2"}
        assert worker["readinessProbe"]["grpc"] == {"port": port}
        svc = r.get("Service", _fullname(component))
        assert svc["spec"]["ports"][0]["port"] == port

    # Headless Service for stable identities, ClusterIP Service for clients.
    headless = r.get("Service", _fullname("store-headless"))
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
    client = r.get("Service", _fullname("store"))
    assert client["spec"]["type"] == "ClusterIP"
    assert {p["name"] for p in client["spec"]["ports"]} == {"grpc", "metrics"}
    assert r.notes is None or "kvstore-store" in r.notes


def test_external_redis(rendered: dict[str, Rendered]) -> None:
    r = rendered["external-redis"]
    url = "redis://redis-master.shared-services.svc.cluster.local:6379/2"
    assert [s["metadata"]["name"] for s in r.all("StatefulSet")] == [_fullname("store")]
    assert not any(_component(s) == "redis" for s in r.all("Service"))
    store = _container(r.one("StatefulSet", "store"), "store")
    assert _env(store)["KVSTORE_REDIS"] == {"name": "KVSTORE_REDIS", "value": url}
    for component in ("prefill", "decode"):
        assert _flags(_container(r.one("Deployment", component)))["store"] == url
    sts = r.one("StatefulSet", "store")
    assert sts["spec"]["replicas"] == 2
    assert r.one("PodDisruptionBudget", "store")["spec"]["maxUnavailable"] == 1
    # NVMe tier on an emptyDir bounded by the tier's size plus 10%.
    assert "volumeClaimTemplates" not in sts["spec"]
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["nvme"] == {"name": "nvme", "emptyDir": {"sizeLimit": "110Gi"}}
    assert _flags(store)["nvme-dir"] == "/var/lib/kvstore/nvme"


def test_no_nvme(rendered: dict[str, Rendered]) -> None:
    r = rendered["no-nvme"]
    sts = r.one("StatefulSet", "store")
    store = _container(sts, "store")
    assert "volumeClaimTemplates" not in sts["spec"]
    assert "nvme-dir" not in _flags(store) and "nvme" not in _flags(store)
    assert all(v["name"] != "nvme" for v in sts["spec"]["template"]["spec"]["volumes"])
    assert all(m["name"] != "nvme" for m in store["volumeMounts"])
    # 512MiB DRAM + 1GiB overhead.
    assert store["resources"]["limits"]["memory"] == "1536Mi"
    # Single node without Redis: no KVSTORE_REDIS, workers talk to the store Service.
    assert "KVSTORE_REDIS" not in _env(store)
    assert not any(_component(d) == "redis" for d in r.docs)
    store_svc = f"{_fullname('store')}:7070"
    for component in ("prefill", "decode"):
        assert _flags(_container(r.one("Deployment", component)))["store"] == store_svc


def test_tls(rendered: dict[str, Rendered]) -> None:
    r = rendered["tls"]
    sts = r.one("StatefulSet", "store")
    pod = sts["spec"]["template"]["spec"]
    store = _container(sts, "store")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "kvstore-server-tls"
    assert {i["key"] for i in volumes["tls"]["secret"]["items"]} == {"tls.crt", "tls.key", "ca.crt"}
    assert {"name": "tls", "mountPath": "/etc/kvstore/tls", "readOnly": True} in store["volumeMounts"]
    flags = _flags(store)
    assert flags["tls-cert"] == "/etc/kvstore/tls/tls.crt"
    assert flags["tls-key"] == "/etc/kvstore/tls/tls.key"
    assert flags["tls-client-ca"] == "/etc/kvstore/tls/ca.crt"
    # Tenants file from its own Secret.
    assert volumes["tenants"]["secret"]["secretName"] == "kvstore-tenants"
    assert flags["tenants"] == "/etc/kvstore/tenants/tenants.yaml"
    # The kubelet's gRPC probe cannot speak TLS: probes fall back to TCP.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in store[probe] and store[probe]["tcpSocket"] == {"port": "grpc"}
    # Stable DNS identities, which a certificate can name.
    assert _env(store)["KVSTORE_ADVERTISE"]["value"] == (
        f"$(POD_NAME).{_fullname('store-headless')}.$(POD_NAMESPACE).svc.cluster.local:7070"
    )


def test_replicas3_loadtest_servicemonitor(rendered: dict[str, Rendered]) -> None:
    r = rendered["replicas3"]
    sts = r.one("StatefulSet", "store")
    store = _container(sts, "store")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["replicas"] == 3
    assert store["resources"]["requests"]["memory"] == "18Gi"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "local-nvme"
    assert claim["spec"]["resources"]["requests"]["storage"] == "850Gi"
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete", "whenScaled": "Retain"}
    anti = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == "kubernetes.io/hostname"

    pdb = r.one("PodDisruptionBudget", "store")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    # The ServiceMonitor scrapes each store pod exactly once: of the Services it
    # selects, only one has the port it names.
    sm = r.one("ServiceMonitor", "store")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    selected = [s for s in r.all("Service")
                if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    with_port = [s for s in selected if any(p["name"] == "metrics" for p in s["spec"]["ports"])]
    assert [s["metadata"]["name"] for s in with_port] == [_fullname("store")]
    assert with_port[0]["spec"]["selector"].items() <= pod_labels.items()

    # The load test drives the prefill and decode Services.
    job = r.one("Job", "loadtest")
    assert job["metadata"]["name"] == _fullname("loadtest-1")
    bench = _container(job)
    assert "python -m bench.ttft" in " ".join(bench["command"])
    flags = _flags(bench)
    assert flags["prefill"] == f"{_fullname('prefill')}:7080"
    assert flags["decode"] == f"{_fullname('decode')}:7090"
    assert "quick" in flags and flags["out"] == "/results/ttft.json"
    assert {"name": "results", "mountPath": "/results"} in bench["volumeMounts"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    (wait,) = job["spec"]["template"]["spec"]["initContainers"]
    assert "kvstore health" in wait["command"][-1]
    assert r.notes is None or "loadtest-1" in r.notes


def test_hostpath_config(rendered: dict[str, Rendered]) -> None:
    r = rendered["hostpath-config"]
    sts = r.one("StatefulSet", "store")
    pod = sts["spec"]["template"]["spec"]
    store = _container(sts, "store")
    assert "volumeClaimTemplates" not in sts["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["nvme"]["hostPath"] == {"path": "/mnt/nvme0/kvstore", "type": "DirectoryOrCreate"}
    assert _flags(store)["nvme-dir"] == "/var/lib/kvstore/nvme"
    # fsGroup does not reach hostPath volumes: an init container hands the
    # directory over, with CHOWN as its only capability.
    (init,) = pod["initContainers"]
    assert init["command"] == ["chown", "10001:10001", "/var/lib/kvstore/nvme"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert pod["nodeSelector"] == {"node.kubernetes.io/nvme": "true"}
    # Config file from values, with a checksum that rolls the pods on change.
    cm = r.one("ConfigMap", "store")
    assert yaml.safe_load(cm["data"]["config.yaml"]) == {"write-policy": "write-through", "nvme-segment": "512MiB"}
    assert _flags(store)["config"] == "/etc/kvstore/config/config.yaml"
    assert volumes["config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert re.fullmatch(r"[0-9a-f]{64}", sts["spec"]["template"]["metadata"]["annotations"]["checksum/config"])
    # Redis URL from a Secret, passed to the workers through $(KVSTORE_REDIS).
    secret_ref = {"secretKeyRef": {"name": "kvstore-redis-url", "key": "url"}}
    assert _env(store)["KVSTORE_REDIS"]["valueFrom"] == secret_ref
    for component in ("prefill", "decode"):
        worker = _container(r.one("Deployment", component))
        assert _flags(worker)["store"] == "$(KVSTORE_REDIS)"
        assert _env(worker)["KVSTORE_REDIS"]["valueFrom"] == secret_ref


@pytest.mark.parametrize("case", CASES)
def test_store_args_parse_with_the_cli(rendered: dict[str, Rendered], case: str, tmp_path: Path) -> None:
    """The flags and KVSTORE_* variables the chart gives the store are ones
    `kvstore serve` accepts, with values it can parse."""
    cli = pytest.importorskip("kvstore.cli", reason="the kvstore package is not importable")
    config = pytest.importorskip("kvstore.config", reason="the kvstore package is not importable")
    sizes = pytest.importorskip("kvstore.sizes", reason="the kvstore package is not importable")
    r = rendered[case]
    sts = r.one("StatefulSet", "store")
    store = _container(sts, "store")
    args = list(store["command"][1:] + store["args"])
    cm = next(iter(r.all("ConfigMap")), None)
    if cm is not None:  # the mounted config file, read from a local copy
        local = tmp_path / "config.yaml"
        local.write_text(cm["data"]["config.yaml"])
        args = [f"--config={local}" if a.startswith("--config=") else a for a in args]
    env = {name: e.get("value", "redis://from-a-secret:6379/0") for name, e in _env(store).items()
           if name.startswith("KVSTORE_")}
    cfg = config.load(cli.build_parser().parse_args(args), env=env)
    assert cfg.listen == "0.0.0.0:7070"
    assert cfg.dram == sizes.parse_size(_flags(store)["dram"])
    assert cfg.redis == env.get("KVSTORE_REDIS")
    assert (cfg.nvme_dir is not None) == ("nvme-dir" in _flags(store))


# ---------------------------------------------------------------- refused values


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"store": {"replicas": 3}, "redis": {"enabled": False}}, "needs cluster mode"),
        ({"redis": {"externalUrl": "redis://r:6379/0"}}, "set redis.enabled=false"),
        ({"tls": {"enabled": True}}, "tls.existingSecret"),
        ({"tenants": {"enabled": True}}, "tenants.existingSecret"),
        ({"store": {"dram": "4GB"}}, "/store/dram"),
        ({"store": {"nvme": {"volume": {"type": "nfs"}}}}, "/store/nvme/volume/type"),
        ({"store": {"drams": "4GiB"}}, "drams"),
        ({"loadtest": {"enabled": True}, "decode": {"enabled": False}}, "needs prefill.enabled=true"),
    ],
    ids=["replicas-without-redis", "redis-twice", "tls-without-secret", "tenants-without-secret",
         "bad-size", "bad-volume-type", "unknown-key", "loadtest-without-decode"],
)
def test_refused_values(values: dict[str, Any], message: str) -> None:
    assert message in render_error(values)


# ------------------------------------------------------------- README examples


def _readme_yaml_blocks() -> list[tuple[int, list[dict[str, Any]]]]:
    text = (ROOT / "deploy" / "README.md").read_text()
    blocks = []
    for match in re.finditer(r"^( *)```yaml\n(.*?)^\1```", text, flags=re.M | re.S):
        line = text.count("\n", 0, match.start()) + 1
        body = textwrap.dedent(match.group(2))
        blocks.append((line, [d for d in yaml.safe_load_all(body) if d]))
    return blocks


def test_readme_examples(tmp_path: Path) -> None:
    """Every YAML block of deploy/README.md is either chart values that render
    to valid manifests, or Kubernetes manifests that validate."""
    blocks = _readme_yaml_blocks()
    assert len(blocks) >= 4, "deploy/README.md lost its examples"
    problems = []
    for line, docs in blocks:
        if all("apiVersion" in d and "kind" in d for d in docs):
            manifests = docs
        else:
            (values,) = docs
            values_file = tmp_path / f"readme-{line}.yaml"
            values_file.write_text(yaml.safe_dump(values))
            manifests = [d for path, text in render(values, values_file).items() if path.endswith(".yaml")
                         for d in yaml.safe_load_all(text) if d]
        for doc in manifests:
            if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
                continue
            try:
                kv_utils.validate(doc, KUBE_VERSIONS[-1], strict=True)
            except kv_utils.ValidationError as exc:
                problems.append(f"README line {line}: {doc['kind']}: {list(exc.path)}: {exc.message}")
    assert problems == []

"""Offline tests of the Helm chart in deploy/helm/kvstore: rendering and validation.

For every values file in tests/data/helm_values/ (one deployment shape each)
the chart is rendered with the Helm SDK, linted as ``helm lint --strict`` does,
and every rendered manifest is validated against the Kubernetes JSON schemas
with kubernetes-validate in strict mode (unknown fields are errors), for the
oldest Kubernetes version the chart supports (Chart.yaml kubeVersion) and the
newest one kubernetes-validate ships. The ServiceMonitor is a CRD outside the
core schemas: it is checked against a small schema instead
(tests/helm_support.py). Every shape is checked for the invariants of a sound
chart (labels, selectors, named ports, volumes, env references); values the
chart must refuse, and the examples of deploy/README.md, are checked here too.
What each shape must produce for the store (replicas, Redis wiring, TLS mounts
and flags, NVMe volumes, ...) is in tests/test_helm_chart_store.py.

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

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.helm_support import (
    CASES,
    CRD_SCHEMAS,
    KUBE_VERSIONS,
    NAMESPACE,
    RELEASE,
    ROOT,
    Rendered,
    kv_utils,
    lint,
    render,
    render_error,
    rendered_cases,
    validation_problems,
    yaml,
)


@pytest.fixture(scope="module")
def rendered() -> dict[str, Rendered]:
    return rendered_cases()


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
    problems = validation_problems(docs)
    assert problems == []


@pytest.mark.parametrize("case", CASES)
def test_labels_and_names(rendered: dict[str, Rendered], case: str) -> None:
    for doc in rendered[case].docs:
        meta = doc["metadata"]
        what = f"{doc['kind']}/{meta['name']}"
        assert meta["name"].startswith(f"{RELEASE}-kvstore"), f"{what}: not named after the release"
        assert len(meta["name"]) <= 63, what
        labels = meta.get("labels", {})
        for key in (
            "helm.sh/chart",
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/managed-by",
            "app.kubernetes.io/version",
        ):
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
            wl for wl in r.workloads() if selector.items() <= wl["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(targets) == 1, f"{what}: selects {len(targets)} workloads"
        port_names = {
            p["name"] for c in targets[0]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
        }
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"{what}: targetPort {port['targetPort']} not on the pods"


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
    ids=[
        "replicas-without-redis",
        "redis-twice",
        "tls-without-secret",
        "tenants-without-secret",
        "bad-size",
        "bad-volume-type",
        "unknown-key",
        "loadtest-without-decode",
    ],
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
            manifests = [
                d
                for path, text in render(values, values_file).items()
                if path.endswith(".yaml")
                for d in yaml.safe_load_all(text)
                if d
            ]
        for doc in manifests:
            if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
                continue
            try:
                kv_utils.validate(doc, KUBE_VERSIONS[-1], strict=True)
            except kv_utils.ValidationError as exc:
                problems.append(f"README line {line}: {doc['kind']}: {list(exc.path)}: {exc.message}")
    assert problems == []

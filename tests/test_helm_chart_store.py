"""Offline tests of the store settings of the Helm chart in deploy/helm/kvstore.

For each deployment shape of tests/data/helm_values/ (rendered once, see
tests/helm_support.py) the store StatefulSet, its Services and its neighbours
are checked for what that shape must produce (replicas, Redis wiring, TLS
mounts and flags, NVMe volumes, probes, resources, the bulk TCP lane's port,
--cluster-ttl, no metrics token), and that the flags the chart gives
``kvstore serve`` parse with the store's own CLI. Settings no shape file
covers (another TCP lane port, GPU store nodes with an HBM tier, a bearer
token on /metrics) are rendered from inline values, and their manifests
validated. tests/test_helm_chart.py holds the rendering, lint and schema
checks common to every shape.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.helm_support import (
    CASES,
    NAMESPACE,
    Rendered,
    component_of,
    container,
    env_of,
    flags_of,
    fullname,
    render_docs,
    render_error,
    rendered_cases,
    validation_problems,
    yaml,
)


@pytest.fixture(scope="module")
def rendered() -> dict[str, Rendered]:
    return rendered_cases()


# ------------------------------------------------------------------ each shape


def test_default(rendered: dict[str, Rendered]) -> None:
    r = rendered["default"]
    sts = r.one("StatefulSet", "store")
    assert sts["spec"]["replicas"] == 1
    assert not r.all("PodDisruptionBudget"), "a PDB over one replica would block node drains"
    assert not r.all("ServiceMonitor") and not r.all("Job")

    store = container(sts, "store")
    assert store["command"] == ["kvstore"] and store["args"][0] == "serve"
    flags = flags_of(store)
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
    env = env_of(store)
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["KVSTORE_ADVERTISE"]["value"] == "$(POD_IP):7070"

    # In-chart Redis, wired into the store and the workers.
    redis_url = f"redis://{fullname('redis')}.{NAMESPACE}.svc.cluster.local:6379/0"
    assert env["KVSTORE_REDIS"]["value"] == redis_url
    redis = r.one("StatefulSet", "redis")
    assert container(redis)["image"].startswith("docker.io/library/redis:")
    assert r.get("Service", fullname("redis")) is not None
    for component, module, port in (("prefill", "prefill_node", 7080), ("decode", "decode_node", 7090)):
        worker = container(r.one("Deployment", component))
        assert worker["command"] == ["python", "-m", module]
        assert flags_of(worker) == {"listen": f"0.0.0.0:{port}", "store": redis_url, "model": "smollm2"}
        assert worker["readinessProbe"]["grpc"] == {"port": port}
        svc = r.get("Service", fullname(component))
        assert svc["spec"]["ports"][0]["port"] == port

    # Headless Service for stable identities, ClusterIP Service for clients.
    headless = r.get("Service", fullname("store-headless"))
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
    client = r.get("Service", fullname("store"))
    assert client["spec"]["type"] == "ClusterIP"
    assert {p["name"] for p in client["spec"]["ports"]} == {"grpc", "metrics", "tcp-lane"}
    assert r.notes is None or "kvstore-store" in r.notes


def test_external_redis(rendered: dict[str, Rendered]) -> None:
    r = rendered["external-redis"]
    url = "redis://redis-master.shared-services.svc.cluster.local:6379/2"
    assert [s["metadata"]["name"] for s in r.all("StatefulSet")] == [fullname("store")]
    assert not any(component_of(s) == "redis" for s in r.all("Service"))
    store = container(r.one("StatefulSet", "store"), "store")
    assert env_of(store)["KVSTORE_REDIS"] == {"name": "KVSTORE_REDIS", "value": url}
    for component in ("prefill", "decode"):
        assert flags_of(container(r.one("Deployment", component)))["store"] == url
    sts = r.one("StatefulSet", "store")
    assert sts["spec"]["replicas"] == 2
    assert r.one("PodDisruptionBudget", "store")["spec"]["maxUnavailable"] == 1
    # NVMe tier on an emptyDir bounded by the tier's size plus 10%.
    assert "volumeClaimTemplates" not in sts["spec"]
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["nvme"] == {"name": "nvme", "emptyDir": {"sizeLimit": "110Gi"}}
    assert flags_of(store)["nvme-dir"] == "/var/lib/kvstore/nvme"


def test_no_nvme(rendered: dict[str, Rendered]) -> None:
    r = rendered["no-nvme"]
    sts = r.one("StatefulSet", "store")
    store = container(sts, "store")
    assert "volumeClaimTemplates" not in sts["spec"]
    assert "nvme-dir" not in flags_of(store) and "nvme" not in flags_of(store)
    assert all(v["name"] != "nvme" for v in sts["spec"]["template"]["spec"]["volumes"])
    assert all(m["name"] != "nvme" for m in store["volumeMounts"])
    # 512MiB DRAM + 1GiB overhead.
    assert store["resources"]["limits"]["memory"] == "1536Mi"
    # Single node without Redis: no KVSTORE_REDIS, workers talk to the store Service.
    assert "KVSTORE_REDIS" not in env_of(store)
    assert not any(component_of(d) == "redis" for d in r.docs)
    store_svc = f"{fullname('store')}:7070"
    for component in ("prefill", "decode"):
        assert flags_of(container(r.one("Deployment", component)))["store"] == store_svc


def test_tls(rendered: dict[str, Rendered]) -> None:
    r = rendered["tls"]
    sts = r.one("StatefulSet", "store")
    pod = sts["spec"]["template"]["spec"]
    store = container(sts, "store")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "kvstore-server-tls"
    assert {i["key"] for i in volumes["tls"]["secret"]["items"]} == {"tls.crt", "tls.key", "ca.crt"}
    assert {"name": "tls", "mountPath": "/etc/kvstore/tls", "readOnly": True} in store["volumeMounts"]
    flags = flags_of(store)
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
    assert env_of(store)["KVSTORE_ADVERTISE"]["value"] == (
        f"$(POD_NAME).{fullname('store-headless')}.$(POD_NAMESPACE).svc.cluster.local:7070"
    )


def test_replicas3_loadtest_servicemonitor(rendered: dict[str, Rendered]) -> None:
    r = rendered["replicas3"]
    sts = r.one("StatefulSet", "store")
    store = container(sts, "store")
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
    selected = [
        s for s in r.all("Service") if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    with_port = [s for s in selected if any(p["name"] == "metrics" for p in s["spec"]["ports"])]
    assert [s["metadata"]["name"] for s in with_port] == [fullname("store")]
    assert with_port[0]["spec"]["selector"].items() <= pod_labels.items()

    # The load test drives the prefill and decode Services.
    job = r.one("Job", "loadtest")
    assert job["metadata"]["name"] == fullname("loadtest-1")
    bench = container(job)
    assert "python -m bench.ttft" in " ".join(bench["command"])
    flags = flags_of(bench)
    assert flags["prefill"] == f"{fullname('prefill')}:7080"
    assert flags["decode"] == f"{fullname('decode')}:7090"
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
    store = container(sts, "store")
    assert "volumeClaimTemplates" not in sts["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["nvme"]["hostPath"] == {"path": "/mnt/nvme0/kvstore", "type": "DirectoryOrCreate"}
    assert flags_of(store)["nvme-dir"] == "/var/lib/kvstore/nvme"
    # fsGroup does not reach hostPath volumes: an init container hands the
    # directory over, with CHOWN as its only capability.
    (init,) = pod["initContainers"]
    assert init["command"] == ["chown", "10001:10001", "/var/lib/kvstore/nvme"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert pod["nodeSelector"] == {"node.kubernetes.io/nvme": "true"}
    # Config file from values, with a checksum that rolls the pods on change.
    cm = r.one("ConfigMap", "store")
    assert yaml.safe_load(cm["data"]["config.yaml"]) == {"write-policy": "write-through", "nvme-segment": "512MiB"}
    assert flags_of(store)["config"] == "/etc/kvstore/config/config.yaml"
    assert volumes["config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert re.fullmatch(r"[0-9a-f]{64}", sts["spec"]["template"]["metadata"]["annotations"]["checksum/config"])
    # Redis URL from a Secret, passed to the workers through $(KVSTORE_REDIS).
    secret_ref = {"secretKeyRef": {"name": "kvstore-redis-url", "key": "url"}}
    assert env_of(store)["KVSTORE_REDIS"]["valueFrom"] == secret_ref
    for component in ("prefill", "decode"):
        worker = container(r.one("Deployment", component))
        assert flags_of(worker)["store"] == "$(KVSTORE_REDIS)"
        assert env_of(worker)["KVSTORE_REDIS"]["valueFrom"] == secret_ref


def _serve_config(r: Rendered, tmp_path: Path) -> tuple[Any, dict[str, str], dict[str, Any]]:
    """The store's ServeConfig as `kvstore serve` would load it from the rendered
    command line and KVSTORE_* variables; also those variables and the container."""
    cli = pytest.importorskip("kvstore.cli", reason="the kvstore package is not importable")
    config = pytest.importorskip("kvstore.config", reason="the kvstore package is not importable")
    sts = r.one("StatefulSet", "store")
    store = container(sts, "store")
    args = list(store["command"][1:] + store["args"])
    cm = next(iter(r.all("ConfigMap")), None)
    if cm is not None:  # the mounted config file, read from a local copy
        local = tmp_path / "config.yaml"
        local.write_text(cm["data"]["config.yaml"])
        args = [f"--config={local}" if a.startswith("--config=") else a for a in args]
    env = {
        name: e.get("value", "redis://from-a-secret:6379/0")
        for name, e in env_of(store).items()
        if name.startswith("KVSTORE_")
    }
    return config.load(cli.build_parser().parse_args(args), env=env), env, store


@pytest.mark.parametrize("case", CASES)
def test_store_args_parse_with_the_cli(rendered: dict[str, Rendered], case: str, tmp_path: Path) -> None:
    """The flags and KVSTORE_* variables the chart gives the store are ones
    `kvstore serve` accepts, with values it can parse."""
    sizes = pytest.importorskip("kvstore.sizes", reason="the kvstore package is not importable")
    cfg, env, store = _serve_config(rendered[case], tmp_path)
    assert cfg.listen == "0.0.0.0:7070"
    assert cfg.dram == sizes.parse_size(flags_of(store)["dram"])
    assert cfg.redis == env.get("KVSTORE_REDIS")
    assert (cfg.nvme_dir is not None) == ("nvme-dir" in flags_of(store))
    assert cfg.tcp_lane_listen == flags_of(store).get("tcp-lane-listen", "")
    assert cfg.cluster_ttl == float(flags_of(store).get("cluster-ttl", "10"))


# --------------------------------------------------------------- store settings


def _service_ports(r: Rendered) -> dict[str, dict[str, dict[str, Any]]]:
    """Ports by name of the store's client and headless Services."""
    return {
        name: {p["name"]: p for p in r.get("Service", fullname(name))["spec"]["ports"]}
        for name in ("store", "store-headless")
    }


@pytest.mark.parametrize("case", CASES)
def test_tcp_lane(rendered: dict[str, Rendered], case: str) -> None:
    """The bulk TCP lane listens on a fixed port that both store Services
    expose; it is plaintext, so under TLS neither flag nor port is rendered
    (the store itself turns the lane off when gRPC uses TLS)."""
    r = rendered[case]
    store = container(r.one("StatefulSet", "store"), "store")
    ports = {p["name"]: p for p in store["ports"]}
    services = _service_ports(r)
    if "tls-cert" in flags_of(store):
        assert "tcp-lane-listen" not in flags_of(store)
        assert "tcp-lane" not in ports
        assert all("tcp-lane" not in svc for svc in services.values())
        return
    assert flags_of(store)["tcp-lane-listen"] == "0.0.0.0:7072"
    assert ports["tcp-lane"] == {"name": "tcp-lane", "containerPort": 7072, "protocol": "TCP"}
    for name, svc in services.items():
        assert svc["tcp-lane"] == {"name": "tcp-lane", "port": 7072, "targetPort": "tcp-lane", "protocol": "TCP"}, name
    assert r.notes is None or "TCP lane" in r.notes
    # A lane is known only to the pod that opened it: through the client
    # Service a client's lane connection must reach its gRPC connection's pod.
    assert r.get("Service", fullname("store"))["spec"]["sessionAffinity"] == "ClientIP"


def test_tcp_lane_port_from_values() -> None:
    r = render_docs({"store": {"ports": {"tcpLane": 17072}, "service": {"sessionAffinity": "None"}}})
    assert "sessionAffinity" not in r.get("Service", fullname("store"))["spec"]
    store = container(r.one("StatefulSet", "store"), "store")
    assert flags_of(store)["tcp-lane-listen"] == "0.0.0.0:17072"
    assert {"name": "tcp-lane", "containerPort": 17072, "protocol": "TCP"} in store["ports"]
    for name, svc in _service_ports(r).items():
        assert svc["tcp-lane"]["port"] == 17072 and svc["tcp-lane"]["targetPort"] == "tcp-lane", name
    assert validation_problems(r.docs) == []


@pytest.mark.parametrize("case", CASES)
def test_cluster_ttl(rendered: dict[str, Rendered], case: str) -> None:
    """--cluster-ttl (store.clusterTtl, default 10 s) goes with cluster mode only."""
    store = container(rendered[case].one("StatefulSet", "store"), "store")
    if "KVSTORE_REDIS" in env_of(store):
        assert flags_of(store)["cluster-ttl"] == "10"
    else:
        assert "cluster-ttl" not in flags_of(store)


def test_cluster_ttl_from_values(tmp_path: Path) -> None:
    r = render_docs({"store": {"clusterTtl": 2.5}})
    store = container(r.one("StatefulSet", "store"), "store")
    assert flags_of(store)["cluster-ttl"] == "2.5"
    cfg, _, _ = _serve_config(r, tmp_path)
    assert cfg.cluster_ttl == 2.5
    # Without Redis the value has nothing to apply to and is not rendered.
    r = render_docs({"store": {"clusterTtl": 30}, "redis": {"enabled": False}})
    assert "cluster-ttl" not in flags_of(container(r.one("StatefulSet", "store"), "store"))


_TOKEN_MOUNT = {"name": "metrics-token", "mountPath": "/etc/kvstore/metrics-token", "readOnly": True}


@pytest.mark.parametrize("case", CASES)
def test_no_metrics_token_by_default(rendered: dict[str, Rendered], case: str) -> None:
    """Without metrics.tokenSecret.name /metrics stays open: no flag, volume,
    mount or ServiceMonitor authorization."""
    r = rendered[case]
    sts = r.one("StatefulSet", "store")
    store = container(sts, "store")
    assert "metrics-token-file" not in flags_of(store)
    assert all(v["name"] != "metrics-token" for v in sts["spec"]["template"]["spec"]["volumes"])
    assert all(m["name"] != "metrics-token" for m in store["volumeMounts"])
    for sm in r.all("ServiceMonitor"):
        assert all("authorization" not in e for e in sm["spec"]["endpoints"])


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_metrics_token(tmp_path: Path, tls: bool) -> None:
    """metrics.tokenSecret: the user's Secret mounted read-only, --metrics-token-file
    pointing into it, and the ServiceMonitor sending the same Secret as a bearer token."""
    values: dict[str, Any] = {
        "metrics": {
            "tokenSecret": {"name": "kvstore-metrics-token"},
            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        },
    }
    if tls:
        values["tls"] = {"enabled": True, "existingSecret": "kvstore-server-tls"}
    r = render_docs(values)
    assert validation_problems(r.docs) == []
    assert not r.all("Secret"), "the token Secret is the user's, not the chart's"
    sts = r.one("StatefulSet", "store")
    store = container(sts, "store")
    assert flags_of(store)["metrics-token-file"] == "/etc/kvstore/metrics-token/token"
    assert _TOKEN_MOUNT in store["volumeMounts"]
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["metrics-token"]["secret"] == {
        "secretName": "kvstore-metrics-token",
        "defaultMode": 0o440,
        "items": [{"key": "token", "path": "token"}],
    }
    (endpoint,) = r.one("ServiceMonitor", "store")["spec"]["endpoints"]
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "kvstore-metrics-token", "key": "token"},
    }
    assert r.one("ServiceMonitor", "store")["metadata"]["namespace"] == NAMESPACE
    # The probes must keep working when /metrics answers 401: none of them uses it.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "httpGet" not in store[probe]
        if tls:
            assert store[probe]["tcpSocket"] == {"port": "grpc"}
        else:
            assert store[probe]["grpc"] == {"port": 7070}
    cfg, _, _ = _serve_config(r, tmp_path)
    assert cfg.metrics_token_file == "/etc/kvstore/metrics-token/token"
    assert r.notes is None or "kvstore-metrics-token" in r.notes


def test_metrics_token_key_and_path_from_values() -> None:
    """Another key and mount path; without a ServiceMonitor only the store side is rendered."""
    r = render_docs(
        {"metrics": {"tokenSecret": {"name": "scrape", "key": "bearer.txt", "mountPath": "/var/run/metrics"}}}
    )
    assert validation_problems(r.docs) == []
    assert not r.all("ServiceMonitor")
    sts = r.one("StatefulSet", "store")
    store = container(sts, "store")
    assert flags_of(store)["metrics-token-file"] == "/var/run/metrics/bearer.txt"
    assert {**_TOKEN_MOUNT, "mountPath": "/var/run/metrics"} in store["volumeMounts"]
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["metrics-token"]["secret"]["items"] == [{"key": "bearer.txt", "path": "bearer.txt"}]
    # A ServiceMonitor named explicitly in the release namespace is fine.
    r = render_docs(
        {
            "metrics": {
                "tokenSecret": {"name": "scrape", "key": "bearer.txt"},
                "serviceMonitor": {"enabled": True, "namespace": NAMESPACE},
            }
        }
    )
    (endpoint,) = r.one("ServiceMonitor", "store")["spec"]["endpoints"]
    assert endpoint["authorization"]["credentials"] == {"name": "scrape", "key": "bearer.txt"}


@pytest.mark.parametrize("case", CASES)
def test_no_gpu_by_default(rendered: dict[str, Rendered], case: str) -> None:
    sts = rendered[case].one("StatefulSet", "store")
    store = container(sts, "store")
    assert "hbm" not in flags_of(store) and "hbm-fraction" not in flags_of(store)
    assert "nvidia.com/gpu" not in store["resources"].get("limits", {})
    assert "runtimeClassName" not in sts["spec"]["template"]["spec"]


def test_gpu_store_with_hbm(tmp_path: Path) -> None:
    """A GPU store node: --hbm, an nvidia.com/gpu limit beside the computed
    memory and CPU, and the RuntimeClass of the NVIDIA runtime."""
    sizes = pytest.importorskip("kvstore.sizes", reason="the kvstore package is not importable")
    r = render_docs({"store": {"hbm": "8GiB", "gpu": {"count": 1}, "runtimeClassName": "nvidia"}})
    assert validation_problems(r.docs) == []
    sts = r.one("StatefulSet", "store")
    store = container(sts, "store")
    flags = flags_of(store)
    assert flags["hbm"] == "8GiB" and "hbm-fraction" not in flags
    resources = store["resources"]
    assert resources["limits"] == {"memory": "5Gi", "nvidia.com/gpu": 1}
    assert resources["requests"] == {"memory": "5Gi", "cpu": "2"}
    assert sts["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    cfg, _, _ = _serve_config(r, tmp_path)
    assert cfg.hbm == sizes.parse_size("8GiB") and cfg.hbm_fraction == 0.0
    assert r.notes is None or "HBM tier 8GiB" in r.notes


def test_gpu_store_with_hbm_fraction(tmp_path: Path) -> None:
    r = render_docs({"store": {"hbmFraction": 0.5, "gpu": {"count": 2}}})
    assert validation_problems(r.docs) == []
    sts = r.one("StatefulSet", "store")
    store = container(sts, "store")
    assert flags_of(store)["hbm-fraction"] == "0.5" and "hbm" not in flags_of(store)
    assert store["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert "runtimeClassName" not in sts["spec"]["template"]["spec"]
    cfg, _, _ = _serve_config(r, tmp_path)
    assert cfg.hbm == 0 and cfg.hbm_fraction == 0.5
    # hbm wins over hbmFraction, as in the store (--hbm-fraction applies when --hbm is 0).
    r = render_docs({"store": {"hbm": "4GiB", "hbmFraction": 0.5, "gpu": {"count": 1}}})
    flags = flags_of(container(r.one("StatefulSet", "store"), "store"))
    assert flags["hbm"] == "4GiB" and "hbm-fraction" not in flags


def test_gpu_without_hbm() -> None:
    """A GPU without an HBM tier (for the cuda_ipc lane): the limit only."""
    r = render_docs({"store": {"gpu": {"count": 1}}})
    store = container(r.one("StatefulSet", "store"), "store")
    assert store["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "hbm" not in flags_of(store) and "hbm-fraction" not in flags_of(store)


def test_gpu_limit_from_resources() -> None:
    """An nvidia.com/gpu limit set through store.resources also satisfies an HBM tier."""
    r = render_docs({"store": {"hbm": "8GiB", "resources": {"limits": {"nvidia.com/gpu": 1}}}})
    store = container(r.one("StatefulSet", "store"), "store")
    assert store["resources"]["limits"]["nvidia.com/gpu"] == 1 and flags_of(store)["hbm"] == "8GiB"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"store": {"ports": {"tcpLane": 7070}}}, "must be different ports"),
        ({"store": {"ports": {"tcpLane": 9090}}}, "must be different ports"),
        ({"store": {"ports": {"tcpLane": 0}}}, "/store/ports/tcpLane"),
        ({"store": {"clusterTtl": 0}}, "/store/clusterTtl"),
        ({"store": {"clusterTtl": "10s"}}, "/store/clusterTtl"),
        ({"store": {"hbm": "8GiB"}}, "set store.gpu.count"),
        ({"store": {"hbmFraction": 0.5}}, "set store.gpu.count"),
        (
            {"store": {"hbm": "8GiB", "gpu": {"count": 1}, "resources": {"limits": {"nvidia.com/gpu": 0}}}},
            "set store.gpu.count",
        ),
        ({"store": {"hbm": "8GB", "gpu": {"count": 1}}}, "/store/hbm"),
        ({"store": {"hbmFraction": 1, "gpu": {"count": 1}}}, "/store/hbmFraction"),
        ({"store": {"gpu": {"count": -1}}}, "/store/gpu/count"),
        ({"metrics": {"tokenSecret": {"name": "Bad_Name"}}}, "/metrics/tokenSecret/name"),
        ({"metrics": {"tokenSecret": {"name": "t", "key": "a/b"}}}, "/metrics/tokenSecret/key"),
        ({"metrics": {"tokenSecret": {"name": "t", "mountPath": "relative"}}}, "/metrics/tokenSecret/mountPath"),
        (
            {"metrics": {"tokenSecret": {"name": "t"}, "serviceMonitor": {"enabled": True, "namespace": "monitoring"}}},
            "needs the ServiceMonitor in the release namespace",
        ),
    ],
    ids=[
        "tcp-lane-on-grpc",
        "tcp-lane-on-metrics",
        "tcp-lane-zero",
        "cluster-ttl-zero",
        "cluster-ttl-string",
        "hbm-without-gpu",
        "hbm-fraction-without-gpu",
        "hbm-gpu-limit-zero",
        "hbm-bad-size",
        "hbm-fraction-one",
        "gpu-count-negative",
        "metrics-token-bad-name",
        "metrics-token-bad-key",
        "metrics-token-relative-path",
        "metrics-token-servicemonitor-elsewhere",
    ],
)
def test_refused_store_values(values: dict[str, Any], message: str) -> None:
    assert message in render_error(values)

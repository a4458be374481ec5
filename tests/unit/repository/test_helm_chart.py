"""The Helm chart in helm/embedfleet: render, lint and validate it offline.

The chart is rendered and linted by Helm's own Go engine through ``helm-python-sdk``
(``helm_python``), which ships ``libhelm_c.so`` in its wheel: no helm binary, no
cluster and no network. Rendered core objects are checked with
``kubernetes-validate --strict`` (schemas bundled in the wheel); the CRD objects
(KEDA ScaledObject / TriggerAuthentication, ServiceMonitor) against the minimal
JSON schemas in ``helm/embedfleet/ci/schemas``.

Install what these tests need with ``pip install -r helm/requirements-chart.txt``.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Imported, not skipped: CI installs these with the dev extra, and a chart test that silently
# skips would let a broken template land.
import helm_python as helm
import helm_python._native as helm_native
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.paths import REPO_ROOT

pytestmark = pytest.mark.chart

REPO = REPO_ROOT
CHART_DIR = REPO / "helm" / "embedfleet"
CI_DIR = CHART_DIR / "ci"
CRD_SCHEMA_DIR = CI_DIR / "schemas"

# Kubernetes version the rendered objects are validated against (bundled offline in
# kubernetes-validate) and that `helm lint` checks the chart's kubeVersion against.
KUBE_VERSION = "1.33.0"
RELEASE = "ef"
# The API group/version a cluster with KEDA serves (what `.Capabilities.APIVersions.Has` asks)
KEDA_API = "keda.sh/v1alpha1"
WITH_KEDA = (KEDA_API,)
K8S_NAMESPACE = "ml"

EXPECTED_CI_FILES = {
    "default-values.yaml",
    "gpu-values.yaml",
    "gpu-replicas-values.yaml",
    "keda-values.yaml",
    "no-keda-hpa-values.yaml",
    "query-workers-values.yaml",
    "existing-secret-values.yaml",
}

# Kinds validated by kubernetes-validate; anything else must have a CRD schema below,
# so that no rendered object escapes validation.
CORE_KINDS = {
    "ConfigMap",
    "Secret",
    "ServiceAccount",
    "Deployment",
    "Service",
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
    "Ingress",  # the gateway's (optional)
    "PersistentVolumeClaim",  # the gateway's files volume
}
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject_v1alpha1.json",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "triggerauthentication_v1alpha1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor_v1.json",
}


# --------------------------------------------------------------------------- helpers


@dataclass
class Rendered:
    """The parsed output of one chart render."""

    docs: list[dict[str, Any]]
    notes: str
    raw: dict[str, str] = field(repr=False)

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [d for d in self.all(kind) if name is None or d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
        return found[0]

    def of_component(self, kind: str, component: str) -> dict[str, Any]:
        """The one ``kind`` object labelled with ``component`` (app.kubernetes.io/component)."""
        found = [
            d
            for d in self.all(kind)
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == component
        ]
        assert len(found) == 1, f"expected one {component} {kind}, found {len(found)}"
        return found[0]

    def deployment(self, component: str) -> dict[str, Any]:
        return self.of_component("Deployment", component)

    def scaled_object(self, component: str) -> dict[str, Any]:
        return self.of_component("ScaledObject", component)

    def config(self) -> dict[str, str]:
        return self.one("ConfigMap")["data"]


def assert_entries(mapping: dict[str, Any], expected: dict[str, Any]) -> None:
    """``mapping`` holds every entry of ``expected`` (compared whole: a failure shows each
    difference at once)."""
    assert {key: mapping.get(key) for key in expected} == expected


def render(
    values: dict[str, Any] | None = None,
    *,
    chart_dir: Path = CHART_DIR,
    release: str = RELEASE,
    namespace: str = K8S_NAMESPACE,
    api_versions: tuple[str, ...] = WITH_KEDA,
) -> Rendered:
    """Render the chart like `helm template --kube-version … --api-versions …` and parse every
    manifest. By default the cluster serves KEDA's API, as the chart's KEDA defaults assume;
    ``api_versions=()`` renders for a cluster without it.

    Raises the engine's ``helm_python.HelmError`` subclasses (schema violations,
    template syntax errors, ``fail``/``required``) and ``yaml.YAMLError`` when a
    template renders text that is not YAML.
    """
    # helm-python-sdk's Chart.render does not expose `--api-versions`; its engine's render call
    # takes them in the same options object (Helm's own InstallOptions field names).
    opts = {
        "name": release,
        "namespace": namespace,
        "kube_version": f"v{KUBE_VERSION}",
        "api_versions": list(api_versions),
    }
    with helm.Chart.load(chart_dir) as chart:
        raw = json.loads(
            helm_native.call_string(
                "helm_render",
                chart._raw(),
                None if values is None else json.dumps(values),
                json.dumps(opts),
            )
        )
    docs: list[dict[str, Any]] = []
    notes = ""
    for path in sorted(raw):
        text = raw[path]
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc is None:
                continue
            assert isinstance(doc, dict), f"{path}: rendered a non-mapping document"
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), f"{path}: not an object"
            docs.append(doc)
    return Rendered(docs=docs, notes=notes, raw=raw)


def lint_problems(values: dict[str, Any] | None = None, chart_dir: Path = CHART_DIR) -> list[str]:
    """`helm lint --strict`: every warning or error, as text (empty when clean)."""
    report = helm.lint(
        chart_dir,
        values,
        strict=True,
        namespace=K8S_NAMESPACE,
        kube_version=f"v{KUBE_VERSION}",
    )
    problems = [f"{m['path']}: {m['error']}" for m in report["messages"] if int(m["severity"]) >= 2]
    problems += [e for e in report["errors"] if not any(e in p for p in problems)]
    return problems


def load_ci_values(name: str) -> dict[str, Any]:
    """A ci/*-values.yaml file, parsed by Helm's own values reader."""
    return helm.values_from_yaml((CI_DIR / name).read_text())


def _crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    schema = json.loads((CRD_SCHEMA_DIR / CRD_SCHEMAS[(api_version, kind)]).read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def validate_objects(rendered: Rendered) -> None:
    """Validate every rendered object: core kinds strictly, CRDs against ci/schemas."""
    for doc in rendered.docs:
        key = (doc["apiVersion"], doc["kind"])
        where = f"{doc['kind']}/{doc['metadata'].get('name')}"
        if key in CRD_SCHEMAS:
            errors = sorted(
                _crd_validator(*key).iter_errors(doc), key=lambda e: list(e.absolute_path)
            )
            assert not errors, f"{where}: " + "; ".join(
                f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors
            )
            if doc["kind"] == "ScaledObject":
                spec = doc["spec"]
                assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100), where
        else:
            assert doc["kind"] in CORE_KINDS, f"{where}: no schema to validate it against"
            try:
                kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
            except kubernetes_validate.ValidationError as err:
                path = "/".join(map(str, err.absolute_path))
                pytest.fail(f"{where}: {path}: {err.message}")


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env_of(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container(deployment).get("env", [])}


def gpu_resources(deployment: dict[str, Any]) -> dict[str, Any]:
    """Every resource request/limit whose name mentions a GPU."""
    resources = container(deployment).get("resources", {})
    return {
        f"{section}.{name}": qty
        for section in ("requests", "limits")
        for name, qty in resources.get(section, {}).items()
        if "gpu" in name
    }


def trigger(scaled_object: dict[str, Any], stream: str = "ingest") -> dict[str, Any]:
    """The redis-streams lag trigger of a ScaledObject on the ingest or the query stream."""
    triggers = scaled_object["spec"]["triggers"]
    assert all(t["type"] == "redis-streams" for t in triggers)
    found = [t for t in triggers if t["name"] == f"{stream}-lag"]
    assert len(found) == 1, f"no {stream}-lag trigger in {scaled_object['metadata']['name']}"
    return found[0]


def secret_value(rendered: Rendered, name: str, key: str) -> str:
    secret = rendered.one("Secret", name)
    return base64.b64decode(secret["data"][key]).decode()


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


# --------------------------------------------------------------------------- fixtures

CASES = ["chart-defaults", *sorted(EXPECTED_CI_FILES)]


@pytest.fixture(scope="module")
def rendered_cases() -> dict[str, Rendered]:
    cases: dict[str, Rendered] = {"chart-defaults": render()}
    for name in sorted(EXPECTED_CI_FILES):
        cases[name] = render(load_ci_values(name))
    return cases


@pytest.fixture(scope="module")
def chart_values() -> dict[str, Any]:
    with helm.Chart.load(CHART_DIR) as chart:
        return chart.values


# --------------------------------------------------------------------------- the engine


def test_engine_is_the_bundled_helm_library() -> None:
    """helm-python-sdk binds a shared library from its own wheel (nothing downloaded)."""
    lib = Path(helm.library_path)
    assert lib.is_file()
    if not os.environ.get("HELM_C_LIB"):  # the package's own override
        assert Path(helm.__file__).resolve().parent in lib.resolve().parents
    assert re.match(r"v?\d+\.\d+", helm.helm_sdk_version())


def test_ci_value_sets_exist() -> None:
    found = {p.name for p in CI_DIR.glob("*-values.yaml")}
    assert found >= EXPECTED_CI_FILES, f"missing: {EXPECTED_CI_FILES - found}"


# --------------------------------------------------------------------------- every value set


@pytest.mark.parametrize("case", CASES)
def test_lint_strict(case: str) -> None:
    values = None if case == "chart-defaults" else load_ci_values(case)
    assert lint_problems(values) == []


@pytest.mark.parametrize("case", CASES)
def test_rendered_objects_are_valid(case: str, rendered_cases: dict[str, Rendered]) -> None:
    validate_objects(rendered_cases[case])


@pytest.mark.parametrize("case", CASES)
def test_every_case_has_the_essentials(case: str, rendered_cases: dict[str, Rendered]) -> None:
    r = rendered_cases[case]
    worker = r.deployment("worker")
    c = container(worker)
    pod = worker["spec"]["template"]["spec"]
    config = r.config()

    assert c["command"] == ["embedfleet", "worker"]
    assert "--query-only" not in c["command"] + c.get("args", [])

    # probes on the named health port
    port = int(config["EMBEDFLEET_HEALTH_PORT"])
    assert {"name": "http", "containerPort": port, "protocol": "TCP"} in c["ports"]
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "too short for a model"

    # the drain fits in the grace period
    drain = int(config["EMBEDFLEET_DRAIN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] > drain

    # settings from the ConfigMap, the URL from a Secret
    assert {"configMapRef": {"name": r.one("ConfigMap")["metadata"]["name"]}} in c["envFrom"]
    assert all(k.startswith("EMBEDFLEET_") for k in config)
    assert "EMBEDFLEET_REDIS_URL" not in config
    url_ref = env_of(worker)["EMBEDFLEET_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert url_ref["name"] and url_ref["key"]

    # hardened pod, with writable /tmp and model cache
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    hf_home = env_of(worker)["HF_HOME"]["value"]
    cache_mount = next(p for p in mounts if hf_home.startswith(p + "/") or hf_home == p)
    assert "emptyDir" in volumes[mounts[cache_mount]]

    # operators can find the backlog
    for word in ("XLEN", "XINFO GROUPS", "XPENDING", "embedfleet status"):
        assert word in r.notes

    # each PDB covers exactly one worker Deployment; the metrics Service selects worker pods
    pod_labels = worker["spec"]["template"]["metadata"]["labels"]
    pdbs = r.all("PodDisruptionBudget")
    assert len(pdbs) == len(r.all("Deployment"))
    for pdb in pdbs:
        selector = pdb["spec"]["selector"]["matchLabels"].items()
        covered = [
            d
            for d in r.all("Deployment")
            if selector <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(covered) == 1, pdb["metadata"]["name"]
    service = r.one("Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"


# --------------------------------------------------------------------------- defaults


def test_defaults(rendered_cases: dict[str, Rendered], chart_values: dict[str, Any]) -> None:
    r = rendered_cases["chart-defaults"]
    worker = r.deployment("worker")
    pod = worker["spec"]["template"]["spec"]

    assert gpu_resources(worker) == {}, "no GPU unless asked"
    assert "tolerations" not in pod
    assert "runtimeClassName" not in pod
    assert "replicas" not in worker["spec"], "KEDA owns the replica count"

    config = r.config()
    assert_entries(
        config,
        {
            "EMBEDFLEET_NAMESPACE": "embedfleet",
            "EMBEDFLEET_GROUP": "workers",
            "EMBEDFLEET_HEALTH_PORT": "9400",
            "EMBEDFLEET_DRAIN_TIMEOUT_S": "60",
        },
    )
    assert (
        pod["terminationGracePeriodSeconds"] == 60 + chart_values["terminationGraceMarginSeconds"]
    )

    # chart-created Secret holds the URL
    ref = env_of(worker)["EMBEDFLEET_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert secret_value(r, ref["name"], ref["key"]) == chart_values["redis"]["url"]

    so = r.scaled_object("worker")
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    assert so["spec"]["scaleTargetRef"]["name"] == worker["metadata"]["name"]
    assert so["spec"]["minReplicaCount"] == 0, "bulk workers scale to zero"
    md = trigger(so)["metadata"]
    assert_entries(
        md,
        {
            "stream": "embedfleet:ingest",
            "consumerGroup": "workers",
            "lagCount": "5000",
            "activationLagCount": "0",
            "address": "redis-master:6379",
            "databaseIndex": "0",
        },
    )
    assert "enableTLS" not in md
    assert "authenticationRef" not in trigger(so), "no password, no TriggerAuthentication"
    # without query workers a query wakes the bulk fleet from zero
    query_md = trigger(so, "query")["metadata"]
    assert query_md["stream"] == "embedfleet:query"
    assert query_md["consumerGroup"] == "workers"
    assert (query_md["lagCount"], query_md["activationLagCount"]) == ("50", "0")
    assert r.all("TriggerAuthentication") == []
    assert r.all("HorizontalPodAutoscaler") == []
    assert r.all("ServiceMonitor") == []
    with pytest.raises(AssertionError):
        r.deployment("query-worker")


# --------------------------------------------------------------------------- image


def _makefile_image() -> str:
    """The repository and version `make image` tags (Makefile's IMAGE, pyproject's version)."""
    makefile = (REPO / "Makefile").read_text()
    repository = re.search(r"^IMAGE \?= (\S+)$", makefile, re.MULTILINE)
    version = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert repository and version
    return f"{repository.group(1)}:{version.group(1)}"


def test_default_image_is_what_make_image_tags(rendered_cases: dict[str, Rendered]) -> None:
    r = rendered_cases["chart-defaults"]
    assert container(r.deployment("worker"))["image"] == _makefile_image()


def test_cuda_variant_is_one_value_away(rendered_cases: dict[str, Rendered]) -> None:
    assert container(rendered_cases["gpu-values.yaml"].deployment("worker"))["image"] == (
        _makefile_image() + "-cuda"
    )
    explicit = render({"image": {"variant": "cuda", "tag": "v9"}})
    assert container(explicit.deployment("worker"))["image"].endswith(":v9"), "a tag wins"


def test_pods_fit_the_image(rendered_cases: dict[str, Rendered]) -> None:
    """The Dockerfile's non-root uid, a read-only root and a writable /tmp, as the image expects."""
    dockerfile = (REPO / "Dockerfile").read_text()
    uid = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.MULTILINE)
    assert uid, "the image runs as a fixed uid"
    image_env = dict(re.findall(r"^\s+(HOME|TMPDIR)=(\S+)", dockerfile, re.MULTILINE))
    assert image_env == {"HOME": "/tmp", "TMPDIR": "/tmp"}
    for case in ("chart-defaults", "gpu-values.yaml", "query-workers-values.yaml"):
        r = rendered_cases[case]
        for deployment in r.all("Deployment"):
            pod = deployment["spec"]["template"]["spec"]
            worker = pod["containers"][0]
            assert pod["securityContext"]["runAsUser"] == int(uid.group(1))
            assert pod["securityContext"]["runAsGroup"] == int(uid.group(2))
            assert worker["securityContext"]["readOnlyRootFilesystem"] is True
            mounts = {m["mountPath"]: m["name"] for m in worker["volumeMounts"]}
            assert mounts["/tmp"] == "tmp"
            assert {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"]


def test_chart_app_version_is_the_package_version() -> None:
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert _makefile_image().endswith(":" + chart["appVersion"])


# --------------------------------------------------------------------------- GPU


def test_gpu_values(rendered_cases: dict[str, Rendered]) -> None:
    r = rendered_cases["gpu-values.yaml"]
    worker = r.deployment("worker")
    pod = worker["spec"]["template"]["spec"]
    assert gpu_resources(worker) == {"requests.nvidia.com/gpu": 1, "limits.nvidia.com/gpu": 1}
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    config = r.config()
    assert config["EMBEDFLEET_DEVICE"] == "cuda"
    assert config["EMBEDFLEET_DTYPE"] == "float16"
    # all three batching budgets for a GPU (the worker's defaults are the CPU's)
    assert config["EMBEDFLEET_TOKEN_BUDGET"] == "131072"
    assert config["EMBEDFLEET_MAX_BATCH"] == "1024"
    assert config["EMBEDFLEET_READ_COUNT"] == "8192"

    # the model PVC is mounted read-only and becomes EMBEDFLEET_MODEL
    mount = next(m for m in container(worker)["volumeMounts"] if m["name"] == "model")
    assert mount["readOnly"] is True
    assert mount["subPath"] == "all-MiniLM-L6-v2"
    assert config["EMBEDFLEET_MODEL"] == mount["mountPath"] == "/models/all-MiniLM-L6-v2"
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": "embedding-models", "readOnly": True}

    # a longer drain gets a longer grace period
    assert config["EMBEDFLEET_DRAIN_TIMEOUT_S"] == "120"
    assert pod["terminationGracePeriodSeconds"] >= 120


def test_gpu_resource_type_and_count_are_configurable() -> None:
    r = render(
        {
            "gpu": {
                "enabled": True,
                "count": 2,
                "resourceName": "amd.com/gpu",
                "tolerateTaint": False,
            }
        }
    )
    worker = r.deployment("worker")
    assert gpu_resources(worker) == {"requests.amd.com/gpu": 2, "limits.amd.com/gpu": 2}
    assert "tolerations" not in worker["spec"]["template"]["spec"]
    validate_objects(r)


def test_model_replicas_share_the_pods_gpu(rendered_cases: dict[str, Rendered]) -> None:
    r = rendered_cases["gpu-replicas-values.yaml"]
    worker = r.deployment("worker")
    assert gpu_resources(worker) == {"requests.nvidia.com/gpu": 1, "limits.nvidia.com/gpu": 1}
    assert env_of(worker)["EMBEDFLEET_REPLICAS"]["value"] == "8"
    assert r.config()["EMBEDFLEET_GPU_MEMORY_FRACTION"] == "-1", "auto: 1/8 each"
    # a health/metrics port per replica, where the worker opens them (HEALTH_PORT + i)
    expected = [("http", 9400)] + [(f"http-r{i}", 9400 + i) for i in range(1, 8)]
    assert [(p["name"], p["containerPort"]) for p in container(worker)["ports"]] == expected
    assert container(worker)["readinessProbe"]["httpGet"]["port"] == "http"
    service = r.one("Service", f"{RELEASE}-embedfleet-metrics")
    assert [(p["name"], p["targetPort"]) for p in service["spec"]["ports"]] == [
        (name, name) for name, _ in expected
    ]
    monitor = r.one("ServiceMonitor")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [name for name, _ in expected]

    # always set: the worker's own default (auto) would size a GPU pod from the node's cores,
    # past the ports the chart declares
    single = rendered_cases["gpu-values.yaml"]
    assert env_of(single.deployment("worker"))["EMBEDFLEET_REPLICAS"]["value"] == "1"
    assert [p["name"] for p in container(single.deployment("worker"))["ports"]] == ["http"]
    # query workers run one replica, whatever the bulk pods do
    both = render({"modelReplicas": 4, "queryWorkers": {"enabled": True}})
    assert env_of(both.deployment("query-worker"))["EMBEDFLEET_REPLICAS"]["value"] == "1"
    assert env_of(both.deployment("worker"))["EMBEDFLEET_REPLICAS"]["value"] == "4"
    validate_objects(both)


def test_gpu_disabled_means_no_gpu_anywhere() -> None:
    r = render({"gpu": {"enabled": False}, "queryWorkers": {"enabled": True}})
    for component in ("worker", "query-worker"):
        assert gpu_resources(r.deployment(component)) == {}


# --------------------------------------------------------------------------- KEDA


def test_keda_values(rendered_cases: dict[str, Rendered]) -> None:
    r = rendered_cases["keda-values.yaml"]
    so = r.scaled_object("worker")
    t = trigger(so)
    md = t["metadata"]
    assert_entries(
        md,
        {
            "stream": "{prod}:ingest",  # the stream follows config.NAMESPACE
            "consumerGroup": "bulk",
            "lagCount": "20000",
            "activationLagCount": "10",
            "address": "redis.data.svc.cluster.local:6380",
            "databaseIndex": "0",
        },
    )
    assert md["enableTLS"] == "true", "rediss:// turns TLS on"
    spec = so["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 32)
    assert spec["fallback"] == {"failureThreshold": 3, "replicas": 2}
    assert (
        spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
            "stabilizationWindowSeconds"
        ]
        == 300
    )

    # credentials reach KEDA through a TriggerAuthentication reading the chart's Secret
    ta = r.one("TriggerAuthentication")
    assert t["authenticationRef"]["name"] == ta["metadata"]["name"]
    refs = {ref["parameter"]: ref for ref in ta["spec"]["secretTargetRef"]}
    assert secret_value(r, refs["password"]["name"], refs["password"]["key"]) == "s3cret"
    assert secret_value(r, refs["username"]["name"], refs["username"]["key"]) == "embedfleet"
    assert "s3cret" not in json.dumps(so) + json.dumps(ta)
    query_trigger = trigger(so, "query")
    assert query_trigger["metadata"]["stream"] == "{prod}:query"
    assert query_trigger["metadata"]["enableTLS"] == "true"
    assert query_trigger["authenticationRef"] == t["authenticationRef"]

    config = r.config()
    assert config["EMBEDFLEET_NAMESPACE"] == "{prod}"
    assert config["EMBEDFLEET_GROUP"] == "bulk"
    assert "'{prod}:ingest'" in r.notes

    sm = r.one("ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    service = r.one("Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()


@pytest.mark.parametrize("namespace", ["embedfleet", "tenant-a", "{emb}"])
def test_lag_trigger_follows_the_namespace_and_group(namespace: str) -> None:
    r = render(
        {"config": {"NAMESPACE": namespace, "GROUP": "g1"}, "queryWorkers": {"enabled": True}}
    )
    assert trigger(r.scaled_object("worker"))["metadata"]["stream"] == f"{namespace}:ingest"
    query_trigger = trigger(r.scaled_object("query-worker"), "query")
    assert query_trigger["metadata"]["stream"] == f"{namespace}:query"
    assert trigger(r.scaled_object("worker"))["metadata"]["consumerGroup"] == "g1"
    assert query_trigger["metadata"]["consumerGroup"] == "g1"
    assert r.config()["EMBEDFLEET_NAMESPACE"] == namespace


def test_partition_tag_table_is_current() -> None:
    from embedfleet.shared.keys import chart_tag_table

    assert (CHART_DIR / "files" / "partition-tags.json").read_text() == chart_tag_table(), (
        "regenerate it: python -m embedfleet.shared.keys"
        " > helm/embedfleet/files/partition-tags.json"
    )


def test_partitions_get_one_lag_trigger_each_summed() -> None:
    from embedfleet.shared.keys import Keys

    r = render({"partitions": 6, "keda": {"lagCount": 2000, "queryLagCount": 20}})
    so = r.scaled_object("worker")
    triggers = so["spec"]["triggers"]
    keys = Keys(partitions=6)
    assert [t["name"] for t in triggers] == [f"p{i}" for i in range(6)] + ["interactive", "query"]
    assert [t["metadata"]["stream"] for t in triggers] == [
        *(p.ingest for p in keys.partitions_keys),
        keys.priority_streams.interactive,
        keys.priority_streams.query,
    ], "the chart's streams are the ones shared/keys.py names"
    assert all(t["type"] == "redis-streams" for t in triggers)
    modifiers = so["spec"]["advanced"]["scalingModifiers"]
    assert modifiers == {
        "formula": "p0 + p1 + p2 + p3 + p4 + p5 + interactive + query * 100",
        "target": "2000",
        "activationTarget": "0",
        "metricType": "AverageValue",
    }
    assert r.config()["EMBEDFLEET_PARTITIONS"] == "6"
    validate_objects(r)


def test_cluster_uses_the_cluster_streams_scaler() -> None:
    r = render(
        {
            "partitions": 3,
            "redis": {"cluster": True, "url": "redis://:pw@redis-cluster.data:6379/0"},
            "queryWorkers": {"enabled": True},
        }
    )
    bulk = r.scaled_object("worker")["spec"]
    assert {t["type"] for t in bulk["triggers"]} == {"redis-cluster-streams"}
    assert [t["name"] for t in bulk["triggers"]] == ["p0", "p1", "p2", "interactive"]
    assert bulk["advanced"]["scalingModifiers"]["formula"] == "p0 + p1 + p2 + interactive"
    for t in bulk["triggers"]:
        assert t["metadata"]["addresses"] == "redis-cluster.data:6379"
        assert "address" not in t["metadata"] and "databaseIndex" not in t["metadata"]
    query = r.scaled_object("query-worker")["spec"]["triggers"]
    assert [(t["type"], t["metadata"]["stream"]) for t in query] == [
        ("redis-cluster-streams", "embedfleet:{q}:query")
    ]
    config = r.config()
    assert (config["EMBEDFLEET_PARTITIONS"], config["EMBEDFLEET_REDIS_CLUSTER"]) == ("3", "true")
    validate_objects(r)


def test_one_partition_renders_as_before() -> None:
    plain, explicit = render(), render({"partitions": 1})
    assert plain.scaled_object("worker") == explicit.scaled_object("worker")
    assert "advanced" not in plain.scaled_object("worker")["spec"]
    assert "EMBEDFLEET_PARTITIONS" not in plain.config()


def test_partitions_refuse_a_hash_tag_in_the_namespace() -> None:
    with pytest.raises(helm.HelmError, match="must not hold a hash tag"):
        render({"partitions": 2, "config": {"NAMESPACE": "{emb}"}})


def test_redis_url_parsing_for_keda() -> None:
    r = render({"redis": {"url": "redis://:pw@redis.example:7000/3"}})
    md = trigger(r.scaled_object("worker"))["metadata"]
    assert md["address"] == "redis.example:7000"
    assert md["databaseIndex"] == "3"
    ta = r.one("TriggerAuthentication")
    assert [ref["parameter"] for ref in ta["spec"]["secretTargetRef"]] == ["password"]

    # no port: Redis's default; explicit tls flag on a redis:// URL; explicit address wins
    r = render({"redis": {"url": "redis://cache", "tls": True, "tlsInsecureSkipVerify": True}})
    md = trigger(r.scaled_object("worker"))["metadata"]
    assert md["address"] == "cache:6379"
    assert "databaseIndex" not in md
    assert (md["enableTLS"], md["unsafeSsl"]) == ("true", "true")
    r = render({"redis": {"address": "proxy:6000", "database": 5}})
    md = trigger(r.scaled_object("worker"))["metadata"]
    assert (md["address"], md["databaseIndex"]) == ("proxy:6000", "5")


# --------------------------------------------------------------------------- HPA


def test_no_keda_hpa_values(rendered_cases: dict[str, Rendered]) -> None:
    r = rendered_cases["no-keda-hpa-values.yaml"]
    assert r.all("ScaledObject") == []
    assert r.all("TriggerAuthentication") == []
    hpas = {d["spec"]["scaleTargetRef"]["name"]: d for d in r.all("HorizontalPodAutoscaler")}
    worker = r.deployment("worker")
    query = r.deployment("query-worker")
    assert set(hpas) == {worker["metadata"]["name"], query["metadata"]["name"]}
    assert hpas[worker["metadata"]["name"]]["apiVersion"] == "autoscaling/v2"
    assert hpas[worker["metadata"]["name"]]["spec"]["minReplicas"] == 2
    assert hpas[query["metadata"]["name"]]["spec"]["minReplicas"] >= 1
    metric = hpas[worker["metadata"]["name"]]["spec"]["metrics"][0]
    assert metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["averageUtilization"] == 60
    assert "replicas" not in worker["spec"]
    assert (
        r.one("PodDisruptionBudget", worker["metadata"]["name"])["spec"]["maxUnavailable"] == "25%"
    )


def test_no_autoscaler_uses_fixed_replicas() -> None:
    r = render({"keda": {"enabled": False}, "replicaCount": 3, "queryWorkers": {"enabled": True}})
    assert r.deployment("worker")["spec"]["replicas"] == 3
    assert r.deployment("query-worker")["spec"]["replicas"] >= 1
    assert r.all("HorizontalPodAutoscaler") == [] == r.all("ScaledObject")


def test_hpa_is_ignored_while_keda_is_on() -> None:
    r = render({"autoscaling": {"hpa": {"enabled": True}}})
    assert r.all("HorizontalPodAutoscaler") == []
    assert len(r.all("ScaledObject")) == 1


# --------------------------------------------------------------------------- query workers


def test_query_workers_values(rendered_cases: dict[str, Rendered]) -> None:
    r = rendered_cases["query-workers-values.yaml"]
    bulk = r.deployment("worker")
    query = r.deployment("query-worker")
    assert container(query)["command"] == ["embedfleet", "worker", "--query-only"]
    assert "--query-only" not in container(bulk)["command"]
    assert bulk["metadata"]["name"] != query["metadata"]["name"]
    assert bulk["spec"]["selector"]["matchLabels"] != query["spec"]["selector"]["matchLabels"], (
        "the two Deployments must not adopt each other's pods"
    )

    # bulk on GPU, query workers on CPU (queryWorkers.gpu.enabled=false overrides gpu)
    assert gpu_resources(bulk) == {"requests.nvidia.com/gpu": 1, "limits.nvidia.com/gpu": 1}
    assert gpu_resources(query) == {}
    assert container(query)["resources"]["requests"]["cpu"] == "2"
    assert "tolerations" not in query["spec"]["template"]["spec"]
    assert env_of(query)["OMP_NUM_THREADS"]["value"] == "2"

    so = r.scaled_object("query-worker")
    assert so["spec"]["scaleTargetRef"]["name"] == query["metadata"]["name"]
    assert so["spec"]["minReplicaCount"] >= 1, "queries are never left without a worker"
    assert so["spec"]["maxReplicaCount"] == 6
    assert [t["name"] for t in so["spec"]["triggers"]] == ["query-lag"]
    md = trigger(so, "query")["metadata"]
    assert md["stream"] == "embedfleet:query"
    assert md["consumerGroup"] == "workers"
    assert md["lagCount"] == "20"
    bulk_so = r.scaled_object("worker")
    assert bulk_so["spec"]["minReplicaCount"] == 0
    assert [t["name"] for t in bulk_so["spec"]["triggers"]] == ["ingest-lag", "interactive-lag"], (
        "with query workers, queries do not wake the bulk fleet (large requests do: bulk "
        "workers read the interactive stream)"
    )
    assert len(r.all("PodDisruptionBudget")) == 2


def test_query_worker_minimum_is_at_least_one() -> None:
    with pytest.raises(helm.HelmValuesError):
        render({"queryWorkers": {"enabled": True, "keda": {"minReplicaCount": 0}}})
    with pytest.raises(helm.HelmValuesError):
        render({"queryWorkers": {"enabled": True, "replicaCount": 0}})


# --------------------------------------------------------------------------- secrets


def test_existing_secret_values(rendered_cases: dict[str, Rendered]) -> None:
    r = rendered_cases["existing-secret-values.yaml"]
    assert r.all("Secret") == [], "the chart must not create a Secret"
    worker = r.deployment("worker")
    env = env_of(worker)
    assert env["EMBEDFLEET_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-credentials",
        "key": "url",
    }
    assert env["REDIS_ADDRESS"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-credentials",
        "key": "address",
    }
    md = trigger(r.scaled_object("worker"))["metadata"]
    assert md["addressFromEnv"] == "REDIS_ADDRESS"
    assert "address" not in md
    assert md["databaseIndex"] == "2"
    assert md["enableTLS"] == "true"
    ta = r.one("TriggerAuthentication")
    assert ta["spec"]["secretTargetRef"] == [
        {"parameter": "password", "name": "redis-credentials", "key": "password"}
    ]
    assert "checksum/secret" not in worker["spec"]["template"]["metadata"]["annotations"]
    assert "redis-credentials" in r.notes

    # no ServiceAccount created, the named one used
    assert r.all("ServiceAccount") == []
    assert worker["spec"]["template"]["spec"]["serviceAccountName"] == "embedfleet-workers"

    # hostPath model, read-only
    pod = worker["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume["hostPath"] == {"path": "/mnt/models/bge-small-en-v1.5", "type": "Directory"}
    mount = next(m for m in container(worker)["volumeMounts"] if m["name"] == "model")
    assert mount["readOnly"] is True
    assert r.config()["EMBEDFLEET_MODEL"] == "/models/bge-small-en-v1.5"


# --------------------------------------------------------------------------- settings


def test_config_map_rendering() -> None:
    r = render(
        {
            "config": {
                "TOKEN_BUDGET": 1048576,
                "READ_COUNT": 4096,
                "SLICE_MS": 12.5,
                "MODEL": "BAAI/bge-small-en-v1.5",
                "LOG_FORMAT": "console",
                "SOME_FUTURE_SETTING": True,
                "THREADS": None,
            },
            "drainTimeoutSeconds": 300,
            "extraEnv": [{"name": "TOKENIZERS_PARALLELISM", "value": "false"}],
            "extraArgs": ["--extra"],
        }
    )
    config = r.config()
    assert_entries(
        config,
        {
            "EMBEDFLEET_TOKEN_BUDGET": "1048576",  # no float formatting of big ints
            "EMBEDFLEET_READ_COUNT": "4096",
            "EMBEDFLEET_SLICE_MS": "12.5",
            "EMBEDFLEET_MODEL": "BAAI/bge-small-en-v1.5",
            "EMBEDFLEET_LOG_FORMAT": "console",
            "EMBEDFLEET_SOME_FUTURE_SETTING": "true",
            "EMBEDFLEET_DRAIN_TIMEOUT_S": "300",
        },
    )
    assert "EMBEDFLEET_THREADS" not in config
    worker = r.deployment("worker")
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 300
    assert env_of(worker)["TOKENIZERS_PARALLELISM"]["value"] == "false"
    assert container(worker)["args"] == ["--extra"]
    validate_objects(r)


def test_health_port_setting_moves_the_probes() -> None:
    r = render({"config": {"HEALTH_PORT": 9500}})
    c = container(r.deployment("worker"))
    assert c["ports"][0] == {"name": "http", "containerPort": 9500, "protocol": "TCP"}
    assert r.config()["EMBEDFLEET_HEALTH_PORT"] == "9500"
    assert c["startupProbe"]["httpGet"]["port"] == "http"


@pytest.mark.parametrize(("drain", "margin"), [(1, 0), (60, 30), (900, 15)])
def test_grace_period_covers_the_drain(drain: int, margin: int) -> None:
    r = render({"drainTimeoutSeconds": drain, "terminationGraceMarginSeconds": margin})
    pod = r.deployment("worker")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == drain + margin >= drain
    assert r.config()["EMBEDFLEET_DRAIN_TIMEOUT_S"] == str(drain)


# --------------------------------------------------------------------------- rejections


@pytest.mark.parametrize(
    "values",
    [
        {"replicas": 2},  # typo of replicaCount
        {"Gpu": {"enabled": True}},
        {"gpu": {"enabeld": True}},
        {"gpu": {"count": 0}},
        {"keda": {"lagcount": 10}},
        {"config": {"dtype": "float16"}},  # keys are upper case
        {"config": {"EMBEDFLEET_DTYPE": "float16"}},  # ... and without the prefix
        {"config": {"DTYPE": "fp8"}},
        {"config": {"DEVICE": "tpu"}},
        {"config": {"LOG_FORMAT": "xml"}},
        {"config": {"REDIS_URL": "redis://x"}},  # secrets never go to the ConfigMap
        {"config": {"CONSUMER": "w1"}},  # one name for every pod would break the group
        {"config": {"THREADS": -1}},
        {"config": {"HEALTH_PORT": 70000}},
        {"redis": {"url": "http://redis:6379"}},
        {"redis": {"existingSecrett": "x"}},
        {"drainTimeoutSeconds": "60"},
        {"modelVolume": {"type": "nfs"}},
        {"modelReplicas": 0},
        {"config": {"REPLICAS": 4}},  # from modelReplicas, with a port per replica
        {"config": {"GPU_MEMORY_FRACTION": 2}},
        {"config": {"CUDA_QUERY_LANE": "fast"}},
        {"models": [{"name": "code"}]},  # a model needs its model
        {"models": [{"name": "a:b", "model": "/m"}]},  # not a lane name: ':' forges keys
        {"models": [{"name": "code", "model": "/m", "replicas": 2}]},  # replicaCount
        {"models": [{"name": "code", "model": "/m", "device": "tpu"}]},
    ],
    ids=lambda v: json.dumps(v, sort_keys=True),
)
def test_schema_rejects_bad_values(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render(values)
    assert lint_problems(values), "helm lint must report it too"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"redis": {"url": ""}}, "redis.url"),
        ({"redis": {"existingSecret": "creds"}}, "redis.address"),
        ({"modelVolume": {"enabled": True, "type": "pvc"}}, "modelVolume.claimName"),
        ({"modelVolume": {"enabled": True, "type": "hostPath"}}, "modelVolume.hostPath"),
        (
            {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
            "metrics.service.enabled",
        ),
        ({"modelReplicas": 2, "gpu": {"enabled": True, "count": 2}}, "set gpu.count to 1"),
        (
            {"models": [{"name": "Code", "model": "/a"}, {"name": "code", "model": "/b"}]},
            "both make the Deployment name",
        ),
        ({"models": [{"name": "code", "model": "/m", "config": {"MODEL": "/x"}}]}, "MODEL"),
    ],
)
def test_incomplete_values_fail_with_a_clear_message(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)


def test_existing_secret_without_keda_needs_no_address() -> None:
    r = render({"redis": {"existingSecret": "creds"}, "keda": {"enabled": False}})
    assert r.all("Secret") == []
    ref = env_of(r.deployment("worker"))["EMBEDFLEET_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "creds", "key": "redis-url"}


# --------------------------------------------------------------------------- broken chart


@pytest.fixture
def chart_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "embedfleet"
    shutil.copytree(CHART_DIR, dst)
    return dst


def test_render_helper_raises_on_a_template_syntax_error(chart_copy: Path) -> None:
    template = chart_copy / "templates" / "deployment.yaml"
    template.write_text(template.read_text() + "\n{{ if .Values.gpu.enabled }}\n")
    with pytest.raises(helm.HelmRenderError, match=r"deployment\.yaml"):
        render(chart_dir=chart_copy)
    assert any("deployment.yaml" in p for p in lint_problems(chart_dir=chart_copy))


def test_render_helper_raises_on_an_unknown_function(chart_copy: Path) -> None:
    template = chart_copy / "templates" / "configmap.yaml"
    template.write_text(template.read_text() + "\n  X: {{ .Values.image.tag | nosuchfunc }}\n")
    with pytest.raises(helm.HelmRenderError, match="nosuchfunc"):
        render(chart_dir=chart_copy)


def test_render_helper_raises_on_invalid_yaml_output(chart_copy: Path) -> None:
    template = chart_copy / "templates" / "service.yaml"
    template.write_text(template.read_text() + "\n  bad: [unclosed\n")
    with pytest.raises(yaml.YAMLError):
        render(chart_dir=chart_copy)
    assert lint_problems(chart_dir=chart_copy)


# --------------------------------------------------------------------------- docs


# Values documented as one row (free-form maps or Kubernetes objects passed through).
OPAQUE_VALUES = {
    "config",
    "resources",
    "updateStrategy",
    "podSecurityContext",
    "securityContext",
    "probes.startup",
    "probes.liveness",
    "probes.readiness",
}


def _leaf_paths(value: Any, prefix: str = "") -> list[str]:
    if isinstance(value, dict) and value and prefix not in OPAQUE_VALUES:
        return [p for k, v in value.items() for p in _leaf_paths(v, f"{prefix}.{k}".lstrip("."))]
    return [prefix]


def test_readme_documents_every_value(chart_values: dict[str, Any]) -> None:
    readme = (CHART_DIR / "README.md").read_text()
    # values.yaml keys (nulls included, which Helm's merged values may drop)
    raw_values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    paths = set(_leaf_paths(deep_merge(chart_values, raw_values)))
    missing = sorted(p for p in paths if f"`{p}`" not in readme)
    assert not missing, f"values not documented in README.md: {missing}"
    for setting in (
        "NAMESPACE", "GROUP", "MODEL", "DEVICE", "DTYPE", "THREADS", "READ_COUNT",
        "TOKEN_BUDGET", "SINK", "SLICE_MS", "HEALTH_PORT", "DRAIN_TIMEOUT_S", "LOG_FORMAT",
        "LOG_LEVEL", "MAX_DELIVERIES", "RECLAIM_IDLE_MS", "REDIS_URL",
    ):  # fmt: skip
        assert f"EMBEDFLEET_{setting}" in readme, setting


# --------------------------------------------------------------------------- a cluster without KEDA


def _keda_objects(r: Rendered) -> list[dict[str, Any]]:
    return [d for d in r.docs if d["apiVersion"].startswith("keda.sh/")]


@pytest.mark.parametrize("query_workers", [False, True])
@pytest.mark.parametrize("hpa", [False, True])
def test_without_keda_the_chart_falls_back(hpa: bool, query_workers: bool) -> None:
    """keda.enabled (the default) on a cluster that does not serve keda.sh/v1alpha1: no KEDA
    object (the install would fail on an unknown kind), the HPA or fixed replicas instead, and
    the notes say why. With KEDA's API the same values give the ScaledObjects and no HPA."""
    values = {
        "replicaCount": 3,
        "autoscaling": {"hpa": {"enabled": hpa}},
        "queryWorkers": {"enabled": query_workers},
        "redis": {"url": "redis://user:pw@redis:6379/0"},  # credentials: a TriggerAuthentication
        "gateway": {"enabled": True},
    }
    components = ["worker", "query-worker"] if query_workers else ["worker"]
    without = render(values, api_versions=())
    validate_objects(without)
    assert _keda_objects(without) == []
    hpas = {d["spec"]["scaleTargetRef"]["name"] for d in without.all("HorizontalPodAutoscaler")}
    for component in components:
        deployment = without.deployment(component)
        name = deployment["metadata"]["name"]
        if hpa:
            assert name in hpas and "replicas" not in deployment["spec"]
        else:
            assert name not in hpas and deployment["spec"]["replicas"] >= 1
    if not hpa:
        assert without.deployment("worker")["spec"]["replicas"] == 3
    assert "KEDA is not installed in this cluster" in without.notes
    assert "--api-versions keda.sh/v1alpha1" in without.notes
    assert ("HorizontalPodAutoscaler on CPU" in without.notes) is hpa
    assert ("fixed, 3 replica(s)" in without.notes) is not hpa

    with_keda = render(values)
    validate_objects(with_keda)
    assert {d["kind"] for d in _keda_objects(with_keda)} == {
        "ScaledObject",
        "TriggerAuthentication",
    }
    for component in components:
        assert "replicas" not in with_keda.deployment(component)["spec"]
        with_keda.scaled_object(component)
    # the gateway's own CPU HPA is the only one KEDA leaves
    assert [h["metadata"]["name"] for h in with_keda.all("HorizontalPodAutoscaler")] == [
        with_keda.deployment("gateway")["metadata"]["name"]
    ]
    assert "KEDA is not installed" not in with_keda.notes


def test_keda_off_says_nothing_about_a_missing_keda() -> None:
    r = render({"keda": {"enabled": False}}, api_versions=())
    assert "KEDA is not installed" not in r.notes
    assert "fixed, 1 replica(s)" in r.notes


@pytest.mark.parametrize("partitions", [1, 6])
@pytest.mark.parametrize("query_workers", [False, True])
def test_triggers_count_every_stream_the_gateway_and_producer_enqueue_to(
    partitions: int, query_workers: bool
) -> None:
    """Scale from zero: whatever is enqueued (the gateway's small requests on the query stream, its
    large ones on the interactive stream, the Producer's chunks on the ingest streams) sits on a
    stream some ScaledObject counts, with the names from shared/keys.py (the keys' one owner)."""
    from embedfleet.shared.keys import Keys

    keys = Keys(namespace="embedfleet", partitions=partitions)
    ingest = {p.ingest for p in keys.partitions_keys}
    query = keys.priority_streams.query
    interactive = keys.priority_streams.interactive  # the gateway's large requests
    r = render({"partitions": partitions, "queryWorkers": {"enabled": query_workers}})
    bulk = {t["metadata"]["stream"] for t in r.scaled_object("worker")["spec"]["triggers"]}
    if query_workers:
        assert bulk == ingest | {interactive}
        query_so = r.scaled_object("query-worker")
        assert [t["metadata"]["stream"] for t in query_so["spec"]["triggers"]] == [query]
        assert query_so["spec"]["minReplicaCount"] >= 1
    else:
        assert bulk == ingest | {interactive, query}
        assert r.scaled_object("worker")["spec"]["minReplicaCount"] == 0
    for t in r.scaled_object("worker")["spec"]["triggers"]:
        assert t["metadata"]["consumerGroup"] == keys.group


# --------------------------------------------------------------------------- several models

TWO_MODELS: dict[str, Any] = {
    "models": [
        {
            "name": "code",
            "model": "/models/code-embedder",
            "device": "cuda",
            "replicaCount": 2,
            "gpu": {"enabled": True, "count": 1},
            "resources": {"limits": {"memory": "8Gi"}},
            "keda": {"minReplicaCount": 1, "maxReplicaCount": 4},
            "config": {"DTYPE": "float16"},
        },
        {"name": "BAAI/bge-m3", "model": "all-MiniLM-L6-v2", "device": "cpu"},
    ]
}


@pytest.mark.parametrize("partitions", [1, 3])
def test_two_models_render_a_worker_set_and_a_trigger_set_each(partitions: int) -> None:
    """Each entry of `models`: its own Deployment (EMBEDFLEET_MODEL_LANE, its model, device,
    resources, GPU), PDB and ScaledObject whose triggers watch exactly that lane's streams, as
    shared/keys.py names them; the default model's objects are those of the single-model
    chart, unchanged."""
    from embedfleet.shared.keys import Keys

    values = {**TWO_MODELS, "partitions": partitions}
    r = render(values)
    validate_objects(r)
    assert not lint_problems(values)
    single = render({"partitions": partitions})
    assert r.deployment("worker") == single.deployment("worker")
    assert r.scaled_object("worker") == single.scaled_object("worker")
    assert len(r.all("Deployment")) == len(single.all("Deployment")) + 2
    assert len(r.all("ScaledObject")) == len(single.all("ScaledObject")) + 2
    keys = Keys(namespace="embedfleet", partitions=partitions)
    for entry, slug in (
        (TWO_MODELS["models"][0], "code"),
        (TWO_MODELS["models"][1], "baai-bge-m3"),
    ):
        component = f"model-{slug}"
        deployment = r.deployment(component)
        assert deployment["metadata"]["name"] == f"{RELEASE}-embedfleet-m-{slug}"
        env = env_of(deployment)
        assert_entries(
            {name: e.get("value") for name, e in env.items()},
            {
                "EMBEDFLEET_MODEL_LANE": entry["name"],
                "EMBEDFLEET_MODEL": entry["model"],
                "EMBEDFLEET_DEVICE": entry["device"],
            },
        )
        assert r.of_component("PodDisruptionBudget", component)
        lane = keys.for_model(entry["name"])
        expected = {p.ingest for p in lane.partitions_keys}
        expected |= {lane.priority_streams.interactive, lane.priority_streams.query}
        so = r.scaled_object(component)
        assert so["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        streams = [t["metadata"]["stream"] for t in so["spec"]["triggers"]]
        assert sorted(streams) == sorted(expected)  # one trigger per stream of the lane
        assert all(t["metadata"]["consumerGroup"] == keys.group for t in so["spec"]["triggers"])
        if partitions > 1:
            assert "scalingModifiers" in so["spec"]["advanced"]
    code = r.deployment("model-code")
    assert env_of(code)["EMBEDFLEET_DTYPE"]["value"] == "float16"
    assert gpu_resources(code) == {"requests.nvidia.com/gpu": 1, "limits.nvidia.com/gpu": 1}
    assert container(code)["resources"]["limits"]["memory"] == "8Gi"
    code_so = r.scaled_object("model-code")["spec"]
    assert (code_so["minReplicaCount"], code_so["maxReplicaCount"]) == (1, 4)
    bge_so = r.scaled_object("model-baai-bge-m3")["spec"]
    assert (bge_so["minReplicaCount"], bge_so["maxReplicaCount"]) == (0, 10)  # the chart's keda


def test_two_models_without_keda_get_fixed_replicas() -> None:
    r = render(TWO_MODELS, api_versions=())
    validate_objects(r)
    assert not r.all("ScaledObject")
    assert r.deployment("model-code")["spec"]["replicas"] == 2
    assert r.deployment("model-baai-bge-m3")["spec"]["replicas"] == 1  # the chart's replicaCount

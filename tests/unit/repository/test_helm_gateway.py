"""The chart's gateway: Deployment, Service, optional Ingress, HPA on CPU, files volume, keys."""

from __future__ import annotations

import base64
import re
from typing import Any

import pytest

from tests.unit.repository.test_helm_chart import (
    REPO,
    _makefile_image,
    container,
    env_of,
    lint_problems,
    render,
    validate_objects,
)

pytestmark = pytest.mark.chart

GATEWAY = {
    "gateway": {
        "enabled": True,
        "apiKeys": {"keys": ["sk-one", "sk-two"]},
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "tls": [{"secretName": "tls", "hosts": ["embeddings.example.com"]}],
        },
        "config": {"GATEWAY_MAX_INPUTS": 512},
    }
}


def _gateway_objects(values: dict[str, Any]):
    r = render(values)
    validate_objects(r)
    assert lint_problems(values) == []
    return r


def test_gateway_is_off_by_default() -> None:
    r = render()
    assert not [
        d for d in r.docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == "gateway"
    ]


def test_gateway_deployment_service_ingress_hpa_files_and_keys() -> None:
    r = _gateway_objects(GATEWAY)
    deployment = r.deployment("gateway")
    c = container(deployment)
    pod = deployment["spec"]["template"]["spec"]
    assert c["command"] == ["embedfleet", "serve"]
    assert "replicas" not in deployment["spec"]  # the HPA owns the count
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in c["ports"]
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    env = env_of(deployment)
    assert env["EMBEDFLEET_GATEWAY_HOST"]["value"] == "0.0.0.0"
    assert env["EMBEDFLEET_GATEWAY_MAX_INPUTS"]["value"] == "512"
    assert env["EMBEDFLEET_REDIS_URL"]["valueFrom"]["secretKeyRef"]["key"]
    # the keys come from a Secret, mounted as the file EMBEDFLEET_API_KEYS_FILE names
    keys_file = env["EMBEDFLEET_API_KEYS_FILE"]["value"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert keys_file.startswith(mounts["api-keys"]["mountPath"] + "/")
    secret_name = volumes["api-keys"]["secret"]["secretName"]
    secret = r.one("Secret", secret_name)
    key = keys_file.rsplit("/", 1)[1]
    assert base64.b64decode(secret["data"][key]).decode().splitlines() == ["sk-one", "sk-two"]
    # batch files on a claim shared by the replicas, where EMBEDFLEET_FILES_DIR points
    files_dir = env["EMBEDFLEET_FILES_DIR"]["value"]
    assert mounts["files"]["mountPath"] == files_dir
    claim = r.one("PersistentVolumeClaim")
    assert volumes["files"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    # Service → pods, Ingress → Service, HPA on CPU → Deployment
    service = r.one("Service", deployment["metadata"]["name"])
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    ingress = r.one("Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": service["metadata"]["name"], "port": {"name": "http"}}
    assert ingress["spec"]["ingressClassName"] == "nginx"
    hpa = r.one("HorizontalPodAutoscaler", deployment["metadata"]["name"])
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    # hardened like the workers, and the worker Deployment is untouched
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert container(r.deployment("worker"))["command"] == ["embedfleet", "worker"]


def test_existing_secret_and_claim_and_fixed_replicas() -> None:
    values = {
        "gateway": {
            "enabled": True,
            "replicaCount": 3,
            "autoscaling": {"enabled": False},
            "apiKeys": {"existingSecret": "my-keys", "existingSecretKey": "keys.txt"},
            "files": {"existingClaim": "shared-files"},
        }
    }
    r = _gateway_objects(values)
    deployment = r.deployment("gateway")
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert deployment["spec"]["replicas"] == 3
    assert volumes["api-keys"]["secret"]["secretName"] == "my-keys"
    assert env_of(deployment)["EMBEDFLEET_API_KEYS_FILE"]["value"].endswith("/keys.txt")
    assert volumes["files"]["persistentVolumeClaim"]["claimName"] == "shared-files"
    assert not r.all("PersistentVolumeClaim") and not r.all("Ingress")
    assert all(s["metadata"]["name"] != "my-keys" for s in r.all("Secret"))


def test_an_open_gateway_has_no_keys_file() -> None:
    r = _gateway_objects({"gateway": {"enabled": True, "files": {"create": False}}})
    deployment = r.deployment("gateway")
    assert "EMBEDFLEET_API_KEYS_FILE" not in env_of(deployment)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes["files"]


def test_gateway_runs_from_the_gateway_image() -> None:
    """Not the worker image, which lacks the gateway extra: by default the tag `make
    image-gateway` gives (the Dockerfile's `gateway` target), in the workers' repository."""
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^image-gateway:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert recipe and "--target gateway" in recipe.group(1)
    assert "-t $(IMAGE):$(VERSION)-gateway" in recipe.group(1)
    assert re.search(r"^FROM \S+ AS gateway$", (REPO / "Dockerfile").read_text(), re.MULTILINE)

    r = _gateway_objects({"gateway": {"enabled": True}})
    gateway = container(r.deployment("gateway"))
    assert gateway["image"] == _makefile_image() + "-gateway"
    assert gateway["imagePullPolicy"] == "IfNotPresent"  # image.pullPolicy
    assert container(r.deployment("worker"))["image"] == _makefile_image()
    assert f"image {_makefile_image()}-gateway" in r.notes

    r = _gateway_objects(
        {
            "image": {"repository": "registry.example.com/ef", "pullPolicy": "Always"},
            "gateway": {"enabled": True},
        }
    )
    assert container(r.deployment("gateway"))["image"].startswith("registry.example.com/ef:")
    assert container(r.deployment("gateway"))["imagePullPolicy"] == "Always"
    r = _gateway_objects(
        {
            "gateway": {
                "enabled": True,
                "image": {"repository": "gw", "tag": "1.2", "pullPolicy": "Never"},
            }
        }
    )
    gateway = container(r.deployment("gateway"))
    assert (gateway["image"], gateway["imagePullPolicy"]) == ("gw:1.2", "Never")


def test_gateway_on_a_cluster_without_keda() -> None:
    """The gateway with the chart's defaults (KEDA on) where KEDA is not installed: no KEDA
    object, the workers on fixed replicas so that the gateway has a worker to wait for."""
    r = render(GATEWAY, api_versions=())
    validate_objects(r)
    assert not [d for d in r.docs if d["apiVersion"].startswith("keda.sh/")]
    assert r.deployment("worker")["spec"]["replicas"] == 1
    assert container(r.deployment("gateway"))["command"] == ["embedfleet", "serve"]
    # the gateway's own HPA is unaffected
    assert (
        r.one("HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["name"]
        == (r.deployment("gateway")["metadata"]["name"])
    )


def test_gateway_readiness_does_not_wait_for_workers() -> None:
    """/readyz is the gateway's and Redis's readiness: a gateway in front of a fleet scaled to
    zero must be ready (in the Service) so that its requests reach a stream and wake KEDA."""
    c = container(_gateway_objects(GATEWAY).deployment("gateway"))
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "initialDelaySeconds" not in c["readinessProbe"]

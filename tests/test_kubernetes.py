"""The deployment docs' Kubernetes example is valid and keeps the promises the page makes.

The manifest is read from docs/operations/deployment.md itself and checked offline against
Kubernetes' own schemas (``kubernetes-validate``, strict: an unknown field is an error), then
against the broker: its roles and settings parse, the probes ask /healthz and /readyz on the
image's port, the grace period outlasts the drain, it runs as the image's user on a read-only
root, and each PodDisruptionBudget selects exactly one Deployment's pods.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]  # no stubs, no py.typed
import pytest
import yaml

from broker.settings import Settings
from tests.doc_pages import snippets
from tests.test_packaging import EXIT_AFTER_DRAIN_S, container_port, image_env

PAGE = "operations/deployment.md"
SECTION = "A Kubernetes example"
KUBERNETES = "1.33.0"
IMAGE_UID = 10001


def documents() -> list[dict[str, Any]]:
    (manifest,) = snippets(PAGE, SECTION, "yaml")
    return [doc for doc in yaml.safe_load_all(manifest) if doc]


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for doc in documents() if doc["kind"] == kind]


@pytest.mark.parametrize(
    "document", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}"
)
def test_each_resource_is_valid_for_kubernetes(document: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(document, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{document['kind']}/{document['metadata']['name']}: {exc.message}")


def test_the_example_runs_api_replicas_and_workers_with_budgets() -> None:
    deployments = {doc["metadata"]["name"]: doc for doc in of_kind("Deployment")}
    roles = {}
    for name, deployment in deployments.items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = {item["name"]: item["value"] for item in container["env"]}
        settings = Settings.from_env({**image_env(), **env})
        roles[name] = settings.role
        assert deployment["spec"]["replicas"] >= 2, name
    assert sorted(roles.values()) == ["api", "worker"]
    budgets = of_kind("PodDisruptionBudget")
    assert len(budgets) == len(deployments)
    for budget in budgets:
        selected = budget["spec"]["selector"]["matchLabels"]
        matching = [
            name
            for name, deployment in deployments.items()
            if selected.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matching) == 1, f"{budget['metadata']['name']} selects {matching}"
        assert budget["spec"].get("minAvailable", 1) >= 1
    (service,) = of_kind("Service")
    api = next(d for n, d in deployments.items() if roles[n] == "api")
    assert service["spec"]["selector"].items() <= (
        api["spec"]["template"]["metadata"]["labels"].items()
    )


def test_probes_grace_and_security_follow_the_image() -> None:
    port = container_port()
    for deployment in of_kind("Deployment"):
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
            get = container[probe]["httpGet"]
            assert get["path"] == path, name
            assert ports[get["port"]] == port, name
        env = {item["name"]: item["value"] for item in container["env"]}
        drain = Settings.from_env({**image_env(), **env}).drain_timeout_s
        pause = 0.0
        if "lifecycle" in container:
            command = container["lifecycle"]["preStop"]["exec"]["command"]
            assert command[0] == "sleep", name
            pause = float(command[1])
        grace = pod["terminationGracePeriodSeconds"]
        assert grace >= 1.5 * (pause + drain + EXIT_AFTER_DRAIN_S), f"{name}: {grace} s"
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == IMAGE_UID
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
        assert "/tmp" in mounts, f"{name}: the embedded server and Python need a writable /tmp"

"""deploy/k8s/: every manifest validates (strict, no unknown fields) against the Kubernetes OpenAPI
schemas shipped by the kubernetes-validate package, and the parts that must agree with the code do:
the container's arguments parse with `edgespec verifier serve`'s own parser, the probes ask the
gRPC health service for the name the server registers, the Service is headless and targets the
gRPC port, and the edge's fleet spec for it resolves the way the edge parses it."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from edgespec.common import wire
from edgespec.edge.fleet import is_fleet_spec, parse_fleet

kv = pytest.importorskip("kubernetes_validate")
K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
VERSIONS = ("1.29.0", "1.33.0")  # an older cluster still in support, and a recent one


def documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_validate_strictly(version):
    docs = documents()
    assert {d["kind"] for _, d in docs} >= {"Deployment", "Service", "HorizontalPodAutoscaler",
                                            "PodDisruptionBudget", "Secret", "Namespace"}
    for name, doc in docs:
        kv.validate(doc, version, strict=True)  # raises ValidationError with the path of the bad field
    # and a wrong manifest is refused (the validator is really checking)
    bad = next(d for _, d in docs if d["kind"] == "Deployment")
    bad = yaml.safe_load(yaml.safe_dump(bad))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, version, strict=True)


def test_manifests_agree_with_the_code():
    import argparse

    from edgespec.cli.verifier import add_parser

    docs = {d["kind"]: d for _, d in documents()}
    dep, svc = docs["Deployment"], docs["Service"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["edgespec", "verifier", "serve"]
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["verifier", "serve", *c["args"]])   # every flag exists, every value parses
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert args.port == ports["grpc"] and args.metrics_port == ports["metrics"] and args.host == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": args.port, "service": wire.SERVICE_NAME}
    assert any(e["name"] == "EDGESPEC_TOKEN" for e in c["env"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] == "grpc" and svc["spec"]["ports"][0]["port"] == args.port
    spec = f"fleet:{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local:{args.port}"
    assert spec in (K8S / "verifier.yaml").read_text() and is_fleet_spec(spec)
    assert parse_fleet(spec) == ([], spec.removeprefix("fleet:"))

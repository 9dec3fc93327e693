"""deploy/kubernetes/examples/, offline: the Argo Rollouts AnalysisTemplate and the Flagger Canary validated against the
tools' own CRD schemas (tests/data/, each with its source, path and version in its header) with `jsonschema`, strictly
(a field the schema does not declare is refused, as the API server's strict field validation refuses it), and checked
against the sidecar's GET/POST /gate: the path, the methods, the field Argo reads and the status Flagger reads.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is not installed (the dev extra)")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (the dev extra)")

from kdtree.config import Mode  # noqa: E402
from sidecar.api import GateVerdict  # noqa: E402
from sidecar.app import create_app  # noqa: E402
from sidecar.settings import SidecarSettings  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "deploy" / "kubernetes" / "examples"
DATA = REPO / "tests" / "data"  # the CRDs gzipped: they are large
CRDS = {
    ("argoproj.io", "AnalysisTemplate"): DATA / "argo-rollouts-analysis-template-crd.yaml.gz",
    ("flagger.app", "Canary"): DATA / "flagger-crd.yaml.gz",
}


def crd_schema(group: str, kind: str, version: str) -> dict:
    """The openAPIV3Schema of `kind` at `version` from the stored CRD file."""
    for doc in yaml.safe_load_all(gzip.decompress(CRDS[(group, kind)].read_bytes())):
        if doc and doc["spec"]["group"] == group and doc["spec"]["names"]["kind"] == kind:
            (v,) = [v for v in doc["spec"]["versions"] if v["name"] == version]
            assert v["served"], f"{kind} {version} is not served"
            return v["schema"]["openAPIV3Schema"]
    raise AssertionError(f"no CRD for {group} {kind}")


def undeclared(obj, schema: dict, where: str = "") -> list[str]:
    """Fields the structural schema does not declare (kubectl --validate=strict refuses them; without it the API
    server would drop them silently)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(obj, dict) and "properties" in schema:
        for key, value in obj.items():
            if key in schema["properties"]:
                found += undeclared(value, schema["properties"][key], f"{where}.{key}")
            elif not schema.get("additionalProperties"):
                found.append(f"{where}.{key}")
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, value in obj.items():
            found += undeclared(value, schema["additionalProperties"], f"{where}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, value in enumerate(obj):
            found += undeclared(value, schema["items"], f"{where}[{i}]")
    return found


def validate(obj: dict) -> None:
    group, version = obj["apiVersion"].split("/")
    schema = crd_schema(group, obj["kind"], version)
    jsonschema.validate(obj, schema, cls=jsonschema.Draft4Validator)  # OpenAPI v3.0's schemas are Draft 4's
    assert undeclared(obj, schema) == [], f"{obj['kind']}: fields the CRD does not declare"


def example(name: str) -> dict:
    (obj,) = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
    return obj


EXAMPLE_FILES = sorted(p.name for p in EXAMPLES.glob("*.yaml"))


def test_the_stored_schemas_name_their_source():
    for path in CRDS.values():
        head = gzip.decompress(path.read_bytes()).decode().splitlines()[:2]
        assert head[0].startswith("# Source: github.com/") and "commit" in head[0] + head[1], path


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_each_example_matches_its_tools_crd_schema(name):
    validate(example(name))


def test_strict_validation_catches_a_misspelled_field_and_a_wrong_type():
    template = example("argo-analysis-template.yaml")
    template["spec"]["metrics"][0]["provider"]["web"]["jsonpath"] = "{$.pass}"
    with pytest.raises(AssertionError, match="fields the CRD does not declare"):
        validate(template)
    canary = example("flagger-canary.yaml")
    canary["spec"]["analysis"]["webhooks"][0]["type"] = "before-rollout"  # not one of Flagger's hook types
    with pytest.raises(jsonschema.ValidationError):
        validate(canary)


@pytest.fixture(scope="module")
def routes(tmp_path_factory) -> set[tuple[str, str]]:
    app = create_app(SidecarSettings(admin_token="t", state_dir=str(tmp_path_factory.mktemp("state"))))
    return {(r.path, m) for r in app.routes for m in getattr(r, "methods", ())}


def test_argo_reads_the_gates_pass_field_with_get(routes):
    metric = example("argo-analysis-template.yaml")["spec"]["metrics"][0]
    web = metric["provider"]["web"]
    assert web.get("method", "GET") == "GET" and not web.get("headers")  # the gate takes no token
    url = urlsplit(web["url"].replace("{{args.sidecar}}", "http://sidecar:8080").replace("{{args.to}}", "on"))
    assert (url.path, "GET") in routes and parse_qs(url.query) == {"to": ["on"]}
    field = web["jsonPath"].removeprefix("{$.").removesuffix("}")
    assert field in GateVerdict.model_json_schema(by_alias=True)["properties"] and field == "pass"
    assert metric["successCondition"] == "result == true"
    assert web["timeoutSeconds"] > SidecarSettings.model_fields["probe_deadline_s"].default


def test_flagger_posts_to_the_gate_for_real_modes(routes):
    hooks = example("flagger-canary.yaml")["spec"]["analysis"]["webhooks"]
    assert {h["type"] for h in hooks} == {"rollout", "confirm-promotion"}
    for hook in hooks:
        url = urlsplit(hook["url"])
        assert (url.path, "POST") in routes and url.port == SidecarSettings.model_fields[
            "sidecar_port"
        ].default
        (to,) = parse_qs(url.query)["to"]
        assert Mode(to) and "metadata" not in hook  # Flagger's payload is never read
        assert (
            int(hook["timeout"].removesuffix("s")) > SidecarSettings.model_fields["probe_deadline_s"].default
        )

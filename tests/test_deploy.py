"""Offline validation of ``deploy/``: no Docker engine or cluster exists where these run.

What is checked, and against what:

- every YAML and JSON file under ``deploy/`` parses;
- ``deploy/compose/compose.yaml`` validates against the Compose Specification JSON schema as
  vendored (with its Apache-2.0 licence) by the ``check-jsonschema`` package
  (``check_jsonschema/builtin_schemas/vendor/compose-spec.json``);
- every collector configuration (the compose collector, Jaeger v2's, and the ``config.yaml`` of
  each Kubernetes ConfigMap) is structurally sound: pipelines reference only defined
  receivers/processors/exporters, defined components are used, and every component type is a
  known collector-contrib (or, for Jaeger, Jaeger v2) name under its current, non-deprecated
  spelling (:data:`CONTRIB_COMPONENTS`);
- the Kubernetes manifests validate against the Kubernetes JSON schemas shipped offline by the
  ``kubernetes-validate`` package, in strict mode (unknown fields are errors);
- the wiring between the pieces: ports, service names, RBAC, environment variable names that
  otel-gpu reads, the span attribute and event names the tail-sampling policies rely on (taken
  from spans otel-gpu really produces), the dump-link patterns.

Each checker is also run on a deliberately broken input, so the checks are known to fail.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import torch
import yaml

from otel_gpu import attributes

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
COMPOSE = DEPLOY / "compose"
K8S = DEPLOY / "k8s"
K8S_VERSIONS = ("1.30", "1.34")
"""Kubernetes versions whose schemas the manifests must satisfy (kubernetes-validate has 1.25-1.37)."""

# --------------------------------------------------------------------------- known component names

CONTRIB_COMPONENTS: dict[str, frozenset[str]] = {
    "receivers": frozenset(
        """otlp otlp_json_file file_log host_metrics kubelet_stats k8s_cluster k8s_events
        k8s_objects prometheus prometheus_remote_write jaeger zipkin kafka fluent_forward
        journald syslog tcp_log udp_log sql_query docker_stats nop""".split()
    ),
    "processors": frozenset(
        """batch memory_limiter k8s_attributes tail_sampling probabilistic_sampler attributes
        resource resource_detection transform filter span group_by_attrs groupbytrace
        redaction metrics_transform cumulative_to_delta""".split()
    ),
    "exporters": frozenset(
        """otlp_grpc otlp_http debug nop file load_balancing kafka prometheus
        prometheus_remote_write zipkin""".split()
    ),
    "extensions": frozenset(
        """health_check file_storage zpages pprof basicauth bearertokenauth oauth2client
        headers_setter k8s_observer""".split()
    ),
    "connectors": frozenset("forward count routing span_metrics service_graph".split()),
}
"""Component type names of collector-contrib, current spelling (a subset: the ones these configs
may reasonably use; a name missing here fails the test, so add it after checking it).

Source: the ``type:`` field of each component's ``metadata.yaml`` in
open-telemetry/opentelemetry-collector and open-telemetry/opentelemetry-collector-contrib, for the
modules listed in open-telemetry/opentelemetry-collector-releases
``distributions/otelcol-contrib/manifest.yaml``, with the 2026 renames to lower_snake_case
(collector issue #14396, contrib issue #45339; e.g. contrib PRs #45901 ``k8s_attributes``,
#48533 ``load_balancing``, #48728 ``otlp_json_file``; collector PRs #14403 ``otlp_grpc``,
#14397 ``otlp_http``), which the compose/Kubernetes image 0.161.0 accepts."""

DEPRECATED_ALIASES: dict[str, str] = {
    "otlp": "otlp_grpc",  # as an exporter only; ``otlp`` stays the receiver's name
    "otlphttp": "otlp_http",
    "loadbalancing": "load_balancing",
    "k8sattributes": "k8s_attributes",
    "otlpjsonfile": "otlp_json_file",
    "filelog": "file_log",
    "hostmetrics": "host_metrics",
    "kubeletstats": "kubelet_stats",
    "k8sobjects": "k8s_objects",
    "resourcedetection": "resource_detection",
    "metricstransform": "metrics_transform",
    "cumulativetodelta": "cumulative_to_delta",
    "prometheusremotewrite": "prometheus_remote_write",
    "spanmetrics": "span_metrics",
    "servicegraph": "service_graph",
    "fluentforward": "fluent_forward",
}
"""Old names still accepted by current collectors with a deprecation warning (same sources)."""

JAEGER_COMPONENTS: dict[str, frozenset[str]] = {
    "receivers": frozenset({"otlp", "jaeger", "zipkin"}),
    "processors": frozenset({"batch"}),
    "exporters": frozenset({"jaeger_storage_exporter"}),
    "extensions": frozenset(
        {"jaeger_storage", "jaeger_query", "remote_sampling", "healthcheckv2", "expvar"}
    ),
    "connectors": frozenset(),
}
"""Jaeger v2's components, from jaegertracing/jaeger ``cmd/jaeger/internal/all-in-one.yaml``."""

KINDS = ("receivers", "processors", "exporters", "connectors")


def collector_problems(config: dict[str, Any], known: dict[str, frozenset[str]]) -> list[str]:
    """Everything wrong with a collector configuration's structure and names (``[]``: sound)."""
    problems: list[str] = []
    service = config.get("service") or {}
    pipelines = service.get("pipelines") or {}
    if not pipelines:
        problems.append("service.pipelines is empty")
    used: dict[str, set[str]] = {kind: set() for kind in (*KINDS, "extensions")}
    for name, pipeline in pipelines.items():
        for kind in ("receivers", "processors", "exporters"):
            for ref in (pipeline or {}).get(kind) or []:
                used[kind].add(ref)
                defined = config.get(kind) or {}
                connectors = config.get("connectors") or {}
                if ref not in defined and not (kind != "processors" and ref in connectors):
                    problems.append(f"pipeline {name}: {kind[:-1]} {ref!r} is not defined")
        if not (pipeline or {}).get("receivers") or not (pipeline or {}).get("exporters"):
            problems.append(f"pipeline {name}: needs receivers and exporters")
    for ref in service.get("extensions") or []:
        used["extensions"].add(ref)
        if ref not in (config.get("extensions") or {}):
            problems.append(f"service extension {ref!r} is not defined")
    for kind in (*KINDS, "extensions"):
        for component in config.get(kind) or {}:
            type_name = component.split("/", 1)[0]
            if component not in used[kind] and kind != "connectors":
                problems.append(f"{kind[:-1]} {component!r} is defined but not used")
            if kind == "exporters" and type_name == "otlp":
                problems.append("exporter type 'otlp' is a deprecated alias: use 'otlp_grpc'")
            elif kind != "receivers" and type_name in DEPRECATED_ALIASES:
                problems.append(
                    f"{kind[:-1]} type {type_name!r} is a deprecated alias: use "
                    f"{DEPRECATED_ALIASES[type_name]!r}"
                )
            elif type_name not in known[kind]:
                problems.append(f"{kind[:-1]} type {type_name!r} is not a known component")
    return problems


# --------------------------------------------------------------------------- file discovery


def _yaml_docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _k8s_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _k8s_objects() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in _k8s_files():
        for doc in _yaml_docs(path):
            yield path, doc


def _k8s(kind: str, name: str) -> dict[str, Any]:
    [found] = [d for _, d in _k8s_objects() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _configmap_config(name: str) -> dict[str, Any]:
    return yaml.safe_load(_k8s("ConfigMap", name)["data"]["config.yaml"])


def _collector_configs() -> list[tuple[str, dict[str, Any], dict[str, frozenset[str]]]]:
    configs = [
        (
            "compose/otelcol.yaml",
            yaml.safe_load((COMPOSE / "otelcol.yaml").read_text()),
            CONTRIB_COMPONENTS,
        ),
        (
            "compose/jaeger.yaml",
            yaml.safe_load((COMPOSE / "jaeger.yaml").read_text()),
            JAEGER_COMPONENTS,
        ),
    ]
    for path, doc in _k8s_objects():
        if doc["kind"] == "ConfigMap" and "config.yaml" in doc.get("data", {}):
            label = f"k8s/{path.name}:{doc['metadata']['name']}"
            configs.append((label, yaml.safe_load(doc["data"]["config.yaml"]), CONTRIB_COMPONENTS))
    return configs


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _volume(spec: str) -> tuple[str, str]:
    """(source, target) of a compose short-syntax volume, ``${VAR:-default}`` read as its default."""
    source, target, *_ = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", spec).split(":")
    return source, target


def _compose_schema() -> dict[str, Any]:
    text = (
        importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
        .joinpath("compose-spec.json")
        .read_text()
    )
    return json.loads(text)


def _compose_errors(document: Any) -> list[str]:
    schema = _compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(document)]


# --------------------------------------------------------------------------- every file parses


def test_every_yaml_and_json_file_parses() -> None:
    """Every ``*.yaml``/``*.yml``/``*.json`` under deploy/ parses, including the collector
    configurations embedded in Kubernetes ConfigMaps."""
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))
    assert len(files) >= 12, files
    for path in files:
        if path.suffix == ".json":
            json.loads(path.read_text())
        else:
            assert _yaml_docs(path), path
    for _, doc in _k8s_objects():
        for value in (doc.get("data") or {}).values():
            yaml.safe_load(value)


# --------------------------------------------------------------------------- docker compose


def test_compose_file_validates_against_the_compose_spec() -> None:
    """compose.yaml is valid under the Compose Specification schema, and the schema check rejects
    an unknown service key and a malformed port list."""
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    assert _compose_errors(compose) == []
    broken = copy.deepcopy(compose)
    broken["services"]["otelcol"]["portz"] = ["4317:4317"]
    broken["services"]["grafana"]["ports"] = {"3000": 3000}
    errors = _compose_errors(broken)
    assert any("'portz' was unexpected" in e for e in errors), errors
    assert any(e.startswith("['services', 'grafana', 'ports']") for e in errors), errors


def test_compose_has_the_stack_and_mounts_files_that_exist() -> None:
    """The stack is collector (contrib image), Jaeger, Tempo and Grafana (plus the dump server);
    every relative bind-mount source exists, and each config lands where its command reads it."""
    services = yaml.safe_load((COMPOSE / "compose.yaml").read_text())["services"]
    assert {"otelcol", "jaeger", "tempo", "grafana", "dumps"} <= set(services)
    assert services["otelcol"]["image"].startswith("otel/opentelemetry-collector-contrib:")
    assert services["jaeger"]["image"].startswith("jaegertracing/jaeger:2.")
    assert services["tempo"]["image"].startswith("grafana/tempo:")
    assert services["grafana"]["image"].startswith("grafana/grafana:1")
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source, _ = _volume(volume)
            if source.startswith("./"):
                assert (COMPOSE / source).exists(), f"{name}: {source} does not exist"
    mounts = {_volume(v)[1] for s in services.values() for v in s.get("volumes", [])}
    assert "/etc/otelcol/config.yaml" in mounts
    assert "--config=/etc/otelcol/config.yaml" in services["otelcol"]["command"]
    assert "--config=/etc/jaeger/config.yaml" in services["jaeger"]["command"]
    assert "-config.file=/etc/tempo.yaml" in services["tempo"]["command"]
    assert "/etc/grafana/provisioning/datasources/otel-gpu.yaml" in mounts


def test_compose_collector_receives_otlp_and_our_jsonl_files() -> None:
    """The collector listens for OTLP/gRPC and OTLP/HTTP on published ports, and reads the spool
    directory's ``*.jsonl`` with ``start_at: beginning`` and a ``max_log_size`` far above the
    1 MiB default (one line is one export batch); it exports to both Jaeger and Tempo."""
    config = yaml.safe_load((COMPOSE / "otelcol.yaml").read_text())
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert protocols["http"]["endpoint"].endswith(":4318")
    jsonfile = config["receivers"]["otlp_json_file"]
    assert jsonfile["include"] == ["/spool/*.jsonl"]
    assert jsonfile["start_at"] == "beginning"
    assert int(jsonfile["max_log_size"]) >= 64 * 2**20
    services = yaml.safe_load((COMPOSE / "compose.yaml").read_text())["services"]
    assert ("./spool", "/spool") in {_volume(v) for v in services["otelcol"]["volumes"]}
    assert {"127.0.0.1:4317:4317", "127.0.0.1:4318:4318"} <= set(services["otelcol"]["ports"])
    endpoints = {e["endpoint"] for e in config["exporters"].values() if "endpoint" in e}
    assert endpoints == {"jaeger:4317", "tempo:4317"}


# --------------------------------------------------------------------------- collector configurations


@pytest.mark.parametrize(
    ("label", "config", "known"), _collector_configs(), ids=[c[0] for c in _collector_configs()]
)
def test_collector_pipelines_reference_defined_known_components(
    label: str, config: dict[str, Any], known: dict[str, frozenset[str]]
) -> None:
    """Each pipeline uses only defined receivers/processors/exporters, nothing defined is left
    unused, and every component type is a known, non-deprecated name of its distribution."""
    assert collector_problems(config, known) == []


def test_collector_checker_fails_on_broken_configs() -> None:
    """The checker catches an undefined reference, a typo'd type, a deprecated alias and an
    unused component."""
    base = yaml.safe_load((COMPOSE / "otelcol.yaml").read_text())
    undefined = copy.deepcopy(base)
    undefined["service"]["pipelines"]["traces"]["exporters"].append("otlp_grpc/nowhere")
    typo = copy.deepcopy(base)
    typo["processors"]["memory_limitter"] = typo["processors"].pop("memory_limiter")
    typo["service"]["pipelines"]["traces"]["processors"][0] = "memory_limitter"
    alias = copy.deepcopy(base)
    alias["exporters"]["otlp/jaeger"] = alias["exporters"].pop("otlp_grpc/jaeger")
    alias["service"]["pipelines"]["traces"]["exporters"][0] = "otlp/jaeger"
    unused = copy.deepcopy(base)
    unused["processors"]["transform"] = {}
    assert collector_problems(undefined, CONTRIB_COMPONENTS) == [
        "pipeline traces: exporter 'otlp_grpc/nowhere' is not defined"
    ]
    assert collector_problems(typo, CONTRIB_COMPONENTS) == [
        "processor type 'memory_limitter' is not a known component"
    ]
    assert collector_problems(alias, CONTRIB_COMPONENTS) == [
        "exporter type 'otlp' is a deprecated alias: use 'otlp_grpc'"
    ]
    assert collector_problems(unused, CONTRIB_COMPONENTS) == [
        "processor 'transform' is defined but not used"
    ]


def test_jaeger_ui_links_dump_dir_and_is_mounted() -> None:
    """Jaeger's UI config (mounted where jaeger.yaml reads it) turns the span attribute
    ``otel_gpu.dump.dir``, the name the flight recorder sets, into a link to the dump server."""
    from otel_gpu.recorder import recorder

    ui = json.loads((COMPOSE / "jaeger-ui.json").read_text())
    [pattern] = ui["linkPatterns"]
    assert (pattern["type"], pattern["key"]) == ("tags", recorder.ATTR_DIR)
    assert pattern["url"] == "http://localhost:8099/#{" + recorder.ATTR_DIR + "}"
    jaeger = yaml.safe_load((COMPOSE / "jaeger.yaml").read_text())
    assert jaeger["extensions"]["jaeger_query"]["ui"]["config_file"] == "/etc/jaeger/ui.json"
    services = yaml.safe_load((COMPOSE / "compose.yaml").read_text())["services"]
    assert "./jaeger-ui.json:/etc/jaeger/ui.json:ro" in services["jaeger"]["volumes"]
    assert "127.0.0.1:8099:8099" in services["dumps"]["ports"]
    [(source, target)] = [_volume(v) for v in services["dumps"]["volumes"]]
    assert target == "/dumps" + source  # the attribute's absolute path is the URL path
    assert services["dumps"]["command"][-2:] == ["--directory", "/dumps"]


def test_grafana_datasources_and_dump_correlations() -> None:
    """Grafana provisions Tempo and Jaeger (at their compose addresses) and, on each, an external
    trace correlation whose regex takes ``otel_gpu.dump.dir`` out of the span's tags into the
    link's variable; ``$$`` keeps Grafana's env expansion off it; label and description are
    strings (Grafana's provisioning requires both)."""
    from otel_gpu.recorder import recorder

    sources = {
        d["type"]: d
        for d in yaml.safe_load((COMPOSE / "grafana/datasources.yaml").read_text())["datasources"]
    }
    assert sources["tempo"]["url"] == "http://tempo:3200"
    assert sources["jaeger"]["url"] == "http://jaeger:16686"
    tags = json.dumps(
        [
            {"key": "code.function.name", "value": "f"},
            {"key": recorder.ATTR_DIR, "value": "/tmp/d/7/f"},
        ],
        separators=(",", ":"),
    )
    for source in sources.values():
        [correlation] = source["correlations"]
        assert isinstance(correlation["label"], str) and isinstance(correlation["description"], str)
        assert correlation["type"] == "external"
        [transformation] = correlation["config"]["transformations"]
        assert transformation["field"] == "tags"
        match = re.search(transformation["expression"], tags)
        assert match and match.group(1) == "/tmp/d/7/f"
        assert (
            re.search(transformation["expression"], tags.replace(recorder.ATTR_DIR, "other"))
            is None
        )
        url = correlation["config"]["target"]["url"]
        assert url == "http://localhost:8099/$${" + transformation["mapValue"] + "}"


# --------------------------------------------------------------------------- Kubernetes


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", _k8s_files(), ids=lambda p: p.name)
def test_k8s_manifests_validate_against_kubernetes_schemas(path: Path, version: str) -> None:
    """Every object validates in strict mode (no unknown fields) against the Kubernetes schemas
    of ``version`` shipped by kubernetes-validate."""
    for doc in _yaml_docs(path):
        kubernetes_validate.validate(doc, version, strict=True)


def test_k8s_schema_check_fails_on_a_broken_manifest() -> None:
    """A misspelt field or a non-string ConfigMap value is a validation error."""
    daemonset = copy.deepcopy(_k8s("DaemonSet", "otel-gpu-agent"))
    daemonset["spec"]["template"]["spec"]["containers"][0]["imag"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, K8S_VERSIONS[0], strict=True)
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "x"},
        "data": {"a": 1},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(configmap, K8S_VERSIONS[0], strict=True)


def test_kustomization_lists_every_manifest() -> None:
    """``kubectl apply -k deploy/k8s`` applies every manifest file."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in _k8s_files())


def test_agent_daemonset_wiring() -> None:
    """The node agent: memory_limiter first, k8s_attributes, batch; load_balancing by trace ID
    to the gateway's headless Service and port; its hostPorts are the OTLP receiver's ports; it
    runs under the service account the RBAC grants, on GPU-tainted nodes too."""
    config = _configmap_config("otel-gpu-agent")
    processors = config["service"]["pipelines"]["traces"]["processors"]
    assert processors == ["memory_limiter", "k8s_attributes", "batch"]
    association = config["processors"]["k8s_attributes"]["pod_association"]
    assert {"from": "resource_attribute", "name": "k8s.pod.uid"} in association[0]["sources"]
    lb = config["exporters"]["load_balancing"]
    assert lb["routing_key"] == "traceID"
    assert "endpoint" not in lb["protocol"]["otlp"]
    service = _k8s("Service", "otel-gpu-gateway-headless")
    assert service["spec"]["clusterIP"] == "None"
    name, namespace = lb["resolver"]["k8s"]["service"].split(".")
    assert (name, namespace) == (service["metadata"]["name"], service["metadata"]["namespace"])
    assert lb["resolver"]["k8s"]["ports"] == [p["port"] for p in service["spec"]["ports"]]
    pod = _k8s("DaemonSet", "otel-gpu-agent")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    host_ports = {p["hostPort"] for p in container["ports"]}
    receiver_ports = {
        int(p["endpoint"].rsplit(":", 1)[1])
        for p in config["receivers"]["otlp"]["protocols"].values()
    }
    assert host_ports == receiver_ports == {4317, 4318}
    assert _env(container)["K8S_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert pod["serviceAccountName"] == "otel-gpu-agent"
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert "limits" in container["resources"]  # memory_limiter's percentages need a limit


def test_rbac_grants_what_the_agent_needs() -> None:
    """The agent's service account can read pods, namespaces and replica sets cluster-wide
    (k8s_attributes) and endpoint slices in its namespace (load_balancing's k8s resolver)."""
    role = _k8s("ClusterRole", "otel-gpu-agent")
    granted = {
        (g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
    }
    assert {("", "pods"), ("", "namespaces"), ("apps", "replicasets")} <= granted
    assert all(set(rule["verbs"]) == {"get", "list", "watch"} for rule in role["rules"])
    binding = _k8s("ClusterRoleBinding", "otel-gpu-agent")
    assert binding["roleRef"]["name"] == "otel-gpu-agent"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "otel-gpu-agent", "namespace": "observability"}
    ]
    lb_role = _k8s("Role", "otel-gpu-agent-loadbalancing")
    assert any("endpointslices" in rule["resources"] for rule in lb_role["rules"])
    lb_binding = _k8s("RoleBinding", "otel-gpu-agent-loadbalancing")
    assert lb_binding["subjects"][0]["name"] == "otel-gpu-agent"


def test_gateway_tail_sampling_policies() -> None:
    """The gateway keeps ERROR traces, traces with NaN/Inf (span attribute and stats events),
    traces with a stuck call or a snapshot, and a percentage of the rest, after memory_limiter and before
    batch; it exports to Tempo and Jaeger from environment-configured endpoints."""
    config = _configmap_config("otel-gpu-gateway")
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["processors"] == ["memory_limiter", "tail_sampling", "batch"]
    policies = {p["name"]: p for p in config["processors"]["tail_sampling"]["policies"]}
    assert {p["type"] for p in policies.values()} == {
        "status_code",
        "boolean_attribute",
        "ottl_condition",
        "probabilistic",
    }
    assert policies["keep-errors"]["status_code"]["status_codes"] == ["ERROR"]
    assert policies["keep-nonfinite-tensors"]["boolean_attribute"] == {
        "key": "otel_gpu.nonfinite",
        "value": True,
    }
    assert policies["keep-stuck-calls"]["boolean_attribute"] == {
        "key": "otel_gpu.stuck",
        "value": True,
    }
    assert policies["keep-snapshots"]["boolean_attribute"] == {
        "key": attributes.SNAPSHOT,
        "value": True,
    }
    rest = policies["keep-some-of-the-rest"]["probabilistic"]["sampling_percentage"]
    assert 0 < rest < 100
    assert set(pipeline["exporters"]) == {"otlp_grpc/tempo", "otlp_grpc/jaeger"}
    [container] = _k8s("Deployment", "otel-gpu-gateway")["spec"]["template"]["spec"]["containers"]
    for exporter in pipeline["exporters"]:
        variable = re.fullmatch(r"\$\{env:(\w+)\}", config["exporters"][exporter]["endpoint"])
        assert variable and variable.group(1) in _env(container)


_OTTL = re.compile(r'name == "(?P<event>[\w.]+)" and attributes\["(?P<key>\w+)"\] > 0')


def test_sampling_policies_match_what_otel_gpu_emits(otel_gpu_spans: Any) -> None:
    """The names the policies rely on are the ones otel-gpu produces: a level-5 call whose output
    holds NaN and Inf carries ``otel_gpu.nonfinite = True`` and ``otel_gpu.stats`` events whose
    ``nan_count``/``inf_count`` the OTTL conditions test; a raising call has status ERROR."""
    from opentelemetry.trace import StatusCode

    import otel_gpu

    spans = otel_gpu_spans(level=5)

    @otel_gpu.api(name="deploy_test.log")
    def log(x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)

    @otel_gpu.api(name="deploy_test.fail")
    def fail() -> None:
        raise ValueError("boom")

    log(torch.tensor([-1.0, 0.0, 1.0]))  # NaN and -inf
    with pytest.raises(ValueError):
        fail()
    by_name = {s.name: s for s in spans.get()}
    bad = by_name["deploy_test.log"]
    policies = {
        p["name"]: p
        for p in _configmap_config("otel-gpu-gateway")["processors"]["tail_sampling"]["policies"]
    }
    attribute = policies["keep-nonfinite-tensors"]["boolean_attribute"]
    assert bad.attributes[attribute["key"]] is attribute["value"]
    conditions = policies["keep-nonfinite-stats-events"]["ottl_condition"]["spanevent"]
    assert {m.group("key") for m in map(_OTTL.fullmatch, conditions) if m} == {
        "nan_count",
        "inf_count",
    }
    for condition in conditions:
        wanted = _OTTL.fullmatch(condition)
        assert wanted, condition
        assert any(
            e.name == wanted.group("event") and e.attributes.get(wanted.group("key"), 0) > 0
            for e in bad.events
        ), condition
    assert by_name["deploy_test.fail"].status.status_code is StatusCode.ERROR
    assert policies["keep-errors"]["status_code"]["status_codes"] == [StatusCode.ERROR.name]


def test_serving_example_env_is_what_otel_gpu_reads() -> None:
    """The example pod exports with ``OTEL_GPU_LOGDEST=otlp`` at a valid level to its node agent
    (status.hostIP, the agent's gRPC hostPort), sets exactly the K8S_* variables otel-gpu's
    resource reads from the downward API, and dumps under a mounted hostPath."""
    from otel_gpu import config, resource

    deployment = _k8s("Deployment", "gpu-serving-example")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = _env(container)
    assert env["OTEL_GPU_LOGDEST"] == "otlp"
    config.load(env={k: v for k, v in env.items() if isinstance(v, str)})  # valid values
    assert int(env["OTEL_GPU_LOGLEVEL"]) in config.LEVELS
    assert env["NODE_IP"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://$(NODE_IP):4317"
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "grpc"
    names = list(env)
    assert names.index("NODE_IP") < names.index("OTEL_EXPORTER_OTLP_ENDPOINT")  # $(VAR) order
    expected = {
        "K8S_POD_NAME": "metadata.name",
        "K8S_POD_UID": "metadata.uid",
        "K8S_NAMESPACE_NAME": "metadata.namespace",
        "K8S_NODE_NAME": "spec.nodeName",
    }
    assert {k for k in env if k.startswith("K8S_")} == set(resource.K8S_ENV)
    for variable, field in expected.items():
        assert env[variable] == {"fieldRef": {"fieldPath": field}}, variable
    assert env["K8S_CONTAINER_NAME"] == container["name"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    [(volume, _path)] = [
        (n, p) for n, p in mounts.items() if env["OTEL_GPU_DUMP_DIR"].startswith(p + "/")
    ]
    assert "hostPath" in volumes[volume] or "persistentVolumeClaim" in volumes[volume]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1

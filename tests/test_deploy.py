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
  from spans otel-gpu really produces), the dump-link patterns;
- the metrics route and the Grafana dashboard: the dashboard's structure (what Grafana's schema
  requires, :func:`dashboard_problems`), its data sources against the provisioned ones, every
  metric and label name in its PromQL against the metrics contract (:data:`METRICS_CONTRACT`),
  exemplars on the latency panel; every collector's metrics pipeline (defined components, no
  tail sampler); where installed (both optional), ``promql-parser`` parses every panel query and
  the schema models of ``grafana-foundation-sdk`` round-trip the dashboard without a lost key.

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
    assert {"otelcol", "jaeger", "tempo", "grafana", "dumps", "prometheus"} <= set(services)
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
    1 MiB default (one line is one export batch): trace files with ``otlp_json_file`` and the
    ``*.metrics.jsonl`` beside them with ``otlp_json_file/metrics``; traces go to both Jaeger and
    Tempo, metrics to Prometheus."""
    config = yaml.safe_load((COMPOSE / "otelcol.yaml").read_text())
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert protocols["http"]["endpoint"].endswith(":4318")
    for name in ("otlp_json_file", "otlp_json_file/metrics"):
        jsonfile = config["receivers"][name]
        assert jsonfile["start_at"] == "beginning", name
        assert int(jsonfile["max_log_size"]) >= 64 * 2**20, name
        assert jsonfile["storage"] == "file_storage", name
    assert config["receivers"]["otlp_json_file"]["include"] == ["/spool/*.jsonl"]
    services = yaml.safe_load((COMPOSE / "compose.yaml").read_text())["services"]
    assert ("./spool", "/spool") in {_volume(v) for v in services["otelcol"]["volumes"]}
    assert {"127.0.0.1:4317:4317", "127.0.0.1:4318:4318"} <= set(services["otelcol"]["ports"])
    pipelines = config["service"]["pipelines"]
    endpoints = {
        signal: {config["exporters"][e].get("endpoint") for e in pipelines[signal]["exporters"]}
        for signal in ("traces", "metrics")
    }
    assert endpoints["traces"] == {"jaeger:4317", "tempo:4317", None}  # None: debug
    assert endpoints["metrics"] == {"http://prometheus:9090/api/v1/otlp", None}


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
    for pipeline in typo["service"]["pipelines"].values():
        pipeline["processors"][0] = "memory_limitter"
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
        if d["type"] in ("tempo", "jaeger")
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


# --------------------------------------------------------------------------- metrics and the dashboard

DASHBOARD = COMPOSE / "grafana/dashboards/otel-gpu.json"

METRICS_CONTRACT: dict[str, tuple[str, str, frozenset[str]]] = {
    "otel_gpu.call.duration": (
        "histogram",
        "s",
        frozenset(
            {
                "otel_gpu_call_duration_seconds_bucket",
                "otel_gpu_call_duration_seconds_sum",
                "otel_gpu_call_duration_seconds_count",
            }
        ),
    ),
    "otel_gpu.call.device.duration": (
        "histogram",
        "s",
        frozenset(
            {
                "otel_gpu_call_device_duration_seconds_bucket",
                "otel_gpu_call_device_duration_seconds_sum",
                "otel_gpu_call_device_duration_seconds_count",
            }
        ),
    ),
    "otel_gpu.calls": ("counter", "{call}", frozenset({"otel_gpu_calls_total"})),
    "otel_gpu.call.errors": ("counter", "{call}", frozenset({"otel_gpu_call_errors_total"})),
    "otel_gpu.call.nonfinite": ("counter", "{call}", frozenset({"otel_gpu_call_nonfinite_total"})),
    "hw.gpu.utilization": ("gauge", "1", frozenset({"hw_gpu_utilization_ratio"})),
    "hw.gpu.memory.usage": ("gauge", "By", frozenset({"hw_gpu_memory_usage_bytes"})),
    "hw.gpu.memory.limit": ("gauge", "By", frozenset({"hw_gpu_memory_limit_bytes"})),
    "hw.gpu.memory.utilization": ("gauge", "1", frozenset({"hw_gpu_memory_utilization_ratio"})),
}
"""The metrics the dashboard is built on: OTel name -> (instrument, unit, Prometheus series names
after the collector's/Prometheus's translation). docs/metrics.md is the full list."""

PROMETHEUS_METRICS = frozenset().union(*(names for _, _, names in METRICS_CONTRACT.values()))

METRIC_LABELS = frozenset(
    {"code_function_name", "error_type", "hw_id", "hw_name", "hw_vendor", "hw_gpu_task"}
)
"""Point attributes of those metrics, as labels (``code.function.name`` -> ``code_function_name``)."""

_UNIT_SUFFIX = {"s": "seconds", "By": "bytes", "1": "ratio"}


def prometheus_series(name: str, instrument: str, unit: str) -> frozenset[str]:
    """The series names Prometheus's OTLP translation (``UnderscoreEscapingWithSuffixes``, the
    collector's ``prometheus_remote_write`` too) gives an OTel metric: dots to underscores, the
    unit as a suffix (``{...}`` annotations dropped), ``_total`` for counters, and the three
    series of a classic histogram."""
    base = name.replace(".", "_")
    suffix = _UNIT_SUFFIX.get(unit, "")
    if suffix and not base.endswith("_" + suffix):
        base += "_" + suffix
    if instrument == "counter":
        return frozenset({base + "_total"})
    if instrument == "histogram":
        return frozenset({base + "_bucket", base + "_sum", base + "_count"})
    return frozenset({base})


_PROMQL_WORDS = frozenset(
    "by without on ignoring group_left group_right bool and or unless offset".split()
)


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, label
    names (inside ``{}`` or a ``by (...)`` clause), strings, durations or numbers."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        if text[match.end() :].lstrip().startswith("(") or match.group() in _PROMQL_WORDS:
            continue
        names.add(match.group())
    return names


def promql_label_names(expr: str) -> set[str]:
    """Label names a PromQL expression matches on (``{name=~...}``) or groups by (``by (...)``)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels = set()
    for selector in re.findall(r"\{([^}]*)\}", text):
        labels.update(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", selector))
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", text):
        labels.update(label.strip() for label in group.split(",") if label.strip())
    return labels


def dashboard_problems(dashboard: dict[str, Any]) -> list[str]:
    """What Grafana's dashboard schema requires and a file could get wrong (``[]``: sound):
    ``schemaVersion``, ``uid`` and ``title``; per panel an integer ``id`` unique in the
    dashboard, ``type``, a ``gridPos`` inside the 24-column grid, a ``datasource`` and at least
    one target with a ``refId`` unique in the panel; and no two panels overlapping."""
    problems: list[str] = []
    for key, kind in (("schemaVersion", int), ("uid", str), ("title", str)):
        if not isinstance(dashboard.get(key), kind):
            problems.append(f"dashboard: {key} missing or not {kind.__name__}")
    panels = dashboard.get("panels") or []
    if not panels:
        problems.append("dashboard: no panels")
    ids: set[int] = set()
    boxes: list[tuple[int, tuple[int, int, int, int]]] = []
    for index, panel in enumerate(panels):
        pid = panel.get("id")
        label = f"panel {pid if isinstance(pid, int) else '#' + str(index)}"
        if not isinstance(pid, int):
            problems.append(f"{label}: id missing or not an integer")
        elif pid in ids:
            problems.append(f"{label}: id is not unique")
        else:
            ids.add(pid)
        if not isinstance(panel.get("type"), str):
            problems.append(f"{label}: type missing")
        datasource = panel.get("datasource")
        if not (isinstance(datasource, dict) and datasource.get("uid") and datasource.get("type")):
            problems.append(f"{label}: datasource needs a type and a uid")
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"{label}: no targets")
        ref_ids = [t.get("refId") for t in targets]
        if None in ref_ids or len(set(ref_ids)) != len(ref_ids):
            problems.append(f"{label}: every target needs a refId unique in the panel")
        grid = panel.get("gridPos") or {}
        if not all(isinstance(grid.get(k), int) for k in "xywh"):
            problems.append(f"{label}: gridPos needs integer x, y, w, h")
            continue
        x, y, w, h = (grid[k] for k in "xywh")
        if x < 0 or y < 0 or w < 1 or h < 1 or x + w > 24:
            problems.append(f"{label}: gridPos {grid} is outside the 24-column grid")
        for other, (ox, oy, ow, oh) in boxes:
            if x < ox + ow and ox < x + w and y < oy + oh and oy < y + h:
                problems.append(f"{label}: gridPos overlaps panel {other}")
        boxes.append((pid if isinstance(pid, int) else -1, (x, y, w, h)))
    return problems


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _prometheus_targets(dashboard: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [
        (panel, target)
        for panel in dashboard["panels"]
        for target in panel["targets"]
        if (target.get("datasource") or panel["datasource"])["type"] == "prometheus"
    ]


def _provisioned_datasources() -> dict[str, dict[str, Any]]:
    text = (COMPOSE / "grafana/datasources.yaml").read_text()
    return {d["uid"]: d for d in yaml.safe_load(text)["datasources"]}


def test_metric_names_follow_the_contract_and_prometheus_translation() -> None:
    """The Prometheus names the dashboard queries are the translation of the OTel names and
    units, and the call metrics' names and units are the ones otel-gpu declares
    (``otel_gpu.metrics.names``)."""
    from otel_gpu.metrics import names

    for name, (instrument, unit, series) in METRICS_CONTRACT.items():
        assert prometheus_series(name, instrument, unit) == series, name
    declared = {m.name: m.unit for m in vars(names).values() if isinstance(m, names.Metric)}
    for name, (_, unit, _) in METRICS_CONTRACT.items():
        if name.startswith("otel_gpu.") or name in declared:
            assert declared.get(name) == unit, f"{name}: otel-gpu declares {declared.get(name)!r}"
    assert names.FUNCTION.replace(".", "_") in METRIC_LABELS
    assert names.ERROR_TYPE.replace(".", "_") in METRIC_LABELS


def test_dashboard_is_structurally_sound() -> None:
    """The dashboard has what Grafana's schema requires (see :func:`dashboard_problems`)."""
    assert dashboard_problems(_dashboard()) == []


def test_dashboard_checker_fails_on_broken_dashboards() -> None:
    """The checker catches a duplicate panel id, overlapping panels, a panel off the grid, a
    panel without a datasource, a duplicate refId and a missing schemaVersion."""
    base = _dashboard()
    duplicate = copy.deepcopy(base)
    duplicate["panels"][1]["id"] = duplicate["panels"][0]["id"]
    overlap = copy.deepcopy(base)
    overlap["panels"][1]["gridPos"] = dict(overlap["panels"][0]["gridPos"], x=6)
    off_grid = copy.deepcopy(base)
    off_grid["panels"][0]["gridPos"]["w"] = 30
    no_source = copy.deepcopy(base)
    del no_source["panels"][0]["datasource"]
    refs = copy.deepcopy(base)
    refs["panels"][1]["targets"][1]["refId"] = refs["panels"][1]["targets"][0]["refId"]
    no_version = copy.deepcopy(base)
    del no_version["schemaVersion"]
    first, second = base["panels"][0]["id"], base["panels"][1]["id"]
    assert dashboard_problems(duplicate) == [f"panel {first}: id is not unique"]
    assert dashboard_problems(overlap) == [f"panel {second}: gridPos overlaps panel {first}"]
    assert dashboard_problems(off_grid) == [
        f"panel {first}: gridPos {off_grid['panels'][0]['gridPos']} is outside the 24-column grid",
        f"panel {second}: gridPos overlaps panel {first}",
    ]
    assert dashboard_problems(no_source) == [f"panel {first}: datasource needs a type and a uid"]
    assert dashboard_problems(refs) == [
        f"panel {second}: every target needs a refId unique in the panel"
    ]
    assert dashboard_problems(no_version) == ["dashboard: schemaVersion missing or not int"]


def test_dashboard_uses_only_provisioned_datasources() -> None:
    """Every data source a panel, a target or a template variable names is provisioned in
    ``grafana/datasources.yaml``, under the same uid and type."""
    provisioned = _provisioned_datasources()
    dashboard = _dashboard()
    used = [p["datasource"] for p in dashboard["panels"]]
    used += [
        t["datasource"] for p in dashboard["panels"] for t in p["targets"] if "datasource" in t
    ]
    used += [v["datasource"] for v in dashboard["templating"]["list"] if "datasource" in v]
    assert {u["uid"] for u in used} == {"otel-gpu-prometheus", "otel-gpu-tempo"}
    for source in used:
        assert source["uid"] in provisioned, source
        assert provisioned[source["uid"]]["type"] == source["type"], source


def test_dashboard_queries_only_the_contract_metrics_and_labels() -> None:
    """Every PromQL expression of the dashboard (panels and template variables) names metrics of
    the contract only, matches or groups on their labels, ``le``, ``job`` and ``instance`` only,
    and together the panels show every metric of the contract. The extractor itself finds a
    misspelt metric and label."""
    dashboard = _dashboard()
    allowed_labels = METRIC_LABELS | {"le", "job", "instance"}
    exprs = [t["expr"] for _, t in _prometheus_targets(dashboard)]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "textbox":  # typed by the user (request), no query
            continue
        # label_values(<series selector>, <label>): Grafana's, not PromQL
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"])
        assert match, variable["query"]["query"]
        assert match.group(2) in allowed_labels
        exprs.append(match.group(1))
    used: set[str] = set()
    for expr in exprs:
        names_in_expr = promql_metric_names(expr)
        assert names_in_expr, expr
        assert names_in_expr <= PROMETHEUS_METRICS, (expr, names_in_expr - PROMETHEUS_METRICS)
        assert promql_label_names(expr) <= allowed_labels, expr
        used |= names_in_expr
    shown = PROMETHEUS_METRICS - {
        "otel_gpu_call_duration_seconds_sum",
        "otel_gpu_call_duration_seconds_count",
        "otel_gpu_call_device_duration_seconds_sum",
        "otel_gpu_call_device_duration_seconds_count",
    }
    assert used >= shown, shown - used
    typo = 'sum by (code_function_nme) (rate(otel_gpu_calls_totl{job=~"$service"}[5m]))'
    assert promql_metric_names(typo) == {"otel_gpu_calls_totl"}
    assert promql_label_names(typo) == {"code_function_nme", "job"}


def _grafana_interpolated(expr: str) -> str:
    """An expression as Grafana sends it: ``$__rate_interval`` a duration, variables a regex."""
    expr = expr.replace("$__rate_interval", "1m")
    return re.sub(r"\$\{?\w+(?::\w+)?\}?", ".*", expr)


def test_dashboard_promql_parses() -> None:
    """Every panel expression, interpolated as Grafana would, parses with a PromQL parser
    (``promql-parser``, a Python binding of a Rust port of Prometheus's grammar), and its
    vector selectors name contract metrics only; an unbalanced expression is rejected."""
    promql_parser = pytest.importorskip("promql_parser")
    seen: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            seen.add(node.name)

    for _, target in _prometheus_targets(_dashboard()):
        promql_parser.walk(promql_parser.parse(_grafana_interpolated(target["expr"])), visit)
    assert seen and seen <= PROMETHEUS_METRICS, seen
    with pytest.raises(ValueError):
        promql_parser.parse("sum(rate(otel_gpu_calls_total[1m])")


def test_dashboard_round_trips_through_grafana_schema_models() -> None:
    """Decoded into the typed models of ``grafana-foundation-sdk`` (generated from Grafana's
    dashboard, panel and query schemas) and encoded again, the dashboard loses no key and
    changes no value: every key is one the schemas know. A misspelt key is lost."""
    pytest.importorskip("grafana_foundation_sdk")
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    plugins.register_default_plugins()

    def lost(original: Any, encoded: Any, path: str = "") -> list[str]:
        if isinstance(original, dict):
            if not isinstance(encoded, dict):
                return [path]
            return [
                p
                for key, value in original.items()
                for p in (
                    [f"{path}.{key}"]
                    if key not in encoded
                    else lost(value, encoded[key], f"{path}.{key}")
                )
            ]
        if isinstance(original, list):
            if not isinstance(encoded, list) or len(original) != len(encoded):
                return [path]
            return [
                p
                for i, (a, b) in enumerate(zip(original, encoded))
                for p in lost(a, b, f"{path}[{i}]")
            ]
        return [] if original == encoded else [path]

    def round_trip(document: dict[str, Any]) -> Any:
        return json.loads(JSONEncoder().encode(Dashboard.from_json(document)))

    dashboard = _dashboard()
    assert lost(dashboard, round_trip(dashboard)) == []
    misspelt = copy.deepcopy(dashboard)
    misspelt["panels"][0]["gridpos"] = misspelt["panels"][0].pop("gridPos")
    assert lost(misspelt, round_trip(misspelt)) == [".panels[0].gridpos"]


def test_latency_panel_shows_p50_p99_with_exemplars_linked_to_tempo() -> None:
    """The latency panel is a time series (the panel type that draws exemplars) with p99 and p50
    by ``histogram_quantile`` over the duration buckets per API, exemplars on the p99 query; the
    Prometheus data source turns the exemplar label ``trace_id`` (the name Prometheus's OTLP
    translation gives the trace id) into a link to the provisioned Tempo data source."""
    [panel] = [
        p
        for p in _dashboard()["panels"]
        if any("otel_gpu_call_duration_seconds_bucket" in t.get("expr", "") for t in p["targets"])
    ]
    assert panel["type"] == "timeseries"
    assert panel["fieldConfig"]["defaults"]["unit"] == "s"
    quantiles = {}
    for target in panel["targets"]:
        match = re.match(r"histogram_quantile\((0\.\d+), sum by \(([^)]*)\)", target["expr"])
        assert match, target["expr"]
        assert {s.strip() for s in match.group(2).split(",")} == {"le", "code_function_name"}
        quantiles[match.group(1)] = target
    assert set(quantiles) == {"0.5", "0.99"}
    assert quantiles["0.99"]["exemplar"] is True
    sources = _provisioned_datasources()
    prometheus = sources[panel["datasource"]["uid"]]
    [destination] = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert destination["name"] == "trace_id"
    assert sources[destination["datasourceUid"]]["type"] == "tempo"


def test_dashboard_panels_and_template_variables() -> None:
    """There are panels for calls/s, errors/s per API and ``error_type``, NaN/Inf calls per API,
    GPU memory (usage and limit) and utilisation per GPU UUID, and a Tempo panel of failed calls;
    every call-metric query is filtered by the ``service`` (job) and ``function`` variables, and
    every GPU query by ``service``, which are multi-valued with an ``All`` regex."""
    dashboard = _dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == {"service", "function", "request"}  # request: test_deploy_serving.py
    for variable in (variables["service"], variables["function"]):
        assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*"
    assert "job)" in variables["service"]["query"]["query"]
    assert variables["function"]["query"]["query"].endswith(", code_function_name)")
    by_metric: dict[str, set[str]] = {}
    for _, target in _prometheus_targets(dashboard):
        expr = target["expr"]
        assert 'job=~"$service"' in expr, expr
        metrics = promql_metric_names(expr)
        if any(m.startswith("otel_gpu_") for m in metrics):
            assert 'code_function_name=~"$function"' in expr, expr
        for metric in metrics:
            by_metric.setdefault(metric, set()).update(re.findall(r"\bby \(([^)]*)\)", expr))
    assert by_metric["otel_gpu_calls_total"] == {"code_function_name"}
    assert by_metric["otel_gpu_call_errors_total"] == {"code_function_name, error_type"}
    assert by_metric["otel_gpu_call_nonfinite_total"] == {"code_function_name"}
    for gauge in ("hw_gpu_memory_usage_bytes", "hw_gpu_memory_limit_bytes"):
        assert by_metric[gauge] == {"hw_id, hw_name"}, gauge
    for gauge in ("hw_gpu_utilization_ratio", "hw_gpu_memory_utilization_ratio"):
        assert by_metric[gauge] == {"hw_id, hw_name"}, gauge
    [tempo] = [
        p
        for p in dashboard["panels"]
        if p["datasource"]["type"] == "tempo" and not p["title"].startswith("Request")
    ]
    [query] = tempo["targets"]
    assert query["queryType"] == "traceql"
    assert "status = error" in query["query"]
    assert "${service:regex}" in query["query"] and "${function:regex}" in query["query"]


def test_prometheus_datasource_interval_is_otel_gpus_export_interval() -> None:
    """The Prometheus data source's interval (the basis of ``$__rate_interval``, at least four of
    them) is otel-gpu's default metrics export interval: pushed metrics have no scrape interval,
    and a shorter setting would leave ``rate()`` windows with a single point."""
    from otel_gpu import config

    interval = _provisioned_datasources()["otel-gpu-prometheus"]["jsonData"]["timeInterval"]
    match = re.fullmatch(r"(\d+)s", interval)
    assert match, interval
    assert int(match.group(1)) == config.load(env={}).metrics_interval


def test_tempo_links_spans_to_their_metrics() -> None:
    """Tempo's data source links a span to the call rate and p99 of its API in the provisioned
    Prometheus: span ``service.name`` and ``code.function.name`` map to the labels ``job`` and
    ``code_function_name``, and the queries use contract metrics with ``$$__tags`` (a literal
    ``$__tags`` after Grafana's environment expansion)."""
    sources = _provisioned_datasources()
    links = sources["otel-gpu-tempo"]["jsonData"]["tracesToMetrics"]
    assert sources[links["datasourceUid"]]["type"] == "prometheus"
    assert {t["key"]: t["value"] for t in links["tags"]} == {
        "service.name": "job",
        attributes.CODE_FUNCTION_NAME: "code_function_name",
    }
    for query in links["queries"]:
        assert "{$$__tags}" in query["query"]
        assert promql_metric_names(query["query"].replace("$$__tags", "")) <= PROMETHEUS_METRICS


def test_compose_prometheus_and_grafana_provisioning_are_wired() -> None:
    """Prometheus runs with its OTLP receiver and exemplar storage, reads the mounted config, and
    listens on the port the collector pushes to; Grafana mounts the data sources, the dashboard
    provider and the dashboards folder where the provider reads; every port of the stack is
    published on 127.0.0.1 only; every config file in deploy/compose is mounted."""
    services = yaml.safe_load((COMPOSE / "compose.yaml").read_text())["services"]
    prometheus = services["prometheus"]
    assert re.fullmatch(r"prom/prometheus:v3\.\d+\.\d+", prometheus["image"])
    flags = prometheus["command"]
    assert {"--web.enable-otlp-receiver", "--enable-feature=exemplar-storage"} <= set(flags)
    [config_flag] = [f for f in flags if f.startswith("--config.file=")]
    mounts = {_volume(v)[1]: _volume(v)[0] for v in prometheus["volumes"]}
    assert mounts[config_flag.split("=", 1)[1]] == "./prometheus.yaml"
    assert "127.0.0.1:9090:9090" in prometheus["ports"]
    assert "prometheus" in services["otelcol"]["depends_on"]
    collector = yaml.safe_load((COMPOSE / "otelcol.yaml").read_text())
    pushed = collector["exporters"]["otlp_http/prometheus"]["endpoint"]
    assert pushed == "http://prometheus:9090/api/v1/otlp"  # + /v1/metrics: Prometheus's route
    grafana = {_volume(v)[1]: _volume(v)[0] for v in services["grafana"]["volumes"]}
    provider_target = "/etc/grafana/provisioning/dashboards/otel-gpu.yaml"
    assert grafana[provider_target] == "./grafana/dashboards.yaml"
    [provider] = yaml.safe_load((COMPOSE / "grafana/dashboards.yaml").read_text())["providers"]
    assert provider["type"] == "file"
    assert grafana[provider["options"]["path"]] == "./grafana/dashboards"
    assert (COMPOSE / "grafana/dashboards" / DASHBOARD.name).is_file()
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name}: {port}"
    mounted = {
        (COMPOSE / _volume(v)[0]).resolve()
        for s in services.values()
        for v in s.get("volumes", [])
        if _volume(v)[0].startswith("./")
    }
    for path in COMPOSE.rglob("*"):
        if path.suffix in (".yaml", ".json") and path.name != "compose.yaml":
            assert path.resolve() in mounted or path.parent.resolve() in mounted, path


def test_prometheus_config_keeps_exemplars_and_promotes_few_resource_attributes() -> None:
    """prometheus.yaml stores exemplars, keeps the translation whose names the dashboard uses,
    accepts late OTLP samples, and promotes only resource attributes otel-gpu's resource sets
    (host and the Kubernetes placement it reads from the downward API)."""
    from otel_gpu import resource

    config = yaml.safe_load((COMPOSE / "prometheus.yaml").read_text())
    assert config["storage"]["exemplars"]["max_exemplars"] > 0
    assert config["otlp"]["translation_strategy"] == "UnderscoreEscapingWithSuffixes"
    assert config["storage"]["tsdb"]["out_of_order_time_window"]
    promoted = set(config["otlp"]["promote_resource_attributes"])
    emitted = set(resource.detect_attributes()) | set(resource.K8S_ENV.values())
    assert promoted <= emitted, promoted - emitted
    assert {"host.name", "k8s.pod.name"} <= promoted


def _metrics_file(trace_file: str) -> str:
    """Where otel-gpu's file destination writes metrics (``<name>.metrics.jsonl``), by its code."""
    from otel_gpu.metrics.provider import metrics_path

    return metrics_path(trace_file)


def test_spool_receivers_split_trace_and_metrics_files() -> None:
    """Each spool file is read by exactly one receiver, the one of its signal: trace files by
    ``otlp_json_file`` (traces pipeline), the ``.metrics.jsonl`` beside each by
    ``otlp_json_file/metrics`` (metrics pipeline); together their globs match both."""
    import fnmatch

    config = yaml.safe_load((COMPOSE / "otelcol.yaml").read_text())
    pipelines = config["service"]["pipelines"]
    readers = {
        "traces": config["receivers"]["otlp_json_file"],
        "metrics": config["receivers"]["otlp_json_file/metrics"],
    }
    assert "otlp_json_file" in pipelines["traces"]["receivers"]
    assert "otlp_json_file" not in pipelines["metrics"]["receivers"]
    assert "otlp_json_file/metrics" in pipelines["metrics"]["receivers"]
    assert "otlp_json_file/metrics" not in pipelines["traces"]["receivers"]

    def reads(receiver: dict[str, Any], path: str) -> bool:
        included = any(fnmatch.fnmatch(path, g) for g in receiver["include"])
        return included and not any(fnmatch.fnmatch(path, g) for g in receiver.get("exclude", []))

    for trace_file in ("/spool/spans-4711.jsonl", "/spool/demo-0-12.jsonl", "/spool/x.y.jsonl"):
        metrics_file = _metrics_file(trace_file)
        assert [s for s, r in readers.items() if reads(r, trace_file)] == ["traces"], trace_file
        assert [s for s, r in readers.items() if reads(r, metrics_file)] == ["metrics"]
    assert not any(reads(r, "/spool/README.md") for r in readers.values())


def metrics_pipeline_problems(config: dict[str, Any]) -> list[str]:
    """What is wrong with a collector's metrics routing (``[]``: sound): a ``metrics`` pipeline
    exists, it starts with memory_limiter and batches, and no metrics pipeline goes through a
    tail sampler (which decides per trace and would hold or drop metrics with it)."""
    pipelines = config["service"]["pipelines"]
    problems = []
    if "metrics" not in pipelines:
        problems.append("no metrics pipeline")
    for name, pipeline in pipelines.items():
        if name.split("/", 1)[0] != "metrics":
            continue
        processors = pipeline.get("processors") or []
        if not processors or processors[0] != "memory_limiter":
            problems.append(f"{name}: memory_limiter must come first")
        if "batch" not in processors:
            problems.append(f"{name}: no batch processor")
        for processor in processors:
            if processor.split("/", 1)[0] == "tail_sampling":
                problems.append(f"{name}: goes through the tail sampler {processor!r}")
    return problems


_METRICS_ROUTES = {
    "compose/otelcol.yaml": lambda: yaml.safe_load((COMPOSE / "otelcol.yaml").read_text()),
    "k8s/agent.yaml": lambda: _configmap_config("otel-gpu-agent"),
}


@pytest.mark.parametrize("label", sorted(_METRICS_ROUTES))
def test_collectors_route_metrics_without_tail_sampling(label: str) -> None:
    """The compose collector and the node agent each have a metrics pipeline, defined components
    only (:func:`collector_problems`), memory_limiter first, batch, and no tail sampler."""
    config = _METRICS_ROUTES[label]()
    assert metrics_pipeline_problems(config) == []
    assert collector_problems(config, CONTRIB_COMPONENTS) == []
    assert "debug" in config["service"]["pipelines"]["metrics"]["exporters"] or label.startswith(
        "k8s/"
    )


def test_no_collector_sends_metrics_through_the_tail_sampler() -> None:
    """No pipeline other than traces holds the gateway's tail sampler, in any collector config;
    the checker fails on a metrics pipeline that does, and on a config without one."""
    for label, config, _ in _collector_configs():
        for name, pipeline in config["service"]["pipelines"].items():
            if any(p.split("/", 1)[0] == "tail_sampling" for p in pipeline.get("processors") or []):
                assert name.split("/", 1)[0] == "traces", f"{label}: {name}"
    gateway = _configmap_config("otel-gpu-gateway")
    sampled = copy.deepcopy(gateway)
    sampled["service"]["pipelines"]["metrics"] = {
        "receivers": ["otlp"],
        "processors": ["memory_limiter", "tail_sampling", "batch"],
        "exporters": ["otlp_grpc/tempo"],
    }
    assert metrics_pipeline_problems(sampled) == [
        "metrics: goes through the tail sampler 'tail_sampling'"
    ]
    assert metrics_pipeline_problems(gateway) == ["no metrics pipeline"]


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
        "latency",  # slow requests (tests/test_deploy_serving.py)
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


def test_agent_sends_metrics_to_remote_write_with_the_compose_labels() -> None:
    """The agent's metrics pipeline ends in ``prometheus_remote_write`` at an endpoint the
    DaemonSet sets in an environment variable, not in the trace-ID load balancer; resource
    attributes stay in ``target_info`` except the ones ``transform/promote`` copies, which are
    exactly those compose's Prometheus promotes (the same labels in both set-ups)."""
    config = _configmap_config("otel-gpu-agent")
    pipeline = config["service"]["pipelines"]["metrics"]
    assert pipeline["exporters"] == ["prometheus_remote_write"]
    assert pipeline["processors"] == [
        "memory_limiter",
        "k8s_attributes",
        "transform/promote",
        "batch",
    ]
    exporter = config["exporters"]["prometheus_remote_write"]
    variable = re.fullmatch(r"\$\{env:(\w+)\}", exporter["endpoint"])
    [container] = _k8s("DaemonSet", "otel-gpu-agent")["spec"]["template"]["spec"]["containers"]
    assert variable and _env(container)[variable.group(1)].startswith("http")
    assert exporter["resource_to_telemetry_conversion"] == {"enabled": False}
    assert exporter["target_info"] == {"enabled": True}
    [group] = config["processors"]["transform/promote"]["metric_statements"]
    assert group["context"] == "datapoint"
    copied = set()
    for statement in group["statements"]:
        match = re.fullmatch(
            r'set\(attributes\["([\w.]+)"\], resource\.attributes\["\1"\]\) '
            r'where resource\.attributes\["\1"\] != nil',
            statement,
        )
        assert match, statement
        copied.add(match.group(1))
    prometheus = yaml.safe_load((COMPOSE / "prometheus.yaml").read_text())
    assert copied == set(prometheus["otlp"]["promote_resource_attributes"])


def test_serving_example_sends_metrics_to_its_agent() -> None:
    """The example pod turns metrics on and sends them over gRPC, the protocol of the agent's
    hostPort its endpoint names, as its traces."""
    from otel_gpu import config

    [container] = _k8s("Deployment", "gpu-serving-example")["spec"]["template"]["spec"][
        "containers"
    ]
    env = _env(container)
    assert config.load(env={"OTEL_GPU_METRICS": env["OTEL_GPU_METRICS"]}).metrics is True
    assert env["OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"] == "grpc"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4317")

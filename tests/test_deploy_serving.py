"""deploy/ for serving: the gateway keeps the step traces a failed or slow request links to, and the
dashboard's "request → calls" panel follows the links (offline, as tests/test_deploy.py checks
the rest of deploy/).

The attribute the step policy tests and the links the panel's TraceQL follows are taken from
spans otel-gpu really produces inside ``otel_gpu.batch``.
"""

from __future__ import annotations

import re
from typing import Any

import otel_gpu

try:
    from test_deploy import _configmap_config, _dashboard, dashboard_problems
except ModuleNotFoundError:  # tests/ imported as a package
    from tests.test_deploy import _configmap_config, _dashboard, dashboard_problems

_OTTL_SPAN = re.compile(r'attributes\["(?P<key>[\w.]+)"\] > 0')
TP = ["00-" + f"{i + 1:032x}" + "-" + f"{i + 1:016x}" + "-01" for i in range(3)]


def _policies() -> dict[str, dict[str, Any]]:
    config = _configmap_config("otel-gpu-gateway")
    return {p["name"]: p for p in config["processors"]["tail_sampling"]["policies"]}


def test_the_gateway_keeps_every_step_trace_and_slow_requests(otel_gpu_spans: Any) -> None:
    """``keep-batch-steps`` keeps a trace with a span whose ``otel_gpu.batch.links`` is above 0,
    which the step span and every call of a step of several requests carry (and a call outside a
    step does not); ``keep-slow-requests`` keeps traces past a latency threshold."""
    spans = otel_gpu_spans(level=1)

    @otel_gpu.api(name="deploy_test.forward")
    def forward(x: int) -> int:
        return x

    with otel_gpu.batch(requests=TP):
        forward(1)
    forward(2)
    policy = _policies()["keep-batch-steps"]
    assert policy["type"] == "ottl_condition"
    [condition] = policy["ottl_condition"]["span"]
    match = _OTTL_SPAN.fullmatch(condition)
    assert match, condition
    key = match.group("key")
    got = spans.get()
    inside = [s for s in got if s.links]
    outside = [s for s in got if not s.links]
    assert {s.name for s in inside} == {"otel_gpu.batch", "deploy_test.forward"}
    assert all(s.attributes[key] > 0 for s in inside)
    assert all(key not in s.attributes for s in outside)
    slow = _policies()["keep-slow-requests"]
    assert slow["type"] == "latency" and slow["latency"]["threshold_ms"] > 0


def test_the_request_panel_follows_links_to_a_request_trace(otel_gpu_spans: Any) -> None:
    """The panel's TraceQL selects spans by ``link:traceID`` against the ``request`` text
    variable (and the service filter); otel-gpu's step and call spans carry the request's trace
    id in their links; the dashboard stays structurally sound."""
    dashboard = _dashboard()
    assert dashboard_problems(dashboard) == []
    [panel] = [p for p in dashboard["panels"] if p["title"].startswith("Request → calls")]
    assert panel["datasource"]["type"] == "tempo"
    [target] = panel["targets"]
    assert target["queryType"] == "traceql"
    assert 'link:traceID = "${request}"' in target["query"]
    assert "${service:regex}" in target["query"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["request"]["type"] == "textbox"

    spans = otel_gpu_spans(level=1)

    @otel_gpu.api(name="deploy_test.forward")
    def forward(x: int) -> int:
        return x

    with otel_gpu.batch(requests=TP):
        forward(1)
    request_trace = int(TP[1].split("-")[1], 16)
    assert all(any(link.context.trace_id == request_trace for link in s.links) for s in spans.get())

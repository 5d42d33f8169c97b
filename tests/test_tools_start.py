"""The trace tools and the front door start without torch: ``import otel_gpu``, ``otel-gpu
--help``, ``show``, ``ship`` (sending to a real OTLP receiver), ``recover --help`` and ``info
--help`` leave ``torch`` out of ``sys.modules``, while the public API still resolves on use.

Each check runs in a fresh interpreter, since this test process has imported torch already.
The assertions are on the module set, never on times (``otel-gpu bench`` measures those).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from commands import python_command

REPO = Path(__file__).resolve().parent.parent

_LINE = {
    "resourceSpans": [
        {
            "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "s"}}]},
            "scopeSpans": [
                {
                    "scope": {"name": "otel_gpu"},
                    "spans": [
                        {
                            "traceId": "0af7651916cd43dd8448eb211c80319c",
                            "spanId": f"{i + 1:016x}",
                            "name": f"op{i}",
                            "startTimeUnixNano": "1000",
                            "endTimeUnixNano": "2000",
                        }
                        for i in range(3)
                    ],
                }
            ],
        }
    ]
}

_PROGRAM = """
import contextlib, io, json, sys
sys.path.insert(0, {tests!r})
import otel_gpu
import otel_gpu.cli, otel_gpu.cli.show, otel_gpu.cli.ship, otel_gpu.cli.recover, otel_gpu.cli.info
import otel_gpu.traces.reader, otel_gpu.traces.show, otel_gpu.traces.ship
from otel_gpu.cli import main
from otlp_receiver import grpc_receiver, http_receiver

codes = {{}}
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    for args in (["--help"], ["show", "--help"], ["ship", "--help"], ["recover", "--help"],
                 ["info", "--help"]):
        try:
            codes[" ".join(args)] = main(args)
        except SystemExit as exc:
            codes[" ".join(args)] = exc.code
    codes["show"] = main(["show", "--no-color", {path!r}])
    codes["ship --check"] = main(["ship", "--check", {path!r}])
    for protocol, receiver in (("grpc", grpc_receiver), ("http/protobuf", http_receiver)):
        with receiver() as rx:
            import os
            os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = protocol
            os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = rx.endpoint
            codes["ship " + protocol] = main(["ship", {path!r}])
            received = sorted(s.span_id.hex() for _, s in rx.received.wait_for_spans(3))
            codes["received " + protocol] = received
print(json.dumps({{
    "codes": codes,
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    "api_is_lazy": "otel_gpu.calls.decorator" not in sys.modules,
}}))
"""


def _run(program: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = python_command(["-c", program], env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_trace_tools_run_without_importing_torch(tmp_path: Path) -> None:
    """``--help`` of the tools, ``show`` of a file, ``ship --check`` and ``ship`` to a gRPC and
    an HTTP receiver all succeed (every span arrives), and torch was never imported."""
    path = tmp_path / "spans.jsonl"
    path.write_text(json.dumps(_LINE) + "\n")
    result = _run(_PROGRAM.format(tests=str(REPO / "tests"), path=str(path)))
    ids = [f"{i + 1:016x}" for i in range(3)]
    assert result["codes"] == {
        "--help": 0,
        "show --help": 0,
        "ship --help": 0,
        "recover --help": 0,
        "info --help": 0,
        "show": 0,
        "ship --check": 0,
        "ship grpc": 0,
        "received grpc": ids,
        "ship http/protobuf": 0,
        "received http/protobuf": ids,
    }
    assert result["torch"] == []
    assert result["api_is_lazy"]


def test_the_public_api_resolves_on_first_use() -> None:
    """``import otel_gpu`` imports no torch; ``otel_gpu.api``, ``from otel_gpu import
    instrument`` and ``dir(otel_gpu)`` give the same objects as their defining modules, and the
    ``instrumentation`` package stays a package beside the ``instrument`` function."""
    program = """
import json, sys
import otel_gpu
before = "torch" in sys.modules
names = dir(otel_gpu)
from otel_gpu import instrument, api
import otel_gpu.instrumentation
from otel_gpu.runtime import api as real_api
from otel_gpu.instrumentation.targets import instrument as real_instrument
try:
    otel_gpu.no_such_name
    missing = "no error"
except AttributeError as exc:
    missing = str(exc)
print(json.dumps({
    "torch_before": before,
    "all_listed": sorted(set(otel_gpu.__all__) - set(names)),
    "same": [otel_gpu.api is real_api, api is real_api, instrument is real_instrument,
             otel_gpu.instrument is real_instrument],
    "package": type(otel_gpu.instrumentation).__name__,
    "star": sorted(n for n in otel_gpu.__all__ if not hasattr(otel_gpu, n)),
    "missing": missing,
}))
"""
    result = _run(program)
    assert result == {
        "torch_before": False,
        "all_listed": [],
        "same": [True, True, True, True],
        "package": "module",
        "star": [],
        "missing": "module 'otel_gpu' has no attribute 'no_such_name'",
    }

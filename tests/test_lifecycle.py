"""Process lifecycle: spans still queued at exit are written; forked children write their own files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap

from commands import python_command


def _run(code: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    full_env.update(env)
    return python_command(["-c", textwrap.dedent(code)], env=full_env, timeout=timeout)


def _span_names(path) -> list[str]:
    names = []
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                names.extend(s["name"] for s in ss["spans"])
    return names


def test_queued_spans_are_flushed_at_normal_exit(tmp_path):
    """A program that never calls flush() still gets every span into its .jsonl file at exit."""
    out = tmp_path / "t.jsonl"
    result = _run(
        """
        import otel_gpu
        @otel_gpu.api
        def f(i):
            return i
        for i in range(500):
            f(i)
        """,
        {"OTEL_GPU_LOGLEVEL": "1", "OTEL_GPU_LOGDEST": str(out)},
    )
    assert result.returncode == 0, result.stderr
    assert len(_span_names(out)) == 500


def test_exit_flush_runs_before_the_applications_provider_shuts_down(tmp_path):
    """With the app's global provider (created first), otel-gpu's queued spans still reach its exporter at exit."""
    out = tmp_path / "app.jsonl"
    result = _run(
        f"""
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.exporter.otlp.json.file import FileSpanExporter
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(FileSpanExporter({str(out)!r})))
        trace.set_tracer_provider(provider)
        import otel_gpu
        @otel_gpu.api
        def f(i):
            return i
        with trace.get_tracer("app").start_as_current_span("request"):
            for i in range(50):
                f(i)
        """,
        {"OTEL_GPU_LOGLEVEL": "1"},
    )
    assert result.returncode == 0, result.stderr
    names = _span_names(out)
    assert names.count("request") == 1
    assert len([n for n in names if n.endswith(".f")]) == 50


def test_forked_child_writes_its_own_file(tmp_path):
    """With %i in the path, a fork child builds its own pipeline and file; no line is shared or torn."""
    pattern = str(tmp_path / "t_%i.jsonl")
    result = _run(
        """
        import os, otel_gpu
        @otel_gpu.api
        def f(i):
            return i
        f(0)
        pid = os.fork()
        if pid == 0:
            for i in range(20):
                f(i)
            os._exit(0 if otel_gpu.flush() else 1)
        _, status = os.waitpid(pid, 0)
        for i in range(10):
            f(i)
        print(pid, status)
        """,
        {"OTEL_GPU_LOGLEVEL": "1", "OTEL_GPU_LOGDEST": pattern},
    )
    assert result.returncode == 0, result.stderr
    child_pid, status = (int(x) for x in result.stdout.split())
    assert status == 0
    # each process's spans, and its metrics beside them (on by default for a .jsonl file)
    files = sorted(f for f in tmp_path.glob("t_*.jsonl") if not f.name.endswith(".metrics.jsonl"))
    assert len(files) == 2
    assert len(list(tmp_path.glob("t_*.metrics.jsonl"))) == 2
    child = tmp_path / f"t_{child_pid}.jsonl"
    assert len(_span_names(child)) == 20
    parent = next(f for f in files if f != child)
    assert len(_span_names(parent)) == 11


_SLOW_EXPORT = """
    import sys, time
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
    import otel_gpu

    class SlowExporter(SpanExporter):  # a destination slower than the program: 2 ms a span
        def __init__(self, path):
            self.out = open(path, "a")

        def export(self, spans):
            for span in spans:
                time.sleep(0.002)
                self.out.write(span.name + "\\n")
            self.out.flush()
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(SlowExporter(sys.argv[1])))
    otel_gpu.configure(level=1, tracer_provider=provider)

    @otel_gpu.api
    def f(i):
        return i

    for i in range(2000):
        f(i)
    # ends at once: ~4 s of export still queued
"""


def _slow_exit(tmp_path, **env: str) -> tuple[subprocess.CompletedProcess, int]:
    out = tmp_path / "names.txt"
    proc = python_command(
        ["-c", textwrap.dedent(_SLOW_EXPORT), str(out)],
        env={**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, **env},
        timeout=300,
    )
    return proc, len(out.read_text().splitlines()) if out.exists() else 0


def test_exit_builds_every_queued_span_by_default(tmp_path):
    """With OTEL_GPU_FLUSH_TIMEOUT unset, exit waits for every queued span while export makes
    progress: a run whose spans take longer than the old fixed 3 s to export loses none (it lost
    15% of a level-5 run), and nothing is reported dropped."""
    proc, delivered = _slow_exit(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert delivered == 2000
    assert "dropped" not in proc.stderr


def test_an_explicit_flush_timeout_bounds_exit_and_counts_the_loss(tmp_path):
    """OTEL_GPU_FLUSH_TIMEOUT set is the user's choice of a bound: exit stops building spans
    then, and says how many it left."""
    proc, delivered = _slow_exit(tmp_path, OTEL_GPU_FLUSH_TIMEOUT="0.5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert delivered < 2000
    match = re.search(r"otel-gpu dropped (\d+) span\(s\)", proc.stderr)
    assert match and int(match.group(1)) >= 2000 - delivered

"""The front door: every ``otel-gpu`` command reports a bad setting or a bad flag the same way
(one stderr line naming the variable or flag and what is allowed, exit 2, no traceback), the
console says where a level-10 call's dump went, ``bench`` labels a budget MET only within its
limit, and an instrument target whose module was never imported is reported at exit.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from commands import otel_gpu_command, python_command
from jsonl_spans import read_spans

import otel_gpu
from otel_gpu import bench
from otel_gpu.bench import report as _report
from otel_gpu.instrumentation import targets

REPO = Path(__file__).resolve().parent.parent
COMMANDS = ("demo", "info", "run", "show", "replay", "recover", "ship", "bench")
LEVELS_ALLOWED = "0, 1, 3, 5, 10"


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FLASHINFER_"))}
    env["XDG_RUNTIME_DIR"] = str(tmp)
    env.update(extra)
    return env


def _otel_gpu(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return otel_gpu_command(args, env, cwd=cwd, timeout=300)


def _valid_args(command: str, tmp: Path) -> list[str]:
    """Arguments that are fine on their own, so that only the setting or flag under test is wrong."""
    trace = tmp / "trace.jsonl"
    trace.write_text("")
    return {
        "demo": [],
        "info": [],
        "run": ["--", sys.executable, "-c", "pass"],
        "show": [str(trace)],
        "replay": ["--dir", str(tmp)],
        "recover": [str(tmp)],
        "ship": ["--check", str(trace)],
        "bench": ["--quick", "--only", "bare"],
    }[command]


def _bad_flag(command: str) -> tuple[list[str], str]:
    """A bad level flag: ``--level=2`` where the command has one, else an option it does not know
    (one token, so that a command with positional arguments cannot take the 2 for one)."""
    if command in ("demo", "run"):
        return ["--level=2"], "argument --level: '2'"
    return ["--level=2"], "unrecognized arguments: --level=2"


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """Every command three ways (bad OTEL_GPU_LOGLEVEL, bad level flag, --help), run at once:
    each process imports torch, so one after the other would take minutes."""
    tmp = tmp_path_factory.mktemp("front_door")
    jobs = {}
    for command in COMMANDS:
        args = _valid_args(command, tmp)
        flag, _ = _bad_flag(command)
        jobs[(command, "env")] = ([command, *args], _env(tmp, OTEL_GPU_LOGLEVEL="7"))
        # the flag goes before run's program, where run reads its own options
        jobs[(command, "flag")] = ([command, *flag, *args], _env(tmp))
        jobs[(command, "help")] = ([command, "--help"], _env(tmp))
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = {key: pool.submit(_otel_gpu, args, env, tmp) for key, (args, env) in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


READS_LEVEL = tuple(c for c in COMMANDS if c not in ("show", "replay"))


@pytest.mark.parametrize("command", READS_LEVEL)
def test_a_bad_level_in_the_environment_is_one_line_and_exit_2(ran, command):
    """Every command that reads the settings, not only run and recover: OTEL_GPU_LOGLEVEL=7 gives
    one stderr line that names the command, the variable, the value and the allowed levels, exit
    2, no traceback."""
    proc = ran[(command, "env")]
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc)
    assert line.startswith(f"otel-gpu {command}: OTEL_GPU_LOGLEVEL='7' (environment) is invalid")
    assert LEVELS_ALLOWED in line


@pytest.mark.parametrize("command", ("show", "replay"))
def test_a_bad_level_a_command_never_reads_is_not_its_error(ran, command):
    """`show` reads a trace file and `replay` runs at level 1 whatever the environment says: a bad
    OTEL_GPU_LOGLEVEL is not theirs to refuse, so they do their own work and never name it."""
    proc = ran[(command, "env")]
    assert "OTEL_GPU_LOGLEVEL" not in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip(), "the command's own outcome (no spans, no dumps) is reported"


@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_level_flag_is_one_line_naming_the_flag(ran, command):
    """`--level 2` is one line naming the flag (and, where the command has it, the allowed
    levels), without argparse's usage block and without blaming configure(); exit 2."""
    proc = ran[(command, "flag")]
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc)
    _, expected = _bad_flag(command)
    assert line.startswith(f"otel-gpu {command}: {expected}"), line
    assert "configure()" not in line and "usage:" not in line
    if command in ("demo", "run"):
        assert LEVELS_ALLOWED in line


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_clean(ran, command):
    """`otel-gpu COMMAND --help` prints its usage on stdout, nothing on stderr, and exits 0."""
    proc = ran[(command, "help")]
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith(f"usage: otel-gpu {command}")


def test_the_flag_beats_the_environment(tmp_path):
    """A level given as a flag is what the command uses: a bad OTEL_GPU_LOGLEVEL it overrides
    does not stop `otel-gpu run --level 1`."""
    env = _env(tmp_path, OTEL_GPU_LOGLEVEL="7")
    args = ["run", "--level", "1", "--dest", str(tmp_path / "t.jsonl")]
    proc = _otel_gpu([*args, "--", sys.executable, "-c", "print('ran')"], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ran\n"


def test_an_unwritable_dest_flag_names_the_flag(tmp_path):
    """`--dest` is checked as OTEL_GPU_LOGDEST is (a missing directory), and the line names the
    flag rather than the variable or configure()."""
    missing = tmp_path / "no" / "such" / "t.jsonl"
    proc = _otel_gpu(["demo", "--dest", str(missing)], _env(tmp_path), tmp_path)
    assert proc.returncode == 2
    line = _one_line(proc)
    assert line.startswith(f"otel-gpu demo: argument --dest: {str(missing)!r} is invalid")
    assert "does not exist" in line and "configure()" not in line


# --------------------------------------------------------------------------- the console at level 10


def test_the_level_10_console_says_where_the_dump_went(tmp_path):
    """The end-of-call block of a level-10 call has a `dump: DIR` line naming the call's dump
    directory, which exists and holds its manifest; the pre-call block, printed before the
    recorder has named it, has none. A call the recorder filters out says why instead."""
    log = tmp_path / "console.txt"
    otel_gpu.configure(
        level=10, dest=str(log), dump_dir=str(tmp_path / "dumps"), dump_exclude="*skip_me"
    )

    @otel_gpu.api
    def double(x: int) -> int:
        return 2 * x

    @otel_gpu.api
    def skip_me(x: int) -> int:
        return x

    assert double(3) == 6 and skip_me(1) == 1
    otel_gpu.flush()
    text = log.read_text()
    dumps = [line for line in text.splitlines() if line.startswith("  dump: ")]
    assert len(dumps) == 1, text
    directory = Path(dumps[0].removeprefix("  dump: "))
    assert directory.parent == tmp_path / "dumps" and (directory / "manifest.json").is_file()
    lines = text.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("▶ ") and "double" in x)
    block = []  # double's ▶ block: printed before the recorder named the directory
    for line in lines[start + 1 :]:
        if line.startswith(("─", "◀")):
            break
        block.append(line)
    assert block and not any("dump" in line for line in block)
    end = next(i for i, x in enumerate(lines) if x.startswith("◀ ") and "double" in x)
    assert lines.index(dumps[0]) > end  # in double's ◀ block
    assert "  not dumped: filtered" in text


# --------------------------------------------------------------------------- bench labels


def _ours1_vs_fi1(ratio: float) -> dict:
    fi1 = bench.Result(bench._BY_NAME["fi1"], status="ready", n=1, caller=[100.0], total=[100.0])
    ours = 100.0 * ratio
    ours1 = bench.Result(bench._BY_NAME["ours1"], status="ready", n=1, caller=[ours], total=[ours])
    for r in (fi1, ours1):
        r.calls = r.spans = 1
    return _report.build({"fi1": fi1, "ours1": ours1}, device="cpu", rounds=1, target_s=0.01)


@pytest.mark.parametrize(
    ("ratio", "status", "shown"),
    [
        (0.99, "met", "[MET   ] level 1 total ≤ 1.0× FlashInfer level 1: 0.990× (limit 1.0×)"),
        (1.0, "met", "[MET   ] level 1 total ≤ 1.0× FlashInfer level 1: 1.000× (limit 1.0×)"),
        (1.08, "missed", "[MISSED] level 1 total ≤ 1.0× FlashInfer level 1: 1.080× (limit 1.0×)"),
        (1.0004, "missed", "[MISSED] level 1 total ≤ 1.0× FlashInfer level 1: 1.0004× (limit"),
    ],
)
def test_a_budget_is_met_only_within_its_limit(ratio, status, shown):
    """A ratio budget is MET at or under its limit and MISSED above it, and the printed ratio
    never rounds onto the wrong side of the limit (1.0004 is not shown as 1.000)."""
    report = _ours1_vs_fi1(ratio)
    budget = next(b for b in report["budgets"] if b["name"].startswith("level 1 total"))
    assert budget["status"] == status
    assert shown in _report.render(report)


def test_the_identity_budget_claims_no_ratio_limit():
    """Level 0 is met because the decorator returned the function itself; the measured ratio
    of two calls of one function is noise, printed as such, never as `1.080× (limit 1.0×)`."""
    bare = bench.Result(bench._BY_NAME["bare"], status="ready", n=1, caller=[100.0], total=[100.0])
    ours0 = bench.Result(
        bench._BY_NAME["ours0"], status="ready", n=1, caller=[108.0], total=[108.0]
    )
    ours0.info = {"identity": True}
    report = _report.build({"bare": bare, "ours0": ours0}, device="cpu", rounds=1, target_s=0.01)
    budget = next(b for b in report["budgets"] if b["name"].startswith("level 0"))
    assert budget["status"] == "met" and budget["limit"] is None
    line = next(x for x in _report.render(report).splitlines() if "level 0 is" in x)
    assert line.startswith("  [MET   ]") and "(limit" not in line and "1.08×, not a budget" in line


# --------------------------------------------------------------------------- never imported


def test_a_target_never_imported_is_reported_once_at_exit(tmp_path):
    """`otel-gpu run --instrument nosuchmod_xyz` warns once, at the program's exit, that nothing
    was instrumented for it; a Python process the program starts does not repeat it."""
    program = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'], check=True)"
    args = ["run", "--level", "1", "--dest", str(tmp_path / "t.jsonl")]
    args += ["--instrument", "nosuchmod_xyz", "--", sys.executable, "-c", program]
    proc = _otel_gpu(args, _env(tmp_path), tmp_path)
    assert proc.returncode == 0, proc.stderr
    expected = (
        "otel-gpu: instrument target 'nosuchmod_xyz' was never imported in this process; "
        "nothing was instrumented for it"
    )
    assert proc.stderr.splitlines() == [expected]


def test_an_imported_target_is_not_reported(tmp_path):
    """A target the program imports (so it was instrumented) gets no exit warning."""
    (tmp_path / "frontdoor_target.py").write_text("def f():\n    return 1\n")
    args = ["run", "--level", "1", "--dest", str(tmp_path / "t.jsonl")]
    args += ["--instrument", "frontdoor_target", "--", sys.executable, "-c"]
    args += ["import frontdoor_target; frontdoor_target.f()"]
    proc = _otel_gpu(args, _env(tmp_path), tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert [s["name"] for s in read_spans(tmp_path / "t.jsonl")] == ["frontdoor_target.f"]


def test_instrument_from_code_reports_at_exit_too(tmp_path):
    """`otel_gpu.instrument()` called by the program itself: a dotted path and a glob that
    matched nothing are listed in one line at exit; an applied target is not."""
    (tmp_path / "frontdoor_applied.py").write_text("def dumps(x):\n    return str(x)\n")
    code = (
        "import otel_gpu, frontdoor_applied; "
        f"otel_gpu.configure(level=1, dest={str(tmp_path / 't.jsonl')!r}); "
        "otel_gpu.instrument('nosuch_a.fn'); otel_gpu.instrument('nosuch_b.*'); "
        "otel_gpu.instrument('frontdoor_applied.dumps')"
    )
    proc = python_command(["-c", code], env=_env(tmp_path), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0
    assert proc.stderr.splitlines() == [
        "otel-gpu: instrument targets 'nosuch_a.fn', 'nosuch_b.*' were never imported in this "
        "process; nothing was instrumented for them"
    ]


def test_never_imported_forgets_a_target_once_its_module_is_imported(module_factory, tmp_path):
    """`never_imported()` lists a pending target until its module is imported and instrumented."""
    otel_gpu.configure(level=1, dest=str(tmp_path / "t.jsonl"))
    (tmp_path / "frontdoor_late.py").write_text("def g():\n    return 2\n")
    sys.path.insert(0, str(tmp_path))
    try:
        otel_gpu.instrument("frontdoor_late")
        assert targets.never_imported() == ["frontdoor_late"]
        import frontdoor_late  # noqa: F401

        assert targets.never_imported() == []
        assert "frontdoor_late.g" in targets.instrumented()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("frontdoor_late", None)


@pytest.mark.slow
def test_bench_progress_gives_each_rounds_own_time(tmp_path):
    """Progress lines give each round's own time, not the time since start (which read as
    100 s per round): their sum stays within the whole run, worker start-up included."""
    log = io.StringIO()
    started = time.monotonic()
    bench.run(rounds=3, target_s=0.005, only=["bare"], device="cpu", workdir=str(tmp_path), log=log)
    wall = time.monotonic() - started
    rounds = [
        float(t) for t in re.findall(r"^round \d/3 done in ([\d.]+) s$", log.getvalue(), re.M)
    ]
    assert len(rounds) == 3, log.getvalue()
    assert sum(rounds) <= wall
    assert re.search(r"^workers ready and calibrated in \d+ s", log.getvalue(), re.M)


@pytest.mark.parametrize("entry", ["otel-gpu", "python -m otel_gpu"])
def test_the_demo_has_public_span_names_and_one_service_name(tmp_path, entry):
    """The demo's spans are named by a public-looking module (``otel_gpu.demo.*``, not a private
    ``otel_gpu.cli._demo_lib``), and its service is ``otel-gpu-demo`` however it is started (it
    was ``otel_gpu`` under ``python -m`` and ``otel-gpu`` under the script)."""
    trace = tmp_path / "demo.jsonl"
    script = Path(sys.executable).with_name("otel-gpu")
    head = [str(script)] if entry == "otel-gpu" else [sys.executable, "-m", "otel_gpu"]
    proc = subprocess.run(
        [*head, "demo", "--level", "1", "--dest", str(trace)],
        env=_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    spans = read_spans(trace, plain=True)
    names = {s["name"] for s in spans}
    assert {"otel_gpu.demo.rms_norm", "otel_gpu.demo.gather_rows"} <= names
    assert not any("_demo" in name for name in names)
    assert {s["resource"]["service.name"] for s in spans} == {"otel-gpu-demo"}

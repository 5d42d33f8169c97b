"""``otel-gpu ranks``: the rank behind, where it is, and divergences, from every rank's files;
exit 0 when the ranks agree, 1 when one is behind or they diverged, 2 on bad input.

Crafted files pin each rule; two real 4-rank gloo jobs pin the whole path: one rank sleeping
before its 8th ``all_reduce`` (spans, recover, ranks), and one rank with a different shape."""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path
from typing import Any

import crafted_calls
import distributed_job
from commands import otel_gpu_command, without_otel
from jsonl_spans import read_spans

from otel_gpu.traces import ranks as ranks_module

SECOND = 1_000_000_000


class Rank:
    """Spans of one rank, written as otel-gpu writes them (or, ``collector``, with base64 ids
    and snake_case keys as other producers do)."""

    def __init__(self, rank: int, world: int = 4) -> None:
        self.rank = rank
        self.world = world
        self.spans: list[dict[str, Any]] = []
        self.clock = 1_000 * SECOND
        self.seq = 0

    def _span(self, name: str, attrs: dict[str, Any], *, seconds: float = 0.001, **extra) -> str:
        span_id = os.urandom(8).hex()
        start = self.clock
        self.clock += int(seconds * SECOND) + SECOND // 1000
        span = {
            "traceId": os.urandom(16).hex(),
            "spanId": span_id,
            "name": name,
            "startTimeUnixNano": str(start),
            "endTimeUnixNano": str(start + int(seconds * SECOND)),
            "attributes": crafted_calls.attrs(attrs),
            **extra,
        }
        self.spans.append(span)
        return span_id

    def collective(self, op: str = "all_reduce", shape: tuple[int, ...] = (4,), **kw) -> str:
        self.seq += 1
        attrs = {
            "otel_gpu.collective.op": op,
            "otel_gpu.collective.group.id": "0",
            "otel_gpu.collective.group.name": "default_pg",
            "otel_gpu.collective.group.ranks": list(range(self.world)),
            "otel_gpu.collective.group.size": self.world,
            "otel_gpu.collective.group.rank": self.rank,
            "otel_gpu.collective.seq": self.seq,
            "otel_gpu.collective.async_op": False,
            "otel_gpu.input.tensor.shape": list(shape),
            "otel_gpu.input.tensor.dtype": kw.pop("dtype", "torch.float32"),
        }
        return self._span(f"torch.distributed.{op}", attrs, **kw)

    def recovered(self, name: str, seconds: float) -> str:
        """A call in flight when the process died, as otel-gpu recover exports it."""
        return self._span(
            name,
            {"otel_gpu.recovered": True},
            seconds=seconds,
            status={"code": 2, "message": "process died during call"},
        )

    def call(self, name: str) -> str:
        return self._span(name, {})

    def stuck(self, span_id: str, name: str, seconds: float, frames: list[str]) -> None:
        stack = "".join(
            f'  File "{f}", line {i + 1}, in fn{i}\n    x()\n' for i, f in enumerate(frames)
        )
        self._span(
            f"otel_gpu.stuck {name}",
            {
                "otel_gpu.stuck": True,
                "otel_gpu.stuck.seconds": seconds,
                "otel_gpu.stuck.span_id": span_id,
                "otel_gpu.stuck.call": name,
            },
            events=[
                {
                    "name": "otel_gpu.thread_stack",
                    "timeUnixNano": str(self.clock),
                    "attributes": crafted_calls.attrs(
                        {"otel_gpu.stuck.thread": True, "code.stacktrace": stack}
                    ),
                }
            ],
        )

    def write(self, directory: Path, collector: bool = False) -> str:
        resource = {
            "attributes": crafted_calls.attrs({"service.name": "job", "otel_gpu.rank": self.rank})
        }
        if collector:
            spans = [
                {
                    **{k: v for k, v in s.items() if k not in ("traceId", "spanId")},
                    "trace_id": base64.b64encode(bytes.fromhex(s["traceId"])).decode(),
                    "span_id": base64.b64encode(bytes.fromhex(s["spanId"])).decode(),
                }
                for s in self.spans
            ]
            line = {"resource_spans": [{"resource": resource, "scope_spans": [{"spans": spans}]}]}
        else:
            line = {
                "resourceSpans": [{"resource": resource, "scopeSpans": [{"spans": self.spans}]}]
            }
        path = directory / f"spans-{self.rank}.jsonl"
        path.write_text(json.dumps(line) + "\n")
        return str(path)


def _run(paths: list[str], as_json: bool = False) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = ranks_module.ranks(paths, as_json=as_json, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _job(n: int = 4) -> list[Rank]:
    return [Rank(r, n) for r in range(n)]


def test_ranks_that_agree_exit_0(tmp_path):
    """Every rank completed the same collectives: exit 0, 'all ranks agree'."""
    job = _job()
    for r in job:
        for _ in range(5):
            r.collective()
    code, out, _ = _run([r.write(tmp_path) for r in job])
    assert code == 0
    assert "last completed by every rank: #5 all_reduce" in out
    assert "all ranks agree" in out


def test_the_rank_that_never_entered_is_named_with_where_it_is(tmp_path):
    """Ranks 0, 1, 3 died inside their 8th all_reduce (recovered spans, no sequence number);
    rank 2 never entered it: it is named, with its last collective and its stuck call's top
    frames, and how long the others waited. The collector's format is read too."""
    job = _job()
    for r in job:
        for _ in range(7):
            r.collective()
    for r in (job[0], job[1], job[3]):
        r.recovered("torch.distributed.all_reduce", seconds=42.0)
    load = job[2].recovered("mylib.load_batch", seconds=44.0)
    job[2].stuck(load, "mylib.load_batch", 30.0, ["/app/main.py", "/app/data.py"])
    paths = [r.write(tmp_path, collector=(r.rank == 1)) for r in job]
    code, out, _ = _run(paths)
    assert code == 1
    assert "last completed by every rank: #7 all_reduce" in out
    assert "stalled at #8 all_reduce: entered by ranks 0, 1, 3, never by rank 2" in out
    assert "waited 42.0 s" in out
    assert "rank 2 is behind: last collective #7 all_reduce" in out
    assert "in flight: mylib.load_batch" in out
    assert "/app/data.py:2 in fn1" in out.split("top frames")[1].splitlines()[1]
    code, out, _ = _run(paths, as_json=True)
    report = json.loads(out)
    assert code == 1 and report["status"] == "straggler"
    (group,) = report["groups"]
    assert group["stalled"]["seq"] == 8 and group["stalled"]["missing"] == [2]
    assert [b["rank"] for b in group["behind"]] == [2]


def test_a_function_call_some_ranks_are_in_and_one_never_entered(tmp_path):
    """Decorated functions line up by their k-th call: ranks in flight in their 3rd step while
    rank 1 never started it make rank 1 the one behind."""
    job = _job(3)
    for r in job:
        r.call("train.step")
        r.call("train.step")
    job[0].recovered("train.step", 5.0)
    job[2].recovered("train.step", 5.0)
    code, out, _ = _run([r.write(tmp_path) for r in job])
    assert code == 1
    assert "function train.step" in out
    assert "stalled at #3 train.step: entered by ranks 0, 2, never by rank 1" in out


def test_different_shapes_or_collectives_at_one_number_are_a_divergence(tmp_path):
    """Same sequence number, a different shape on one rank, then a different op: both reported."""
    job = _job()
    for r in job:
        r.collective()
        r.collective(shape=(8,) if r.rank == 3 else (4,))
        r.collective(op="broadcast" if r.rank == 0 else "all_reduce")
    code, out, _ = _run([r.write(tmp_path) for r in job], as_json=True)
    report = json.loads(out)
    assert code == 1 and report["status"] == "divergence"
    first, second = report["divergences"]
    assert first["seq"] == 2 and first["what"] == "inputs"
    shapes = {tuple(v["ranks"]): v["value"]["tensor.shape"] for v in first["variants"]}
    assert shapes == {(0, 1, 2): [4], (3,): [8]}
    assert second["seq"] == 3 and second["what"] == "op"
    code, out, _ = _run([r.write(tmp_path) for r in job])
    assert "divergence in group default_pg at #2: all_reduce with different inputs" in out


def test_point_to_point_calls_line_up_per_pair_without_blaming_the_others(tmp_path):
    """Ranks 0 and 1 exchange send/recv between all_reduces; ranks 2 and 3 take no part: the
    ranks agree, and a shape that differs between a send and its recv is a divergence."""
    job = _job()

    def p2p(r: Rank, op: str, peer: int, seq: int, shape: tuple[int, ...] = (2,)) -> None:
        r._span(
            f"torch.distributed.{op}",
            {
                "otel_gpu.collective.op": op,
                "otel_gpu.collective.group.id": "0",
                "otel_gpu.collective.group.name": "default_pg",
                "otel_gpu.collective.group.ranks": [0, 1, 2, 3],
                "otel_gpu.collective.group.rank": r.rank,
                "otel_gpu.collective.peer": peer,
                "otel_gpu.collective.seq": seq,
                "otel_gpu.input.tensor.shape": list(shape),
            },
        )

    for r in job:
        r.collective()
        if r.rank == 0:
            p2p(r, "send", 1, 1)
            p2p(r, "isend", 1, 2)
        if r.rank == 1:
            p2p(r, "recv", 0, 1)
            p2p(r, "irecv", 0, 2)
        r.collective()
    code, out, _ = _run([r.write(tmp_path) for r in job])
    assert code == 0, out
    p2p(job[0], "send", 1, 3, shape=(2,))
    p2p(job[1], "recv", 0, 3, shape=(3,))
    code, out, _ = _run([r.write(tmp_path) for r in job], as_json=True)
    (divergence,) = json.loads(out)["divergences"]
    assert code == 1 and divergence["seq"] == 3 and divergence["what"] == "inputs"


def test_bad_input_exits_2_with_one_line(tmp_path):
    """A missing file, an invalid line, or files with no call span: exit 2, the reason named."""
    good = Rank(0)
    good.collective()
    path = good.write(tmp_path)
    code, _, err = _run([path, str(tmp_path / "missing.jsonl")])
    assert code == 2 and "missing.jsonl: no such file" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    code, _, err = _run([str(bad)])
    assert code == 2 and "bad.jsonl:1: not JSON" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, _, err = _run([str(empty)])
    assert code == 2 and "no otel-gpu call spans" in err


def test_the_command_line_front_door(tmp_path):
    """`otel-gpu ranks` is a command: exit code and --json through the CLI."""
    job = _job(2)
    for r in job:
        r.collective()
    job[0].recovered("torch.distributed.all_reduce", 3.0)
    paths = [r.write(tmp_path) for r in job]
    result = otel_gpu_command(["ranks", "--json", *paths], without_otel())
    assert result.returncode == 1, result.stderr
    assert json.loads(result.stdout)["groups"][0]["stalled"]["missing"] == [1]


# --------------------------------------------------------------------------- real jobs


def _recover(directory: Path) -> None:
    env = without_otel(
        OTEL_GPU_LOGDEST=str(directory / "spans-%r.jsonl"),
        OTEL_GPU_JOURNAL_DIR=str(directory / "journal"),
    )
    result = otel_gpu_command(["recover"], env)
    assert result.returncode == 0, result.stderr


def test_a_4_rank_job_with_a_sleeping_rank(tmp_path):
    """4 gloo ranks; rank 2 sleeps before its 8th all_reduce. `otel-gpu snapshot` on rank 2
    exports its stack while it sleeps; every rank's collectives are spans numbered 1..7 in
    order; after the job is killed and recovered, `otel-gpu ranks` names rank 2, the 8th
    all_reduce and where rank 2 was."""
    procs = distributed_job.start(tmp_path, JOB_SLEEPER="2", JOB_SLEEP_BEFORE="8")
    try:
        distributed_job.wait_for(lambda: (tmp_path / "sleeping-2").exists(), "rank 2 to sleep")

        def stuck_reported() -> bool:  # the waiting ranks are inside all_reduce #8
            files = [tmp_path / f"spans-{r}.jsonl" for r in (0, 1, 3)]
            return all(f.exists() and b'"otel_gpu.stuck"' in f.read_bytes() for f in files)

        distributed_job.wait_for(stuck_reported, "the waiting ranks' stuck-call reports")
        # while rank 2 sleeps: a snapshot of it exports its stack
        env = without_otel(OTEL_GPU_JOURNAL_DIR=str(tmp_path / "journal"))
        asked = otel_gpu_command(["snapshot", str(procs[2].pid), "--timeout", "120"], env)
        assert asked.returncode == 0, asked.stderr
        assert f"pid {procs[2].pid}: snapshot exported" in asked.stdout
        snapshots = [
            s
            for s in read_spans(tmp_path / "spans-2.jsonl", plain=True)
            if s["name"] == "otel_gpu.snapshot"
        ]
        assert len(snapshots) == 1
        stacks = [
            {a["key"]: a["value"] for a in e["attributes"]}
            for e in snapshots[0]["events"]
            if e["name"] == "otel_gpu.thread_stack"
        ]
        (main,) = [s for s in stacks if s["thread.name"]["stringValue"] == "MainThread"]
        assert "time.sleep(3600)" in main["code.stacktrace"]["stringValue"]
        assert procs[2].poll() is None  # the snapshot did not disturb the sleeping rank
    finally:
        distributed_job.stop(procs)
    for rank in range(4):
        spans = read_spans(tmp_path / f"spans-{rank}.jsonl", plain=True)
        seqs = [
            s["attrs"]["otel_gpu.collective.seq"]
            for s in spans
            if s["name"] == "torch.distributed.all_reduce"
        ]
        assert seqs == list(range(1, 8)), (rank, seqs)
        assert {s["resource"]["otel_gpu.rank"] for s in spans} in ({rank}, {str(rank)})
    _recover(tmp_path)
    paths = [str(tmp_path / f"spans-{r}.jsonl") for r in range(4)]
    result = otel_gpu_command(["ranks", *paths], without_otel())
    assert result.returncode == 1, result.stdout + result.stderr
    assert "stalled at #8 all_reduce: entered by ranks 0, 1, 3, never by rank 2" in result.stdout
    assert "rank 2 is behind: last collective #7 all_reduce" in result.stdout
    frames = result.stdout.split("top frames (snapshot):")[1].splitlines()
    assert "job.py" in frames[1] and "<module>" in frames[1]  # where rank 2 slept


def test_a_4_rank_job_where_one_rank_has_a_different_shape(tmp_path):
    """Rank 1's 3rd all_reduce has 8 floats, the others' 4: `otel-gpu ranks` reports the
    divergence at #3 with both shapes (gloo's timeout ends the job)."""
    procs = distributed_job.start(
        tmp_path, calls=5, JOB_DIVERGE="1", JOB_DIVERGE_AT="3", JOB_TIMEOUT="10"
    )
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        distributed_job.stop(procs)
    paths = [str(tmp_path / f"spans-{r}.jsonl") for r in range(4)]
    result = otel_gpu_command(["ranks", "--json", *paths], without_otel())
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    (divergence,) = [d for d in report["divergences"] if d["seq"] == 3]
    shapes = {tuple(v["ranks"]): v["value"]["tensor.shape"] for v in divergence["variants"]}
    assert shapes == {(0, 2, 3): [4], (1,): [8]}


def test_a_job_exchanging_tensors_every_p2p_way_has_ranks_that_agree(tmp_path):
    """A correct 2-rank gloo job using send/irecv, isend/recv, send/recv and batch_isend_irecv:
    `otel-gpu ranks` says all ranks agree (torch's send and recv call the patched isend and
    irecv inside; counted twice, they made a correct job look like a straggler and two
    divergences), and each rank has exactly one span per p2p call it made."""
    procs = distributed_job.start(tmp_path, world=2, calls=3, JOB_P2P="1")
    try:
        for p in procs:
            assert p.wait(timeout=300) == 0, (tmp_path / f"log-{procs.index(p)}.txt").read_text()
    finally:
        distributed_job.stop(procs)
    paths = [str(tmp_path / f"spans-{r}.jsonl") for r in range(2)]
    ops = {
        r: [
            s["attrs"]["otel_gpu.collective.op"]
            for s in read_spans(Path(paths[r]), plain=True)
            if s["name"].startswith("torch.distributed.")
            and s["attrs"]["otel_gpu.collective.op"] in ("send", "recv", "isend", "irecv")
        ]
        for r in range(2)
    }
    assert sorted(ops[0]) == ["isend", "isend", "send", "send"]
    assert sorted(ops[1]) == ["irecv", "irecv", "recv", "recv"]
    result = otel_gpu_command(["ranks", *paths], without_otel())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all ranks agree" in result.stdout

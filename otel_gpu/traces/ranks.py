"""``otel-gpu ranks``: line the ranks of a job up and name the ones behind, or that diverged.

Reads every rank's trace files (otel-gpu's JSON Lines, the collector's file format, recovered
spans; lines through :mod:`otel_gpu.traces.reader`) and lines calls up:

* collectives (the ``torch.distributed`` target) per process group by their sequence number
  (``otel_gpu.collective.seq``); point-to-point calls per pair of ranks;
* other calls by name, the k-th call of a function on one rank against the k-th on the others
  (a rank counts as behind in a function only if it made the (k-1)-th call: a function that
  only some ranks call does not make the others stragglers).

The wavefront of a group is the last call every rank of it completed, and the first call some
ranks entered and others never did; the ranks that never did are behind. Each is described by
what the files hold about it: its last call, its calls still open (recovered from its journal,
or named by a stuck-call report), and the top frames of its newest stack (a snapshot span, or a
stuck-call report). Divergence: ranks that entered different collectives at the same number,
or the same collective with different input shapes or dtypes.

A recovered collective (a call in flight when its process died) carries no group or sequence
number: the journal is written before the call runs. It is given the group of the rank's last
collective of the same op and the number after that group's last one: the call a rank was
waiting in when it died is the one after its last completed call.
"""

from __future__ import annotations

import gc
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import IO, Any

from otel_gpu._text import printable
from otel_gpu.attributes import (
    CODE_STACKTRACE,
    COLLECTIVE_GROUP_ID,
    COLLECTIVE_GROUP_NAME,
    COLLECTIVE_GROUP_RANK,
    COLLECTIVE_GROUP_RANKS,
    COLLECTIVE_OP,
    COLLECTIVE_PEER,
    COLLECTIVE_PREFIX,
    COLLECTIVE_SEQ,
    EVENT_THREAD_STACK,
    INPUT_PREFIX,
    RECOVERED,
    SNAPSHOT_SPAN_NAME,
    STUCK,
    STUCK_SECONDS,
    STUCK_SPAN_ID,
    STUCK_SPAN_NAME,
    STUCK_THREAD,
)
from otel_gpu.traces import device, reader
from otel_gpu.traces.output import clip, clipped, dump

__all__ = ["EXIT_AGREE", "EXIT_FOUND", "EXIT_USAGE", "Report", "analyse", "load", "ranks"]

EXIT_AGREE = 0
"""Every rank agrees: no straggler, no divergence."""
EXIT_FOUND = 1
"""A rank behind, or ranks that diverged."""
EXIT_USAGE = 2
"""Bad input: a missing or invalid file, or no span at all."""

RANK_KEY = "otel_gpu.rank"  # the resource attribute (RANK) naming the process's rank
_P2P = {"send": "p2p", "isend": "p2p", "recv": "p2p", "irecv": "p2p"}
# inputs that may legitimately differ between ranks: their shapes are not compared
_UNEVEN = frozenset({"all_to_all", "all_to_all_single", "gather", "scatter"})
_TOP_FRAMES = 4


@dataclass
class Call:
    """One call of one rank, as the files have it."""

    rank: int
    name: str
    span_id: str
    start: int
    end: int
    completed: bool  # False: in flight when its process died (a recovered span)
    error: bool
    op: str = ""  # a collective's op, "" for other calls
    group: str = ""
    group_name: str = ""
    members: tuple[int, ...] = ()
    seq: int | None = None
    signature: dict[str, Any] = field(default_factory=dict)  # input shapes and dtypes
    device: float | None = None  # seconds of its GPU work, where the span has device time
    unresolved: bool = False  # its GPU work had not finished when its span was exported


@dataclass
class Rank:
    """Everything the files say about one rank."""

    rank: int
    calls: list[Call] = field(default_factory=list)
    # stuck call's span id -> (its name, seconds it had run when reported)
    stuck: dict[str, tuple[str, float]] = field(default_factory=dict)
    stack: tuple[int, str, str] | None = None  # (time, where from, stack text) of the newest


@dataclass
class Report:
    """What :func:`analyse` found; :meth:`as_json` is the ``--json`` output."""

    ranks: list[int]
    groups: list[dict[str, Any]]
    divergences: list[dict[str, Any]]

    @property
    def found(self) -> bool:
        return bool(self.divergences) or any(g.get("stalled") for g in self.groups)

    def as_json(self) -> dict[str, Any]:
        return {
            "status": "divergence"
            if self.divergences
            else ("straggler" if self.found else "agree"),
            "ranks": self.ranks,
            "groups": self.groups,
            "divergences": self.divergences,
        }


# --------------------------------------------------------------------------- reading


def load(paths: Sequence[str], problem: reader.Problem) -> dict[int, Rank]:
    """Every rank's calls, stuck reports and stacks in ``paths``. A span with no
    ``otel_gpu.rank`` resource attribute belongs to the rank numbered by its file's position."""
    ranks: dict[int, Rank] = {}
    enabled = gc.isenabled()
    gc.disable()  # as reader.read_all: the calls hold no cycles; each decoded line would
    try:  # otherwise trigger full collections of every call read so far (5x the time)
        for position, path in enumerate(paths):
            for line in reader.read_lines(path, problem):
                try:
                    payload = reader.load_json(line.raw, line.where, line.torn)
                    _line(payload, line.where, position, ranks)
                except reader.TraceFileError as exc:
                    problem(exc)
    finally:
        if enabled:
            gc.enable()
    return ranks


def _line(payload: Any, where: str, position: int, ranks: dict[int, Rank]) -> None:
    for rs in reader.resource_spans(payload, where):
        resource = rs.get("resource") if isinstance(rs, dict) else None
        raw_rank = reader._attributes(resource, where, RANK_KEY.__eq__).get(RANK_KEY)
        try:
            number = int(raw_rank) if raw_rank is not None else position
        except (TypeError, ValueError):
            raise reader.TraceFileError(
                f"{where}: resource attribute {RANK_KEY} is {raw_rank!r}, not a whole number"
            ) from None
        rank = ranks.setdefault(number, Rank(number))
        for raw in reader.spans_in(rs, where):
            _span(raw, where, rank)


def _wanted_key(key: str) -> bool:
    return key.startswith((COLLECTIVE_PREFIX, "otel_gpu.stuck", RECOVERED, device.DEVICE_PREFIX))


def _wanted_collective_key(key: str) -> bool:
    # the input shapes and dtypes: a divergence is a collective's (analyse), never another call's
    return _wanted_key(key) or (key.startswith(INPUT_PREFIX) and key.endswith((".shape", ".dtype")))


class _Decisions(dict[str, bool]):
    """Whether ranks reads an attribute, decided once per distinct key (a file repeats a few
    hundred): its ``__getitem__`` is the filter, a C-level lookup for every key seen before."""

    def __init__(self, decide: Callable[[str], bool]) -> None:
        super().__init__()
        self.decide = decide

    def __missing__(self, key: str) -> bool:
        wanted = self.decide(key)
        if len(self) < 1 << 16:  # a hostile file's distinct keys are decided one by one past this
            self[key] = wanted
        return wanted


_wanted = _Decisions(_wanted_key).__getitem__
_wanted_by_collective = _Decisions(_wanted_collective_key).__getitem__
_COLLECTIVE_NAME = "torch.distributed."  # the torch.distributed target's span names


def _span(raw: dict[str, Any], where: str, rank: Rank) -> None:
    base = reader._span(raw, where, "", attributes=False)  # its attributes read once, below
    collective = base.name.startswith(_COLLECTIVE_NAME)
    attrs = reader._attributes(raw, where, _wanted_by_collective if collective else _wanted)
    if attrs.get(STUCK) is True:
        called = base.name[len(STUCK_SPAN_NAME) :]
        seconds = float(attrs.get(STUCK_SECONDS) or 0.0)
        span_id = str(attrs.get(STUCK_SPAN_ID, ""))
        old = rank.stuck.get(span_id)
        rank.stuck[span_id] = (called, max(seconds, old[1] if old else 0.0))
        _newer_stack(rank, base.end, f"stuck-call report of {called}", _stuck_stack(raw, where))
        return
    if base.name == SNAPSHOT_SPAN_NAME:
        _newer_stack(rank, base.end, "snapshot", _main_stack(raw, where))
        return
    call = Call(
        rank=rank.rank,
        name=base.name,
        span_id=base.span_id,
        start=base.start,
        end=base.end,
        completed=attrs.get(RECOVERED) is not True,
        error=base.error,
        device=device.seconds(attrs),
        unresolved=device.unresolved(attrs),
    )
    op = attrs.get(COLLECTIVE_OP)
    if isinstance(op, str):
        call.op = op
        call.group = str(attrs.get(COLLECTIVE_GROUP_ID, ""))
        call.group_name = str(attrs.get(COLLECTIVE_GROUP_NAME, call.group))
        members = attrs.get(COLLECTIVE_GROUP_RANKS)
        call.members = tuple(int(m) for m in members) if isinstance(members, list) else ()
        seq = attrs.get(COLLECTIVE_SEQ)
        call.seq = seq if isinstance(seq, int) else None
        if op in _P2P:
            peer = attrs.get(COLLECTIVE_PEER)
            me = attrs.get(COLLECTIVE_GROUP_RANK)
            if isinstance(peer, int) and isinstance(me, int) and me < len(call.members):
                pair = tuple(sorted((call.members[me], peer)))
                call.group = f"{call.group}/p2p/{pair[0]}-{pair[1]}"
                call.group_name = f"{call.group_name} p2p {pair[0]}-{pair[1]}"
                call.members = pair
            else:
                call.group = ""  # a recv from any source: nothing to line it up with
    elif base.name.startswith("torch.distributed."):  # a recovered collective: no attributes
        call.op = base.name.rsplit(".", 1)[1]
    call.signature = {
        k[len(INPUT_PREFIX) :]: _hashable(v) for k, v in attrs.items() if k.startswith(INPUT_PREFIX)
    }
    rank.calls.append(call)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _events(raw: dict[str, Any], where: str) -> Iterable[dict[str, Any]]:
    for event in reader.list_at(raw, ("events",), where):
        if isinstance(event, dict) and event.get("name") == EVENT_THREAD_STACK:
            yield reader._attributes(event, where, lambda k: True)


def _stuck_stack(raw: dict[str, Any], where: str) -> str:
    for attrs in _events(raw, where):
        if attrs.get(STUCK_THREAD) is True:
            return str(attrs.get(CODE_STACKTRACE, ""))
    return ""


def _main_stack(raw: dict[str, Any], where: str) -> str:
    """The main thread's stack of a snapshot (its first thread_stack event, if not named)."""
    stacks = list(_events(raw, where))
    for attrs in stacks:
        if attrs.get("thread.name") == "MainThread":
            return str(attrs.get(CODE_STACKTRACE, ""))
    return str(stacks[0].get(CODE_STACKTRACE, "")) if stacks else ""


def _newer_stack(rank: Rank, when: int, source: str, stack: str) -> None:
    if stack and (rank.stack is None or when >= rank.stack[0]):
        rank.stack = (when, source, stack)


def top_frames(stack: str, count: int = _TOP_FRAMES) -> list[str]:
    """The innermost ``count`` frames of a formatted stack, one ``file:line in function`` each."""
    frames = []
    for line in stack.splitlines():
        text = line.strip()
        if text.startswith('File "'):
            path, _, rest = text[len('File "') :].partition('", line ')
            number, _, function = rest.partition(", in ")
            frames.append(f"{path}:{number} in {function}")
    return frames[-count:][::-1]


# --------------------------------------------------------------------------- lining up


def _assign_recovered(rank: Rank) -> None:
    """A recovered collective goes after its rank's last numbered one of the same op's group."""
    last_group: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    last_seq: dict[str, int] = defaultdict(int)
    for call in sorted(rank.calls, key=lambda c: c.start):
        if not call.op:
            continue
        if call.seq is not None and call.group:
            last_group[call.op] = (call.group, call.group_name, call.members)
            last_seq[call.group] = max(last_seq[call.group], call.seq)
        elif call.seq is None and not call.completed and call.op not in _P2P:
            group, name, members = last_group.get(call.op) or next(
                iter(last_group.values()), ("0", "default_pg", ())
            )
            last_seq[group] += 1
            call.group, call.group_name, call.members, call.seq = (
                group,
                name,
                members,
                last_seq[group],
            )


def analyse(ranks: dict[int, Rank]) -> Report:
    """Line the ranks up; find the ranks behind and the divergences."""
    for rank in ranks.values():
        _assign_recovered(rank)
    everyone = sorted(ranks)
    # (group id) -> seq -> rank -> call; (name) -> k -> rank -> call
    lines: dict[str, dict[int, dict[int, Call]]] = defaultdict(lambda: defaultdict(dict))
    names: dict[str, str] = {}
    members: dict[str, set[int]] = defaultdict(set)
    for rank in ranks.values():
        counts: dict[str, int] = defaultdict(int)
        for call in sorted(rank.calls, key=lambda c: c.start):
            if call.op:
                if not call.group or call.seq is None:
                    continue
                key = f"group {call.group}"
                names[key] = call.group_name
                members[key].update(call.members or (rank.rank,))
                lines[key][call.seq][rank.rank] = call
            else:
                counts[call.name] += 1
                key = f"call {call.name}"
                names[key] = call.name
                members[key] = set(everyone)
                lines[key][counts[call.name]][rank.rank] = call
    found = (
        _wavefront(key, names[key], sorted(members[key]), lines[key], ranks)
        for key in sorted(lines, key=lambda k: (not k.startswith("group"), k))
    )
    groups = [g for g in found if g is not None]
    divergences = [
        d
        for key in sorted(lines)
        if key.startswith("group")
        for d in _diverged(names[key], lines[key])
    ]
    return Report(everyone, groups, divergences)


def _wavefront(
    key: str,
    name: str,
    members: list[int],
    line: dict[int, dict[int, Call]],
    ranks: dict[int, Rank],
) -> dict[str, Any] | None:
    collective = key.startswith("group")
    out: dict[str, Any] = {"kind": "group" if collective else "function", "name": name}
    if collective:
        out["id"] = key[len("group ") :]
    out["ranks"] = members
    completed = None
    for number in sorted(line):
        calls = line[number]
        if all(m in calls and calls[m].completed for m in members):
            completed = number
            continue
        missing = [m for m in members if m not in calls]
        in_flight = [r for r, c in calls.items() if not c.completed]
        if not missing or (not collective and not in_flight):
            continue
        if not collective:  # behind in a function only if it called that function before
            missing = [m for m in missing if number > 1 and m in line[number - 1]]
            if not missing:
                continue
        some = next(iter(calls.values()))
        waited, clock = _waited(calls.values(), ranks)
        out["completed"] = _point(completed, line)
        out["stalled"] = {
            "seq": number,
            "call": some.op or some.name,
            "entered": sorted(calls),
            "missing": missing,
            "waited_s": waited,
            "waited_time": clock,
            "device_unresolved": sorted(r for r, c in calls.items() if c.unresolved),
        }
        out["behind"] = [_where(ranks.get(m), m) for m in missing]
        return out
    if not collective:
        return None  # functions that every rank called alike say nothing
    out["completed"] = _point(completed, line)
    return out


def _point(number: int | None, line: dict[int, dict[int, Call]]) -> dict[str, Any] | None:
    if number is None:
        return None
    some = next(iter(line[number].values()))
    return {"seq": number, "call": some.op or some.name}


def _waited(calls: Iterable[Call], ranks: dict[int, Rank]) -> tuple[float, str]:
    """How long the ranks that entered have waited in it, and on which clock (``host`` or
    ``device``): the longest of their stuck reports, of their calls' host durations (for a call
    in flight when its process died, its start to the process's last heartbeat) and of their
    calls' device times (a collective launched asynchronously returns at once on the host while
    its kernel waits on the GPU for the other ranks)."""
    longest, clock = 0.0, "host"
    for call in calls:
        report = ranks[call.rank].stuck.get(call.span_id)
        reported = report[1] if report is not None else 0.0
        host = max((call.end - call.start) / 1e9, reported)
        if host > longest:
            longest, clock = host, "host"
        if call.device is not None and call.device > longest:
            longest, clock = call.device, "device"
    return round(longest, 3), clock


def _where(rank: Rank | None, number: int) -> dict[str, Any]:
    if rank is None:
        return {"rank": number, "seen": False}
    ordered = sorted(rank.calls, key=lambda c: c.start)
    done = [c for c in ordered if c.completed]
    last = done[-1] if done else None
    last_collective = next((c for c in reversed(done) if c.op), None)
    known = {c.span_id: c for c in ordered}
    open_calls = [
        {"name": c.name, "span_id": c.span_id, "seconds": round((c.end - c.start) / 1e9, 3)}
        for c in ordered
        if not c.completed
    ]
    for span_id, (called, seconds) in rank.stuck.items():  # reported stuck, never ended
        if span_id not in known:
            open_calls.append({"name": called, "span_id": span_id, "seconds": seconds})
    out: dict[str, Any] = {
        "rank": rank.rank,
        "seen": True,
        "last_call": last.name if last else None,
        "last_collective": _describe(last_collective),
        "open": open_calls,
    }
    if rank.stack is not None:
        out["stack_from"] = rank.stack[1]
        out["top_frames"] = top_frames(rank.stack[2])
    return out


def _describe(call: Call | None) -> dict[str, Any] | None:
    if call is None:
        return None
    return {"seq": call.seq, "call": call.op, "group": call.group_name}


def _diverged(name: str, line: dict[int, dict[int, Call]]) -> list[dict[str, Any]]:
    found = []
    for number in sorted(line):
        calls = line[number]
        kinds = {r: _P2P.get(c.op, c.op) for r, c in calls.items()}
        if len(set(kinds.values())) > 1:
            found.append(_divergence(name, number, "op", {r: c.op for r, c in calls.items()}))
            continue
        op = next(iter(calls.values())).op
        if op in _UNEVEN:
            continue
        shared = set.intersection(*(set(c.signature) for c in calls.values()))
        shared = {k for k in shared if k.endswith((".shape", ".dtype"))}
        if not shared:
            continue
        shapes = {r: {k: c.signature[k] for k in sorted(shared)} for r, c in calls.items()}
        if len({json.dumps(v, default=str, sort_keys=True) for v in shapes.values()}) > 1:
            found.append(_divergence(name, number, "inputs", shapes, op))
    return found


def _divergence(
    group: str, number: int, what: str, by_rank: dict[int, Any], op: str = ""
) -> dict[str, Any]:
    variants: dict[str, list[int]] = defaultdict(list)
    for rank, value in sorted(by_rank.items()):
        variants[json.dumps(value, default=list, sort_keys=True)].append(rank)
    return {
        "group": group,
        "seq": number,
        "what": what,
        "call": op or None,
        "variants": [{"ranks": r, "value": json.loads(v)} for v, r in variants.items()],
    }


# --------------------------------------------------------------------------- the command


def ranks(
    paths: Sequence[str],
    *,
    as_json: bool = False,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
) -> int:
    """Read, analyse and print; returns the exit code."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    problems: list[reader.TraceFileError] = []
    loaded = load(paths, problems.append)
    if reader.refused(problems, partial(_say, err), "analysed"):
        return EXIT_USAGE
    if not any(r.calls for r in loaded.values()):
        _say(err, f"no otel-gpu call spans in {', '.join(paths)}")
        return EXIT_USAGE
    report = analyse(loaded)
    if as_json:
        dump(report.as_json(), out)  # values whole; NaN and infinities as strings
    else:
        _print(report, out)
    return EXIT_FOUND if report.found else EXIT_AGREE


def _say(err: IO[str], message: str) -> None:
    print(printable(f"otel-gpu ranks: {message}"), file=err)


def _ranks(numbers: Iterable[int]) -> str:
    listed = list(numbers)
    return f"rank{'s' if len(listed) != 1 else ''} {', '.join(str(n) for n in listed)}"


def _print(report: Report, out: IO[str]) -> None:
    """The report for a reader: each value read from a file (names, frames, shapes) clipped."""

    def say(text: str) -> None:
        print(printable(text), file=out)

    report = Report(report.ranks, clipped(report.groups), clipped(report.divergences))

    say(f"{len(report.ranks)} rank(s): {', '.join(str(r) for r in report.ranks)}")
    for group in report.groups:
        label = (
            f"group {group['name']} (id {group['id']}, {_ranks(group['ranks'])})"
            if group["kind"] == "group"
            else f"function {group['name']}"
        )
        done = group.get("completed")
        say(
            f"{label}: last completed by every rank: "
            + (f"#{done['seq']} {done['call']}" if done else "none")
        )
        stalled = group.get("stalled")
        if not stalled:
            continue
        say(
            f"  stalled at #{stalled['seq']} {stalled['call']}: entered by "
            f"{_ranks(stalled['entered'])}, never by {_ranks(stalled['missing'])}; "
            f"the others have waited {stalled['waited_s']:.1f} s "
            f"({stalled.get('waited_time', 'host')} time)"
        )
        if stalled.get("device_unresolved"):
            say(
                f"  device time unresolved on {_ranks(stalled['device_unresolved'])}: their GPU "
                "work in it had not finished when their spans were exported"
            )
        for behind in group["behind"]:
            if not behind["seen"]:
                say(f"  rank {behind['rank']} is behind: no span of it in the files")
                continue
            last = behind["last_collective"]
            say(
                f"  rank {behind['rank']} is behind: last collective "
                + (f"#{last['seq']} {last['call']} ({last['group']})" if last else "none")
                + f", last call {behind['last_call']}"
            )
            if behind["open"]:
                for call in behind["open"]:
                    say(
                        f"    in flight: {call['name']} (span {call['span_id']}, "
                        f"{call['seconds']:.1f} s host time)"
                    )
            else:
                say("    in flight: no otel-gpu call (it is in the program's own code)")
            if behind.get("top_frames"):
                say(f"    top frames ({behind['stack_from']}):")
                for frame in behind["top_frames"]:
                    say(f"      {frame}")
    for d in report.divergences:
        variants = "; ".join(f"{_ranks(v['ranks'])}: {_value(v['value'])}" for v in d["variants"])
        what = (
            "different collectives" if d["what"] == "op" else f"{d['call']} with different inputs"
        )
        say(f"divergence in group {d['group']} at #{d['seq']}: {what}: {variants}")
    if not report.found:
        say("all ranks agree")


def _value(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_value(v)}" for k, v in value.items())
    if isinstance(value, list):
        return clip("[" + ", ".join(str(v) for v in value) + "]")
    return clip(value)

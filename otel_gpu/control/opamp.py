"""OpAMP: with ``OTEL_GPU_OPAMP_ENDPOINT`` set, the process is an agent of a fleet's OpAMP server.

Built on ``opentelemetry-opamp-client`` (the ``opamp`` extra), over HTTP. It starts, on a thread
of its own, at otel-gpu's first configuration in the process (the first decorated function,
``configure()``: ``instrumentation/targets.py``, where live control's listener starts too), and
polls the server every ``OTEL_GPU_OPAMP_INTERVAL`` seconds on the client's threads (its worker
and scheduler, both daemons), so a server that is down, slow or hostile costs a call nothing.
A forked child is no agent of its own.

- It reports who it is: the resource's ``service.*`` attributes identify it, and the rest of the
  resource (host, pid, rank, GPUs: what every span already carries) describes it.
- It reports its effective configuration (``state.effective()``) as ``EffectiveConfig``, under
  the name ``otel-gpu``, again whenever it changed (a window ran out, ``otel-gpu control``).
- It applies the remote configuration named ``otel-gpu``: a JSON object with the fields of a
  control document (:mod:`otel_gpu.control.document`), read whole before anything is applied,
  then reports ``RemoteConfigStatus`` APPLIED, or FAILED with the one-line reason. A refused
  document changes nothing. A configuration it has seen (same hash) is not applied again, and
  at most one configuration is applied (or refused) per interval; a refusal's warning is said
  once per reason, then at most every :data:`WARN_EVERY` seconds with a count.

Bounds on the network (:mod:`otel_gpu.control.opamp_http`): no redirect to another origin is
followed (the headers never leave the configured one), each request is bounded by its deadline
in all, and at most one request is made per interval whatever the server's flags say.

Bounds on what the server sends: an answer is read up to :data:`MAX_RESPONSE_BYTES` (more is a
failed poll), the document up to :data:`MAX_DOCUMENT_BYTES`; it must be UTF-8 JSON without
duplicate keys or NaN. At exit the agent says goodbye to the server for at most
:data:`EXIT_WAIT` seconds. docs/control.md, section OpAMP, has the schema and the settings.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from otel_gpu import _guard
from otel_gpu._text import printable
from otel_gpu.config import Settings
from otel_gpu.control import document, state
from otel_gpu.resource import build_resource

__all__ = [
    "CONFIG_NAME",
    "EXIT_WAIT",
    "JSON_CONTENT_TYPES",
    "MAX_DOCUMENT_BYTES",
    "MAX_RESPONSE_BYTES",
    "REQUEST_TIMEOUT",
    "WARN_EVERY",
    "Agent",
    "read_document",
    "running",
    "start",
    "start_soon",
    "stop",
]

CONFIG_NAME = "otel-gpu"
"""The name of otel-gpu's entry in ``AgentRemoteConfig``'s and ``EffectiveConfig``'s config maps."""
JSON_CONTENT_TYPES = ("application/json", "text/json", "")
"""Content types of the entry read as JSON (empty: the server named none)."""
MAX_DOCUMENT_BYTES = 64 * 1024
"""A control document is a few hundred bytes; a larger entry is refused unread."""
MAX_RESPONSE_BYTES = 4 * 1024 * 1024
"""One answer of the server, read at most this far (protobuf, every entry of its config map)."""
REQUEST_TIMEOUT = 5.0
"""Seconds one poll may wait for the server to connect, then for each read, and in all; at
most half the interval, so that a heartbeat is done before the next is queued (the client's
queue of them has no bound: behind a server that hangs it grew by ~2 a second at 0.5 s)."""
EXIT_WAIT = 1.0
"""Seconds interpreter exit waits for the agent to say goodbye to the server."""
WARN_EVERY = 600.0
"""Seconds between two warnings for the same reason of refusing a remote configuration."""
_MAX_REASONS = 32  # reasons told apart in the warnings; the others share one
_MAX_REASON = 512  # characters of a FAILED status's reason
# Tries of a report after the first, 1 s apart doubling (~15 s): the client's 10 would leave a
# server that came back unheard for up to 512 s; after them the heartbeats, every interval,
# find it again (and an OpAMP server asks an agent it does not know for its full state).
_RETRIES = 4

_log = _guard.logger


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def read_document(remote_config: Any) -> Mapping[str, Any]:
    """The ``otel-gpu`` entry of an ``AgentRemoteConfig`` as a JSON object, or
    :class:`~otel_gpu.control.document.ControlError` saying in one line why it is not one."""
    entries = remote_config.config.config_map
    if CONFIG_NAME not in entries:
        names = ", ".join(sorted(repr(n)[:40] for n in list(entries)[:8])) or "none"
        raise document.ControlError(
            f"the remote configuration has no entry named {CONFIG_NAME!r} (entries: {names})"
        )
    entry = entries[CONFIG_NAME]
    kind = entry.content_type.split(";")[0].strip().lower()
    if kind not in JSON_CONTENT_TYPES:
        raise document.ControlError(
            f"{CONFIG_NAME!r} has content type {entry.content_type[:60]!r}; allowed: "
            "application/json, text/json"
        )
    body = entry.body
    if len(body) > MAX_DOCUMENT_BYTES:
        raise document.ControlError(
            f"{CONFIG_NAME!r} is {len(body)} bytes; a control document has at most "
            f"{MAX_DOCUMENT_BYTES}"
        )
    try:
        doc = json.loads(
            body.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant
        )
    except UnicodeDecodeError:
        raise document.ControlError(f"{CONFIG_NAME!r} is not UTF-8 text") from None
    except _DuplicateKey as exc:
        raise document.ControlError(
            f"{CONFIG_NAME!r} names the field {str(exc)[:40]!r} twice; each field once"
        ) from None
    except RecursionError:
        raise document.ControlError(f"{CONFIG_NAME!r} is nested too deeply") from None
    except ValueError as exc:
        raise document.ControlError(f"{CONFIG_NAME!r} is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise document.ControlError(
            f"{CONFIG_NAME!r} is a JSON {type(doc).__name__}, not an object with the fields "
            f"{', '.join(document.FIELDS)}"
        )
    return doc


class _QuietRetries(logging.Filter):
    """The client logs each failed attempt at WARNING with the request's bytes; the agent says
    once that the server is unreachable instead (:meth:`Agent.on_connect_failed`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Job ")


_QUIET = _QuietRetries()


def _scalar(value: Any) -> bool:
    return isinstance(value, (str, bool, int, float))


def _identity(attributes: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(identifying, non-identifying) agent attributes from the resource: OpAMP identifies an
    agent by its service, and the client encodes only scalar values."""
    identifying = {k: v for k, v in attributes.items() if k.startswith("service.") and _scalar(v)}
    others = {k: v for k, v in attributes.items() if k not in identifying and _scalar(v)}
    return identifying, others


def _json_able(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _public(endpoint: str) -> str:
    """The endpoint without credentials or query, to name the server in messages and spans."""
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


class _Throttle:
    """When to say a reason again: the first time, then at most once per ``every`` seconds
    (with how often it was not said meanwhile); past :data:`_MAX_REASONS` reasons, the others
    share one turn, so a server that invents a reason at each poll is not a line each."""

    def __init__(self, every: float = WARN_EVERY) -> None:
        self._every = every
        self._said: dict[str, tuple[float, int]] = {}

    def turn(self, reason: str) -> int | None:
        """None: not now; else how often ``reason`` went unsaid since it was last said."""
        if reason not in self._said and len(self._said) >= _MAX_REASONS:
            reason = "\0others"
        now = time.monotonic()
        said = self._said.get(reason)
        if said is None or now - said[0] >= self._every:
            self._said[reason] = (now, 0)
            return 0 if said is None else said[1]
        self._said[reason] = (said[0], said[1] + 1)
        return None


class Agent:
    """One process's OpAMP agent: the client's agent and client, and the callbacks that apply
    the remote configuration. Callbacks run on the client's worker thread, one at a time."""

    def __init__(
        self,
        settings: Settings,
        attributes: Mapping[str, Any],
        *,
        parse: Callable[[Mapping[str, Any]], Any] = document.parse,
        apply: Callable[[Any, str], Any] = state.apply,
        effective: Callable[[], Any] = state.effective,
    ) -> None:
        from opentelemetry._opamp.agent import OpAMPAgent
        from opentelemetry._opamp.client import OpAMPClient
        from opentelemetry._opamp.proto import opamp_pb2

        from otel_gpu.control import opamp_http

        assert settings.opamp_endpoint
        self.endpoint = settings.opamp_endpoint
        self.public = _public(self.endpoint)
        self.source = f"opamp {self.public}"
        """Who asked, in the control span of a change this agent applies."""
        self._parse, self._apply, self._effective = parse, apply, effective
        self._statuses = opamp_pb2.RemoteConfigStatuses
        self._seen: bytes | None = None  # the last remote configuration handled (its hash)
        self._reported: Any = None  # the effective configuration last reported
        self._down = False  # the server did not answer the last attempt
        self._error = ""  # the server's last error message, said once
        self._interval = settings.opamp_interval
        self._took: float | None = None  # when the last remote configuration was handled
        self._pending: Any = None  # one that came sooner than an interval after it
        self._warnings = _Throttle()
        self._refused: type[Exception] = opamp_http.Refused
        self._pace = opamp_http.Pace(settings.opamp_interval)
        identifying, others = _identity(attributes)
        self.client = OpAMPClient(
            endpoint=self.endpoint,
            headers=dict(settings.opamp_headers),
            timeout_millis=int(min(REQUEST_TIMEOUT, settings.opamp_interval / 2) * 1000),
            agent_identifying_attributes=identifying,
            agent_non_identifying_attributes=others,
            # duck-typed: the client's classes are imported only where the extra is installed
            transport=opamp_http.Transport(  # type: ignore[arg-type]
                self.endpoint, MAX_RESPONSE_BYTES, self._pace
            ),
        )
        self._pace.full_state = self.client.build_full_state_message
        self._note_effective()
        self.agent = OpAMPAgent(
            interval=settings.opamp_interval,
            callbacks=self,  # type: ignore[arg-type]
            client=self.client,
            max_retries=_RETRIES,
            heartbeat_max_retries=0,  # one try: the next heartbeat is the retry
        )

    def start(self) -> None:
        logging.getLogger("opentelemetry._opamp.agent").addFilter(_QUIET)  # once: same object
        self.agent.start()
        # its own exit hook says goodbye with no bound and joins the threads with none
        atexit.unregister(self.agent.stop)

    def stop(self, wait: float = EXIT_WAIT) -> None:
        """Say goodbye and tell the threads to stop, waiting at most ``wait`` seconds for the
        goodbye. The threads are not joined: they are daemons, and the worker would take up to
        a second to notice."""
        self._pace.stopping.set()  # a poll waiting for its turn is not made
        thread = threading.Thread(
            target=self.agent.stop, kwargs={"timeout": 0}, name="otel-gpu-opamp-stop", daemon=True
        )
        thread.start()
        thread.join(wait)

    # ------------------------------------------------------------------ the client's callbacks

    def on_connect(self, agent: Any, client: Any) -> None:
        if self._down:
            self._down = False
            _log.info("otel-gpu: the OpAMP server at %s answers again", self.public)
        try:
            if self._note_effective():  # changed since the last report: a window ran out...
                self._pace.owed = True  # the next poll carries it
        except Exception as exc:
            _guard_quietly(exc)

    def on_connect_failed(self, agent: Any, client: Any, error: Exception) -> None:
        if not self._down:
            self._down = True
            if isinstance(error, self._refused):  # the transport said why
                return
            _log.warning(
                "otel-gpu: the OpAMP server at %s does not answer (%s); this process keeps its "
                "configuration, and polls again in the background",
                self.public,
                printable(str(error))[:200],
            )

    def on_error(self, agent: Any, client: Any, error_response: Any) -> None:
        error = printable(str(getattr(error_response, "error_message", "")))[:200]
        if error != self._error:  # once per message, not at every poll
            self._error = error
            _log.warning(
                "otel-gpu: the OpAMP server at %s answered with an error: %s", self.public, error
            )

    def on_message(self, agent: Any, client: Any, message: Any) -> None:
        remote = message.remote_config
        if remote is None:
            remote = self._pending  # one that came too soon, if the server did not repeat it
        if remote is None:
            return
        given = bytes(remote.config_hash)
        seen = given or hashlib.sha256(remote.config.SerializeToString()).digest()
        if seen == self._seen:
            self._pending = None
            return  # the server sends its configuration again until it has our status
        now = self._pace.started or time.monotonic()  # the poll that brought it
        if self._took is not None and now - self._took < self._interval:
            self._pending = remote  # at most one per interval: a flapping server sets the pace
            return
        self._pending, self._seen, self._took = None, seen, now
        status, reason = self._take(remote)
        try:
            client.update_remote_config_status(given, status, reason)
            self._note_effective()
            self._pace.owed = True  # the status goes with the next poll
        except Exception as exc:
            _guard_quietly(exc)

    # ------------------------------------------------------------------ applying

    def _take(self, remote: Any) -> tuple[Any, str]:
        """Read, validate and apply the ``otel-gpu`` entry: (status, reason)."""
        try:
            change = self._parse(read_document(remote))
            self._apply(change, self.source)
        except document.ControlError as exc:
            reason = printable(" ".join(str(exc).split()))[:_MAX_REASON]
            unsaid = self._warnings.turn(reason)
            if unsaid is not None:
                _log.warning(
                    "otel-gpu: refused the OpAMP remote configuration: %s%s",
                    reason,
                    f" (refused {unsaid} more times for this reason since it was last said)"
                    if unsaid
                    else "",
                )
            return self._statuses.RemoteConfigStatuses_FAILED, reason
        except Exception as exc:
            _guard_quietly(exc)
            reason = f"otel-gpu could not apply it: {type(exc).__name__}: {exc}"
            return self._statuses.RemoteConfigStatuses_FAILED, reason[:_MAX_REASON]
        return self._statuses.RemoteConfigStatuses_APPLIED, ""

    def _note_effective(self) -> bool:
        """Put the effective configuration in the client's next full state; whether it changed."""
        current = _json_able(self._effective())
        if current == self._reported:
            return False
        self._reported = current
        self.client.update_effective_config({CONFIG_NAME: current}, "application/json")
        return True


def _guard_quietly(exc: BaseException) -> None:
    """An internal error on the agent's thread: reported once, never raised there (the client
    would log it with a traceback, and a test's strict mode has no caller to fail)."""
    try:
        _guard.internal_error("opamp", exc)
    except BaseException:
        pass


# ---------------------------------------------------------------------- the process's agent

_lock = threading.Lock()
_running: Agent | None = None
_key: tuple[Any, ...] | None = None
_hooked = False


def running() -> Agent | None:
    """The process's agent, if one runs."""
    return _running


def start(settings: Settings, attributes: Mapping[str, Any] | None = None) -> Agent | None:
    """Start the process's agent for ``settings`` (kept if one runs for the same server), or
    say in one line why not. ``attributes``: the resource's (default: otel-gpu's resource).
    Never raises."""
    global _running, _key, _hooked
    if not settings.opamp_endpoint:
        stop()
        return None
    if attributes is None:
        attributes = dict(build_resource().attributes)
    if settings.control != "on":
        _guard.warn_once(
            "opamp-control-off",
            "otel-gpu: OTEL_GPU_OPAMP_ENDPOINT is set without OTEL_GPU_CONTROL=on: this process "
            "reports to the OpAMP server, but a remote configuration changes no function's "
            "level (docs/control.md)",
        )
    key = (settings.opamp_endpoint, settings.opamp_headers, settings.opamp_interval, os.getpid())
    with _lock:
        if _running is not None and _key == key:
            return _running
        old, _running, _key = _running, None, None
        try:
            import opentelemetry._opamp.agent  # noqa: F401
        except ImportError:
            _guard.warn_once(
                "opamp-client",
                "otel-gpu: OTEL_GPU_OPAMP_ENDPOINT is set but opentelemetry-opamp-client is not "
                "installed (pip install 'otel-gpu[opamp]'); this process is no OpAMP agent",
            )
            agent = None
        else:
            try:
                agent = Agent(settings, attributes)
                agent.start()
            except Exception as exc:
                agent = None
                _guard_quietly(exc)
        _running, _key = agent, (key if agent is not None else None)
        if not _hooked:
            atexit.register(_at_exit)
            _hooked = True
    if old is not None:
        old.stop()
    return agent


def start_soon(settings: Settings) -> None:
    """:func:`start` on a thread of its own, from the first decorated function: detecting the
    resource, importing the client and building the agent are no caller's cost."""
    threading.Thread(
        target=start, args=(settings,), name="otel-gpu-opamp-start", daemon=True
    ).start()


def stop(wait: float = EXIT_WAIT) -> None:
    """Stop the process's agent, if one runs (at most ``wait`` seconds)."""
    global _running, _key
    with _lock:
        agent, _running, _key = _running, None, None
    if agent is not None:
        agent.stop(wait)


def _at_exit() -> None:
    try:
        stop()
    except Exception:  # exit goes on
        pass


def _forget_in_child() -> None:
    # the parent's agent threads are not in the child: its pipeline starts an agent of its own
    global _running, _key, _lock
    _running, _key, _lock = None, None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)

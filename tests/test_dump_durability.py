"""OTEL_GPU_DUMP_DURABILITY: what each mode promises, and which thread pays for it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections import Counter

import pytest
import torch
from dump_files import RECORDER_PROBES, start_recording
from dump_files import call_dirs as _dirs
from dump_files import finish as _finish
from dump_files import read_manifest as _manifest_of

from otel_gpu import config
from otel_gpu.devices import cuda
from otel_gpu.export import pipeline
from otel_gpu.recorder import manifest, tensor_files
from otel_gpu.recorder import recorder as dump
from otel_gpu.replay import Allow, Options, replay

MODES = ("fsync", "process", "async")

LIB = (
    """
import torch
import otel_gpu

@otel_gpu.api
def combine(x, y, scale=1.0):
    return x * scale + y

@otel_gpu.api
def scribble(x):
    x.add_(100)  # changes its input in place: the recorded inputs must be the values before
    return x * 2

"""
    + RECORDER_PROBES
)


@pytest.fixture
def lib(module_factory):
    """Returns ``load()``: LIB as a fresh module, decorated at the level in force."""
    return lambda: module_factory(LIB, "durablelib")


def _recorder() -> dump.Recorder:
    pipe = pipeline.current()
    assert pipe is not None
    (recorder,) = [o for o in pipe.observers if isinstance(o, dump.Recorder)]
    return recorder


# --------------------------------------------------------------------------- configuration


def test_default_is_fsync():
    """Without the variable the recorder keeps today's guarantee: fsync before the call."""
    assert config.load(env={}).dump_durability == "fsync"


@pytest.mark.parametrize("raw", ["never", "sync", "1"])
def test_invalid_value_names_the_variable_and_the_allowed_values(raw):
    """A typo fails at configuration with a ConfigError naming the variable and fsync, process, async."""
    with pytest.raises(config.ConfigError) as info:
        config.load(env={"OTEL_GPU_DUMP_DURABILITY": raw})
    message = str(info.value)
    assert "OTEL_GPU_DUMP_DURABILITY" in message
    assert "fsync, process, async" in message


def test_configure_argument_beats_the_environment():
    """configure(dump_durability=...) wins over OTEL_GPU_DUMP_DURABILITY (fixed precedence)."""
    settings = config.load({"dump_durability": "async"}, env={"OTEL_GPU_DUMP_DURABILITY": "fsync"})
    assert settings.dump_durability == "async"


# --------------------------------------------------------------------------- what is on disk, and when


@pytest.mark.parametrize("mode", ["fsync", "process"])
def test_inputs_are_on_disk_before_the_call_runs(otel_gpu_spans, lib, tmp_path, mode):
    """fsync and process: inside the call the manifest says inputs_saved and the inputs load."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path, dump_durability=mode)
    seen = {}

    def check(x):
        (directory,) = _dirs(root)
        seen["status"] = _manifest_of(directory)["status"]
        seen["x"] = tensor_files.load_tensors(directory, "inputs.pt")["input.x"]

    m.probe(torch.arange(4.0), check)
    assert seen["status"] == "inputs_saved"
    assert torch.equal(seen["x"], torch.arange(4.0))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_every_mode_leaves_complete_calls_that_replay_to_pass(
    otel_gpu_spans, lib, tmp_path, mode, fmt
):
    """After shutdown every call is complete (inputs, outputs, manifest) and replays to pass."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path, dump_durability=mode, dump_format=fmt)
    for i in range(6):
        m.combine(torch.full((8,), float(i)), torch.ones(8), 2.0)
    _finish()
    dirs = _dirs(root)
    assert len(dirs) == 6
    for i, directory in enumerate(dirs):
        man = _manifest_of(directory)
        assert man["status"] == "completed"
        inputs = tensor_files.load_tensors(directory, man["files"]["inputs"])
        outputs = tensor_files.load_tensors(directory, man["files"]["outputs"])
        assert torch.equal(inputs["input.x"], torch.full((8,), float(i)))
        assert torch.equal(outputs["output"], torch.full((8,), 2.0 * i + 1))
    results = replay(str(root), Options(allow=Allow([m.__name__])))
    assert [r.verdict for r in results] == ["pass"] * 6, [r.detail for r in results]


@pytest.mark.parametrize("mode", MODES)
def test_inputs_changed_in_place_by_the_call_are_recorded_as_they_were(
    otel_gpu_spans, lib, tmp_path, mode
):
    """Every mode records the inputs as they were before the call (async copies them first)."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path, dump_durability=mode)
    x = torch.ones(16)
    m.scribble(x)
    _finish()
    (directory,) = _dirs(root)
    man = _manifest_of(directory)
    assert torch.equal(tensor_files.load_tensors(directory, "inputs.pt")["input.x"], torch.ones(16))
    outputs = tensor_files.load_tensors(directory, "outputs.pt")
    assert torch.equal(outputs[man["mutated"]["input.x"]["key"]], torch.full((16,), 101.0))
    assert torch.equal(outputs["output"], torch.full((16,), 202.0))


@pytest.mark.parametrize("mode", MODES)
def test_outputs_changed_after_the_call_are_recorded_as_returned(
    otel_gpu_spans, lib, tmp_path, mode
):
    """Reused copy buffers never leak a later value: each call keeps the output it returned."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path, dump_durability=mode)
    for i in range(10):
        out = m.combine(torch.full((1024,), float(i)), torch.zeros(1024))
        out.fill_(-1.0)
    _finish()
    for i, directory in enumerate(_dirs(root)):
        outputs = tensor_files.load_tensors(directory, "outputs.pt")
        assert torch.equal(outputs["output"], torch.full((1024,), float(i)))


@pytest.mark.parametrize("mode", MODES)
def test_a_raised_exception_is_recorded_and_reaches_the_caller_untouched(
    otel_gpu_spans, lib, tmp_path, mode
):
    """The caller gets the same exception object; the manifest says raised once written."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path, dump_durability=mode)
    with pytest.raises(ValueError, match="bad input"):
        m.fails(torch.ones(3))
    _finish()
    (directory,) = _dirs(root)
    man = _manifest_of(directory)
    assert man["status"] == "raised"
    assert man["exception"]["type"] == "builtins.ValueError"
    assert torch.equal(tensor_files.load_tensors(directory, "inputs.pt")["input.x"], torch.ones(3))


# --------------------------------------------------------------------------- who fsyncs


@pytest.fixture
def fsyncs(monkeypatch):
    """Counts os.fsync calls by thread name ("caller" for the test's own thread)."""
    counts: Counter[str] = Counter()
    real = os.fsync
    caller = threading.get_ident()

    def counting(fd):
        me = threading.current_thread()
        counts["caller" if me.ident == caller else me.name] += 1
        return real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return counts


@pytest.mark.parametrize("mode", ["process", "async"])
def test_the_caller_thread_never_fsyncs_in_the_faster_modes(
    otel_gpu_spans, lib, tmp_path, fsyncs, mode
):
    """process and async: no fsync on the caller's thread (nor on the writer: nothing is fsync'd)."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path, dump_durability=mode)
    for _ in range(5):
        m.combine(torch.ones(64), torch.ones(64))
    with pytest.raises(ValueError):
        m.fails(torch.ones(2))
    _finish()
    assert len(_dirs(root)) == 6
    assert fsyncs["caller"] == 0
    assert sum(fsyncs.values()) == 0


def test_fsync_mode_fsyncs_inputs_manifest_and_directory_before_the_call(
    otel_gpu_spans, lib, tmp_path, fsyncs
):
    """fsync: the caller fsyncs the inputs file, the manifest and the directory (3 per call) before
    the call; the writer fsyncs outputs, manifest and directory after it."""
    _, m = start_recording(otel_gpu_spans, lib, tmp_path, dump_durability="fsync")
    seen = {}
    m.probe(torch.ones(4), lambda x: seen.setdefault("before", fsyncs["caller"]))
    _finish()
    assert seen["before"] == 3
    assert fsyncs["caller"] == 3
    assert fsyncs["otel-gpu-dump"] == 3


# --------------------------------------------------------------------------- async details


def test_async_writes_the_manifest_once_when_the_call_ends_first(
    otel_gpu_spans, lib, tmp_path, monkeypatch
):
    """A call that returns before the writer reached its inputs gets one manifest (completed),
    never an inputs_saved one, and needs no returned marker."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path, dump_durability="async")
    gate = threading.Event()
    writes: list[bytes] = []
    real_save, real_write = tensor_files.save_tensors, manifest.write_bytes

    def slow_save(*args, **kwargs):
        gate.wait(5)
        return real_save(*args, **kwargs)

    def recording_write(directory, name, data, fsync=True):
        writes.append(data)
        return real_write(directory, name, data, fsync)

    monkeypatch.setattr(tensor_files, "save_tensors", slow_save)
    monkeypatch.setattr(manifest, "write_bytes", recording_write)
    m.combine(torch.ones(4), torch.ones(4))  # returns while the writer is held
    gate.set()
    _finish()
    (directory,) = _dirs(root)
    assert [json.loads(w)["status"] for w in writes] == ["completed"]
    assert not os.path.exists(os.path.join(directory, manifest.RETURNED))


def test_async_marks_a_call_returned_once_its_inputs_saved_manifest_exists(
    otel_gpu_spans, lib, tmp_path
):
    """When the writer saved the inputs while the call ran, the caller creates the returned
    marker, so a process that dies before the outputs are written is never a false crash."""
    root, m = start_recording(otel_gpu_spans, lib, tmp_path, dump_durability="async")

    def wait_for_writer(x):
        assert _recorder().flush(5.0)

    m.probe(torch.ones(4), wait_for_writer)
    (directory,) = _dirs(root)
    assert os.path.exists(os.path.join(directory, manifest.RETURNED))
    _finish()
    assert _manifest_of(directory)["status"] == "completed"


def test_async_back_pressure_keeps_every_call_complete(otel_gpu_spans, lib, tmp_path, monkeypatch):
    """With a queue of one call the caller writes itself, after its own queued inputs: nothing lost."""
    monkeypatch.setattr(dump, "_QUEUE_ITEMS", 1)
    root, m = start_recording(otel_gpu_spans, lib, tmp_path, dump_durability="async")
    for i in range(20):
        m.combine(torch.full((256,), float(i)), torch.zeros(256))
    _finish()
    dirs = _dirs(root)
    assert len(dirs) == 20
    for i, directory in enumerate(dirs):
        assert _manifest_of(directory)["status"] == "completed"
        outputs = tensor_files.load_tensors(directory, "outputs.pt")
        assert torch.equal(outputs["output"], torch.full((256,), float(i)))


# --------------------------------------------------------------------------- reused and pinned buffers


def test_host_buffers_are_reused_by_size_and_bounded():
    """A released buffer serves the next copy of the same size; beyond max_bytes none is kept."""
    pool = tensor_files.HostBuffers(max_bytes=4096)
    first = pool.copy({"a": torch.ones(256)})  # 1 KiB
    buf = first.buffers[0][0]
    pool.release(first)
    second = pool.copy({"a": torch.zeros(256)})
    assert second.buffers[0][0] is buf
    assert torch.equal(second.tensors["a"], torch.zeros(256))
    big = pool.copy({"b": torch.ones(2048)})  # 8 KiB: not kept
    pool.release(big)
    assert pool._kept == 0


class _FakeCuda:
    """Pretends every tensor lives on a CUDA device: pinned buffers and asynchronous copies are
    counted, and copies only "land" when the event is waited for."""

    def __init__(self) -> None:
        self.pinned = 0
        self.waits: Counter[str] = Counter()
        self.caller = threading.get_ident()

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(cuda, "is_cuda_tensor", lambda t: True)
        monkeypatch.setattr(cuda, "pinned_empty", self.pinned_empty)
        monkeypatch.setattr(cuda, "copy_to_host", self.copy_to_host)
        monkeypatch.setattr(cuda, "wait_copy", self.wait_copy)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        self.pinned += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor):
        return (dst, src.clone())  # the values at copy time, written into dst on wait

    def wait_copy(self, event) -> None:
        me = threading.current_thread()
        self.waits["caller" if me.ident == self.caller else me.name] += 1
        dst, values = event
        dst.copy_(values)


@pytest.mark.parametrize("mode", MODES)
def test_cuda_copies_use_pinned_buffers_and_are_waited_for_by_the_writer(
    otel_gpu_spans, lib, tmp_path, monkeypatch, mode
):
    """With CUDA faked: outputs (and async inputs) go to reused pinned buffers with a non-blocking
    copy; only the writer thread waits for the copies, and the files hold the right values."""
    fake = _FakeCuda()
    fake.install(monkeypatch)
    root, m = start_recording(otel_gpu_spans, lib, tmp_path, dump_durability=mode)
    for i in range(8):
        out = m.combine(torch.full((64,), float(i)), torch.ones(64))
        out.fill_(-1.0)
        _recorder().flush(5.0)  # buffers return to the pool before the next call
    _finish()
    assert fake.waits["caller"] == 0
    copies_per_call = 3 if mode == "async" else 1  # x, y and the output; or the output
    assert fake.waits["otel-gpu-dump"] == 8 * copies_per_call
    assert fake.pinned == copies_per_call  # allocated once, then reused
    for i, directory in enumerate(_dirs(root)):
        man = _manifest_of(directory)
        assert man["status"] == "completed"
        assert torch.equal(
            tensor_files.load_tensors(directory, "inputs.pt")["input.x"],
            torch.full((64,), float(i)),
        )
        assert torch.equal(
            tensor_files.load_tensors(directory, "outputs.pt")["output"],
            torch.full((64,), float(i) + 1),
        )


# --------------------------------------------------------------------------- a process killed inside the call

CHILD = """
import os, signal, sys
import torch
sys.path.insert(0, sys.argv[1])
import killlib
killlib.step(torch.arange(6.0).view(2, 3), torch.full((3,), 7.0), tag="last words")
"""

KILLLIB = """
import os, signal, time
import otel_gpu

@otel_gpu.api
def step(x, y, tag):
    time.sleep(float(os.environ.get("KILL_AFTER", "0")))
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_child(tmp_path, mode: str, kill_after: float = 0.0) -> str:
    """Run a child that SIGKILLs itself inside a decorated call; returns the dump root."""
    (tmp_path / "killlib.py").write_text(textwrap.dedent(KILLLIB))
    root = tmp_path / "dumps"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_GPU_LOGLEVEL="10",
        OTEL_GPU_LOGDEST=str(tmp_path / "spans.jsonl"),
        OTEL_GPU_JOURNAL="false",
        OTEL_GPU_DUMP_DIR=str(root),
        OTEL_GPU_DUMP_DURABILITY=mode,
        KILL_AFTER=str(kill_after),
        PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        + os.pathsep
        + env.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)], env=env, capture_output=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    return str(root)


@pytest.mark.parametrize("mode", ["fsync", "process"])
def test_a_process_killed_inside_the_call_leaves_loadable_inputs(tmp_path, mode):
    """fsync and process: SIGKILL inside the call leaves a manifest (inputs_saved) and complete inputs:
    the data is in the kernel's page cache even without fsync."""
    root = _killed_child(tmp_path, mode)
    (directory,) = _dirs(root)
    man = _manifest_of(directory)
    assert man["status"] == "inputs_saved"
    assert not os.path.exists(os.path.join(directory, manifest.RETURNED))
    inputs = tensor_files.load_tensors(directory, man["files"]["inputs"])
    assert torch.equal(inputs["input.x"], torch.arange(6.0).view(2, 3))
    assert torch.equal(inputs["input.y"], torch.full((3,), 7.0))
    assert {p["name"]: p["value"] for p in man["params"]}["tag"] == {"t": "str", "v": "last words"}


def test_async_kill_inside_the_call_leaves_loadable_inputs_once_the_writer_had_time(tmp_path):
    """async: the writer thread writes the inputs while the call runs; a call killed after that
    leaves the same complete case as the durable modes (sooner than that, it may leave nothing)."""
    root = _killed_child(tmp_path, "async", kill_after=1.0)
    (directory,) = _dirs(root)
    man = _manifest_of(directory)
    assert man["status"] == "inputs_saved"
    inputs = tensor_files.load_tensors(directory, man["files"]["inputs"])
    assert torch.equal(inputs["input.x"], torch.arange(6.0).view(2, 3))

"""config.py is the only module of otel-gpu that reads the environment.

Proved by recording reads, not by grepping: a subprocess replaces ``os.environ``, ``os.getenv``
and ``os.environb`` with mappings that note the file of the frame that reads each variable,
imports every module of ``otel_gpu`` and ``exporters``, and runs otel-gpu as a program would.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from commands import python_command

import otel_gpu

PACKAGE = Path(otel_gpu.__file__).resolve().parent
ROOT = PACKAGE.parent
CONFIG = PACKAGE / "config.py"

# Runs in a fresh interpreter: argv[1] the repository root, argv[2] a scratch directory, and
# argv[3] the source of one more module to import first ("" for none).
SCRIPT = textwrap.dedent(
    r'''
    import collections.abc
    import importlib
    import json
    import os
    import pkgutil
    import sys

    ROOT, TMP, EXTRA = sys.argv[1], sys.argv[2], sys.argv[3]
    HELPERS = {"<string>", os.__file__, collections.abc.Mapping.get.__code__.co_filename}
    reads = []


    class Recording(collections.abc.MutableMapping):
        """A mapping over the real environment that notes who reads it."""

        def __init__(self, real):
            self._real = real

        def _note(self, key):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename in HELPERS:
                frame = frame.f_back  # Mapping.get, os.getenv and this class are not readers
            reads.append((frame.f_code.co_filename if frame else "?", str(key)))

        def __getitem__(self, key):
            self._note(key)
            return self._real[key]

        def __contains__(self, key):
            self._note(key)
            return key in self._real

        def __iter__(self):
            self._note("*")  # iterating reads every variable
            return iter(list(self._real))

        def __len__(self):
            return len(self._real)

        def __setitem__(self, key, value):
            self._real[key] = value

        def __delitem__(self, key):
            del self._real[key]

        def copy(self):
            self._note("*")
            return dict(self._real)


    os.environ = Recording(os.environ)  # os.getenv reads os.environ too
    os.environb = Recording(os.environb)

    os.environ["OTEL_GPU_JOURNAL_DIR"] = os.path.join(TMP, "journal")
    os.environ["OTEL_GPU_DUMP_DIR"] = os.path.join(TMP, "dumps")
    os.environ["XDG_RUNTIME_DIR"] = TMP

    import otel_gpu

    if EXTRA:  # a module that reads variables itself: its reads must be seen as its own
        with open(os.path.join(TMP, "probe_reader.py"), "w") as f:
            f.write(EXTRA)
        sys.path.insert(0, TMP)
        importlib.import_module("probe_reader")
    for package in (otel_gpu, importlib.import_module("otel_gpu.exporters")):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not info.name.endswith(".__main__"):  # importing it would run the command line
                importlib.import_module(info.name)
    importlib.import_module("otel_gpu.instrumentation._bootstrap.sitecustomize")

    import types

    import torch

    from otel_gpu.export import pipeline

    small = types.ModuleType("small_lib")
    exec("def scale(x, k=2):\n    return x * k\n", small.__dict__)
    sys.modules["small_lib"] = small
    for level in (1, 5, 10):
        spans = os.path.join(TMP, f"spans{level}.jsonl")
        otel_gpu.configure(level=level, dest=[spans, "stderr"], journal=True)  # a file and the console

        @otel_gpu.api
        def add(a, b):
            return a + b

        add(torch.ones(2), torch.ones(2))
        otel_gpu.instrument(small)
        small.scale(torch.ones(3))
        otel_gpu.uninstrument(small)
        otel_gpu.flush()
    pipeline.shutdown()
    sizes = {
        level: os.path.getsize(os.path.join(TMP, f"spans{level}.jsonl")) for level in (1, 5, 10)
    }
    print(json.dumps({"reads": reads, "sizes": sizes}))
    '''
)


def _run(tmp_path: Path, extra: str = "") -> tuple[list[tuple[str, str]], dict[str, int]]:
    proc = python_command(
        ["-c", SCRIPT, str(ROOT), str(tmp_path), extra], cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return [tuple(r) for r in result["reads"]], result["sizes"]


def _project_readers(reads: list[tuple[str, str]]) -> dict[str, set[str]]:
    """Reads made by otel-gpu's own files (third-party libraries such as torch are left out)."""
    ours = (str(PACKAGE) + "/", str(ROOT / "exporters") + "/")
    readers: dict[str, set[str]] = {}
    for filename, key in reads:
        if filename.startswith(ours):
            readers.setdefault(filename, set()).add(key)
    return readers


def test_only_config_reads_the_environment(tmp_path: Path) -> None:
    """Importing every module and running levels 1, 5 and 10 reads variables only in config.py."""
    reads, sizes = _run(tmp_path)
    readers = _project_readers(reads)
    assert str(CONFIG) in readers  # the recording works: config.py's reads are seen
    assert {"OTEL_GPU_LOGLEVEL", "OTEL_GPU_JOURNAL_DIR"} <= readers[str(CONFIG)]
    assert all(size > 0 for size in sizes.values()), sizes  # the run exported spans
    others = {f: keys for f, keys in readers.items() if f != str(CONFIG)}
    assert not others, f"modules other than config.py read the environment: {others}"


def test_each_read_is_charged_to_the_module_that_makes_it(tmp_path: Path) -> None:
    """A module reading os.environ, os.getenv or a copy of the environment is named as reader."""
    extra = "import os\nA = os.environ.get('HOME')\nB = os.getenv('PATH')\nC = dict(os.environ)\n"
    reads, _ = _run(tmp_path, extra)
    probe = str(tmp_path / "probe_reader.py")
    assert {"HOME", "PATH", "*"} <= {key for filename, key in reads if filename == probe}

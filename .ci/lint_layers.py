"""Check the import-linter contract of pyproject.toml ([tool.importlinter]): `make lint` runs it.

``otel_gpu.exporters`` lives in ``exporters/`` (pyproject's ``package-dir``), outside the
``otel_gpu/`` folder import-linter walks, so the package is first assembled as it is installed
(``otel_gpu/`` with ``exporters/`` inside it) in a temporary directory, and checked there.

    python .ci/lint_layers.py             # exit status: 0 when every contract is kept
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc")


def assemble(into: Path) -> Path:
    """The installed layout of the package under ``into``, with the contract beside it."""
    package = into / "otel_gpu"
    shutil.copytree(ROOT / "otel_gpu", package, ignore=_SKIP)
    shutil.copytree(ROOT / "exporters", package / "exporters", ignore=_SKIP)
    shutil.copy(ROOT / "pyproject.toml", into / "pyproject.toml")
    return package


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on an assembled tree; its own copy of otel_gpu comes first on the path."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run(
        [sys.executable, "-c", command, "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def check(plant: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package as installed; ``plant`` appends text to some of its files
    first (``{"otel_gpu/_text.py": "..."}``: the tests plant an upward import this way)."""
    with tempfile.TemporaryDirectory(prefix="otel-gpu-layers-") as tmp:
        assemble(Path(tmp))
        for relative, text in (plant or {}).items():
            with open(Path(tmp) / relative, "a", encoding="utf-8") as f:
                f.write(text)
        return lint(Path(tmp))


def main() -> int:
    result = check()
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# make gpu-kit: the wheels a GPU machine without network needs to run the GPU suite
# (tests/gpu/run.sh), downloaded here, where the package registries are reachable.
#
# The GPU machine brings its own Python and torch (and CUDA); otel-gpu must not touch them.
# What it lacks is otel-gpu's OpenTelemetry dependencies. They are fetched as binary wheels for
# the GPU machine's Python (GPU_KIT_PYTHON, default 3.12) on manylinux x86_64, at the versions
# .ci/constraints-test.txt pins, with everything they need, into .gpu-kit/ (ignored by git).
# torch, CUDA's packages and numpy are never in the kit. Then the set is checked: pip resolves
# every requirement from the kit alone (--no-index) for that Python, or this script fails.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
PYVER=${GPU_KIT_PYTHON:-3.12}
KIT=${GPU_KIT_DIR:-.gpu-kit}
CONSTRAINTS=.ci/constraints-test.txt

# otel-gpu's own dependencies, less torch, numpy, safetensors, rich and nvidia-ml-py, which
# the GPU image has (the suite reports their versions); plus what the GPU suite imports.
REQUIREMENTS=(
    opentelemetry-api
    opentelemetry-sdk
    opentelemetry-exporter-otlp
    opentelemetry-exporter-otlp-json-file
    opentelemetry-semantic-conventions
    opentelemetry-proto
)

PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
TARGET_ARGS=(--only-binary=:all: --python-version "$PYVER" --implementation cp "${PLATFORMS[@]}")

echo "==> wheels for CPython $PYVER, manylinux x86_64, pinned by $CONSTRAINTS, into $KIT/"
rm -rf "$KIT"
mkdir -p "$KIT"
"$PYTHON" -m pip download -q --disable-pip-version-check -d "$KIT" "${TARGET_ARGS[@]}" \
    -c "$CONSTRAINTS" "${REQUIREMENTS[@]}"

# Never carry what would shadow the GPU machine's torch stack.
for pattern in 'torch-*' 'nvidia_*' 'triton-*' 'numpy-*'; do
    rm -f "$KIT"/$pattern
done

echo "==> checking the kit alone resolves every requirement for CPython $PYVER (--no-index)"
# no configuration file: only the kit is looked at, as on the GPU machine
PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip install -q --disable-pip-version-check --dry-run --ignore-installed \
    --no-index --find-links "$KIT" --target "$(mktemp -d)" "${TARGET_ARGS[@]}" \
    "${REQUIREMENTS[@]}"

# The manifest: each wheel's SHA-256 and name (sha256sum's format). tests/gpu/run.sh installs
# nothing from a kit with a wheel that is not in it, or whose hash differs.
{
    echo "# The GPU kit: wheels for CPython $PYVER on manylinux x86_64; made by make gpu-kit"
    echo "# from $CONSTRAINTS. Installed by tests/gpu/run.sh with --no-index, after it checks"
    echo "# each wheel against its SHA-256 here."
    "$PYTHON" - "$KIT" <<'EOF'
import hashlib, sys
from pathlib import Path

for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    print(f"{hashlib.sha256(wheel.read_bytes()).hexdigest()}  {wheel.name}")
EOF
} > "$KIT/MANIFEST.txt"
count=$(ls -1 "$KIT"/*.whl | wc -l)
size=$(du -sh "$KIT" | cut -f1)
echo "==> $count wheels, $size in $KIT/ (names and SHA-256: $KIT/MANIFEST.txt)"
echo "    on the GPU machine, from the repository root: bash tests/gpu/run.sh"

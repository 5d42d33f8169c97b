#!/usr/bin/env bash
# The GPU suite on a machine with a GPU and no network: one command, from the repository root.
#
#   bash tests/gpu/run.sh [--out DIR] [--kit DIR] [--suite-only] [--bench] [--rounds N] [--short]
#
# It installs the wheels of the GPU kit (`make gpu-kit`, made where the package registries are
# reachable) with --no-index into a temporary folder, builds otel-gpu from this tree into the
# same folder, and puts that folder on PYTHONPATH. The machine's own Python, torch and CUDA are
# used as they are: nothing is installed into them, and the script checks torch still loads
# from where it did. Then it prints the GPU, driver, CUDA and torch versions, runs tests/gpu,
# and (unless --suite-only) the short real workload of tests/gpu/workload.py; --bench adds the
# per-call rows of `otel-gpu bench --device cuda` (--rounds N of them, default 5); --short runs the workload without its
# torch.compile checks and level-10 replay (the timings and identical-output checks only, minutes
# less, when time on a GPU machine is short). Everything goes to DIR (default ./gpu-run):
# run.log (all of it), suite.xml (JUnit), workload.json, bench.json, traces/.
# PYTHON picks the interpreter (default python3). Exit status: non-zero when anything failed.
# On a machine without CUDA the GPU tests report skips and the workload says it was skipped.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python3}
OUT=$ROOT/gpu-run
KIT=$ROOT/.gpu-kit
WORKLOAD=1
BENCH=0
ROUNDS=5
WORKLOAD_OPTS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT=$2; shift 2 ;;
        --kit) KIT=$2; shift 2 ;;
        --suite-only) WORKLOAD=0; shift ;;
        --bench) BENCH=1; shift ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --short) WORKLOAD_OPTS=(--no-compile --no-replay); shift ;;
        -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "run.sh: unknown argument '$1' (allowed: --out DIR, --kit DIR, --suite-only, --bench, --rounds N, --short)" >&2; exit 2 ;;
    esac
done
if ! ls "$KIT"/*.whl >/dev/null 2>&1; then
    echo "run.sh: no wheels in $KIT: run 'make gpu-kit' on a machine with the package registries first" >&2
    exit 2
fi
# The kit is checked before anything else runs or is installed: every wheel is one `make gpu-kit`
# wrote (its name and SHA-256 in $KIT/MANIFEST.txt), and none carries a file Python would run
# at every start from the folder it is installed into (sitecustomize, usercustomize, or a .pth
# file at the top, also through a wheel's .data/purelib or .data/platlib). Exit 2, naming it.
if ! "$PYTHON" - "$KIT" <<'EOF'
import hashlib, re, sys, zipfile
from pathlib import Path

kit = Path(sys.argv[1])
manifest = kit / "MANIFEST.txt"


def refuse(message):
    print(f"run.sh: {message}; the kit is not installed (make it again with 'make gpu-kit')",
          file=sys.stderr)
    sys.exit(2)


if not manifest.is_file():
    refuse(f"{manifest} is missing: no SHA-256 manifest to check the wheels against")
known = {}
for number, line in enumerate(manifest.read_text("utf-8", "replace").splitlines(), 1):
    line = line.strip()
    if not line or line.startswith("#"):
        continue
    fields = line.split()
    if len(fields) != 2 or not re.fullmatch(r"[0-9a-f]{64}", fields[0]):
        refuse(f"{manifest}, line {number}: not '<sha256>  <wheel>'")
    known[fields[1]] = fields[0]
present = {wheel.name for wheel in kit.glob("*.whl")}
for name in sorted(set(known) - present):
    refuse(f"the manifest lists {name!a}, which is not in {kit}")
for wheel in sorted(kit.glob("*.whl")):
    if wheel.name not in known:
        refuse(f"{wheel.name!a} is not in {manifest}: a wheel make gpu-kit did not write")
    digest = hashlib.sha256()
    with open(wheel, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != known[wheel.name]:
        refuse(f"{wheel.name!a}: its SHA-256 is not the manifest's (the wheel changed since)")
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile) as exc:
        refuse(f"{wheel.name!a} is not a readable wheel ({exc})")
    for entry in names:
        top = re.sub(r"^[^/]+\.data/(purelib|platlib)/", "", entry)
        first = top.split("/")[0]
        if first.split(".")[0] in ("sitecustomize", "usercustomize") or (
            "/" not in top and top.endswith(".pth")
        ):
            refuse(f"{wheel.name!a} carries {entry!a}, which Python would run at every start")
EOF
then
    exit 2
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/run.log
: > "$LOG"
say() { echo "$@" | tee -a "$LOG"; }
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/otel-gpu-kit.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
SITE=$STAGE/site

torch_file() { "$PYTHON" -c 'import torch; print(torch.__file__)' 2>/dev/null; }
TORCH_BEFORE=$(torch_file)
if [ -z "$TORCH_BEFORE" ]; then
    say "run.sh: $PYTHON cannot import torch: the GPU suite runs on the machine's own torch"
    exit 2
fi

say "==> installing the kit ($(ls -1 "$KIT"/*.whl | wc -l) wheels) into a temporary folder, --no-index"
if ! "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
        --no-cache-dir --target "$SITE" "$KIT"/*.whl >>"$LOG" 2>&1; then
    say "run.sh: installing the kit failed (the end of $LOG says why)"; tail -20 "$LOG"; exit 2
fi
say "==> building otel-gpu from $ROOT into the same folder"
if ! "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
        --no-cache-dir --no-build-isolation --target "$SITE" "$ROOT" >>"$LOG" 2>&1; then
    say "run.sh: building otel-gpu failed (it needs setuptools >= 70.1, or an older one with wheel, in $PYTHON; the end of $LOG says why)"
    tail -20 "$LOG"; exit 2
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
if [ "$(torch_file)" != "$TORCH_BEFORE" ]; then
    say "run.sh: torch now loads from $(torch_file), not $TORCH_BEFORE: refusing to go on"
    exit 2
fi

say "==> versions"
(cd "$STAGE" && "$PYTHON" -) >>"$LOG" 2>&1 <<'EOF'
import platform, subprocess, sys
import torch
import opentelemetry.sdk.version as sdk
import otel_gpu.cli
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "from", torch.__file__)
print("torch CUDA", torch.version.cuda, "| cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("GPU", torch.cuda.get_device_name(0), f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.1f} GiB",
          f"{torch.cuda.device_count()} device(s)")
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    print("driver", smi.stdout.strip() or smi.stderr.strip())
except (OSError, subprocess.SubprocessError) as exc:
    print("driver: nvidia-smi not available:", exc)
print("opentelemetry-sdk", sdk.__version__)
print(otel_gpu.cli.version_line(), "from", otel_gpu.__file__)
EOF
tail -n +1 "$LOG" | sed -n '/==> versions/,$p' | tail -n +2

status=0
say "==> the GPU suite (tests/gpu)"
BENCH_OPT=()
if "$PYTHON" -c 'import pytest_benchmark' 2>/dev/null; then BENCH_OPT=(--benchmark-disable); fi
# from the temporary folder: the tree's own otel_gpu/ (without its exporters) must not shadow the
# one built into SITE
(cd "$STAGE" && "$PYTHON" -m pytest -c "$ROOT/pyproject.toml" --rootdir "$ROOT" "$ROOT/tests/gpu" \
    -v -rs -p no:cacheprovider "${BENCH_OPT[@]}" --junitxml "$OUT/suite.xml") 2>&1 | tee -a "$LOG"
suite=${PIPESTATUS[0]}
[ "$suite" -eq 0 ] || status=1

if [ "$WORKLOAD" -eq 1 ]; then
    say "==> the workload (tests/gpu/workload.py)"
    (cd "$STAGE" && "$PYTHON" "$ROOT/tests/gpu/workload.py" "$OUT" "${WORKLOAD_OPTS[@]}") 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$BENCH" -eq 1 ]; then
    say "==> otel-gpu bench --device cuda (per-call rows, bare and levels 0-10, the tiny GPT2)"
    (cd "$STAGE" && timeout 400 "$PYTHON" -m otel_gpu bench --device cuda --rounds "$ROUNDS" --json \
        --only bare,ours0,ours1,ours3,ours5,ours10,gpt2_0,gpt2_1,gpt2_3,gpt2_5 \
        > "$OUT/bench.json") 2>>"$LOG"
    # bench exits 1 when a budget is missed: that is a figure to read, not a failed run
    if ! "$PYTHON" -c 'import json,sys; json.load(open(sys.argv[1]))' "$OUT/bench.json" 2>/dev/null; then
        say "bench did not finish (timed out or failed; the end of $LOG says why)"; status=1
    fi
    (cd "$STAGE" && "$PYTHON" -c 'import json,sys; from otel_gpu.bench.report import render; print(render(json.load(open(sys.argv[1]))))' "$OUT/bench.json") 2>&1 | tee -a "$LOG" || true
fi
say "==> done: suite exit $suite, overall $status; log in $LOG"
exit $status

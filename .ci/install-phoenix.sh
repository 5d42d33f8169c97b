#!/usr/bin/env bash
# Install Arize Phoenix, the OTLP backend of the end-to-end tests (tests/test_e2e_phoenix.py),
# into a virtualenv of its own. Phoenix pins its own OpenTelemetry versions: it must never be
# installed into the project's environment.
#
#   PHOENIX_VENV     where the virtualenv lives (default: .ci/.phoenix-venv in the repository)
#   PHOENIX_VERSION  optional pip version specifier, e.g. "==20.26.1" (default: newest)
#   PYTHON           interpreter that creates the virtualenv (default: python3)
#   PHOENIX_CONSTRAINTS  optional pip constraints file pinning Phoenix's dependencies
#                    (`make test` passes .ci/constraints-phoenix.txt; `make lock` refreshes it)
#
# Idempotent: an existing virtualenv with Phoenix installed (at the requested version) is kept.
# The last line of stdout is the phoenix executable, for OTEL_GPU_TEST_PHOENIX:
#
#   export OTEL_GPU_TEST_PHOENIX="$(.ci/install-phoenix.sh | tail -n 1)"
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${PHOENIX_VENV:-$root/.ci/.phoenix-venv}"
python="${PYTHON:-python3}"
spec="arize-phoenix${PHOENIX_VERSION:-}"

installed_version() {
  "$venv/bin/python" -m pip show arize-phoenix 2>/dev/null | sed -n 's/^Version: //p'
}

have=""
if [ -x "$venv/bin/python" ] && [ -x "$venv/bin/phoenix" ]; then
  have="$(installed_version || true)"
fi
want="${PHOENIX_VERSION:-}"
want="${want#==}"

if [ -n "$have" ] && { [ -z "${PHOENIX_VERSION:-}" ] || [ "$have" = "$want" ]; }; then
  echo "install-phoenix: arize-phoenix $have already in $venv" >&2
else
  echo "install-phoenix: installing $spec into $venv" >&2
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
  constraints=()
  [ -z "${PHOENIX_CONSTRAINTS:-}" ] || constraints=(-c "$PHOENIX_CONSTRAINTS")
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${constraints[@]}" "$spec" >&2
  echo "install-phoenix: arize-phoenix $(installed_version) installed" >&2
fi
"$venv/bin/phoenix" --help >/dev/null  # fails loudly if the install is broken
echo "$venv/bin/phoenix"

#!/usr/bin/env bash
# The device check's rehearsal here, on the CPU: the same loadtest/gpu_check.sh in a fresh
# Python 3.12 venv that holds only what the GPU image holds (the versions its pip list gave:
# .library/device/KINDS.md), plus the carried wheels, which gpu_check.sh installs --no-index.
#
#   make gpu-rehearsal            # builds .venv-rehearsal312 once (PyPI), then runs the check
#
# PyPI's torch 2.11.0 for Python 3.12 is a CUDA build; it runs on a CPU, as the image's would.
# pydantic is removed after the install (something in the list pulls it; the image lacks it,
# so it must come from the carry, as on the device).
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=${REHEARSAL_VENV:-.venv-rehearsal312}
export OUT=${OUT:-$(mktemp -d)}

# The first Python 3.12 that runs (a pyenv shim named python3.12 exists, and fails, where 3.12 is
# installed but not selected).
if [ -z "${PYTHON312:-}" ]; then
  for candidate in "$(command -v python3.12)" "$HOME"/.pyenv/versions/3.12*/bin/python; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      PYTHON312=$candidate
      break
    fi
  done
fi
if [ -z "${PYTHON312:-}" ] && [ ! -f "$VENV/.installed" ]; then
  echo "gpu_rehearsal: no Python 3.12 (set PYTHON312=/path/to/python3.12)" >&2
  exit 2
fi
if [ ! -f "$VENV/.installed" ]; then
  set -e
  "$PYTHON312" -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.11.0 transformers==5.17.0 sentence-transformers==6.0.1 \
    tokenizers==0.23.2 numpy aiohttp msgpack uvloop prometheus-client pyarrow click tqdm pytest
  "$VENV/bin/pip" uninstall -q -y pydantic pydantic-core
  touch "$VENV/.installed"
  set +e
fi
started=$SECONDS
SITE=$(mktemp -d) PYTHON="$VENV/bin/python" bash loadtest/gpu_check.sh --device cpu "$@"
status=$?  # the summary was printed whatever happened; say where the files are
echo "gpu_rehearsal: exit $status in $((SECONDS - started)) s, files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $status

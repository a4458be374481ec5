#!/usr/bin/env bash
# The device check, offline: install the carried wheels, then run loadtest/gpu_check.py.
#
#   make gpu-carry                                   # here, once: .gpu-carry/ (< 64 MiB)
#   bash loadtest/gpu_check.sh                       # on the device machine (carry .gpu-carry)
#   PYTHON=/path/to/venv/bin/python bash loadtest/gpu_check.sh --device cpu   # the rehearsal
#
# Nothing is fetched: the project runs from PYTHONPATH (embedfleet/__init__.py maps the checkout's
# shared/, producer/ and workers/ folders to the names the wheel gives them), the wheels the image lacks are installed with
# --no-index into $SITE, the model is the carried fp16 copy. Results and the summary go to $OUT
# (3 files: summary.md, results.json, log.txt); the summary is printed last. docs/BENCHMARKS.md
# (GPU check) has the device tool's command line.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
CARRY=${CARRY:-.gpu-carry}
SITE=${SITE:-/tmp/site}
export OUT=${OUT:-$(mktemp -d)}

if ! compgen -G "$CARRY/wheels/*.whl" > /dev/null; then
  echo "gpu_check: no wheels in $CARRY/wheels: run 'make gpu-carry' and name $CARRY in carry" >&2
  exit 2
fi
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$CARRY"/wheels/*.whl || { echo "gpu_check: wheel install failed" >&2; exit 3; }
export PYTHONPATH="$SITE:$PWD" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
exec "$PYTHON" -m loadtest.gpu_check "$@"

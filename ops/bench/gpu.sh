#!/usr/bin/env bash
# pagedq on a GPU in one short slot: ops/bench/gpu_check.py (time-boxed: never past its 350 s budget).
#
#   bash ops/bench/gpu.sh [OUT_DIR] [gpu_check options]   # from anywhere; OUT_DIR defaults below
#   PY=/path/to/python bash ops/bench/gpu.sh
#
# Needs only torch, triton, transformers and numpy (no Redis, no network, no model files: the check
# builds random-weight models). Sections: a kernels, b fp32 tokens vs transformers, c bf16 logits vs
# transformers, d engine throughput vs the bandwidth bound, e decode attention bandwidth; each writes
# OUT_DIR/<section>.json as soon as it ends, OUT_DIR/summary.json at the end. Exit code 0 iff all passed.
# The Redis-backed comparisons (python -m ops.bench.cli offline / serve) need a set-up checkout.
set -euo pipefail

cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${1:-${OUT:-ops/bench/results/gpu-check-$(date +%Y%m%d-%H%M%S)}}
shift || true

echo "=== pagedq GPU check $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname), repo $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "(nvidia-smi unavailable)"
exec "$PY" ops/bench/gpu_check.py --out "$OUT" "$@"

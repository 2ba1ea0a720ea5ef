#!/usr/bin/env bash
# pagedq GPU benchmarks, sized for a 10-minute slot on one H200 (or any CUDA GPU).
#
#   bash ops/bench/gpu.sh                 # from the repository root of a set-up checkout (make setup)
#   PY=/path/to/python bash ops/bench/gpu.sh
#
# Steps, each time-boxed with `timeout` (the sum stays under 10 minutes):
#   1. kernels:  ops/bench/kernels.py (Triton paged attention vs SDPA, correctness then timings)
#   2. model:    a random-weight Qwen2.5-0.5B-shaped model (bf16, SmolLM2's tokenizer), built once
#   3. offline:  SmolLM2-135M, pagedq vs transformers continuous batching, bf16, 256 `random` requests
#   4. offline:  the Qwen2.5-0.5B-shaped model, pagedq vs transformers continuous batching, bf16
#   5. serve:    SmolLM2-135M through Redis, pagedq vs the static-batching baseline worker
# Results: ops/bench/results/gpu-<timestamp>/ (one folder per step, each with latest/summary.md).
# A step that fails or runs out of time is reported and the next one still runs; the exit code is
# non-zero when any step failed.
set -euo pipefail

cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
STAMP=$(date +%Y%m%d-%H%M%S)
OUT=${OUT:-ops/bench/results/gpu-$STAMP}
QWEN_DIR=${QWEN_DIR:-${PAGEDQ_CACHE:-$HOME/.cache/pagedq}/bench/qwen2.5-0.5b-shape}
THREADS=${THREADS:-4}
mkdir -p "$OUT"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "=== pagedq GPU benchmarks $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname)"
echo "=== repo $(git rev-parse --short HEAD 2>/dev/null || echo '?'), results in $OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "(nvidia-smi unavailable)"
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "| transformers", transformers.__version__)'

FAILED=()
T0=$(date +%s)
step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2 start rc
  shift 2
  start=$(date +%s)
  echo
  echo "=== [$(($(date +%s) - T0))s] $name (at most ${secs}s)"
  if timeout --kill-after=15 "$secs" "$@"; then
    echo "=== $name done in $(($(date +%s) - start))s"
  else
    rc=$?
    [ "$rc" -eq 124 ] && echo "!!! $name timed out after ${secs}s" || echo "!!! $name failed (exit $rc)"
    FAILED+=("$name")
  fi
}

# One repeat: GPU timings are far steadier than the shared CPUs', and the slot is short.
COMMON=(--device cuda --dtype bfloat16 --threads "$THREADS" --repeats 1 --no-progress --child-timeout 90)

step kernels 90 "$PY" -m ops.bench.kernels --batches 1,32,256 --contexts 512,4096,16384 --out "$OUT/kernels.json"

step qwen-model 45 "$PY" - "$QWEN_DIR" <<'PYEOF'
import sys
from pathlib import Path

out = Path(sys.argv[1])
if (out / "config.json").exists():
    print("already built:", out)
    raise SystemExit(0)
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2Config

from worker.models.prepare import prepare

smol = prepare("smollm2")
cfg = Qwen2Config(  # Qwen2.5-0.5B's shape
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
    rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
tmp = out.with_name(out.name + ".partial")
model.save_pretrained(tmp)
AutoTokenizer.from_pretrained(smol).save_pretrained(tmp)  # prompts are drawn below its 49152 ids
GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(tmp)
tmp.rename(out)
print("built", out, sum(p.numel() for p in model.parameters()) / 1e6, "M parameters")
PYEOF

# transformers continuous batching with its own defaults ("auto": sized from free GPU memory, CUDA graphs).
step offline-smollm2 120 "$PY" -m ops.bench.cli offline --model smollm2 "${COMMON[@]}" --requests 256 \
  --systems pagedq,hf-cb --hf-cb auto --out "$OUT/offline-smollm2"

step offline-qwen 120 "$PY" -m ops.bench.cli offline --model "$QWEN_DIR" "${COMMON[@]}" --requests 256 \
  --systems pagedq,hf-cb --hf-cb auto --out "$OUT/offline-qwen0.5b-shape"

step serve-smollm2 180 "$PY" -m ops.bench.cli serve --model smollm2 "${COMMON[@]}" --requests 128 \
  --serve-requests 64 --rates 0.5,1 --long-requests 32 --systems pagedq,hf-static --out "$OUT/serve-smollm2"

echo
echo "=== finished in $(($(date +%s) - T0))s; results in $OUT"
for f in "$OUT"/*/latest/summary.md; do
  [ -f "$f" ] && { echo; echo "----- $f"; sed -n '/^## Goals/,/^## Plots/p' "$f"; }
done
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "!!! failed or timed out: ${FAILED[*]}"
  exit 1
fi

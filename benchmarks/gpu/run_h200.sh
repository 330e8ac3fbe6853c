#!/usr/bin/env bash
# The GPU checks and benchmarks in one go, on the H200 host (repo root; the environment bundle in
# .gpucache/, the Llama 3 tokenizer in .assets/llama3 — both git-ignored, carried with the tree):
#
#   bash benchmarks/gpu/run_h200.sh [tests] [bench] [serve]     (default: tests bench)
#
# 1. builds the random-weight Llama-3.1-8B-shaped model on the GPU ($BANYAN_GPU_MODEL, /tmp/llama8b)
# 2. tests:  pytest -m gpu tests/gpu (parity vs HF fp32, FlashInfer vs torch, graphs vs eager)
# 3. bench:  benchmarks/bench_worker.py (ModelRunner.execute vs HF generate, same model, same run)
# 4. serve:  benchmarks/bench_serve.py (end to end through banyan serve)
# Logs and JSON go to $OUT (default /tmp/banyan-gpu); the tables are printed last.
set -uo pipefail
OUT=${OUT:-/tmp/banyan-gpu}
MODEL=${BANYAN_GPU_MODEL:-/tmp/llama8b}
STEPS=${*:-tests bench}
mkdir -p "$OUT"
source .gpucache/env.sh || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, transformers, flashinfer; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'flashinfer', flashinfer.__version__)"; } 2>&1 | tee "$OUT/env.txt"

t0=$SECONDS
timeout 240 python3 -m benchmarks.gpu.make_model --out "$MODEL" --tokenizer .assets/llama3 2>&1 | tail -2
echo "model: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"

status=0
if [[ $STEPS == *tests* ]]; then
  t0=$SECONDS
  BANYAN_GPU_MODEL=$MODEL BANYAN_GPU_REPORT=$OUT/parity.json timeout 300 \
    python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -rA --timeout 280 >"$OUT/tests.log" 2>&1 || status=1
  grep -E "passed|failed|Error|error|assert" "$OUT/tests.log" | grep -v "^PASSED" | tail -25
  echo "tests: $((SECONDS - t0)) s"
fi
if [[ $STEPS == *bench* ]]; then
  t0=$SECONDS
  timeout 280 python3 benchmarks/bench_worker.py --model "$MODEL" --out "$OUT/bench.json" >"$OUT/bench.log" 2>&1 || status=1
  grep -v '"stage"\|\] stage' "$OUT/bench.log" | tail -45
  echo "bench: $((SECONDS - t0)) s"
fi
if [[ $STEPS == *serve* ]]; then
  t0=$SECONDS
  timeout 420 python3 benchmarks/bench_serve.py --model "$MODEL" --out "$OUT/serve.json" --log "$OUT/serve_server.log" --jump-forward-off-too \
    >"$OUT/serve.log" 2>&1 || status=1
  tail -12 "$OUT/serve.log"
  echo "serve: $((SECONDS - t0)) s"
fi
[[ -f $OUT/parity.json ]] && cat "$OUT/parity.json"
exit $status

#!/usr/bin/env bash
# The GPU checks and benchmarks in one go, on the H200 host (repo root; the environment bundle in
# .gpucache/, the Llama 3 tokenizer in .assets/llama3, wheels the bundle lacks in .whl/ (made with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 ... smg-grpc-proto==0.4.28`) — all
# git-ignored, carried with the tree):
#
#   bash benchmarks/gpu/run_h200.sh [tests] [bench] [serve] [suite|suite-a|suite-b|suite-c|suite-d|suite-x] [hicache]
#                                   [small-m] [fp8] [profile] [parts]
#                                                                                      (default: tests bench)
#
# 1. builds the random-weight Llama-3.1-8B-shaped model on the GPU ($BANYAN_GPU_MODEL, /tmp/llama8b)
# 2. tests:  pytest -m gpu tests/gpu (parity vs HF fp32, FlashInfer vs torch, graphs vs eager)
# 3. bench:  benchmarks/bench_worker.py (ModelRunner.execute vs HF generate, same model, same run)
# 4. serve:  benchmarks/bench_serve.py (end to end through banyan serve)
# 5. suite:  benchmarks/gpu/suite.py, the performance issue's W1–W5 + HF baselines (~12 min in all);
#    under a 10-minute command limit run it in two calls: suite-a (W1, W2, HF; ~6 min) and suite-b
#    (W3, W4, W5; ~7 min), each writing $OUT/suite/suite_<workloads>.json; the table of both is
#    merged when both are there (else: python -m benchmarks.gpu.suite --merge A.json B.json --out D).
#    suite-c runs W2, W2S (W2 without the SMG gRPC service) and W7 (priority scheduling: two servers, a
#    capacity run, two 45-s mixed runs).
#    $SUITE_ARGS go to the suite (e.g. "--hf-subset 64"), $SERVE_ARGS to banyan serve. A timeout
#    (SIGTERM) stops the servers and prints the table of what finished; the JSON has it too.
#    suite-x: the workloads in $SUITE_WORKLOADS under a $SUITE_T-s limit (default 520).
#    suite-d: W2, W2H (W2 with the host tier) and W6 (multi-turn, GPU pool capped at 60k tokens: GPU tier
#    only / + host tier / + disk tier and a restart), its own call (~10 min budget: if it runs out, split
#    W6 with SUITE_ARGS="--w6-variants off,host" then "--w6-variants disk").
# 6. hicache: the hierarchical cache's GPU tests (copy stream, demote ordering, outputs with the host
#    tier = without) and benchmarks/gpu/hicache_copy.py (copy GB/s, what copies cost concurrent GEMMs).
# 7. small-m: benchmarks/gpu/small_m_bench.py (decode-size linears: cuBLAS / _scaled_mm vs Banyan's kernel).
# 8. fp8: fp8_check.py on a conditioned model (/tmp/llama8b-cond: accuracy figures that mean something),
#    then W1 and W2 with FP8 weights and with the FP8 KV cache (~7 min).
# 9. profile: benchmarks/gpu/decode_profile.py (a decode step's kernels by group, batch 1 and 64; bf16 and
#    FP8 weights; ~2 min).
# 10. parts: benchmarks/gpu/decode_parts_bench.py (decode attention with / without tensor cores by batch and
#    context; greedy argmax one- vs two-stage; ~1 min). $SMALL_M_ARGS go to small_m_bench (e.g. --fp8-only).
# Logs and JSON go to $OUT (default /tmp/banyan-gpu); the tables are printed last. When more than 8 files
# would come back (the device tool's limit), everything is packed into $OUT/results.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/banyan-gpu}
MODEL=${BANYAN_GPU_MODEL:-/tmp/llama8b}
STEPS=${*:-tests bench}
mkdir -p "$OUT"
source .gpucache/env.sh || exit 1
# Python packages the bundle lacks travel as wheels in .whl/ (git-ignored, carried): smg-grpc-proto
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
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
if [[ $STEPS =~ suite(-[abcdx])? ]]; then
  case ${BASH_REMATCH[0]} in suite-a) W=W1,W2,HF T=520 ;; suite-b) W=W3,W4,W5 T=520 ;; suite-c) W=W2,W2S,W7 T=520 ;;
    suite-d) W=W2,W2H,W6 T=520 ;;
    suite-x) W=${SUITE_WORKLOADS:?suite-x needs SUITE_WORKLOADS} T=${SUITE_T:-520} ;;
    *) W=W1,W2,W3,W4,W5,HF T=1200 ;; esac
  t0=$SECONDS
  # shellcheck disable=SC2086  # word splitting of the extra flags is intended
  timeout $T python3 -m benchmarks.gpu.suite --model "$MODEL" --out "$OUT/suite" --workloads "$W" ${SUITE_ARGS:-} \
    -- ${SERVE_ARGS:-} >"$OUT/suite_${W//,/-}.log" 2>&1 || status=1
  grep '^\[suite\]' "$OUT/suite_${W//,/-}.log" | tail -20
  if [[ $W == W1,W2,HF || $W == W3,W4,W5 ]] && [[ -f $OUT/suite/suite_W1-W2-HF.json && -f $OUT/suite/suite_W3-W4-W5.json ]]; then
    python3 -m benchmarks.gpu.suite --merge "$OUT/suite/suite_W1-W2-HF.json" "$OUT/suite/suite_W3-W4-W5.json" \
      --out "$OUT/suite" | sed -n '/^## /,$p'
  else
    sed -n '/^## Banyan GPU suite/,$p' "$OUT/suite_${W//,/-}.log"
  fi
  echo "suite: $((SECONDS - t0)) s"
fi
if [[ $STEPS == *hicache* ]]; then
  t0=$SECONDS
  timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_hicache_gpu.py -p no:cacheprovider -rA --timeout 230 \
    >"$OUT/hicache_tests.log" 2>&1 || status=1
  grep -E "passed|failed|Error|assert" "$OUT/hicache_tests.log" | grep -v "^PASSED" | tail -15
  timeout 180 python3 -m benchmarks.gpu.hicache_copy --out "$OUT/hicache_copy.json" 2>&1 | tail -12 || status=1
  echo "hicache: $((SECONDS - t0)) s"
fi
if [[ $STEPS == *small-m* ]]; then
  t0=$SECONDS
  # shellcheck disable=SC2086  # flags
  timeout 240 python3 -m benchmarks.gpu.small_m_bench --out "$OUT/small_m.json" ${SMALL_M_ARGS:-} 2>&1 | tail -30 || status=1
  echo "small-m: $((SECONDS - t0)) s"
fi
if [[ $STEPS == *fp8* ]]; then
  t0=$SECONDS
  timeout 120 python3 -m benchmarks.gpu.make_model --out /tmp/llama8b-cond --tokenizer .assets/llama3 --init conditioned \
    2>&1 | tail -1
  timeout 240 python3 -m benchmarks.gpu.fp8_check --model /tmp/llama8b-cond --init conditioned --out "$OUT/fp8_check.json" \
    >"$OUT/fp8_check.log" 2>&1 || status=1
  sed -n '/^JSON/,/^gemm qkv M=1/p' "$OUT/fp8_check.log"
  for v in "fp8w --quantization fp8" "fp8kv --kv-cache-dtype fp8_e4m3"; do
    [[ ,${FP8_SUITE:-fp8w,fp8kv}, == *,${v%% *},* ]] || continue  # ($FP8_SUITE: which of the two runs)
    # shellcheck disable=SC2086  # the flag and its value
    timeout 170 python3 -m benchmarks.gpu.suite --model "$MODEL" --out "$OUT/suite" --workloads W1,W2 --tag "W1-W2-${v%% *}" \
      -- ${v#* } >"$OUT/suite_${v%% *}.log" 2>&1 || status=1
    grep -h '^| W[12] \(batch\|offline\)' "$OUT/suite/suite_W1-W2-${v%% *}.md" 2>/dev/null
  done
  echo "fp8: $((SECONDS - t0)) s"
fi
if [[ $STEPS == *profile* ]]; then
  t0=$SECONDS
  for q in bf16 fp8; do
    # shellcheck disable=SC2046  # no flags for bf16
    timeout 150 python3 -m benchmarks.gpu.decode_profile --model "$MODEL" --batch 1,64 --out "$OUT/decode_profile_$q.json" \
      $( [[ $q == fp8 ]] && echo "-- --quantization fp8" ) >"$OUT/decode_profile_$q.log" 2>&1 || status=1
    sed -n '/^## batch/,$p' "$OUT/decode_profile_$q.log"
  done
  echo "profile: $((SECONDS - t0)) s"
fi
if [[ $STEPS == *parts* ]]; then
  t0=$SECONDS
  timeout 180 python3 -m benchmarks.gpu.decode_parts_bench --out "$OUT/decode_parts.json" 2>&1 | tail -32 || status=1
  echo "parts: $((SECONDS - t0)) s"
fi
[[ -f $OUT/parity.json ]] && cat "$OUT/parity.json"
if (( $(find "$OUT" -type f | wc -l) > 8 )); then  # (the device tool returns 8 files at most)
  tar czf /tmp/results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/results.tgz "$OUT/"
fi
exit $status

#!/usr/bin/env bash
# The ninth session's device calls (the eighth's 2026-12-03c.sh and more steps): named steps, each run only
# when it fits the ~570 s left.
#   BANYAN_GIT_COMMIT=<tree> STEPS="w7si w7t2" FAST="--piecewise-cuda-graph-max-tokens 1536" CAP=512 \
#     bash benchmarks/gpu/calls/2026-12-03d.sh
# Steps: t8 (the GPU test of the Triton decode on an FP8 pool) · fp8 (W2,W3 with an FP8 pool and FAST) · bf16w3 (W3 with FAST: fp8's baseline) · w2h (W2,W2H with
# FAST) · w5 (W5 with FAST) · bench8 (fp8_decode_bench) · w7 (W7, cap $CAP, FAST, traced) · w7t2 (the same with
# two tokenizer replicas, the background over four connections) · w7si (the background streams 8 tokens a
# message) · w45 (W4,W5 with FAST) · lof (W2, FAST, lof policy) · sweep8 (the small-M kernel's FP8 configs and
# ~60 more at M = 1) · w34 (W3,W4 with FAST) · w34base (W3,W4 with the defaults: w34's baseline) · w2 (W2, FAST) · sweepp (the
# prefetching CUDA-core FP8 configs only)
source benchmarks/gpu/calls/setup.sh
END=${END:-570}; CAP=${CAP:-1024}; read -r -a fast <<<"${FAST:-}"
python3 -m benchmarks.gpu.make_model --out /tmp/llama8b --tokenizer .assets/llama3 2>&1 | tail -1
suite() {  # name timeout suite-args... -- serve-args...
  local name=$1 limit=$2; shift 2
  if [ $((SECONDS + limit)) -gt "$END" ]; then echo "$name: skipped (time)"; return; fi
  local t0=$SECONDS
  timeout -k 15 "$limit" python3 -m benchmarks.gpu.suite --model /tmp/llama8b --out "$OUT/$name" --tag "$name" "$@" \
    >"$OUT/$name.log" 2>&1
  echo "$name (rc $?): $((SECONDS - t0)) s"
}
for step in ${STEPS:-fp8}; do
  case $step in
    t8) timeout 60 python3 -m pytest -q -m gpu tests/gpu/test_gpu_parity.py -k fp8_pool -p no:cacheprovider \
          >"$OUT/t8.log" 2>&1; echo "t8 (rc $?)"; tail -2 "$OUT/t8.log" ;;
    bench8) timeout 70 python3 -m benchmarks.gpu.fp8_decode_bench --out "$OUT/fp8_decode.json" \
              --shapes 64x1024,600x1536,1x1024 >"$OUT/fp8_decode.log" 2>&1; tail -6 "$OUT/fp8_decode.log" ;;
    w5) suite w5 150 --workloads W5 -- "${fast[@]}" ;;
    fp8) suite fp8 200 --workloads W2,W3 --w3-baselines= --w3-extra= -- --kv-cache-dtype fp8_e4m3 "${fast[@]}" ;;
    bf16w3) suite bf16w3 150 --workloads W3 --w3-baselines= --w3-extra= -- "${fast[@]}" ;;
    w2h) suite w2h 250 --workloads W2,W2H -- "${fast[@]}" ;;
    w7) suite w7 270 --workloads W7 --w7-duration 20 --step-trace \
          --w7-priority-flags=--priority-prefill-cap,"$CAP" -- "${fast[@]}"
        python3 -m benchmarks.gpu.stage_trace "$OUT/w7/server_w7_priority.log" \
          --steps "$OUT/w7/steps_w7_priority.jsonl" --top 5 >"$OUT/w7_stages.txt" 2>&1
        python3 -m benchmarks.gpu.itl_trace "$OUT/w7/suite_w7.json" "$OUT/w7/steps_w7_priority.jsonl" \
          >"$OUT/w7_itl.txt" 2>&1 ;;
    w7t2) suite w7t2 270 --workloads W7 --w7-duration 20 --step-trace --w7-connections 4 \
          --w7-priority-flags=--priority-prefill-cap,"$CAP" -- --num-tokenizers 2 "${fast[@]}"
        python3 -m benchmarks.gpu.stage_trace "$OUT/w7t2/server_w7_priority.log" \
          --steps "$OUT/w7t2/steps_w7_priority.jsonl" --top 5 >"$OUT/w7t2_stages.txt" 2>&1
        python3 -m benchmarks.gpu.itl_trace "$OUT/w7t2/suite_w7t2.json" "$OUT/w7t2/steps_w7_priority.jsonl" \
          >"$OUT/w7t2_itl.txt" 2>&1 ;;
    w7si) suite w7si 270 --workloads W7 --w7-duration 20 --step-trace --w7-bg-stream-interval 8 \
          --w7-priority-flags=--priority-prefill-cap,"$CAP" -- "${fast[@]}"
        python3 -m benchmarks.gpu.stage_trace "$OUT/w7si/server_w7_priority.log" \
          --steps "$OUT/w7si/steps_w7_priority.jsonl" --top 5 >"$OUT/w7si_stages.txt" 2>&1
        python3 -m benchmarks.gpu.itl_trace "$OUT/w7si/suite_w7si.json" "$OUT/w7si/steps_w7_priority.jsonl" \
          >"$OUT/w7si_itl.txt" 2>&1 ;;
    w45) suite w45 200 --workloads W4,W5 -- "${fast[@]}" ;;
    sweep8) timeout 240 python3 -m benchmarks.gpu.small_m_bench --sweep --ms 1,4 --out "$OUT/sweep8.json" \
              >"$OUT/sweep8.log" 2>&1; echo "sweep8 (rc $?)"; grep '^| ' "$OUT/sweep8.log" | head -12 ;;
    sweepp) timeout 150 python3 -m benchmarks.gpu.small_m_bench --sweep --ms 1,4 --only 'p$' --out "$OUT/sweepp.json" \
              >"$OUT/sweepp.log" 2>&1; echo "sweepp (rc $?)"; grep '^| ' "$OUT/sweepp.log" | head -12 ;;
    w34) suite w34 220 --workloads W3,W4 --w3-baselines= --w3-extra= -- "${fast[@]}" ;;
    w2) suite w2 125 --workloads W2 --step-trace -- "${fast[@]}" ;;
    w34base) suite w34base 220 --workloads W3,W4 --w3-baselines= --w3-extra= ;;
    lof) suite lof 110 --workloads W2 -- --schedule-policy lof "${fast[@]}" ;;
    *) echo "unknown step $step" ;;
  esac
done
cd "$OUT" || exit 1
rm -rf ./*/server_w7_plain.log ./*/steps_w7_plain.jsonl ./*/*.ready
grep -h '^\[suite\]\|^| W' ./*.log 2>/dev/null | head -40; head -16 ./*_stages.txt ./*_itl.txt 2>/dev/null
tar czf /tmp/results.tgz . && rm -rf ./* && mv /tmp/results.tgz .  # (one file back: the tool's limit is 8)

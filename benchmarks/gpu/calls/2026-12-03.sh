#!/usr/bin/env bash
# The seventh session's device call (one H200; docs/perf.md "2026-12-03"): the Triton FP8-KV decode
# kernel against FlashInfer's, the GPU tests of it and of piecewise graphs, W7 with a 512-token cap
# (+ piecewise graphs when their tests pass) with its stage trace, W2 with FP8 KV through the kernel
# (W2 first: the shorter, if the device time runs out).
#   BANYAN_GIT_COMMIT=<tree> bash benchmarks/gpu/calls/2026-12-03.sh      (writes under $OUT)
source benchmarks/gpu/calls/setup.sh
t0=$SECONDS
timeout 90 python3 -m benchmarks.gpu.fp8_decode_bench --out "$OUT/fp8_decode.json" \
  --shapes 64x1024,600x1536,1x1024 >"$OUT/fp8_decode.log" 2>&1
echo "fp8_decode_bench: $((SECONDS - t0)) s"; t0=$SECONDS
rm -f "$OUT/fp8_decode.json"  # (its rows are in the log; few files if the time runs out)
timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_gpu_parity.py \
  -k "triton or piecewise" -p no:cacheprovider >"$OUT/tests.log" 2>&1
ok=$?
echo "tests (rc $ok): $((SECONDS - t0)) s"; t0=$SECONDS
python3 -m benchmarks.gpu.make_model --out /tmp/llama8b --tokenizer .assets/llama3 2>&1 | tail -1
timeout 110 python3 -m benchmarks.gpu.suite --model /tmp/llama8b --out "$OUT/w2" --tag W2-fp8kv-triton --workloads W2 \
  -- --kv-cache-dtype fp8_e4m3 --decode-attention triton >"$OUT/w2.log" 2>&1
echo "W2: $((SECONDS - t0)) s"; t0=$SECONDS
rm -rf "$OUT/w2"  # (its table is in w2.log)
pw=(); [ $ok = 0 ] && pw=(--piecewise-cuda-graph-max-tokens 1024)
timeout 200 python3 -m benchmarks.gpu.suite --model /tmp/llama8b --out "$OUT/w7" --tag W7-cap512 --workloads W7 \
  --w7-duration 20 --step-trace --w7-priority-flags=--priority-prefill-cap,512 -- "${pw[@]}" >"$OUT/w7.log" 2>&1
python3 -m benchmarks.gpu.stage_trace "$OUT/w7/server_w7_priority.log" --steps "$OUT/w7/steps_w7_priority.jsonl" \
  --top 5 >"$OUT/w7_stages.txt" 2>&1
echo "W7: $((SECONDS - t0)) s"
cd "$OUT" || exit 1
rm -rf w7/server_w7_plain.log w7/steps_w7_plain.jsonl w7/*.ready
tail -8 fp8_decode.log; tail -4 tests.log; grep -h '^\[suite\] W7\|^| W7\|^| W2 output' w7.log w2.log; head -14 w7_stages.txt
tar czf /tmp/results.tgz . && rm -rf ./* && mv /tmp/results.tgz .  # (one file back: the tool's limit is 8)

#!/usr/bin/env bash
# The eighth session's first device call (one H200; docs/perf.md "2026-12-03 (eighth session)"): the GPU
# tests of the Triton decode kernel under graphs (the fix) and of piecewise graphs; then, where they pass,
# W7 with piecewise graphs to 1,536 tokens and a 512-token cap, traced; W1/W2 with the Triton decode and piecewise graphs;
# the FP8 decode bench with the fp16-products variant. Every step is skipped when it could overrun ~570 s.
#   BANYAN_GIT_COMMIT=<tree> bash benchmarks/gpu/calls/2026-12-03b.sh      (writes under $OUT)
source benchmarks/gpu/calls/setup.sh
END=${END:-570}
fits() { [ $((SECONDS + $1)) -le "$END" ]; }
t0=$SECONDS
timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_gpu_parity.py -k "triton and not piecewise" \
  -p no:cacheprovider >"$OUT/tests_triton.log" 2>&1; tri=$?
echo "tests triton (rc $tri): $((SECONDS - t0)) s"; t0=$SECONDS
timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_gpu_parity.py -k "piecewise or graph" \
  -p no:cacheprovider >"$OUT/tests_piecewise.log" 2>&1; pwok=$?
echo "tests piecewise/graph (rc $pwok): $((SECONDS - t0)) s"; t0=$SECONDS
python3 -m benchmarks.gpu.make_model --out /tmp/llama8b --tokenizer .assets/llama3 2>&1 | tail -1
pw=(); [ $pwok = 0 ] && pw=(--piecewise-cuda-graph-max-tokens 1536)  # (cap 1,024 + ~240 decode rows)
tr=(); [ $tri = 0 ] && tr=(--decode-attention triton)
if fits 190; then
  timeout 190 python3 -m benchmarks.gpu.suite --model /tmp/llama8b --out "$OUT/w7" --tag W7-cap512-pw --workloads W7 \
    --w7-duration 25 --step-trace --w7-priority-flags=--priority-prefill-cap,512 -- "${pw[@]}" >"$OUT/w7.log" 2>&1
  python3 -m benchmarks.gpu.stage_trace "$OUT/w7/server_w7_priority.log" --steps "$OUT/w7/steps_w7_priority.jsonl" \
    --top 5 >"$OUT/w7_stages.txt" 2>&1
  echo "W7: $((SECONDS - t0)) s"; t0=$SECONDS
fi
if fits 150; then
  timeout 150 python3 -m benchmarks.gpu.suite --model /tmp/llama8b --out "$OUT/w12" --tag W1-W2-fast --workloads W1,W2 \
    --step-trace -- "${pw[@]}" "${tr[@]}" >"$OUT/w12.log" 2>&1
  echo "W1,W2: $((SECONDS - t0)) s"; t0=$SECONDS
fi
if fits 70 && [ $tri = 0 ]; then
  timeout 70 python3 -m benchmarks.gpu.fp8_decode_bench --out "$OUT/fp8_decode.json" \
    --shapes 64x1024,600x1536,1x1024 >"$OUT/fp8_decode.log" 2>&1
  echo "fp8_decode_bench: $((SECONDS - t0)) s"
fi
cd "$OUT" || exit 1
rm -rf w7/server_w7_plain.log w7/steps_w7_plain.jsonl w7/*.ready w12/*.ready
tail -3 tests_triton.log tests_piecewise.log; grep -h '^\[suite\]\|^| W' w7.log w12.log 2>/dev/null | head -30
head -14 w7_stages.txt 2>/dev/null; tail -6 fp8_decode.log 2>/dev/null
tar czf /tmp/results.tgz . && rm -rf ./* && mv /tmp/results.tgz .  # (one file back: the tool's limit is 8)

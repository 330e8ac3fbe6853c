#!/usr/bin/env bash
# The GPU entry script: the performance suite, the kernel micro-benchmarks and the GPU tests, as named steps, on one
# device call (run on the device; `prepare.sh` on the host first makes the folders it carries).
#   STEPS="w1b w2 w34 gtest" bash benchmarks/gpu/calls/gpu.sh
#   BEFORE=/path/to/tree STEPS="cmp12 cmp34" bash benchmarks/gpu/calls/gpu.sh    # this tree against another
# $OUT (default /tmp/banyan-gpu) gets one folder or log per step; a step that would start past $END seconds
# (default 560) is skipped, so the results come back inside a 600-s call. $FAST: `banyan serve` flags every server
# of the suite steps gets (e.g. "--kv-cache-dtype fp8_e4m3"). Steps:
#   w1b · w1f · w1q8    W1 bf16 · FP8 weights · FP8 weights and FP8 KV (w1q8: W1 and W2)
#   w2 · w2q · w2h      W2 bf16 (step trace) · FP8 weights · W2 then W2H
#   w34 · w5 · w45 · w6 W3 + W4 (no baselines) · W5 ($W5_SCALE, $W5_LIMIT) · W4 + W5 · W6 (w6@N: a pool of N tokens)
#   w7                  W7 with --priority-prefill-cap $CAP (w7@N: N), traced
#   fp8                 W2 and W3 on an FP8 pool
#   wbench              bench_worker without HF: batch-1 decode, the 64 × 1k step, prefill rates
#   gemv                small_m_bench at M in $GEMV_MS (1,4): the decode linears against the libraries
#   decode              fp8_decode_bench's served launches against FlashInfer's, both pools, $SHAPES
#   gtest               every GPU test (tests/gpu, -m gpu): parity with HF, FP8, kernels, graphs, tiers
#   parity              the worker's GPU parity tests only (greedy outputs, FP8 paths, piecewise, cascade)
#   cmp12 · cmp34       with $BEFORE (a tree, e.g. `git archive 110603b` unpacked there): this tree and that one on
#                       this card in turn — cmp12: W1 + W2 from a cold start (no tuning decisions, an empty Triton
#                       cache), then a second start on the first one's decisions (W1 again: start-up cached);
#                       cmp34: W3 + W4. Then the table (benchmarks/gpu/suite_compare.py), also in $OUT/compare.md,
#                       of every cmp step run on this machine so far (their results stay in .cmp between calls).
source benchmarks/gpu/calls/setup.sh
END=${END:-560}; CAP=${CAP:-1024}; read -r -a fast <<<"${FAST:-}"
MODEL=${MODEL:-/tmp/llama8b}; CMP=${CMP:-$PWD/.cmp}  # (.cmp: the cmp steps' results, kept between calls)
[ -d "$MODEL" ] || python3 -m benchmarks.gpu.make_model --out "$MODEL" --tokenizer .assets/llama3 2>&1 | tail -1
suite() {  # name limit suite-args... -- serve-args...: one suite run of this tree into $OUT/<name>
  local name=$1 limit=$2; shift 2
  if [ $((SECONDS + limit)) -gt "$END" ]; then echo "$name: skipped (time)"; return; fi
  local t0=$SECONDS
  timeout -k 15 "$limit" python3 -m benchmarks.gpu.suite --model "$MODEL" --out "$OUT/$name" --tag "$name" "$@" \
    >"$OUT/$name.log" 2>&1
  echo "$name (rc $?): $((SECONDS - t0)) s"
}
tree_suite() {  # tree out tag limit suite-args...: a suite run of the tree at $1 (its own code), its own caches
  local tree=$1 out=$2 tag=$3 limit=$4; shift 4
  if [ $((SECONDS + limit)) -gt "$END" ]; then echo "$tag ($tree): skipped (time)"; return; fi
  local t0=$SECONDS
  (cd "$tree" && PYTHONPATH=$PWD:${PYTHONPATH:-} timeout -k 15 "$limit" python3 -m benchmarks.gpu.suite \
    --model "$MODEL" --out "$out" --tag "$tag" "$@" -- "${fast[@]}" >"$out/$tag.log" 2>&1)
  echo "$tag ($tree, rc $?): $((SECONDS - t0)) s"
}
compare() {  # part: both trees, each with its own tuning and Triton caches (kept in .kcache between calls)
  [ -n "${BEFORE:-}" ] && [ -d "$BEFORE/services" ] || { echo "$1: set BEFORE to a tree"; return; }
  for d in .gpucache .assets .whl; do [ -e "$BEFORE/$d" ] || ln -s "$PWD/$d" "$BEFORE/$d"; done
  (cd "$BEFORE" && PYTHONPATH=$PWD:${PYTHONPATH:-} python3 -c "from services.worker.kernels import cuda_gemv as g
print('before tree, cuda gemv:', 'ready' if g.library(True) else g.unavailable(True))")  # (built here, not timed)
  for side in before after; do
    local tree=$PWD; [ "$side" = before ] && tree=$BEFORE
    mkdir -p "$CMP/$side"
    export BANYAN_TUNING_CACHE=$PWD/.kcache/tuning-$side TRITON_CACHE_DIR=$PWD/.kcache/triton-$side
    if [ "$1" = cmp12 ]; then
      rm -rf "$BANYAN_TUNING_CACHE" "$TRITON_CACHE_DIR"  # (cold: nothing decided or compiled before)
      tree_suite "$tree" "$CMP/$side" w12_cold 260 --workloads W1,W2
      tree_suite "$tree" "$CMP/$side" w1_cached 90 --workloads W1
    else
      tree_suite "$tree" "$CMP/$side" w34 200 --workloads W3,W4 --w3-baselines= --w3-extra=
    fi
  done
  export BANYAN_TUNING_CACHE=$PWD/.kcache/tuning; unset TRITON_CACHE_DIR
  python3 -m benchmarks.gpu.suite_compare "$CMP/before" "$CMP/after" --out "$OUT/compare.md"
  mkdir -p "$OUT/cmp" && cp -r "$CMP/before" "$CMP/after" "$OUT/cmp/" 2>/dev/null
}
for step in ${STEPS:-w1b}; do
  cap=$CAP; [[ $step == *@* ]] && cap=${step#*@}
  if [ "$SECONDS" -gt "$END" ]; then echo "$step: skipped (time, \$END)"; continue; fi
  case ${step%@*} in
    w1b) suite w1b 150 --workloads W1 -- "${fast[@]}" ;;
    w1f) suite w1f 150 --workloads W1 -- --quantization fp8 "${fast[@]}" ;;
    w1q8) suite w1q8 240 --workloads W1,W2 -- --quantization fp8 --kv-cache-dtype fp8_e4m3 "${fast[@]}" ;;
    w2) suite w2 150 --workloads W2 --step-trace -- "${fast[@]}" ;;
    w2q) suite w2q 150 --workloads W2 --step-trace -- --quantization fp8 "${fast[@]}" ;;
    w2h) suite w2h 250 --workloads W2,W2H -- "${fast[@]}" ;;
    w34) suite w34 220 --workloads W3,W4 --w3-baselines= --w3-extra= -- "${fast[@]}" ;;
    w5) suite w5 "${W5_LIMIT:-150}" --workloads W5 --scale "${W5_SCALE:-1}" -- "${fast[@]}" ;;
    w45) suite w45 200 --workloads W4,W5 -- "${fast[@]}" ;;
    w6) pool=60000; [[ $step == *@* ]] && pool=$cap  # (the GPU tier against the host's; w6@N: a pool of N tokens)
        suite "w6_$pool" 420 --workloads W6 --w6-variants "${W6V:-off,host}" --w6-pool "$pool" -- "${fast[@]}" ;;
    w7) suite "w7_$cap" 270 --workloads W7 --w7-duration 20 --step-trace \
          --w7-priority-flags=--priority-prefill-cap,"$cap" -- "${fast[@]}" ;;
    fp8) suite fp8 200 --workloads W2,W3 --w3-baselines= --w3-extra= -- --kv-cache-dtype fp8_e4m3 "${fast[@]}" ;;
    wbench) timeout 240 python3 benchmarks/bench_worker.py --model "$MODEL" --skip-hf --out "$OUT/wbench.json" \
              >"$OUT/wbench.log" 2>&1; echo "wbench (rc $?)"; tail -8 "$OUT/wbench.log" ;;
    gemv) timeout 240 python3 -m benchmarks.gpu.small_m_bench --ms "${GEMV_MS:-1,4}" --out "$OUT/gemv.json" \
            >"$OUT/gemv.log" 2>&1; echo "gemv (rc $?)"; grep '^| ' "$OUT/gemv.log" ;;
    decode) timeout 200 python3 -m benchmarks.gpu.fp8_decode_bench --out "$OUT/decode.json" \
              --shapes "${SHAPES:-1x1024,16x1024,64x1024,128x1024,512x1024}" >"$OUT/decode.log" 2>&1
            echo "decode (rc $?)"; tail -12 "$OUT/decode.log" ;;
    gtest) timeout "${GTEST_T:-500}" python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider \
             >"$OUT/gtest.log" 2>&1; echo "gtest (rc $?)"; tail -5 "$OUT/gtest.log" ;;
    parity) timeout 300 python3 -m pytest -q -m gpu tests/gpu/test_gpu_parity.py -p no:cacheprovider \
              >"$OUT/parity.log" 2>&1; echo "parity (rc $?)"; tail -5 "$OUT/parity.log" ;;
    cmp12|cmp34) compare "$step" ;;
    *) echo "$step: no such step (see the list at the top of benchmarks/gpu/calls/gpu.sh)" ;;
  esac
done
[ -d "$BANYAN_TUNING_CACHE" ] && cp -r "$BANYAN_TUNING_CACHE" "$OUT/tuning"  # (for .kcache/tuning on the host)
cd "$OUT" || exit 1
grep -h '^\[suite\] server\|^| W' ./*.log ./*/*.log 2>/dev/null | head -40
tar czf /tmp/results.tgz --exclude=compare.md . && find . -mindepth 1 ! -name compare.md -delete \
  && mv /tmp/results.tgz .  # (what comes back: the tool's limit is 8 files)

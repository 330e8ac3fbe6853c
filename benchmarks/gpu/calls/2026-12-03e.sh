#!/usr/bin/env bash
# The tenth session's device calls: the ninth's steps (2026-12-03d.sh runs this script; its W7 steps now
# write to $OUT/<step>_<cap>), and W7 steps that carry their own cap:
#   BANYAN_GIT_COMMIT=<tree> STEPS="w7t2@128 w7t2c@128" FAST="--kv-cache-dtype fp8_e4m3 --decode-attention triton" \
#     bash benchmarks/gpu/calls/2026-12-03e.sh
# `w7*@N` runs that W7 step with --priority-prefill-cap N (default $CAP) into $OUT/<step>_N; `w7t2c` is w7t2 with
# the priority run's prompts chunked at 128 tokens (--chunked-prefill-size 128 on the priority side only).
# (GPU-test steps' limits include ~20-30 s for the start-up GEMM tuning's first compiles on a fresh machine.)
# Other steps: gemv (the CUDA decode linear: GPU tests, small_m_bench with its configs) · w1b · w1f (W1 bf16 /
# FP8 weights) · hic (the host tier's copier tests) · t8 · fp8 · bf16w3 · w2h · w5 · bench8 · w45 · lof · sweep8 · sweepp · w34 · w34base · w2 · w1q (W1,W2
# with FP8 weights and FAST) · prof, prof0, profc (decode_profile at batch $PROF_BATCH of FP8 W1's setup, or $PROF:
# kernels and the gaps between them in the graph replay; prof0 with FlashInfer's norms, profc with the L2 chain)
# · gtest (the norm, decode-linear and fused norm + linear GPU tests, the worker parity tests) · w1f0, w1fa (w1f
# with BANYAN_FUSED_NORM=0 / =all) · w1f_r (FP8 W1 + --fp8-vocab with BANYAN_ROPE_IN_DECODE=1) · w2p (w2 with
# BANYAN_TRITON_PDL=1) · rtest (the GPU tests of the rope in the decode, the auto decode kernel, Triton PDL)
# · wtest (the FP8 pool's integer widening GPU test) · pick (BANYAN_FP8_WIDEN for the steps after it: the fastest
# widening of bench8's 600 × 1,536) · w1q8 (W1,W2 with FP8 weights and FP8 KV) · spread (the FP8 decode at mixed
# contexts, $SPREAD shapes, by split count and min_part) · pprof (a 16k-token prefill's kernels; the GEMMs alone)
# · pprof8 (pprof with FP8 weights, and the served FP8 linear at M = 16k) · fp8m (the FP8 linear at decode batches of
# 64-1,024 rows: as served, its GEMM alone row-/tensor-wise, cuBLAS bf16, fast accumulation, our FP8 GEMM's configs)
# · w2q, w2q<letters> (W2 with FP8 weights; a: + BANYAN_FP8_FAST_ACCUM=1 (the default since 2026-12-05), p: =0
# (fp32-promoted sums); 0: BANYAN_FP8_FUSED_QUANT=0; g:
# BANYAN_GEMM=0, e.g. w2q0g = as before 2026-12-05) · w2g (bf16 W2 with BANYAN_GEMM=0: the library only) · w6 (W6,
# variants $W6V, default off,host: issue 19's ratio; w6@N: pool N) · w1old (W1 FP8 on the tree in .oldtree)
# · qtest (the fused quantization's, fast accumulation's and our FP8 GEMM's GPU tests, the small-M GPU tests, the
# tuning cache's) · fchk (fp8_check's accuracy with fast accumulation)
# · ftest (the Triton decode on an FP8 pool and cascade GPU tests) · ptest (the prefill attention and rope + write
# GPU tests: strided q/k/v, token-blocked rope) · casc (cascade_cost's 32 × 32 shared-prefix step profiled, bf16 and
# FP8 pools) · w5t (W5 with --step-time-target-ms $STEP_MS, default 12; w5t@N: N ms, into $OUT/w5t_N) · grid (the decode by batch × context:
# the split count and the block/warps of FP8 pools, Triton vs FlashInfer for bf16) · gserved (the same shapes: the
# served launch configurations only, both pools, against FlashInfer's) · w3tr (bf16w3 with the Triton decode from 256
# rows, BANYAN_TRITON_FROM=256; run as w3fi with 65537 on 2026-12-04 when that was the default) · mprof (a W2-like
# mixed step's kernels: 6k prompt tokens beside 525 decodes of ~1.5k) · hprof (step_host_profile: 64 / 256 / 1,150
# prompt tokens beside 16 decodes: the host time to queue a step, its device time, the heaviest Python; $HPROF)
# · wbench (bench_worker without HF: batch-1 decode, the 64 × 1k decode step, prefill rates; wbenchtr: with
# BANYAN_TRITON_ROWS=$TROWS, default 255) · w2tr, w5tr (W2, W5 with it) · bsplit (the bf16 Triton decode by split
# count beside FlashInfer's, $BSPLIT shapes) · $PROF_PROMPT: prof's prompt tokens (128) · lttest (cuBLASLt's
# algorithms' GPU tests) · wbenchlt, w2lt (wbench, bf16 W2 with BANYAN_GEMM_LT=1: cuBLASLt's algorithms tuned)
# · bknob (the bf16 Triton decode by block:warps:stages:pipe, $BKNOB, at $BKSHAPES, splits 1 and 2; bknob@w: at W2's
# decode shapes) · fknob (the
# FP8 pool's served decode with BANYAN_DECODE_PIPE=0 / 1 at $FKSHAPES) · pipetest (its GPU test: the same bits)
# · wbenchl2 (wbench, the o projection prefetched into L2 by the decode attention up to 255 rows, $L2MIB MiB)
# · hprofab (hprof with
# BANYAN_MIXED_ONE_PLAN=0 BANYAN_PIECEWISE_WRITE=0, then with the first alone: before the 2026-12-04 changes)
# · l2test (the 2026-12-04 twentieth session's GPU tests: the decode's L2 prefetch and one-load merge, Triton PDL, the
# norm kernel, FP8 pool, cascade and graph parity) · oprobe (overlap_probe: decode attention beside GEMMs on two streams) · w1fe (w1f with
# $W1ENV exported) · ablate, ablateb (decode_ablate: FP8 W1's / bf16's batch-1 graph with parts as no-ops) · pwtest (the piecewise GPU parity tests) · hproffi (hprof, mixed steps' decodes through FlashInfer's decode: BANYAN_MIXED_TRITON=0) · hprof1 (one plan) · w2s, w2s0, w2d, w2sd (W2
# with steps as two lanes: mixed from $SPLIT prompt tokens, high / equal priority; decode halves from $SPLITD rows) · stest (the two lanes' GPU tests) · lanes (step_host_profile --lanes at W2's plateau: two lanes vs one, the
# same steps in turn).
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
w7step() {  # name cap suite-args... -- serve-args...: one W7 run, traced, then the stage and ITL traces
  local name=$1 cap=$2; shift 2
  local -a args=() serve=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do args+=("$1"); shift; done
  shift; serve=("$@")
  suite "$name" 270 --workloads W7 --w7-duration 20 --step-trace "${args[@]}" \
    --w7-priority-flags=--priority-prefill-cap,"$cap""${PFLAGS:-}" -- "${serve[@]}" "${fast[@]}"
  python3 -m benchmarks.gpu.stage_trace "$OUT/$name/server_w7_priority.log" \
    --steps "$OUT/$name/steps_w7_priority.jsonl" --top 5 >"$OUT/${name}_stages.txt" 2>&1
  python3 -m benchmarks.gpu.itl_trace "$OUT/$name/suite_$name.json" "$OUT/$name/steps_w7_priority.jsonl" \
    >"$OUT/${name}_itl.txt" 2>&1
}
hprof() {  # name lines: step_host_profile (a W5-like mixed step's host time: launch vs device, cProfile's top)
  read -r -a ha <<<"${HPROF:-}"
  timeout 150 python3 -m benchmarks.gpu.step_host_profile --model /tmp/llama8b --out "$OUT/$1.json" \
    -- "${ha[@]}" "${fast[@]}" >"$OUT/$1.log" 2>&1; echo "$1 (rc $?)"; tail -"$2" "$OUT/$1.log"
}
for step in ${STEPS:-fp8}; do
  cap=$CAP; [[ $step == *@* ]] && cap=${step#*@}
  if [ "$SECONDS" -gt "$END" ]; then echo "$step: skipped (time, \$END)"; continue; fi
  case ${step%@*} in
    w7) w7step "w7_$cap" "$cap" -- ;;
    w7t2) w7step "w7t2_$cap" "$cap" --w7-connections 4 -- --num-tokenizers 2 ;;
    w7t2c) PFLAGS=,--chunked-prefill-size,128 w7step "w7t2c_$cap" "$cap" --w7-connections 4 -- --num-tokenizers 2 ;;
    w7si) w7step "w7si_$cap" "$cap" --w7-bg-stream-interval 8 -- ;;
    w1q) suite w1q 240 --workloads W1,W2 -- --quantization fp8 "${fast[@]}" ;;
    gemv) timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_cuda_gemv_gpu.py tests/gpu/test_small_m_gpu.py -k \
            "cuda or tune" -p no:cacheprovider >"$OUT/gemv_tests.log" 2>&1; echo "gemv tests (rc $?)"; tail -3 "$OUT/gemv_tests.log"
          timeout 240 python3 -m benchmarks.gpu.small_m_bench --ms "${GEMV_MS:-1,4}" --out "$OUT/gemv.json" >"$OUT/gemv.log" 2>&1
          echo "gemv bench (rc $?)"; grep '^| \|^cuda' "$OUT/gemv.log" ;;
    hic) timeout 180 python3 -m pytest -q -m gpu tests/gpu/test_hicache_gpu.py -k "not outputs" -p no:cacheprovider \
           >"$OUT/hic.log" 2>&1; echo "hic tests (rc $?)"; tail -2 "$OUT/hic.log" ;;
    w1b) suite w1b 150 --workloads W1 -- "${fast[@]}" ;;
    w1f) read -r -a w1f <<<"${W1F:-}"; suite w1f 150 --workloads W1 -- --quantization fp8 "${w1f[@]}" "${fast[@]}" ;;
    w1fe) read -r -a w1f <<<"${W1F:-}"  # (w1f with the environment $W1ENV: NAME=VALUE ...)
          (if [ -n "${W1ENV:-}" ]; then export ${W1ENV}; fi
           suite w1fe 150 --workloads W1 -- --quantization fp8 "${w1f[@]}" "${fast[@]}") ;;
    w1f0|w1fa)  # (the add-RMSNorm apart from the linears / fused into every one on the CUDA kernel, untimed)
          export BANYAN_FUSED_NORM; [ "$step" = w1f0 ] && BANYAN_FUSED_NORM=0 || BANYAN_FUSED_NORM=all
          read -r -a w1f <<<"${W1F:-}"; suite "$step" 150 --workloads W1 -- --quantization fp8 "${w1f[@]}" "${fast[@]}"
          unset BANYAN_FUSED_NORM ;;
    w1f_r) export BANYAN_ROPE_IN_DECODE=1; suite w1f_r 150 --workloads W1 -- --quantization fp8 --fp8-vocab "${fast[@]}"
           unset BANYAN_ROPE_IN_DECODE ;;
    w2s|w2s0|w2d|w2sd)  # W2 with steps as two lanes (split_step.py): mixed steps from $SPLIT prompt tokens (w2s, w2s0:
          # equal stream priority), decode steps the graphs do not hold from $SPLITD rows as halves (w2d), both (w2sd)
          export BANYAN_SPLIT_MIXED=${SPLIT:-1024} BANYAN_SPLIT_DECODE=0 BANYAN_SPLIT_PRIORITY=1
          [ "$step" = w2s0 ] && BANYAN_SPLIT_PRIORITY=0; [ "$step" = w2d ] && BANYAN_SPLIT_MIXED=0
          [[ $step == w2d || $step == w2sd ]] && BANYAN_SPLIT_DECODE=${SPLITD:-384}
          suite "$step" 125 --workloads W2 --step-trace -- "${fast[@]}"
          unset BANYAN_SPLIT_MIXED BANYAN_SPLIT_DECODE BANYAN_SPLIT_PRIORITY ;;
    lanes) BANYAN_SPLIT_MIXED=1024 BANYAN_SPLIT_DECODE=${SPLITD:-384} timeout 240 \
           python3 -m benchmarks.gpu.step_host_profile \
             --model /tmp/llama8b --lanes --decode-rows 590 --decode-context 1300 --chunks 0,2000,3600,6000 --top 0 \
             --steps 5 --out "$OUT/$step.json" -- "${fast[@]}" >"$OUT/$step.log" 2>&1; echo "$step (rc $?)"
           grep -E "^\||two lanes|green" "$OUT/$step.log" | tail -16 ;;  # (W2's plateau: 590 decodes of ~1.3k beside 0-6k prompt tokens, two lanes vs one)
    stest) timeout 260 python3 -m pytest -q -m gpu tests/gpu/test_split_step_gpu.py -p no:cacheprovider \
             >"$OUT/stest.log" 2>&1; echo "stest (rc $?)"; tail -3 "$OUT/stest.log" ;;
    w2p) export BANYAN_TRITON_PDL=1; suite w2p 125 --workloads W2 --step-trace -- "${fast[@]}"; unset BANYAN_TRITON_PDL ;;
    rtest) timeout 260 python3 -m pytest -q -m gpu tests/gpu/test_gpu_parity.py tests/gpu/test_triton_pdl_gpu.py \
             -k "rope_inside or auto or pdl" -p no:cacheprovider >"$OUT/rtest.log" 2>&1; echo "rtest (rc $?)"
           tail -3 "$OUT/rtest.log" ;;
    t8) timeout 210 python3 -m pytest -q -m gpu tests/gpu/test_gpu_parity.py -k fp8_pool -p no:cacheprovider \
          >"$OUT/t8.log" 2>&1; echo "t8 (rc $?)"; tail -2 "$OUT/t8.log" ;;
    bench8) timeout 150 python3 -m benchmarks.gpu.fp8_decode_bench --out "$OUT/fp8_decode.json" \
              --shapes 64x1024,600x1536,1x1024 >"$OUT/fp8_decode.log" 2>&1; tail -6 "$OUT/fp8_decode.log" ;;
    spread) timeout 150 python3 -m benchmarks.gpu.fp8_decode_bench --out "$OUT/spread.json" --shapes "${SPREAD:-96x2560}" \
              --spread 0.9 --splits ${SPREAD_SPLITS:-1,2,4,8} --min-parts ${SPREAD_MIN:-0,256,512} >"$OUT/spread.log" 2>&1; echo "spread (rc $?)"
            tail -14 "$OUT/spread.log" ;;
    casc) for dt in auto fp8_e4m3; do  # (a 1,024-row shared-prefix step's kernels, bf16 and FP8 pools)
            timeout 150 python3 -m benchmarks.gpu.cascade_cost --model /tmp/llama8b --shapes 32x32 --profile \
              --kv-cache-dtype $dt --out "$OUT/casc_$dt.json" >"$OUT/casc_$dt.log" 2>&1; echo "casc $dt (rc $?)"
            tail -3 "$OUT/casc_$dt.log"; done ;;
    grid) timeout 200 python3 -m benchmarks.gpu.fp8_decode_bench --out "$OUT/grid.json" --spread 0.67 --splits 1,2 \
            --shapes "${GRID:-64x2560,96x2560,128x2560,256x1536,512x768,1024x384,1024x1536}" \
            --only "128_4w3s_f16_asm_us|64_2w3s_f16_asm_us|triton_bf16_64_4w2s_us" >"$OUT/grid.log" 2>&1
          echo "grid (rc $?)"; tail -9 "$OUT/grid.log" ;;
    gserved) timeout 150 python3 -m benchmarks.gpu.fp8_decode_bench --out "$OUT/gserved.json" --spread 0.67 \
            --shapes "${GRID:-64x2560,96x2560,128x2560,256x1536,512x768,1024x384,1024x1536}" --only "_served_(rope_)?us" \
            >"$OUT/gserved.log" 2>&1; echo "gserved (rc $?)"; tail -9 "$OUT/gserved.log" ;;
    hprof) hprof hprof 45 ;;
    hprofab)  # (hprof before the eighteenth session's changes: both off; then the one-plan mixed step alone off)
          BANYAN_MIXED_ONE_PLAN=0 BANYAN_PIECEWISE_WRITE=0 hprof hprof_before 7
          BANYAN_MIXED_ONE_PLAN=0 hprof hprof_split 7 ;;
    hproffi) BANYAN_MIXED_TRITON=0 hprof hprof_fidec 7 ;;  # (mixed steps' decode part through FlashInfer's decode)
    hproftr) BANYAN_MIXED_TRITON=1 hprof hprof_tridec 7 ;;  # (... through Triton's: the default before 8d01e40)
    hprof1) BANYAN_MIXED_ONE_PLAN=64 hprof hprof_one 7 ;;  # (a mixed step's decodes in its paged prefill plan)
    wbench|wbenchtr|wbenchlt|wbenchl2)  # (64 × 1k decode step; wbenchtr: bf16 decode plans up to $TROWS rows through
            # the Triton decode; wbenchlt: BANYAN_GEMM_LT=1, cuBLASLt's algorithms in the start-up GEMM tuning;
            # wbenchl2: the decode graphs up to 255 rows prefetch $L2MIB MiB (32: all) of the o projection into L2)
            [ "$step" = wbenchtr ] && export BANYAN_TRITON_ROWS=${TROWS:-255}
            [ "$step" = wbenchlt ] && export BANYAN_GEMM_LT=1
            [ "$step" = wbenchl2 ] && export BANYAN_L2_ATTN_MIB=${L2MIB:-32} BANYAN_L2_ATTN_ROWS=255
            timeout 240 python3 benchmarks/bench_worker.py --model /tmp/llama8b --skip-hf --out "$OUT/$step.json" \
              >"$OUT/$step.log" 2>&1; echo "$step (rc $?)"; tail -8 "$OUT/$step.log"
            unset BANYAN_TRITON_ROWS BANYAN_GEMM_LT BANYAN_L2_ATTN_MIB BANYAN_L2_ATTN_ROWS ;;
    mprof) timeout 200 python3 -m benchmarks.gpu.prefill_profile --model /tmp/llama8b --rows 3 --length 2048 \
             --decode-rows 525 --out "$OUT/mprof.json" >"$OUT/mprof.log" 2>&1; echo "mprof (rc $?)"; tail -24 "$OUT/mprof.log" ;;
    oprobe) timeout 200 python3 -m benchmarks.gpu.overlap_probe --green "${GREEN:-}" --out "$OUT/oprobe.json" \
              >"$OUT/oprobe.log" 2>&1
            echo "oprobe (rc $?)"; grep -E '^\||green context' "$OUT/oprobe.log" ;;
    l2test) timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_l2_prefetch_gpu.py tests/gpu/test_triton_pdl_gpu.py \
              tests/gpu/test_cuda_norm_gpu.py \
              tests/gpu/test_gpu_parity.py -k "prefetch or pdl or fp8_pool or cascade_matches or graph_replay" \
              -p no:cacheprovider >"$OUT/l2test.log" 2>&1; echo "l2test (rc $?)"; tail -3 "$OUT/l2test.log" ;;
    ftest) timeout 180 python3 -m pytest -q -m gpu tests/gpu/test_gpu_parity.py -k "fp8_pool or cascade_matches" \
             -p no:cacheprovider >"$OUT/ftest.log" 2>&1; echo "ftest (rc $?)"; tail -3 "$OUT/ftest.log" ;;
    pwtest) timeout 210 python3 -m pytest -q -m gpu tests/gpu/test_gpu_parity.py -k piecewise -p no:cacheprovider \
              >"$OUT/pwtest.log" 2>&1; echo "pwtest (rc $?)"; tail -3 "$OUT/pwtest.log" ;;
    ptest) timeout 260 python3 -m pytest -q -m gpu tests/gpu/test_rope_store_gpu.py tests/gpu/test_gpu_parity.py -k \
             "rope_store or attention_matches_torch or worker_matches_torch or cascade_matches or fp8_pool or piecewise" \
             -p no:cacheprovider >"$OUT/ptest.log" 2>&1; echo "ptest (rc $?)"; tail -3 "$OUT/ptest.log" ;;
    pprof) timeout 150 python3 -m benchmarks.gpu.prefill_profile --model /tmp/llama8b --out "$OUT/pprof.json" \
             >"$OUT/pprof.log" 2>&1; echo "pprof (rc $?)"; tail -24 "$OUT/pprof.log" ;;
    fp8m) BANYAN_GEMM_LT=1 timeout 240 python3 -m benchmarks.gpu.small_m_bench --library-only --ms "${FP8M_MS:-64,96,128,256,512,600,1024}" \
            --out "$OUT/fp8m.json" >"$OUT/fp8m.log" 2>&1; echo "fp8m (rc $?)"; grep -A48 "FP8 as served" "$OUT/fp8m.log" ;;
    pprof8) timeout 150 python3 -m benchmarks.gpu.prefill_profile --model /tmp/llama8b --out "$OUT/pprof8.json" \
              -- --quantization fp8 >"$OUT/pprof8.log" 2>&1; echo "pprof8 (rc $?)"; tail -24 "$OUT/pprof8.log" ;;
    wtest) timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_fp8_widen_gpu.py -p no:cacheprovider \
             >"$OUT/wtest.log" 2>&1; echo "wtest (rc $?)"; tail -3 "$OUT/wtest.log" ;;
    pick) BANYAN_FP8_WIDEN=$(python3 -c "
import json, sys
r = [r for r in json.load(open('$OUT/fp8_decode.json'))['rows'] if r['batch'] == 600][0]
t = {w: r.get(f'triton_fp8_64_4w3s_f16_{w}_us') for w in ('cvt', 'int', 'asm')}
print(min((v, w) for w, v in t.items() if isinstance(v, float))[1])" 2>/dev/null || echo asm)
          export BANYAN_FP8_WIDEN; echo "pick: BANYAN_FP8_WIDEN=$BANYAN_FP8_WIDEN" ;;
    w1q8) suite w1q8 240 --workloads W1,W2 -- --quantization fp8 --kv-cache-dtype fp8_e4m3 "${fast[@]}" ;;
    w2q|w2q[ap0g]*)  # W2 with FP8 weights as served (activations quantized by the norm / activation kernels, our FP8
          # GEMM where its start-up tuning chose it); letters after w2q: a = BANYAN_FP8_FAST_ACCUM=1, 0 =
          # BANYAN_FP8_FUSED_QUANT=0 (each linear quantizes its input), g = BANYAN_GEMM=0 (torch._scaled_mm only)
          [[ ${step#w2q} == *a* ]] && export BANYAN_FP8_FAST_ACCUM=1
          [[ ${step#w2q} == *p* ]] && export BANYAN_FP8_FAST_ACCUM=0
          [[ ${step#w2q} == *0* ]] && export BANYAN_FP8_FUSED_QUANT=0
          [[ ${step#w2q} == *g* ]] && export BANYAN_GEMM=0
          # (a cold start: 147 s on an H100 on 2026-12-05, the tunings 85 and Triton's compiles 43; ~22 s cached)
          suite "$step" 240 --workloads W2 --step-trace -- --quantization fp8 "${fast[@]}"
          unset BANYAN_FP8_FAST_ACCUM BANYAN_FP8_FUSED_QUANT BANYAN_GEMM ;;
    pipetest) timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_decode_pipe_gpu.py -p no:cacheprovider \
                >"$OUT/pipetest.log" 2>&1; echo "pipetest (rc $?)"; tail -3 "$OUT/pipetest.log" ;;
    lttest) timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_cublaslt_gpu.py -p no:cacheprovider \
              >"$OUT/lttest.log" 2>&1; echo "lttest (rc $?)"; tail -3 "$OUT/lttest.log" ;;
    qtest) timeout 300 python3 -m pytest -q -m gpu tests/gpu/test_fp8_fused_quant_gpu.py tests/gpu/test_gemm_gpu.py \
             tests/gpu/test_small_m_gpu.py tests/gpu/test_tuning_cache_gpu.py \
             -p no:cacheprovider >"$OUT/qtest.log" 2>&1; echo "qtest (rc $?)"; tail -3 "$OUT/qtest.log" ;;
    fchk)  # (fp8_check's accuracy on the conditioned model with fast accumulation: top-1 vs bf16 at margin >= 0.1)
          timeout 100 python3 -m benchmarks.gpu.make_model --out /tmp/llama8b-cond --tokenizer .assets/llama3 \
            --init conditioned 2>&1 | tail -1
          BANYAN_FP8_FAST_ACCUM=1 timeout 240 python3 -m benchmarks.gpu.fp8_check --model /tmp/llama8b-cond \
            --init conditioned --budget-s 150 --out "$OUT/fchk.json" >"$OUT/fchk.log" 2>&1; echo "fchk (rc $?)"
          grep -iE "top-1|agree" "$OUT/fchk.log" | head -8 ;;
    w5) suite w5 "${W5_LIMIT:-150}" --workloads W5 --scale "${W5_SCALE:-1}" -- "${fast[@]}" ;;
    w5t) ms=${STEP_MS:-12}; name=w5t; [[ $step == *@* ]] && ms=$cap && name=w5t_$cap  # (w5t@N: a target of N ms)
         suite "$name" "${W5_LIMIT:-200}" --workloads W5 --scale "${W5_SCALE:-1}" -- --step-time-target-ms "$ms" \
           "${fast[@]}" ;;
    fp8) suite fp8 200 --workloads W2,W3 --w3-baselines= --w3-extra= -- --kv-cache-dtype fp8_e4m3 "${fast[@]}" ;;
    w3tr) export BANYAN_TRITON_FROM=256; suite w3tr 150 --workloads W3 --w3-baselines= --w3-extra= -- "${fast[@]}"
          unset BANYAN_TRITON_FROM ;;
    bf16w3) suite bf16w3 150 --workloads W3 --w3-baselines= --w3-extra= -- "${fast[@]}" ;;
    w2h) suite w2h 250 --workloads W2,W2H -- "${fast[@]}" ;;
    w45) suite w45 200 --workloads W4,W5 -- "${fast[@]}" ;;
    sweep8) timeout 240 python3 -m benchmarks.gpu.small_m_bench --sweep --ms 1,4 --out "$OUT/sweep8.json" \
              >"$OUT/sweep8.log" 2>&1; echo "sweep8 (rc $?)"; grep '^| ' "$OUT/sweep8.log" | head -12 ;;
    sweepp) timeout 150 python3 -m benchmarks.gpu.small_m_bench --sweep --ms 1,4 --only 'p$' --out "$OUT/sweepp.json" \
              >"$OUT/sweepp.log" 2>&1; echo "sweepp (rc $?)"; grep '^| ' "$OUT/sweepp.log" | head -12 ;;
    w34) suite w34 220 --workloads W3,W4 --w3-baselines= --w3-extra= -- "${fast[@]}" ;;
    w2) suite w2 150 --workloads W2 --step-trace -- "${fast[@]}" ;;  # (the start-up GEMM tuning: + ~20 s)
    w6) pool=60000; [[ $step == *@* ]] && pool=$cap  # (issue 19: GPU tier vs host; w6@N: a pool of N tokens)
        suite "w6_$pool" 420 --workloads W6 --w6-variants "${W6V:-off,host}" --w6-pool "$pool" -- "${fast[@]}" ;;
    w1old)  # W1 FP8 (+ $W1F) on an older tree carried in .oldtree (git archive incl. tests/): before/after
        read -r -a w1f <<<"${W1F:-}"; t0=$SECONDS
        (cd .oldtree && PYTHONPATH=$PWD:$PYTHONPATH timeout -k 15 240 python3 -m benchmarks.gpu.suite \
          --model /tmp/llama8b --out "$OUT/w1old" --tag w1old --workloads W1 -- --quantization fp8 "${w1f[@]}" \
          "${fast[@]}" >"$OUT/w1old.log" 2>&1)
        echo "w1old (rc $?): $((SECONDS - t0)) s" ;;
    w2tr) export BANYAN_TRITON_ROWS=${TROWS:-255}; suite w2tr 150 --workloads W2 --step-trace -- "${fast[@]}"
          unset BANYAN_TRITON_ROWS ;;  # (bf16 W2, decode plans up to $TROWS rows through the Triton decode)
    w5tr) export BANYAN_TRITON_ROWS=${TROWS:-255}
          suite w5tr "${W5_LIMIT:-150}" --workloads W5 --scale "${W5_SCALE:-1}" -- "${fast[@]}"
          unset BANYAN_TRITON_ROWS ;;
    bknob)  # (bknob@w: W2's decode shapes, 256-1,024 rows, where FlashInfer's decode serves today)
           pre=bknob; shapes=${BKSHAPES:-32x1024,64x1024,128x1024}; knobs=${BKNOB:-64:4:2:0 32:4:3:1 32:4:4:1 \
             64:4:3:1 16:2:4:1 32:4:2:0 32:2:3:1}
           [[ $step == *@w ]] && pre=bknob_w shapes=${BKSHAPES:-256x1536,600x1536,1024x384} \
             knobs=${BKNOB:-64:4:2:0 32:4:3:1 64:4:3:1 32:4:4:1}
           for kn in $knobs; do  # (block:warps:stages:pipe — pipe 1: BANYAN_DECODE_PIPE=1, the slots a block ahead)
             [ $((SECONDS + 90)) -gt "$END" ] && { echo "$pre $kn: skipped (time)"; continue; }
             IFS=: read -r kb kw ks kp <<<"$kn"; tag=${kb}_${kw}_${ks}_${kp:-0}
             BANYAN_DECODE_BLOCK=$kb BANYAN_DECODE_WARPS=$kw BANYAN_DECODE_STAGES=$ks BANYAN_DECODE_PIPE=${kp:-0} \
               timeout 120 python3 -m benchmarks.gpu.fp8_decode_bench --out "$OUT/${pre}_$tag.json" --only bf16_served \
               --splits 1,2 --shapes "$shapes" >"$OUT/${pre}_$tag.log" 2>&1
             echo "$pre $kn (rc $?)"; grep '^| [0-9]' "$OUT/${pre}_$tag.log" | tail -3
           done; python3 -m benchmarks.gpu.knob_table "$OUT" 2>&1 | tail -12 ;;
    fknob) for kp in 0 1; do  # (the FP8 pool's decode, served and 32-128-token blocks, BANYAN_DECODE_PIPE off / on)
             [ $((SECONDS + 100)) -gt "$END" ] && { echo "fknob $kp: skipped (time)"; continue; }
             BANYAN_DECODE_PIPE=$kp timeout 180 python3 -m benchmarks.gpu.fp8_decode_bench --out "$OUT/fknob_$kp.json" \
               --only "fp8_served_us|fp8_served_rope_us|fp8_(128_4w3s|64_4w3s|64_2w3s|32_4w3s|64_4w4s)_f16_asm_us" \
               --shapes "${FKSHAPES:-64x1024,128x2560,600x1536,1024x384}" >"$OUT/fknob_$kp.log" 2>&1
             echo "fknob pipe=$kp (rc $?)"
             python3 -c "import json,sys; [print(r['batch'], r['context'], {k[:-3]: v for k, v in r.items()
               if k.startswith(('triton_fp8', 'flashinfer_fp8'))}) for r in json.load(open(sys.argv[1]))['rows']]" \
               "$OUT/fknob_$kp.json" 2>&1 | tail -4
           done; python3 -m benchmarks.gpu.knob_table "$OUT" 2>&1 | tail -12 ;;
    bsplit) timeout 200 python3 -m benchmarks.gpu.fp8_decode_bench --out "$OUT/bsplit.json" --only bf16_served \
              --shapes "${BSPLIT:-32x1024,64x1024,96x1024,128x1024,192x1024,64x2048,96x2048,128x2048,255x1024}" \
              --splits 1,2,4 >"$OUT/bsplit.log" 2>&1; echo "bsplit (rc $?)"; grep '^| ' "$OUT/bsplit.log" ;;
    w2lt) export BANYAN_GEMM_LT=1; suite w2lt 150 --workloads W2 --step-trace -- "${fast[@]}"
          unset BANYAN_GEMM_LT ;;  # (bf16 W2 with cuBLASLt's algorithms in the GEMM tuning)
    w2g) export BANYAN_GEMM=0; suite w2g 125 --workloads W2 --step-trace -- "${fast[@]}"; unset BANYAN_GEMM ;;
    w34base) suite w34base 220 --workloads W3,W4 --w3-baselines= --w3-extra= ;;
    lof) suite lof 110 --workloads W2 -- --schedule-policy lof "${fast[@]}" ;;
    prof|prof0|profc)  # (prof0: FlashInfer's norms, not norm.cu; profc: + the decode linears' L2 chain, $CHAIN_MIB)
          [ "$step" = prof0 ] && export BANYAN_CUDA_NORM=0
          [ "$step" = profc ] && export BANYAN_GEMV_L2_CHAIN=${CHAIN_MIB:-4}
          read -r -a pa <<<"${PROF:---quantization fp8 --fp8-vocab true --decode-attention triton}"
          timeout 200 python3 -m benchmarks.gpu.decode_profile --model /tmp/llama8b --batch "${PROF_BATCH:-1}" \
            --prompt "${PROF_PROMPT:-128}" --out "$OUT/$step.json" -- "${pa[@]}" >"$OUT/$step.log" 2>&1
          echo "$step (rc $?)"
          grep -A12 '^graph replay' "$OUT/$step.log" | head -14; grep 'graph step' "$OUT/$step.log"
          unset BANYAN_GEMV_L2_CHAIN BANYAN_CUDA_NORM ;;
    gtest) timeout ${GTEST_T:-300} python3 -m pytest -q -m gpu tests/gpu/test_cuda_norm_gpu.py tests/gpu/test_cuda_gemv_gpu.py \
             tests/gpu/test_cuda_norm_linear_gpu.py \
             "tests/gpu/test_gpu_parity.py::test_flashinfer_worker_matches_torch_worker" \
             "tests/gpu/test_gpu_parity.py::test_cuda_graph_replay_matches_eager" \
             "tests/gpu/test_gpu_parity.py::test_logits_match_hf_fp32" -p no:cacheprovider \
             >"$OUT/gtest.log" 2>&1; echo "gtest (rc $?)"; tail -4 "$OUT/gtest.log" ;;
    ablate|ablateb)  # (decode_ablate: the batch-1 graph with the norms / the attention as no-ops; ablateb: bf16)
          read -r -a pa <<<"${PROF:---quantization fp8 --fp8-vocab true}"; [ "$step" = ablateb ] && pa=()
          timeout 200 python3 -m benchmarks.gpu.decode_ablate --model /tmp/llama8b --batch "${PROF_BATCH:-1}" \
            --context "${ABL_CTX:-256}" --variants "${ABL:-base,nonorm,noattn,nonorm+noattn}" \
            --out "$OUT/$step.json" -- "${pa[@]}" >"$OUT/$step.log" 2>&1; echo "$step (rc $?)"; grep '^|' "$OUT/$step.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
[ -d "$BANYAN_TUNING_CACHE" ] && cp -r "$BANYAN_TUNING_CACHE" "$OUT/tuning"  # (for .kcache/tuning here)
cd "$OUT" || exit 1
rm -rf ./*/server_w7_plain.log ./*/steps_w7_plain.jsonl ./*/*.ready
grep -h '^\[suite\]\|^| W' ./*.log 2>/dev/null | head -40; head -16 ./*_stages.txt ./*_itl.txt 2>/dev/null
tar czf /tmp/results.tgz . && rm -rf ./* && mv /tmp/results.tgz .  # (one file back: the tool's limit is 8)

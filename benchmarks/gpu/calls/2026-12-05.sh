#!/usr/bin/env bash
# The twenty-ninth session's device calls: the pipelined decode bands (decode_rules.PIPE_BANDS) against the
# launches before them.
#   BANYAN_GIT_COMMIT=<tree> STEPS="band pipetest wbench old.wbench w34 old16.w34" END=560 \
#     bash benchmarks/gpu/calls/2026-12-05.sh
# Steps: band (fp8_decode_bench's served launch of both pools at $BANDSHAPES as the tree serves it and with
# BANYAN_DECODE_PIPE=0, and the pipelined launches forced at one and two splits: bf16 32-token blocks, 4 warps,
# 4 stages (and 3: bf16p3); FP8 64-token blocks, 2 warps, 3 stages; one table) · band2 (the served launch with and
# without the bands only) · pipetest (tests/gpu/test_decode_pipe_gpu.py) · any step of 2026-12-03e.sh, run as the
# tree serves (into $OUT/<step>) · old.<step>: the same with BANYAN_DECODE_PIPE=0 (the launches before the bands)
# · old16.<step>: also BANYAN_TRITON_ROWS=16 (bf16 decode plans through FlashInfer's above 16 rows: before the
# twenty-seventh session's rule) · from256.<step>: BANYAN_TRITON_FROM=256 (bf16 decode plans of >= 256 rows through
# the Triton decode too). Any step that would start past $END (s) is skipped, so the results come back.
source benchmarks/gpu/calls/setup.sh
END=${END:-560}
BANDSHAPES=${BANDSHAPES:-32x1024,48x1024,64x1024,80x1024,96x1024,112x1024,128x1024,160x1024,64x2048,96x2048,128x2560}
band() {  # tag only-regex [env...]: one fp8_decode_bench run at the band's shapes
  local tag=$1 only=$2; shift 2
  env "$@" timeout 150 python3 -m benchmarks.gpu.fp8_decode_bench --out "$OUT/band_$tag.json" --only "$only" \
    --splits 1,2 --shapes "$BANDSHAPES" >"$OUT/band_$tag.log" 2>&1
  echo "band $tag (rc $?)"
}
for item in ${STEPS:-band}; do
  left=$((END - SECONDS))
  if [ "$left" -lt 40 ]; then echo "$item: skipped (time)"; continue; fi
  case $item in
    band|band2)  # (band2: the served launch with and without the bands only)
      band new '_served_us$'
      band old '_served_us$' BANYAN_DECODE_PIPE=0
      if [ "$item" = band ]; then
        band bf16p 'bf16_served_[12]splits' BANYAN_DECODE_PIPE=1 BANYAN_DECODE_BLOCK=32 BANYAN_DECODE_WARPS=4 \
          BANYAN_DECODE_STAGES=4
        band fp8p 'fp8_served_[12]splits' BANYAN_DECODE_PIPE=1 BANYAN_DECODE_BLOCK=64 BANYAN_DECODE_WARPS=2 \
          BANYAN_DECODE_STAGES=3
        band bf16p3 'bf16_served_[12]splits' BANYAN_DECODE_PIPE=1 BANYAN_DECODE_BLOCK=32 BANYAN_DECODE_WARPS=4 \
          BANYAN_DECODE_STAGES=3
      fi
      python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {t: {(r["batch"], r["context"]): r for r in json.loads((out / f"band_{t}.json").read_text())["rows"]}
        for t in ("new", "old", "bf16p", "fp8p", "bf16p3") if (out / f"band_{t}.json").exists()}
print("| batch × context | pool | FlashInfer | before | served | pipelined 1 split | 2 splits | 3 stages: 1 · 2 "
      "| served vs before |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for shape in sorted(runs.get("new", {})):
    for pool, p in (("bf16", "bf16p"), ("fp8", "fp8p")):
        get = lambda t, k: runs.get(t, {}).get(shape, {}).get(k)  # noqa: E731
        old, new = get("old", f"triton_{pool}_served_us"), get("new", f"triton_{pool}_served_us")
        one, two = (get(p, f"triton_{pool}_served_{n}splits_min0_us") for n in (1, 2))
        three = " · ".join(str(get("bf16p3", f"triton_bf16_served_{n}splits_min0_us")) for n in (1, 2))
        gain = f"{(old / new - 1) * 100:+.1f}%" if isinstance(old, float) and isinstance(new, float) else "-"
        print(f"| {shape[0]} × {shape[1]} | {pool} | {get('new', f'flashinfer_{pool}_us')} | {old} | {new} | {one} "
              f"| {two} | {three if pool == 'bf16' else '-'} | {gain} |")
EOF
      ;;
    pipetest)  # (the pipelined decode's GPU test, without 2026-12-03e.sh's model)
      timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_decode_pipe_gpu.py -p no:cacheprovider \
        >"$OUT/pipetest.log" 2>&1; echo "pipetest (rc $?)"; tail -3 "$OUT/pipetest.log" ;;
    old.*|old16.*|from256.*)
      step=${item#*.}; name=${item%%.*}_$step
      case ${item%%.*} in
        old16) export BANYAN_TRITON_ROWS=16 BANYAN_DECODE_PIPE=0 ;;
        old) export BANYAN_DECODE_PIPE=0 ;;
        from256) export BANYAN_TRITON_FROM=256 ;;
      esac
      OUT=$OUT/$name STEPS=$step END=$left bash benchmarks/gpu/calls/2026-12-03e.sh 2>&1 \
        | grep -v '^cuda gemv\|^cublaslt\|^model at' | sed "s/^/$name: /"
      unset BANYAN_TRITON_ROWS BANYAN_DECODE_PIPE BANYAN_TRITON_FROM ;;
    *)
      OUT=$OUT/$item STEPS=$item END=$left bash benchmarks/gpu/calls/2026-12-03e.sh 2>&1 \
        | grep -v '^cuda gemv\|^cublaslt\|^model at' | sed "s/^/$item: /" ;;
  esac
done
cd "$OUT" || exit 1
tar czf /tmp/results.tgz . && rm -rf ./* && mv /tmp/results.tgz .  # (one file back)

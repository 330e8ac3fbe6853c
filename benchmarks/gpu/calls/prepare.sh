#!/usr/bin/env bash
# Run here, on the host, before a session's first device call: makes the git-ignored folders the calls carry
# (`.gpucache .assets .whl .kcache`) in a fresh checkout, each only if missing.
#   [BEFORE_COMMIT=110603b] bash benchmarks/gpu/calls/prepare.sh [RESULTS_DIR]
# RESULTS_DIR: a previous call's extracted $OUT; its tuning/ goes to .kcache/tuning (start-up tunings skipped).
# BEFORE_COMMIT: that commit's code (what the suite runs: no docs, results or tests) unpacked into .before, for gpu.sh's cmp steps
# (carry .before too, and run them with BEFORE=.before).
# .kcache's library (the CUDA decode linear, built by this host's nvcc for sm_90a) is rebuilt when a kernel source
# changed: its file name carries the sources' hash, and a stale one is removed first.
set -euo pipefail
cd "$(dirname "$0")/../../.."
shared=${BANYAN_SHARED:-../shared}
[ -d .gpucache ] || cp -r "$shared/device" .gpucache
[ -d .assets/llama3 ] || { mkdir -p .assets && cp -r "$shared/assets/tokenizers/llama3" .assets/llama3; }
if ! ls .whl/*.whl >/dev/null 2>&1; then  # (the SMG service's protos: the device bundle lacks them)
  mkdir -p .whl && python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
    smg-grpc-proto==0.4.28
fi
mkdir -p .kcache/tuning
BANYAN_KERNEL_CACHE=$PWD/.kcache python3 - <<'EOF'
import pathlib
from services.worker.kernels import cuda_gemv as g
for bf16 in (True, False):
    want = pathlib.Path(g.build("sm_90a", out_dir=g.cache_dir(), bf16=bf16))
    for old in want.parent.glob(f"gemv_sm_90a_{'bf16' if bf16 else 'fp16'}_*.so"):
        if old != want:
            old.unlink()
    print("kcache:", want.name)
EOF
if [ -n "${BEFORE_COMMIT:-}" ]; then
  rm -rf .before && mkdir .before
  git archive "$BEFORE_COMMIT" services shared banyan protos pyproject.toml benchmarks/__init__.py benchmarks/gpu \
    benchmarks/bench_worker.py benchmarks/driver.py tests/__init__.py tests/support.py tests/conftest.py \
    | tar -x -C .before  # (what the suite runs: ~1.8 MB of the 64 MiB a device call carries)
  echo "before: $BEFORE_COMMIT in .before"
fi
if [ $# -gt 0 ] && [ -d "$1/tuning" ]; then cp "$1"/tuning/*.json .kcache/tuning/ && echo "tuning: from $1"; fi
ls -d .gpucache .assets/llama3 .whl/*.whl .kcache/*.so

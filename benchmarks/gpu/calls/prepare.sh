#!/usr/bin/env bash
# Run here, on the host, before a session's first device call: makes the git-ignored folders the calls carry
# (`.gpucache .assets .whl .kcache`) in a fresh checkout, each only if missing.
#   bash benchmarks/gpu/calls/prepare.sh [RESULTS_DIR]
# RESULTS_DIR: a previous call's extracted $OUT; its tuning/ goes to .kcache/tuning (start-up tunings skipped).
# .kcache's libraries (the CUDA decode linear and cuBLASLt's algorithm calls, built by this host's nvcc for sm_90a,
# the latter against cuBLAS 13.0's headers, kept in .kcache/include) are rebuilt when a kernel source changed: their
# file names carry the sources' hash, and a stale one is removed first.
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
if [ ! -f .kcache/include/cublasLt.h ]; then  # (cuBLASLt's headers for lt.cu: those of torch cu130's cuBLAS)
  wheels=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$wheels" \
    "nvidia-cublas>=13.0,<13.1"
  python3 - "$wheels" <<'EOF'
import pathlib, sys, zipfile
out = pathlib.Path(".kcache/include")
out.mkdir(parents=True, exist_ok=True)
for wheel in pathlib.Path(sys.argv[1]).glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.endswith(("/include/cublasLt.h", "/include/cublas_api.h")):
                (out / pathlib.Path(name).name).write_bytes(z.read(name))
EOF
  rm -rf "$wheels"
fi
BANYAN_KERNEL_CACHE=$PWD/.kcache BANYAN_CUBLAS_INCLUDE=$PWD/.kcache/include python3 - <<'EOF'
import pathlib
from services.worker.kernels import cublaslt
want = pathlib.Path(cublaslt.build("sm_90a"))
for old in want.parent.glob("lt_sm_90a_*.so"):
    if old != want:
        old.unlink()
print("kcache:", want.name)
EOF
if [ $# -gt 0 ] && [ -d "$1/tuning" ]; then cp "$1"/tuning/*.json .kcache/tuning/ && echo "tuning: from $1"; fi
ls -d .gpucache .assets/llama3 .whl/*.whl .kcache/*.so

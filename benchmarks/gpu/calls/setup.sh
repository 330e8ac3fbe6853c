# Sourced by the device-call scripts here: $OUT, the restored GPU bundle (.gpucache) and the wheels
# the bundle lacks (.whl) on the path, NVLink multicast off. (prepare.sh, run on the host, makes the carried folders.)
set -uo pipefail
OUT=${OUT:-/tmp/banyan-gpu}
mkdir -p "$OUT"
source .gpucache/env.sh >/dev/null || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# The CUDA decode linear (kernels/gemv.cu) built once, here, not inside a server start the suite times; a
# library carried in .kcache (built by the same nvcc: the cache key has its version) is used as it is.
export BANYAN_KERNEL_CACHE=${BANYAN_KERNEL_CACHE:-$PWD/.kcache}
python3 -c "from services.worker.kernels import cuda_gemv as g; print('cuda gemv:', 'ready' if g.library(True) \
else g.unavailable(True))"
# The start-up tunings' decisions (kernels/tuning_cache.py) kept in .kcache/tuning: a second server of the same
# shapes skips the timing; the call scripts put them in $OUT/tuning to carry to the next call (copy them to .kcache).
export BANYAN_TUNING_CACHE=${BANYAN_TUNING_CACHE:-$PWD/.kcache/tuning}

# Sourced by the device-call scripts here: $OUT, the restored GPU bundle (.gpucache) and the wheels
# the bundle lacks (.whl) on the path, NVLink multicast off.
set -uo pipefail
OUT=${OUT:-/tmp/banyan-gpu}
mkdir -p "$OUT"
source .gpucache/env.sh >/dev/null || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

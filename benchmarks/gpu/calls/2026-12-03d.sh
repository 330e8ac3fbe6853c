#!/usr/bin/env bash
# The ninth session's device calls (STEPS t8 fp8 bf16w3 w2h w5 bench8 w7 w7t2 w7si w45 lof sweep8 sweepp w34
# w34base w2): the same steps live on in the tenth session's script (its W7 steps write to $OUT/<step>_<cap>).
#   BANYAN_GIT_COMMIT=<tree> STEPS="w7si w7t2" FAST="--piecewise-cuda-graph-max-tokens 1536" CAP=512 \
#     bash benchmarks/gpu/calls/2026-12-03d.sh
exec bash "$(dirname "$0")/2026-12-03e.sh" "$@"

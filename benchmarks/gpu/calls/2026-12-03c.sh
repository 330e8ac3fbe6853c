#!/usr/bin/env bash
# The eighth session's later device calls (STEPS t8 fp8 bf16w3 w2h w5 bench8 w7 w7t2 w7si w45 lof): the same
# steps live on in the ninth session's script, which added more (and kills a step 15 s after its SIGTERM).
#   BANYAN_GIT_COMMIT=<tree> STEPS="w7 w5" FAST="--piecewise-cuda-graph-max-tokens 1536" CAP=512 \
#     bash benchmarks/gpu/calls/2026-12-03c.sh
exec bash "$(dirname "$0")/2026-12-03d.sh" "$@"

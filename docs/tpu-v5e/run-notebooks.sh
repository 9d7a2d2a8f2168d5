#!/usr/bin/env bash
# The five notebooks on the lent TPU v5e, each in its own process through the runner's ipc kernel
# (no TCP socket opens there), on the chip's default preset (k3-chip). Wheels: .whl-tpu made here by
#   make tpu-wheels TPU_WHEELS_REQS=docs/tpu-v5e/notebook-wheels.txt
# Usage (a call holds the chip at most 10 minutes, so a few notebooks per call):
#   OUT=DIR bash docs/tpu-v5e/run-notebooks.sh 01:240 03:300
#   OUT=DIR TAG=r PARAMS="-p region_trace True" bash docs/tpu-v5e/run-notebooks.sh 03:300   (DIR/nb03r/)
# writes DIR/nbNN/ (executed notebook, its figures' data, notebook 03's trace under profile/) and
# DIR/nbNN.log; compiled programs are shared between the processes through .jax_cache/.
source docs/tpu-v5e/steps.sh
export JAX_COMPILATION_CACHE_DIR=$PWD/.jax_cache
TAG=${TAG:-} PARAMS=${PARAMS:-}
for spec in "$@"; do
  nb=${spec%%:*}; secs=${spec##*:}
  step "nb$nb$TAG" "$secs" python3 -m mk notebooks --out "$OUT/nb$nb$TAG" --no-export --pause 5 --only "$nb" $PARAMS
  tail -n 3 "$OUT/nb$nb$TAG.out"
  if [ -d "$OUT/nb$nb$TAG/profile" ]; then   # notebook 03's traces: too deep a tree to come back as files
    tar czf "$OUT/nb$nb$TAG-profile.tgz" -C "$OUT/nb$nb$TAG" profile && rm -rf "$OUT/nb$nb$TAG/profile"
  fi
done

# Sourced by the run-*.sh scripts here, from the repo root on the TPU VM (wheels carried as .whl-tpu,
# made by `make tpu-wheels`): installs the wheels, selects the chip plus JAX's CPU backend (mk check's
# oracle), and defines `step`. Outputs go under $OUT (default tpu-out).
set -u
export OUT=${OUT:-tpu-out}; mkdir -p "$OUT"
source .whl-tpu/env.sh
export JAX_PLATFORMS=tpu,cpu
step() {   # step NAME SECONDS CMD...: one program alone on the chip; stdout to $OUT/NAME.out, stderr to
  local name=$1 secs=$2; shift 2   # $OUT/NAME.log; prints its exit status and wall time
  local t0=$(date +%s)
  timeout "$secs" "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
  echo "$name rc=$? $(( $(date +%s) - t0 ))s"
  sleep "${STEP_PAUSE:-3}"   # let the chip free before the next program
}

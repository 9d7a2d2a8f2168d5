#!/usr/bin/env bash
# Chip calls on the lent TPU v5e whose JSON are measurement records (mk.perf.results), each under 10 minutes.
# From the repo root there, with the wheels of `make tpu-wheels` carried as .whl-tpu, and the commit
# the copy was made from (the copy has no .git):
#   MK_COMMIT=$(git rev-parse HEAD) OUT=DIR bash docs/tpu-v5e/run-records.sh base
# base: mk microbench (its stream sweep is the "of stream" denominator) and mk check k3-chip at B = 8
#       with its compile and setup times (~7 min)
# Everything lands in DIR/records.tgz (a lent machine returns at most 8 files).
set -u
FINAL=${OUT:?OUT must name a folder}
export OUT=$(mktemp -d)
STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
case "${1:?which call: base}" in
  base)
     step microbench 200 python3 -m mk microbench --json --write "$OUT/microbench.csv"
     step check-k3chip-mxfp4 360 python3 -m mk check --config k3-chip --batch 8 --steps 4 --json ;;
  *) echo "run-records.sh: no call $1 (base)" >&2; exit 2 ;;
esac
tar czf "$FINAL/records.tgz" -C "$OUT" .

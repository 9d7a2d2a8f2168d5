#!/usr/bin/env bash
# Chip calls on the lent TPU v5e whose JSON are measurement records (mk.perf.results), each under 10 minutes.
# From the repo root there, with the wheels of `make tpu-wheels` carried as .whl-tpu, and the commit
# the copy was made from (the copy has no .git):
#   MK_COMMIT=$(git rev-parse HEAD) OUT=DIR bash docs/tpu-v5e/run-records.sh base
# base: mk microbench (its stream sweep is the "of stream" denominator) and mk check k3-chip at B = 8
#       with its compile and setup times (~7 min)
# peergen: mk bench kernel / fair XLA / peer (tpu-inference's wheel in .whl-tpu), mk bench --mode generate and
#       the parallel prefill of 1,024 tokens against token by token, k3-chip bf16, B = 1 and 8 (~6.5 min)
# Everything lands in DIR/records.tgz (a lent machine returns at most 8 files).
set -u
FINAL=${OUT:?OUT must name a folder}
[ "${DIRECT:-0}" = 1 ] || export OUT=$(mktemp -d)   # DIRECT=1: the steps' files straight into OUT (at most 8)
STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
case "${1:?which call: base}" in
  base)
     step microbench 200 python3 -m mk microbench --json --write "$OUT/microbench.csv"
     step check-k3chip-mxfp4 360 python3 -m mk check --config k3-chip --batch 8 --steps 4 --json ;;
  peergen)   # the peer, the device loop and the parallel prefill at k3-chip, bf16 (~6.5 min)
     step bench-k3chip-bf16-peer 170 python3 -m mk bench --config k3-chip --experts bf16 --impl kernel,xla,peer \
       --batch 1,8 --steps 10 --json
     step generate-k3chip-bf16 110 python3 -m mk bench --mode generate --config k3-chip --experts bf16 --batch 1,8 \
       --impl kernel,xla --steps 64 --chunk 16 --json
     step prefill-k3chip-bf16 80 python3 docs/tpu-v5e/prefill_bench.py --config k3-chip --experts bf16 \
       --lengths 1024 --token-lengths 1024 --reps 2 ;;
  *) echo "run-records.sh: no call $1 (base, peergen)" >&2; exit 2 ;;
esac
[ "$OUT" = "$FINAL" ] || tar czf "$FINAL/records.tgz" -C "$OUT" .

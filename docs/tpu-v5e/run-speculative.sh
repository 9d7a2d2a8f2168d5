#!/usr/bin/env bash
# Speculative decoding on the lent TPU v5e, at a fixed acceptance length (tokens not meaningful: speed):
#   1. `mk bench --mode speculative` on k3-chip, bf16, B = 1, the kernel: k = 3 at L = 1 and k = 7 at L = 1
#      and 6 (SPEC_ACCEPTANCE=1,2,...,8 for the full range, if the time allows), beside plain decoding;
#   2. `mk generate --speculative 7 --fixed-acceptance-length 6 --loop device --json` on k3-chip, twice
#      (prefill_s of the second run);
#   3. `mk simulate --speculative K --acceptance L` for the same cases (modelled, on the host's CPU), and
#      the seed's tpu-v7x16 at 6 tokens a step beside its published 709 tok/s;
#   4. `mk check --config mini --batch 2 --speculative 3 --json` (the verify check at B = 2).
#   MK_COMMIT=$(git rev-parse HEAD) MK_DIRTY=0 OUT=DIR bash docs/tpu-v5e/run-speculative.sh [CONFIG]
# CONFIG: k3-chip (default) or k3-d48. Each step's stdout is $OUT/NAME.out (JSON), stderr $OUT/NAME.log;
# a bench cut short by its time limit still has every finished case in its .log ("bench: row {...}").
config=${1:-k3-chip}
set -u
export OUT=${OUT:-tpu-out}; mkdir -p "$OUT"
source .whl-tpu/env.sh
export JAX_PLATFORMS=tpu,cpu     # the chip, and JAX's CPU backend (mk check's oracle)
step() {   # step NAME SECONDS CMD...: one program alone on the chip; stdout to $OUT/NAME.out, stderr to
  local name=$1 secs=$2; shift 2   # $OUT/NAME.log; prints its exit status and wall time
  local t0=$(date +%s)
  timeout "$secs" "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
  echo "$name rc=$? $(( $(date +%s) - t0 ))s"
  sleep 3                          # let the chip free before the next program
}
step spec-bench-$config 330 python3 -m mk bench --mode speculative --config $config --experts bf16 --batch 1 \
  --impl kernel --speculative 3,7 --acceptance ${SPEC_ACCEPTANCE:-1,6} --steps 32 --json
for run in 1 2; do
  step spec-generate-$config-$run 100 python3 -m mk generate --config $config --backend kernel --prompt-tokens 1,2,3,4 \
    --speculative 7 --fixed-acceptance-length 6 --loop device --max-new-tokens 193 --json
done
for kl in "7 6" "3 1" "7 1"; do set -- $kl
  JAX_PLATFORMS=cpu timeout 60 python3 -m mk simulate --config $config --system tpu-v5e --plan mk --experts bf16 \
    --batch 1 --context 128 --speculative $1 --acceptance $2 --json > "$OUT/spec-sim-$config-k$1-L$2.out"
done
JAX_PLATFORMS=cpu timeout 60 python3 -m mk simulate --speculative 7 --acceptance 6 --batch 1 > "$OUT/spec-sim-seed.out"
step spec-check-mini-b2 120 python3 -m mk check --config mini --batch 2 --speculative 3 --json
python3 - "$OUT" "$config" <<'PY'
import glob, json, os, sys
out, config = sys.argv[1:]
base = f"{out}/spec-bench-{config}"
try:
    rows = json.load(open(base + ".out"))["rows"]
except (OSError, ValueError):                   # cut short: the rows its log kept
    rows = [json.loads(l.split("bench: row ", 1)[1]) for l in open(base + ".log") if l.startswith("bench: row ")]
    print(base, "no JSON (timeout?);", len(rows), "rows from the log")
bench = {}
for r in rows:
    if r.get("k") and not r.get("error"):
        bench[r["k"], r["L"]] = r
        print(f"bench k={r['k']} L={r['L']}: {r['device_tok_s']} tok/s device = {r['speedup_device']}x plain, "
              f"{r['wall_tok_s']:.1f} wall = {r['speedup_wall']}x; verify/decode {r['verify_over_decode']}, "
              f"drafter share {r['drafter_share']}")
    else:
        print("bench", r.get("k"), r.get("L"), r.get("error") or f"plain: {r.get('device_tok_s')} tok/s device, "
              f"{r.get('loop_tok_s')} wall, device step {r.get('device_step_ms')} ms")
for run in (1, 2):
    try:
        g = json.load(open(f"{out}/spec-generate-{config}-{run}.out"))
    except (OSError, ValueError):
        print(f"generate run {run}: no JSON"); continue
    b = bench.get((7, 6))
    print(f"generate run {run}: {g['tokens_per_s']:.1f} tok/s, prefill_s {g['prefill_s']:.2f}, steps {g['steps']}"
          + (f"; {g['tokens_per_s'] / b['wall_tok_s']:.2f} of the bench's wall tok/s" if b else ""))
for path in sorted(glob.glob(f"{out}/spec-sim-{config}-*.out")):
    m = json.load(open(path))[0]
    b = bench.get((m["k"], int(m["acceptance"])))
    print(f"simulate k={m['k']} L={m['acceptance']:g}: {m['mk']['tokens_per_s']:.1f} tok/s modelled"
          + (f", modelled / measured (device) {m['mk']['tokens_per_s'] / b['device_tok_s']:.3f}" if b and b.get("device_tok_s") else ""))
PY
cat "$OUT/spec-sim-seed.out"
tail -n 3 "$OUT/spec-check-mini-b2.log"
[ -s "$OUT/spec-bench-$config.out" ] && mv "$OUT/spec-bench-$config.out" "$OUT/spec-bench-$config.json"
[ -s "$OUT/spec-check-mini-b2.out" ] && mv "$OUT/spec-check-mini-b2.out" "$OUT/spec-check-mini-b2.json"
true

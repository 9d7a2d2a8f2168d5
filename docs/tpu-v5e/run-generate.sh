#!/usr/bin/env bash
# The device decode loop (mk.model.loop) on the lent TPU v5e: `mk bench --mode generate` on k3-chip,
# the kernel and the fair XLA step at B = 1, 2, 4, 8, 64 decode steps per case in chunks of 16. Each
# row: the loop's decode tokens/s beside the step's device rate (trace) and the per-token host loop's
# wall clock. One format per call (2026-12-06f: weights 46-53 s, the kernel's four cases 157-173 s,
# the XLA step's 10-25 s each; both formats in one 8-minute call ran out of time):
#   MK_COMMIT=$(git rev-parse HEAD) MK_DIRTY=0 OUT=DIR bash docs/tpu-v5e/run-generate.sh bf16   (or mxfp4)
# writes DIR/generate-k3chip-FORMAT.json (a record: {"record", "metadata", "rows"}) and its .log; a run
# cut short by its time limit still has every finished case in the .log ("bench: row {...}" lines).
experts=${1:?which expert format: bf16 or mxfp4}
STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
step generate-k3chip-$experts 400 python3 -m mk bench --mode generate --config k3-chip --experts $experts \
  --batch 1,2,4,8 --impl kernel,xla --steps 64 --chunk 16 --json
python3 - "$OUT/generate-k3chip-$experts" <<'PY'
import json, sys
base = sys.argv[1]
try:
    rows = json.load(open(base + ".out"))["rows"]
except (OSError, ValueError):                   # cut short: the rows its log kept
    rows = [json.loads(l.split("bench: row ", 1)[1]) for l in open(base + ".log") if l.startswith("bench: row ")]
    print(base, "no JSON (timeout?);", len(rows), "rows from the log")
for r in rows:
    print(r["experts"], r["impl"], r["batch"], r.get("error") or
          f"loop {r['loop_tok_s']:.1f} tok/s ({r['loop_step_ms']:.3f} ms/step), device {r['device_step_ms']} ms/step, "
          f"of device {r['frac_of_device']}, host loop {r['host_step_ms']} ms/step")
PY
[ -s "$OUT/generate-k3chip-$experts.out" ] && mv "$OUT/generate-k3chip-$experts.out" "$OUT/generate-k3chip-$experts.json"
true

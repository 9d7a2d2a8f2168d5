#!/usr/bin/env bash
# The device decode loop (mk.model.loop) on the lent TPU v5e: `mk bench --mode generate` on k3-chip,
# bf16 then MXFP4 experts, the kernel and the fair XLA step at B = 1, 2, 4, 8, 64 decode steps per
# case in chunks of 16. Each row: the loop's decode tokens/s beside the step's device rate (trace)
# and the per-token host loop's wall clock. Both runs stay under 8 minutes (timeouts 230 + 245 s;
# measured on 2026-12-06e: weights 47 s, the kernel's B = 1 case 48 s with its compiles). A run cut
# short by its timeout still has every finished case in $OUT/NAME.log ("bench: row {...}" lines).
#   OUT=DIR bash docs/tpu-v5e/run-generate.sh
# writes DIR/generate-bf16.out and DIR/generate-mxfp4.out ({"metadata", "rows"} JSON) and their .log.
STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
step generate-bf16 230 python3 -m mk bench --mode generate --config k3-chip --experts bf16 --batch 1,2,4,8 \
  --impl kernel,xla --steps 64 --chunk 16 --json
step generate-mxfp4 245 python3 -m mk bench --mode generate --config k3-chip --experts mxfp4 --batch 1,2,4,8 \
  --impl kernel,xla --steps 64 --chunk 16 --json
for name in generate-bf16 generate-mxfp4; do
  python3 - "$OUT/$name" <<'PY'
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
done
